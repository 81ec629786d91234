"""Decode attention over the paged KV cache in Triton (flash-decoding), in one kernel.

One program per (sequence, KV head, split): it reads its KV tiles (64 tokens over several blocks)
once for all the query heads of the group (GQA) with tensor-core dots and keeps an online softmax.
A sequence uses one split per SPLIT_TOKENS of context, up to the grid's splits (enough to fill the
GPU at a small batch), so a short context takes one pass that writes the output itself. With
several splits each writes a partial result with its log-sum-exp and counts itself in; the last
to arrive merges them and resets the count, so no second kernel runs. Only device tensors are
read (no host syncs): it can be captured in a CUDA graph for a fixed batch size and grid.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_tile import attend, attend_kv_tile, kv_tile_offsets
from kernels.dispatch import launch_options, programmatic_launch, sm_count, wait_for_previous_kernel

# Context per split: below it a sequence's keys are read in one pass (a few tiles in a row cost
# less than a merge); above it they spread over more splits, up to the grid's.
SPLIT_TOKENS = 256


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, part_out_ptr, part_lse_ptr, out_ptr, arrived_ptr,
    scale,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_blk, stride_c_pos, stride_c_kv,
    stride_tab,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_TOKENS: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Before the wait for the previous kernel (the QKV projection or rope_store_kv, which writes q
    # and the newest token's keys and values): the lengths, block tables and older cache entries,
    # which the step's earlier kernels and host copies wrote. The first tile's older keys and values
    # are on their way while that kernel finishes; the newest token's row is read after the wait.
    seq_len = tl.load(lens_ptr + seq)
    splits = tl.minimum(tl.cdiv(seq_len, SPLIT_TOKENS), NUM_SPLITS)
    if split < splits:  # the others have nothing to read: they end at once
        table_ptr = tables_ptr + seq * stride_tab
        offs = tl.arange(0, TILE)
        tok = split * TILE + offs
        kv_offs = kv_tile_offsets(table_ptr, kv_head, tok, tok < seq_len, stride_c_blk, stride_c_pos, stride_c_kv,
                                  BLOCK_SIZE, HEAD_DIM)
        older = (tok < seq_len - 1)[:, None]
        k = tl.load(k_ptr + kv_offs, mask=older, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=older, other=0.0)
        wait_for_previous_kernel(PDL)
        rows = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + rows
        head_ok = rows < GROUP
        dims = tl.arange(0, HEAD_DIM)
        # The group's query heads as one [GROUP_PAD, D] tile (padded to 16 rows for tensor-core dots).
        q = tl.load(q_ptr + seq * stride_q_t + heads[:, None] * stride_q_h + dims[None, :], mask=head_ok[:, None],
                    other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        newest = (tok == seq_len - 1)[:, None]
        k = tl.where(newest, tl.load(k_ptr + kv_offs, mask=newest, other=0.0), k)
        v = tl.where(newest, tl.load(v_ptr + kv_offs, mask=newest, other=0.0), v)
        m, l, acc = attend(q, k, v, (tok < seq_len)[None, :], m, l, acc, scale, IEEE)
        # The splits take TILE-token tiles round-robin; a tile spans several KV blocks, gathered
        # through the block table.
        for start in range((split + splits) * TILE, seq_len, splits * TILE):
            tok = start + offs
            valid = tok < seq_len
            m, l, acc = attend_kv_tile(q, k_ptr, v_ptr, table_ptr, kv_head, tok, valid, valid[None, :],
                                       m, l, acc, scale, stride_c_blk, stride_c_pos, stride_c_kv, BLOCK_SIZE, HEAD_DIM,
                                       IEEE)
        out_offs = seq * stride_o_t + heads[:, None] * stride_o_h + dims[None, :]
        if splits == 1:  # one pass: the output itself
            tl.store(out_ptr + out_offs, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
        else:
            row = (seq * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS  # the group's first split rows
            tl.store(part_out_ptr + (row + split)[:, None] * HEAD_DIM + dims[None, :], acc / l[:, None],
                     mask=head_ok[:, None])
            tl.store(part_lse_ptr + row + split, m + tl.log(l), mask=head_ok)
            # Every thread's stores before the count (release); the last split in reads them all (acquire).
            tl.debug_barrier()
            counter = arrived_ptr + seq * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
                m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
                l = tl.zeros([GROUP_PAD], tl.float32)
                acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
                for other in range(splits):  # an online softmax over the splits' results
                    lse = tl.load(part_lse_ptr + row + other, mask=head_ok, other=0.0, cache_modifier=".cg")
                    part = tl.load(part_out_ptr + (row + other)[:, None] * HEAD_DIM + dims[None, :],
                                   mask=head_ok[:, None], other=0.0, cache_modifier=".cg")
                    m_new = tl.maximum(m, lse)
                    alpha = tl.exp(m - m_new)
                    weight = tl.exp(lse - m_new)
                    l = l * alpha + weight
                    acc = acc * alpha[:, None] + part * weight[:, None]
                    m = m_new
                tl.store(out_ptr + out_offs, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
                tl.store(counter, 0)  # for the next kernel that counts here (a later layer or step)


def num_splits_for(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough splits (at most 32) that batch × kv heads × splits programs cover the device's SMs
    about twice. It depends on the batch shape only, so a CUDA graph captured for a batch size
    keeps it."""
    return max(1, min(32, -(-2 * sm_count(device) // (batch * num_kv_heads))))


_arrival_counts: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counts(device: torch.device, size: int) -> torch.Tensor:
    """Zeroed int32 counters, at least `size`, that every decode attention kernel on the device
    shares: each kernel leaves them at zero, and one kernel runs at a time on the stream. Kept for
    the process's life, as captured CUDA graphs hold their address; a larger batch adds a buffer."""
    buffers = _arrival_counts.setdefault(device, [])
    if not buffers or buffers[-1].numel() < size:
        buffers.append(torch.zeros(max(size, 2048), dtype=torch.int32, device=device))
    return buffers[-1]


def decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, num_splits: int,
) -> torch.Tensor:
    """q: [B, H, D] (one query per sequence); caches: [num_blocks, block_size, KV, D]; → [B, H, D].
    num_splits: the grid's splits per sequence and KV head, of which a sequence uses one per
    SPLIT_TOKENS of its context."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv, _ = k_cache.shape
    group = num_heads // num_kv
    out = torch.empty_like(q)
    if num_splits == 1:  # the kernel writes out itself: no partials
        part_out = part_lse = out
    else:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    tile = 64 if head_dim <= 128 else 32
    pdl = programmatic_launch(q)
    _decode_split_kernel[(batch, num_kv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, out,
        arrival_counts(q.device, batch * num_kv), scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 16), BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        TILE=tile, NUM_SPLITS=num_splits, SPLIT_TOKENS=max(SPLIT_TOKENS // tile, 1) * tile,
        IEEE=q.dtype == torch.float32, PDL=pdl, **launch_options(pdl),
    )
    return out
