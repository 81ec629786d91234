"""Rotary position embedding, fused with writing the new keys and values into the paged KV cache."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.dispatch import launch_options, programmatic_launch, use_triton, wait_for_previous_kernel


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies (float32), with llama3 or linear scaling, as Hugging Face computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32 table: cos in the first half, sin in the second."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos/sin: [T, 1, D] already in x's dtype (Hugging Face's rotate_half form).
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Torch reference. q: [T, H, D], k/v: [T, KV, D]; caches: [num_blocks, block_size, KV, D].

    Rotates q and k, writes k and v at their slots, returns the rotated q.
    """
    half = cos_sin.shape[-1] // 2
    table = cos_sin[positions]
    cos = torch.cat([table[:, :half], table[:, :half]], dim=-1)[:, None, :].to(q.dtype)
    sin = torch.cat([table[:, half:], table[:, half:]], dim=-1)[:, None, :].to(q.dtype)
    q = _rotate(q, cos, sin)
    k = _rotate(k, cos, sin)
    num_kv, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv, head_dim)[slot_mapping] = v.to(v_cache.dtype)
    return q


@triton.jit
def _rotate_heads(
    x_ptr, x_stride_h, out_ptr, out_stride_h, num_heads, half, cos, sin,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One token's heads, as two [heads, half] tiles; cos/sin are [1, half] float32.
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    x = x_ptr + heads * x_stride_h + dims
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + half, mask=mask, other=0.0).to(tl.float32)
    # Round to the input dtype, as the reference does; the store casts to the destination's (the cache's).
    out = out_ptr + heads * out_stride_h + dims
    tl.store(out, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(out + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, q_out_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, q_out_stride_t, q_out_stride_h,
    cache_stride_slot, cache_stride_h, cos_sin_stride, num_heads, num_kv_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    # One program per token: every q and k head rotated, k and v written at the token's slot.
    # Before the wait for the previous kernel (the QKV projection): the position, slot and cos/sin
    # row, which host copies made before the step and no kernel writes (each step's row is a new
    # one, so the table read is a trip to DRAM that the projection's tail now hides).
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    table = cos_sin_ptr + pos * cos_sin_stride + dims
    # cos/sin rounded to the input dtype, as the reference multiplies them in it.
    in_dtype = q_ptr.dtype.element_ty
    cos = tl.load(table, mask=dims < half, other=0.0).to(in_dtype).to(tl.float32)
    sin = tl.load(table + half, mask=dims < half, other=0.0).to(in_dtype).to(tl.float32)
    wait_for_previous_kernel(PDL)
    _rotate_heads(q_ptr + token * q_stride_t, q_stride_h, q_out_ptr + token * q_out_stride_t, q_out_stride_h,
                  num_heads, half, cos, sin, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr + token * k_stride_t, k_stride_h, k_cache_ptr + slot * cache_stride_slot, cache_stride_h,
                  num_kv_heads, half, cos, sin, BLOCK_KV, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_KV)[:, None]
    mask = (heads < num_kv_heads) & (dims < half)
    v = v_ptr + token * v_stride_t + heads * v_stride_h + dims
    cache = v_cache_ptr + slot * cache_stride_slot + heads * cache_stride_h + dims
    out_dtype = v_cache_ptr.dtype.element_ty
    tl.store(cache, tl.load(v, mask=mask).to(out_dtype), mask=mask)
    tl.store(cache + half, tl.load(v + half, mask=mask).to(out_dtype), mask=mask)


@triton.jit
def rope_rows(N, ROWS: tl.constexpr, HALF: tl.constexpr):
    """(rows [ROWS], row_ok) of a one-row QKV kernel's program whose epilogue is store_rope_kv: its
    ROWS / 2 pairs, each feature d < HALF of a head followed by its partner d + HALF, the two that
    RoPE rotates together (over a merged [q heads, k heads, v heads] x head_dim output of N)."""
    r = tl.arange(0, ROWS)
    pair = tl.program_id(0) * (ROWS // 2) + r // 2
    rows = (pair // HALF) * (2 * HALF) + pair % HALF + (r % 2) * HALF
    return rows, pair < N // 2


@triton.jit
def rope_operands(positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, tokens, tokens_ok,
                  dtype: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr):
    """store_rope_kv's inputs for `tokens` [T] (a one-row kernel's is arange(0, 1)): their slots [T],
    and cos and sin [T, ROWS / 2] of the program's pairs, rounded to dtype as rope_store_kv's kernel
    does. Host copies wrote them before the step: they may be read before the wait for the previous
    kernel."""
    pos = tl.load(positions_ptr + tokens, mask=tokens_ok, other=0)
    slot = tl.load(slot_mapping_ptr + tokens, mask=tokens_ok, other=0).to(tl.int64)
    d = (tl.program_id(0) * (ROWS // 2) + tl.arange(0, ROWS // 2)) % HALF
    table = cos_sin_ptr + pos.to(tl.int64)[:, None] * cos_sin_stride + d[None, :]
    return slot, tl.load(table).to(dtype).to(tl.float32), tl.load(table + HALF).to(dtype).to(tl.float32)


@triton.jit
def store_rope_kv(y, ok, tokens, slot, cos, sin, q_out_ptr, k_cache_ptr, v_cache_ptr, cache_stride_slot,
                  cache_stride_h, num_heads, num_kv_heads, ROWS: tl.constexpr, HALF: tl.constexpr):
    """A QKV kernel's float32 outputs y [T, ROWS] for `tokens` [T] and rope_rows' rows (ok: those to
    store), rounded to the projection's dtype, then what rope_store_kv's kernel does with them: q
    and k heads rotated, q into q_out [tokens, heads, 2 * HALF], k and v into the caches at each
    token's slot. Bit for bit the projection followed by that kernel."""
    T: tl.constexpr = y.shape[0]
    x1, x2 = tl.split(tl.reshape(y.to(q_out_ptr.dtype.element_ty).to(tl.float32), [T, ROWS // 2, 2]))
    ok, _ = tl.split(tl.reshape(ok.to(tl.int32), [T, ROWS // 2, 2]))
    ok = ok != 0
    pair = tl.program_id(0) * (ROWS // 2) + tl.arange(0, ROWS // 2)
    head = (pair // HALF)[None, :]
    d = (pair % HALF)[None, :]
    rotated = head < num_heads + num_kv_heads
    in_dtype = q_out_ptr.dtype.element_ty
    o1 = tl.where(rotated, x1 * cos - x2 * sin, x1).to(in_dtype)
    o2 = tl.where(rotated, x2 * cos + x1 * sin, x2).to(in_dtype)
    q = q_out_ptr + tokens.to(tl.int64)[:, None] * (num_heads * 2 * HALF) + head * (2 * HALF) + d
    tl.store(q, o1, mask=ok & (head < num_heads))
    tl.store(q + HALF, o2, mask=ok & (head < num_heads))
    is_k = ok & (head >= num_heads) & rotated
    kv_head = tl.where(is_k, head - num_heads, head - num_heads - num_kv_heads)
    cache = slot[:, None] * cache_stride_slot + kv_head.to(tl.int64) * cache_stride_h + d
    is_v = ok & ~rotated
    tl.store(k_cache_ptr + cache, o1, mask=is_k)
    tl.store(k_cache_ptr + cache + HALF, o2, mask=is_k)
    tl.store(v_cache_ptr + cache, o1, mask=is_v)
    tl.store(v_cache_ptr + cache + HALF, o2, mask=is_v)


def rope_store_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Triton version of `rope_store_kv_ref`, same contract; one program per token.

    q, k and v are taken by strides: in the model they are views into the merged QKV projection's
    output, and copying them out would cost three extra kernels. Only their last dim must be
    unit-stride. Shapes alone decide the launch and the output size, so it is CUDA-graph safe.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    # The reference's flat [slots, KV, D] view; a view, so the kernel writes the caches themselves.
    k_flat, v_flat = k_cache.view(-1, num_kv, head_dim), v_cache.view(-1, num_kv, head_dim)
    assert k_flat.stride() == v_flat.stride() and k_flat.stride(-1) == 1
    cos_sin = cos_sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    half = head_dim // 2
    pdl = programmatic_launch(q)
    _rope_store_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin, k_flat, v_flat, slot_mapping, q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1),
        k_flat.stride(0), k_flat.stride(1), cos_sin.stride(0), num_heads, num_kv, half,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv),
        BLOCK_HALF=triton.next_power_of_2(half), PDL=pdl, **launch_options(pdl),
    )
    return q_out


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """RoPE + KV-cache write; Triton where `use_triton` says so, else the torch reference."""
    if use_triton(q):
        return rope_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    return rope_store_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)


@dataclass(frozen=True)
class RopeKV:
    """What a merged QKV projection's RoPE epilogue needs (rope_store_kv's arguments but q, k, v):
    the token's position and slot, the cos/sin table, the caches [blocks, block_size, KV, D]."""

    positions: torch.Tensor
    cos_sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int


def rope_store_qkv(qkv: torch.Tensor, rope: RopeKV) -> torch.Tensor:
    """rope_store_kv on a merged QKV projection's output [tokens, (heads + 2 KV heads) * head_dim]:
    the rotated q [tokens, heads, head_dim]."""
    tokens, d = qkv.shape[0], rope.head_dim
    q, k, v = qkv.split([rope.num_heads * d, rope.num_kv_heads * d, rope.num_kv_heads * d], dim=-1)
    return rope_store_kv(q.view(tokens, rope.num_heads, d), k.view(tokens, rope.num_kv_heads, d),
                         v.view(tokens, rope.num_kv_heads, d), rope.positions, rope.cos_sin, rope.k_cache,
                         rope.v_cache, rope.slot_mapping)


def rope_arguments(x: torch.Tensor, rope: RopeKV | None) -> tuple[torch.Tensor | None, tuple]:
    """A QKV kernel's RoPE arguments for x [tokens, K], in its signature's order (positions, slot
    mapping, cos/sin table and its row stride, the caches as [slots, KV, D] and their slot and head
    strides, heads, KV heads), and the q it writes, [tokens, heads, head_dim]; without rope, None
    and stand-ins (x)."""
    if rope is None:
        return None, (x,) * 3 + (0,) + (x,) * 2 + (0,) * 4
    k_flat = rope.k_cache.view(-1, rope.num_kv_heads, rope.head_dim)
    v_flat = rope.v_cache.view(-1, rope.num_kv_heads, rope.head_dim)
    assert k_flat.stride() == v_flat.stride() and k_flat.stride(-1) == 1 and rope.cos_sin.is_contiguous()
    q = torch.empty(x.shape[0], rope.num_heads, rope.head_dim, dtype=x.dtype, device=x.device)
    return q, (rope.positions, rope.slot_mapping, rope.cos_sin, rope.cos_sin.stride(0), k_flat, v_flat,
               k_flat.stride(0), k_flat.stride(1), rope.num_heads, rope.num_kv_heads)
