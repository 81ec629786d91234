"""o_proj that merges decode attention's splits itself, with the add-norm after it, for one row,
over float, FP8 or INT4 weights.

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
from kernels import fp8_linear
from kernels.fp8_linear import SIGN_EXP_MAN, channel_scales, e4m3x4_to_f32
from kernels.rmsnorm import NormScale
from kernels.split_k import add_norm_operands, split_workspace, store_add_norm, sum_splits

# Rows of W_o a program takes: every row tile re-reads its group's partials.
MERGE_ROWS = 64
# The most partial bytes all row tiles together re-read from L2 a layer (row tiles x heads x splits
# x head_dim x 4 bytes): past it (the 8B shape, 32 MB) re-reading cost more than the merge kernel.
MAX_PARTIAL_READS = 16 << 20
# The most partial values a program holds at once: its splits in chunks of this many values.
CHUNK_VALUES = 8192
# Warps a program: its W_o block and partials spread over them (a module constant for bench/graph_ab.py;
# 8 and 16 hold fewer registers but ran slower on the 0.5B and 1B shapes).
MERGE_WARPS = 4
# INT4 zero points and scales: loaded for every word of a program's W_o block, or, from this many words
# a block (at MERGE_WARPS), once a group of a head and applied to the group's summed words. Per word,
# the 0.5B shape's 4,096-word blocks spill; once a group, the 1B's 2,048 ran slower (docs/performance.md).
INT4_GROUP_LOADS_WORDS = 4096


# Weight formats the kernel reads (FORMAT): float [N, K]; FP8 int32 words of four e4m3 bytes [N, K / 4]
# with a float32 scale per row (kernels/fp8_linear.py); INT4 int32 words of eight nibbles [N, K / 8]
# with fp16 zeros and scales per row and group (kernels/int4_layout.py's runtime layout).
FLOAT, FP8_WORDS, INT4_WORDS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _columns_of_4(o):
    """o [G, 4W] as four [G, W]: the j-th holds columns 4c + j (an FP8 word's bytes)."""
    even, odd = tl.split(tl.reshape(o, [o.shape[0], o.shape[1] // 4, 2, 2]))
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def _columns_of_8(o):
    """o [G, 8W] as eight [G, W]: the j-th holds columns 8c + j (an INT4 word's nibbles)."""
    even, odd = tl.split(tl.reshape(o, [o.shape[0], o.shape[1] // 8, 4, 2]))
    c0, c2, c4, c6 = _columns_of_4(tl.reshape(even, [o.shape[0], o.shape[1] // 2]))
    c1, c3, c5, c7 = _columns_of_4(tl.reshape(odd, [o.shape[0], o.shape[1] // 2]))
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _merge_o_kernel(
    part_out_ptr, part_lse_ptr, lens_ptr,
    w_ptr, scale_ptr, zeros_ptr, stride_w, stride_g, sign_exp_man,
    bias_ptr, out_ptr, part_ptr, count_ptr, N,
    residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    CHUNK: tl.constexpr, SPLIT_TOKENS: tl.constexpr, ROWS: tl.constexpr, NUM_KV: tl.constexpr, GROUP_SIZE: tl.constexpr,
    GROUP_LOADS: tl.constexpr, FORMAT: tl.constexpr, CVT: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (t, g): KV group g's heads merged from their splits (an online softmax over chunks of
    CHUNK splits, only those the context reaches), times W_o's ROWS x (group heads x HEAD_DIM)
    block for rows tile t; the groups' products summed and the add-norm stored by the last. The
    block is read before the wait, as words for FP8 and INT4 (decoded after the merge as their
    one-row kernels decode them; CVT: FP8 by the hardware conversion)."""
    kv_head = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < N
    heads = tl.arange(0, GROUP_P2)
    head_ok = heads < GROUP
    dims = tl.arange(0, HEAD_DIM)
    PER: tl.constexpr = 1 if FORMAT == FLOAT else (4 if FORMAT == FP8_WORDS else 8)  # values an element holds
    words = tl.arange(0, HEAD_DIM // PER)
    cols = (kv_head * GROUP + heads)[None, :, None] * (HEAD_DIM // PER) + words[None, None, :]
    block_ok = row_ok[:, None, None] & head_ok[None, :, None]
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None, None] * stride_w + cols, mask=block_ok, other=0)
    if FORMAT == FP8_WORDS:
        channel_scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    if FORMAT == INT4_WORDS:
        GPH: tl.constexpr = HEAD_DIM // GROUP_SIZE if HEAD_DIM > GROUP_SIZE else 1  # groups a head
        if GROUP_LOADS:  # the zero point and scale of each of a head's groups, once
            groups = ((kv_head * GROUP + heads) * HEAD_DIM // GROUP_SIZE)[None, :, None] + tl.arange(0, GPH)[None, None, :]
            g_ok = row_ok[:, None, None] & head_ok[None, :, None]
        else:  # each word's group's
            groups = cols * 8 // GROUP_SIZE
            g_ok = block_ok
        g_offs = rows.to(tl.int64)[:, None, None] * stride_g + groups
        zero = tl.load(zeros_ptr + g_offs, mask=g_ok, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + g_offs, mask=g_ok, other=0.0).to(tl.float32)
    seq_len = tl.load(lens_ptr).to(tl.int32)  # int32 or int64 (a decode graph's)
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
    # The attention output as the merge kernel stores it (the model's dtype), padding heads zero.
    o = (acc / tl.where(l > 0, l, 1.0)[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    if FORMAT == FLOAT:
        y = tl.sum(tl.sum(w.to(tl.float32) * o[None, :, :], axis=2), axis=1)
    elif FORMAT == FP8_WORDS:
        o0, o1, o2, o3 = _columns_of_4(o)
        if CVT:
            w0, w1, w2, w3 = e4m3x4_to_f32(w)
            t = w0 * o0[None] + w1 * o1[None] + w2 * o2[None] + w3 * o3[None]
        else:  # the integer decode: e4m3 / 2**120 as float32 bits
            t = ((w << 24) >> 4 & sign_exp_man).to(tl.float32, bitcast=True) * o0[None]
            t += ((w << 16) >> 4 & sign_exp_man).to(tl.float32, bitcast=True) * o1[None]
            t += ((w << 8) >> 4 & sign_exp_man).to(tl.float32, bitcast=True) * o2[None]
            t += (w >> 4 & sign_exp_man).to(tl.float32, bitcast=True) * o3[None]
            channel_scale *= 1.329227995784916e36  # 2**120
        y = tl.sum(tl.sum(t, axis=2), axis=1) * channel_scale
    else:
        o0, o1, o2, o3, o4, o5, o6, o7 = _columns_of_8(o)
        q = ((w & 0xF).to(tl.float32) * o0[None] + ((w >> 4) & 0xF).to(tl.float32) * o1[None]
             + ((w >> 8) & 0xF).to(tl.float32) * o2[None] + ((w >> 12) & 0xF).to(tl.float32) * o3[None]
             + ((w >> 16) & 0xF).to(tl.float32) * o4[None] + ((w >> 20) & 0xF).to(tl.float32) * o5[None]
             + ((w >> 24) & 0xF).to(tl.float32) * o6[None] + ((w >> 28) & 0xF).to(tl.float32) * o7[None])
        o_sum = o0 + o1 + o2 + o3 + o4 + o5 + o6 + o7
        if GROUP_LOADS:  # a group's words summed first, for its one zero point and scale
            q = tl.sum(tl.reshape(q, [ROWS, GROUP_P2, GPH, HEAD_DIM // 8 // GPH]), axis=3)
            o_sum = tl.sum(tl.reshape(o_sum, [GROUP_P2, GPH, HEAD_DIM // 8 // GPH]), axis=2)
        y = tl.sum(tl.sum(scale * (q - zero * o_sum[None]), axis=2), axis=1)  # sum (q - z) * s * o
    y, ok = sum_splits(y, part_ptr, count_ptr, rows, row_ok, N, NUM_KV)
    store_add_norm(y, rows, ok, bias, residual, norm_w, out_ptr, residual_out_ptr, sumsq_ptr)


def merges_splits(splits: AttentionSplits, out_features: int, weight: torch.Tensor) -> bool:
    """Whether o_proj (out_features, its weight or weight words) merges these splits itself: one row
    on Triton, a unit-stride weight, heads of whole INT4 words, and partials that re-read stay under
    MAX_PARTIAL_READS."""
    batch, heads, num_splits, head_dim = splits.part_out.shape
    reads = triton.cdiv(out_features, MERGE_ROWS) * heads * num_splits * head_dim * 4
    return (batch == 1 and use_triton(splits.part_out) and weight.stride(1) == 1 and head_dim % 8 == 0
            and reads <= MAX_PARTIAL_READS)


def merge_o_add_norm(splits: AttentionSplits, weight: torch.Tensor, bias: torch.Tensor | None,
                     residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, NormScale]:
    """o_proj (weight [N, H * D]) of one sequence's split attention, merged here, then the residual
    add and RMSNorm: (h * norm_weight, h, NormScale) as kernels/float_linear.py's
    float_linear_add_norm returns them (merges_splits must hold)."""
    return _merge_o(splits, FLOAT, weight, weight, weight, 0, bias, residual, norm_weight, eps)


def fp8_merge_o_add_norm(splits: AttentionSplits, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor, NormScale]:
    """merge_o_add_norm over an FP8 weight (float8_e4m3fn [N, H * D], weight_scale per row or tensor)."""
    words = weight.view(torch.uint8).view(torch.int32)
    scales = channel_scales(weight_scale, weight.shape[0])
    return _merge_o(splits, FP8_WORDS, words, scales, words, 0, bias, residual, norm_weight, eps)


def int4_merge_o_add_norm(splits: AttentionSplits, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                          group_size: int, bias: torch.Tensor | None, residual: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, NormScale]:
    """merge_o_add_norm over an INT4 weight in the runtime layout (weight int32 [N, H * D / 8], fp16
    zeros and scales [N, H * D / group_size])."""
    assert zeros.stride() == scales.stride()
    return _merge_o(splits, INT4_WORDS, weight, scales, zeros, group_size, bias, residual, norm_weight, eps)


def _merge_o(splits: AttentionSplits, fmt: int, weight: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor,
             group_size: int, bias: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, NormScale]:
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
    group_loads = fmt == INT4_WORDS and MERGE_ROWS * group_p2 * head_dim // 8 >= INT4_GROUP_LOADS_WORDS
    pdl = programmatic_launch(weight)
    _merge_o_kernel[(tiles, splits.num_kv_heads)](
        splits.part_out, splits.part_lse, splits.seq_lens,
        weight, scale, zeros, weight.stride(0), zeros.stride(0) if fmt == INT4_WORDS else 0, SIGN_EXP_MAN,
        bias if bias is not None else out, out, part, counts, out_features,
        residual.reshape(1, -1).contiguous(), norm_weight.contiguous(), residual_out, sumsq,
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, CHUNK=chunk,
        SPLIT_TOKENS=splits.split_tokens, ROWS=MERGE_ROWS, NUM_KV=splits.num_kv_heads, GROUP_SIZE=max(group_size, 1),
        GROUP_LOADS=group_loads, FORMAT=fmt,
        CVT=fmt == FP8_WORDS and fp8_linear.has_e4m3_cvt(weight.device), HAS_BIAS=bias is not None, PDL=pdl,
        num_warps=MERGE_WARPS, num_stages=1, **launch_options(pdl),
    )
    return out.view(residual.shape), residual_out.view(residual.shape), NormScale(sumsq, eps)
