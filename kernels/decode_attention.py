"""Decode attention over the paged KV cache in Triton (flash-decoding).

One program per (sequence, KV head, split): it reads its KV tiles (64 tokens over several blocks)
once for all the query heads of the group (GQA) with tensor-core dots, keeps an online softmax,
and writes a partial result with its log-sum-exp; a second kernel merges the splits, or o_proj's
kernel does (AttentionSplits, kernels/attention_projection.py). Long contexts are spread over
splits so that a small batch still fills the GPU; a batch that fills it alone (one split) takes
one pass, the split kernel writing the output and no merge kernel after. Only device tensors are
read (no host syncs), so it can be captured in a CUDA graph for a fixed batch size and number of
splits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_tile import attend, attend_kv_tile, kv_tile_offsets
from kernels.dispatch import launch_options, programmatic_launch, sm_count, wait_for_previous_kernel


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, fresh_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    scale,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_blk, stride_c_pos, stride_c_kv,
    stride_tab,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Before the wait for the previous kernel (the one that writes q and this step's keys and values):
    # the lengths, block tables and older cache entries, which earlier steps and the host copies
    # wrote. The first tile's older keys and values are on their way while that kernel finishes; the
    # step's own rows (from `fresh` on: the newest token, or a verify step's drafts) after the wait.
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)  # int32 or int64 (a decode graph's) lengths
    fresh = tl.load(fresh_ptr + seq).to(tl.int32)
    table_ptr = tables_ptr + seq * stride_tab
    offs = tl.arange(0, TILE)
    tok = split * TILE + offs
    kv_offs = kv_tile_offsets(table_ptr, kv_head, tok, tok < seq_len, stride_c_blk, stride_c_pos, stride_c_kv,
                              BLOCK_SIZE, HEAD_DIM)
    older = (tok < fresh)[:, None]
    k = tl.load(k_ptr + kv_offs, mask=older, other=0.0)
    v = tl.load(v_ptr + kv_offs, mask=older, other=0.0)
    wait_for_previous_kernel(PDL)
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    head_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    # The group's query heads as one [GROUP_PAD, D] tile (padded to 16 rows for tensor-core dots).
    q = tl.load(q_ptr + seq * stride_q_t + heads[:, None] * stride_q_h + dims[None, :], mask=head_ok[:, None], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    if split * TILE < seq_len:  # else an empty split: no keys at all
        newest = ((tok >= fresh) & (tok < seq_len))[:, None]
        k = tl.where(newest, tl.load(k_ptr + kv_offs, mask=newest, other=0.0), k)
        v = tl.where(newest, tl.load(v_ptr + kv_offs, mask=newest, other=0.0), v)
        m, l, acc = attend(q, k, v, (tok < seq_len)[None, :], m, l, acc, scale, IEEE)
    # Splits take TILE-token tiles round-robin, so even a short context is spread over all of them;
    # a tile spans several KV blocks, gathered through the block table.
    for start in range((split + NUM_SPLITS) * TILE, seq_len, NUM_SPLITS * TILE):
        tok = start + offs
        valid = tok < seq_len
        m, l, acc = attend_kv_tile(q, k_ptr, v_ptr, table_ptr, kv_head, tok, valid, valid[None, :],
                                   m, l, acc, scale, stride_c_blk, stride_c_pos, stride_c_kv, BLOCK_SIZE, HEAD_DIM, IEEE)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    if NUM_SPLITS == 1:  # one pass: the output itself, and no merge kernel after
        tl.store(out_ptr + seq * stride_o_t + heads[:, None] * stride_o_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        # An empty split (past the sequence's end) leaves l = 0: its lse is -inf and it weighs nothing.
        lse = tl.where(l > 0, m + tl.log(l), float("-inf"))
        row = (seq * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out, mask=head_ok[:, None])
        tl.store(part_lse_ptr + row, lse, mask=head_ok)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_o_t, stride_o_h, num_heads,
                         HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    row = (seq * num_heads + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + row + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, axis=0))
    weight = weight / tl.sum(weight, axis=0)
    dims = tl.arange(0, HEAD_DIM)
    parts = tl.load(part_out_ptr + (row + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=(splits < NUM_SPLITS)[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], axis=0)
    tl.store(out_ptr + seq * stride_o_t + head * stride_o_h + dims, out.to(out_ptr.dtype.element_ty))


# Warps a split program: its key tile and the group's query heads over them (a module constant for
# bench/graph_ab.py; 8 warps tied at batch 1 and ran slower at batch 8).
SPLIT_WARPS = 4


def num_splits_for(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough splits (at most 32) that batch × kv heads × splits programs cover the device's SMs
    about twice. It depends on the batch shape only, so a CUDA graph captured for a batch size
    keeps it."""
    return max(1, min(32, -(-2 * sm_count(device) // (batch * num_kv_heads))))


def decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, num_splits: int, fresh: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, H, D] (one query per sequence); caches: [num_blocks, block_size, KV, D]; → [B, H, D].
    fresh [B] int32: each row's first key written by the kernel before this one (default its last)."""
    if num_splits == 1:  # the split kernel writes out itself: no partials
        return _decode_splits(q, k_cache, v_cache, block_tables, seq_lens, scale, 1, fresh)[0]
    part_out, part_lse = _decode_splits(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, fresh)
    return merge_splits(part_out, part_lse, q.dtype)


@dataclass
class AttentionSplits:
    """Decode attention's splits, not yet merged: what o_proj may merge in its own kernel
    (kernels/attention_projection.py) instead of the merge kernel. Split s of a sequence attended
    to the keys of the split_tokens-token tiles s, s + S, s + 2S, ... of its context."""

    part_out: torch.Tensor  # [B, H, S, D] float32: each split's output
    part_lse: torch.Tensor  # [B, H, S] float32: its log-sum-exp (-inf: a split past the context)
    seq_lens: torch.Tensor  # [B] int32
    num_kv_heads: int
    split_tokens: int
    dtype: torch.dtype  # the attention output's

    def merged(self) -> torch.Tensor:
        """The attention output [B, H * D], through the merge kernel."""
        return merge_splits(self.part_out, self.part_lse, self.dtype).flatten(1)


def decode_attention_splits(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, num_splits: int, fresh: torch.Tensor | None = None,
) -> AttentionSplits:
    """decode_attention_triton (num_splits > 1) without its merge."""
    part_out, part_lse = _decode_splits(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, fresh)
    return AttentionSplits(part_out, part_lse, seq_lens, k_cache.shape[2], split_tokens(q.shape[-1]), q.dtype)


def split_tokens(head_dim: int) -> int:
    """Keys in each tile a split takes in turn."""
    return 64 if head_dim <= 128 else 32


def _decode_splits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, num_splits: int, fresh: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    if fresh is None:
        fresh = seq_lens - 1
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv, _ = k_cache.shape
    group = num_heads // num_kv
    if num_splits == 1:  # the split kernel writes out itself: no partials
        out = part_out = part_lse = torch.empty_like(q)
    else:  # partials only: out stands in, never written
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        out = part_out
    pdl = programmatic_launch(q)
    _decode_split_kernel[(batch, num_kv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, fresh, part_out, part_lse, out,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 16), BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        TILE=split_tokens(head_dim), NUM_SPLITS=num_splits, IEEE=q.dtype == torch.float32, PDL=pdl,
        num_warps=SPLIT_WARPS, **launch_options(pdl),
    )
    return (out, out) if num_splits == 1 else (part_out, part_lse)


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """decode_attention_splits' partials merged: [B, H, D] in dtype."""
    batch, num_heads, num_splits, head_dim = part_out.shape
    out = torch.empty(batch, num_heads, head_dim, dtype=dtype, device=part_out.device)
    pdl = programmatic_launch(part_out)
    _merge_splits_kernel[(batch, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), num_heads,
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, SPLITS_PAD=max(triton.next_power_of_2(num_splits), 2), PDL=pdl,
        **launch_options(pdl),
    )
    return out
