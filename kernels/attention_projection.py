"""o_proj that merges decode attention's splits itself, with the add-norm after it, for one row.

Decode attention at batch 1 spreads a sequence over many splits (kernels/decode_attention.py), whose
partial outputs a merge kernel weighs into the attention output before o_proj reads it. Here
o_proj's programs do the merge: program (t, g) reads KV group g's partials (after the wait for
attention), weighs them by their log-sum-exps, and multiplies the group's heads by their columns of
W_o for output rows tile t (its weights read before the wait). The groups are o_proj's K splits,
summed by the last to arrive (kernels/split_k.py's sum_splits), which adds the residual and leaves
the next RMSNorm's factor to the next projection (store_add_norm). So the merge kernel and its
chain of wait, loads and store go from every decode layer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_attention import AttentionSplits
from kernels.dispatch import launch_options, programmatic_launch, use_triton, wait_for_previous_kernel
from kernels.rmsnorm import NormScale
from kernels.split_k import add_norm_operands, split_workspace, store_add_norm, sum_splits

# Rows of W_o a program takes: every row tile re-reads its group's partials.
MERGE_ROWS = 64
# The most partial bytes all row tiles together re-read from L2 a layer (row tiles x heads x splits
# x head_dim x 4 bytes): past it (the 8B shape, 32 MB) re-reading cost more than the merge kernel.
MAX_PARTIAL_READS = 16 << 20
# The most partial values a program holds at once: its splits in chunks of this many values.
CHUNK_VALUES = 8192


@triton.jit
def _merge_o_kernel(
    part_out_ptr, part_lse_ptr, lens_ptr,
    w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, stride_w,
    residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    CHUNK: tl.constexpr, SPLIT_TOKENS: tl.constexpr, ROWS: tl.constexpr, NUM_KV: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (t, g): KV group g's heads merged from their splits (an online softmax over chunks of
    CHUNK splits, only those the context reaches), times W_o's ROWS x (group heads x HEAD_DIM)
    block for rows tile t; the groups' products summed and the add-norm stored by the last."""
    kv_head = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < N
    heads = tl.arange(0, GROUP_P2)
    head_ok = heads < GROUP
    dims = tl.arange(0, HEAD_DIM)
    cols = (kv_head * GROUP + heads)[None, :, None] * HEAD_DIM + dims[None, None, :]
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None, None] * stride_w + cols,
                mask=row_ok[:, None, None] & head_ok[None, :, None], other=0.0)
    seq_len = tl.load(lens_ptr)
    bias, residual, norm_w = add_norm_operands(rows, row_ok, bias_ptr, residual_ptr, norm_w_ptr, HAS_BIAS, True)
    wait_for_previous_kernel(PDL)
    used = tl.minimum(tl.cdiv(seq_len, SPLIT_TOKENS), NUM_SPLITS)  # splits past the context hold nothing
    base = (kv_head * GROUP + heads) * NUM_SPLITS  # [GROUP_P2]: each head's first split
    ss = tl.arange(0, CHUNK)
    m = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    for s0 in range(0, used, CHUNK):
        s = s0 + ss
        ok = head_ok[:, None] & (s < used)[None, :]
        idx = base[:, None] + s[None, :]
        lse = tl.load(part_lse_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(part_out_ptr + idx[:, :, None] * HEAD_DIM + dims[None, None, :], mask=ok[:, :, None],
                        other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(lse - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(parts * p[:, :, None], axis=1)
        m = m_new
    o = (acc / tl.where(l > 0, l, 1.0)[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    y = tl.sum(tl.sum(w.to(tl.float32) * o[None, :, :], axis=2), axis=1)
    y, ok = sum_splits(y, part_ptr, count_ptr, rows, row_ok, N, NUM_KV)
    store_add_norm(y, rows, ok, bias, residual, norm_w, out_ptr, residual_out_ptr, sumsq_ptr)


def merges_splits(splits: AttentionSplits, weight: torch.Tensor) -> bool:
    """Whether o_proj over `weight` [N, H * D] merges these splits itself: one row on Triton, a
    unit-stride weight, and partials that re-read stay under MAX_PARTIAL_READS."""
    batch, heads, num_splits, head_dim = splits.part_out.shape
    reads = triton.cdiv(weight.shape[0], MERGE_ROWS) * heads * num_splits * head_dim * 4
    return batch == 1 and use_triton(splits.part_out) and weight.stride(1) == 1 and reads <= MAX_PARTIAL_READS


def merge_o_add_norm(splits: AttentionSplits, weight: torch.Tensor, bias: torch.Tensor | None,
                     residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, NormScale]:
    """o_proj (weight [N, H * D]) of one sequence's split attention, merged here, then the residual
    add and RMSNorm: (h * norm_weight, h, NormScale) as kernels/float_linear.py's
    float_linear_add_norm returns them (merges_splits must hold)."""
    _, num_heads, num_splits, head_dim = splits.part_out.shape
    group = num_heads // splits.num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    out_features = weight.shape[0]
    tiles = triton.cdiv(out_features, MERGE_ROWS)
    out = torch.empty(1, out_features, dtype=splits.dtype, device=weight.device)
    residual_out = torch.empty_like(out)
    sumsq = torch.empty(1, tiles, dtype=torch.float32, device=weight.device)
    part, counts = split_workspace(out, splits.num_kv_heads, tiles)
    chunk = min(triton.next_power_of_2(num_splits), max(1, CHUNK_VALUES // (group_p2 * head_dim)))
    pdl = programmatic_launch(weight)
    _merge_o_kernel[(tiles, splits.num_kv_heads)](
        splits.part_out, splits.part_lse, splits.seq_lens,
        weight, bias if bias is not None else out, out, part, counts, out_features, weight.stride(0),
        residual.reshape(1, -1).contiguous(), norm_weight.contiguous(), residual_out, sumsq,
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, CHUNK=chunk,
        SPLIT_TOKENS=splits.split_tokens, ROWS=MERGE_ROWS, NUM_KV=splits.num_kv_heads, HAS_BIAS=bias is not None,
        PDL=pdl, num_warps=4, num_stages=1, **launch_options(pdl),
    )
    return out.view(residual.shape), residual_out.view(residual.shape), NormScale(sumsq, eps)
