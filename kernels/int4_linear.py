"""4-bit weight-only linear layers over the runtime layout of kernels/int4_layout.py (weight int32
[N, K // 8], nibble j of word c holding k = 8c + j; fp16 zeros and scales [N, K // G]).

Kernels for x @ W.T, each reading a packed int32 once and dequantizing in registers (float32
accumulation), by the number of rows M:
  - M = 1 (decode): a GEMV on CUDA cores that turns nibbles into floats with a shift and a lop3
    (no int-to-float conversion; bench/sass_count.py counts its loop), tiled by weight size
    (kernels/split_k.py's large_tiling) and split along K when the rows alone leave SMs idle;
  - 1 < M <= TILE_GEMM_MAX_ROWS (decode batches, prefill chunks): a tl.dot GEMM whose weight tile
    [BLOCK_N, BLOCK_K] is each word interleaved 8 times along K and shifted per column;
  - M > TILE_GEMM_MAX_ROWS: the weight dequantized into x's dtype by a third kernel, then cuBLAS.
The GEMM splits K when the output tiles alone would leave SMs idle; the last split of each output
tile to finish sums the splits' float32 partials (and adds the bias), in the same kernel
(kernels/split_k.py). The measurements behind these choices: docs/performance.md, "Kernel notes".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import activation
from kernels.dispatch import (folds_norms, launch_next_kernel, launch_options, programmatic_launch, use_triton,
                              wait_for_previous_kernel)
from kernels.int4_layout import dequantize_int4
from kernels.rmsnorm import NormScale, rms_norm
from kernels.rope import RopeKV, rope_arguments, rope_store_qkv
from kernels.split_k import (add_norm_operands, few_rows, gemv_split, large_tiling, matmul_config, matmul_outputs,
                             norm_arguments, norm_factor, one_row_outputs, split_k_for, split_workspace,
                             store_matmul_outputs, store_one_row_outputs)

# Above this many rows (prefill chunks) the weight is dequantized into x's dtype once and the
# product is cuBLAS's; up to it, the tile GEMM reads the 4-bit weights directly. 1,024 lies between
# the row counts where each is the faster on an H200 (docs/performance.md).
TILE_GEMM_MAX_ROWS = 1024


def int4_linear_ref(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int, bias: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """Torch reference: dequantize, then x [M, K] @ W.T → [M, N] in x's dtype (SiLU·up → [M, N / 2])."""
    w = dequantize_int4(weight, zeros, scales, group_size).to(x.dtype)
    y = x @ w.t()
    y = y if bias is None else y + bias
    return activation.silu_mul_ref(y) if silu_mul else y


@triton.jit
def _nibbles(packed, shifts):
    """The 4-bit values at `shifts` of `packed` as float32 2**23 + q: OR-ing q into the mantissa of
    2**23 (0x4B000000) is cheaper than an int-to-float cvt (quarter rate); 2**23 cancels in q - z."""
    return (((packed >> shifts) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)


# A float32 with the exponent of 1.0 (a kernel argument: in a register, ptxas ORs it in the same
# lop3 as the mask). A nibble OR-ed into its mantissa at bit b reads 1 + q * 2**(b - 23).
ONE_BITS = 0x3F800000


@triton.jit
def _gemv_step(w_tile, z_rows, s_rows, row_ok, c0, w_end, BLOCK_W: tl.constexpr, WPG: tl.constexpr):
    """The GEMV's loads for words c0 .. c0 + BLOCK_W of its rows: the words [ROWS, BLOCK_W]
    (w_tile: the pointers of each row's words 0 .. BLOCK_W, one contiguous run a row, so that Triton
    gives each thread 4 adjacent words of 8 rows) and the groups' zero points and scales
    [ROWS, BLOCK_W / WPG]; zeros past w_end."""
    cols = c0 + tl.arange(0, BLOCK_W)
    p = tl.load(w_tile + c0, mask=row_ok[:, None] & (cols < w_end)[None, :], other=0)
    g = c0 // WPG + tl.arange(0, BLOCK_W // WPG)
    ok = row_ok[:, None] & (g < w_end // WPG)[None, :]
    z = tl.load(z_rows + g[None, :], mask=ok, other=0.0)
    s = tl.load(s_rows + g[None, :], mask=ok, other=0.0)
    return p, z, s


@triton.jit
def _word_inputs(x_ptr, cols, ok, BLOCK_W: tl.constexpr):
    """x at k = 8c + j for the words c [BLOCK_W], read as one contiguous [BLOCK_W, 8] run and split
    in registers: the even (j = 2i) and odd (j = 2i + 1) inputs for i = 0..3, eight [BLOCK_W]
    tensors in float32 (cheaper than eight strided 2-byte loads)."""
    xs = tl.load(x_ptr + (cols * 8)[:, None] + tl.arange(0, 8)[None, :], mask=ok[:, None], other=0.0)
    even, odd = tl.split(tl.reshape(xs.to(tl.float32), [BLOCK_W, 4, 2]))
    e02, e13 = tl.split(tl.reshape(even, [BLOCK_W, 2, 2]))
    o02, o13 = tl.split(tl.reshape(odd, [BLOCK_W, 2, 2]))
    e0, e2 = tl.split(e02)
    e1, e3 = tl.split(e13)
    o0, o2 = tl.split(o02)
    o1, o3 = tl.split(o13)
    return e0, o0, e1, o1, e2, o2, e3, o3


@triton.jit
def _add_nibble_pair(sums, t, one_bits, sixteen_bits, x_even, x_odd):
    """sums plus the products of the nibble pair that `t` (a shifted word) holds at mantissa bits 15
    and 19 with its inputs: (16 + q * 2**-4) * x_even + (1 + q' * 2**-4) * x_odd, one lop3 and one
    FMA each (see _int4_gemv_kernel)."""
    sums += ((t & 0x78000) | sixteen_bits).to(tl.float32, bitcast=True) * x_even[None, :]
    sums += ((t & 0x780000) | one_bits).to(tl.float32, bitcast=True) * x_odd[None, :]
    return sums


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, zeros_ptr, scales_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, stride_w, stride_g,
    words_per_split, one_bits, in_sumsq_ptr, in_parts, eps, residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr,
    positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, k_cache_ptr, v_cache_ptr, cache_stride_slot,
    cache_stride_h, num_heads, num_kv_heads,
    HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr, NORM_IN: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row of x against ROWS weight rows, BLOCK_W words of each per step (whole groups; split
    along K when the rows alone leave SMs idle). No int-to-float conversion: one shift brings two
    nibbles of a word (k = 8c + 2i and 8c + 2i + 1) to mantissa bits 15 and 19, one lop3 each masks
    one and ORs in an exponent, of 16.0 for k even and 1.0 for k odd, so the float32 reads
    16 + q * 2**-4 or 1 + q * 2**-4, and one FMA each multiplies it by x: a shift for two weights,
    a lop3 and an FMA for each, with the constants summing to 16 * x_even + x_odd. Per group,
    q . x = 16 * (sum - that) and y += s * (q . x - z * sum(x)). The float32 sum keeps q . x to
    about 2**-20 of sum |x| (bfloat16 rounds the output to 2**-9). A step's words are one
    [ROWS, BLOCK_W] tile and x one contiguous run, so that each thread holds 4 adjacent words of 8
    rows (each x value serves 8 rows) whatever the group size and Triton version (over
    [ROWS, groups, words] tiles Triton may give a thread fewer rows). SILU_MUL: the weight is a
    merged gate/up [N, K] and the output SiLU(gate) * up [N / 2] (store_one_row). NORM_IN: x is a
    NormScale's row, whose factor scales the outputs; ADD_NORM: the add-norm epilogue
    (store_add_norm); ROPE: a merged QKV weight, RoPE and the KV write in the epilogue (store_rope)."""
    WPG: tl.constexpr = GROUP // 8  # words a group
    GPS: tl.constexpr = BLOCK_W // WPG  # groups a step
    rows, row_ok, slot, cos, sin = one_row_outputs(N, positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride,
                                                   out_ptr.dtype.element_ty, ROWS, SILU_MUL, ROPE, HALF)
    w_begin = tl.program_id(1) * words_per_split
    # Split ends are whole groups (GROUP divides K, and words_per_split is whole steps): telling
    # Triton keeps the word masks constant over 4 words, so the loads stay 16 bytes wide.
    w_end = tl.multiple_of(tl.minimum(w_begin + words_per_split, K // 8), WPG)
    w_tile = w_ptr + rows.to(tl.int64)[:, None] * stride_w + tl.arange(0, BLOCK_W)[None, :]
    z_rows = zeros_ptr + rows.to(tl.int64)[:, None] * stride_g
    s_rows = scales_ptr + rows.to(tl.int64)[:, None] * stride_g
    # Weights are never written, so the first step's may be read before the previous kernel ends;
    # each step loads the next one's before its math.
    p, z, s = _gemv_step(w_tile, z_rows, s_rows, row_ok, w_begin, w_end, BLOCK_W, WPG)
    bias, residual, norm_w = add_norm_operands(rows, row_ok, bias_ptr, residual_ptr, norm_w_ptr, HAS_BIAS, ADD_NORM)
    wait_for_previous_kernel(PDL)
    if NORM_IN:  # its partial sums' latency under the loop's
        factor = norm_factor(in_sumsq_ptr, in_parts, K, eps, 256)
    sixteen_bits = one_bits + 0x2000000  # the exponent of 16.0: even nibbles read 16 + q / 16
    acc = tl.zeros([ROWS, GPS], dtype=tl.float32)
    for c0 in range(w_begin, w_end, BLOCK_W):
        p_next, z_next, s_next = _gemv_step(w_tile, z_rows, s_rows, row_ok, c0 + BLOCK_W, w_end, BLOCK_W, WPG)
        cols = c0 + tl.arange(0, BLOCK_W)
        e0, o0, e1, o1, e2, o2, e3, o3 = _word_inputs(x_ptr, cols, cols < w_end, BLOCK_W)
        # Nibbles 2i and 2i + 1 (bits 8i..8i+7) to bits 15 and 19.
        sums = _add_nibble_pair(tl.zeros([ROWS, BLOCK_W], dtype=tl.float32), p << 15, one_bits, sixteen_bits, e0, o0)
        sums = _add_nibble_pair(sums, p << 7, one_bits, sixteen_bits, e1, o1)
        sums = _add_nibble_pair(sums, p >> 1, one_bits, sixteen_bits, e2, o2)
        sums = _add_nibble_pair(sums, p >> 9, one_bits, sixteen_bits, e3, o3)
        e = tl.sum(tl.reshape(e0 + e1 + e2 + e3, [GPS, WPG]), axis=1)
        o = tl.sum(tl.reshape(o0 + o1 + o2 + o3, [GPS, WPG]), axis=1)
        qx = tl.sum(tl.reshape(sums, [ROWS, GPS, WPG]), axis=2) - (16.0 * e + o)[None, :]  # q . x / 16
        acc += s.to(tl.float32) * (qx - z.to(tl.float32) * ((e + o) * 0.0625)[None, :])
        p, z, s = p_next, z_next, s_next
    y = tl.sum(acc, axis=1) * 16.0
    if NORM_IN:
        y *= factor
    store_one_row_outputs(y, rows, row_ok, out_ptr, bias_ptr, part_ptr, count_ptr, N, bias, residual, norm_w,
                          residual_out_ptr, sumsq_ptr, slot, cos, sin, k_cache_ptr, v_cache_ptr, cache_stride_slot,
                          cache_stride_h, num_heads, num_kv_heads, HAS_BIAS, SPLIT_K, SILU_MUL, ADD_NORM, ROPE, ROWS,
                          HALF)


@triton.jit
def _int4_matmul_kernel(
    x_ptr, w_ptr, zeros_ptr, scales_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_w, stride_g, group_size, tiles_per_split,
    in_sumsq_ptr, in_parts, eps, residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr,
    positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, k_cache_ptr, v_cache_ptr, cache_stride_slot,
    cache_stride_h, num_heads, num_kv_heads,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr, FEW: tl.constexpr, SILU_MUL: tl.constexpr,
    NORM_IN: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr,
):
    """The tile GEMM. FEW: all M rows in one BLOCK_M tile (decode batches up to FEW_ROWS), with the
    one-row kernels' epilogues per row (kernels/split_k.py's store_matmul_outputs)."""
    wait_for_previous_kernel(PDL, False)  # the next kernel launches after the K loop (launch_next_kernel)
    rows, rows_ok, cols, col_ok, slot, cos, sin = matmul_outputs(
        M, N, positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, out_ptr.dtype.element_ty, BLOCK_M, BLOCK_N,
        GROUP_M, FEW, SILU_MUL, ROPE, HALF)
    split = tl.program_id(1)
    ks = tl.arange(0, BLOCK_K)
    words = tl.arange(0, BLOCK_K // 8)
    shifts = (ks % 8) * 4  # k = 8c + j sits in nibble j of word c
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    g_cols = cols.to(tl.int64) * stride_g
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(split * tiles_per_split, tl.minimum((split + 1) * tiles_per_split, K // BLOCK_K)):
        group = tile * BLOCK_K // group_size  # BLOCK_K divides G: one group per tile
        p = tl.load(w_cols + tile * (BLOCK_K // 8) + words[None, :], mask=col_ok[:, None], other=0)
        p = tl.interleave(p, p)  # [BLOCK_N, BLOCK_K]: each word repeated 8 times along K, in
        p = tl.interleave(p, p)  # registers (one load per word)
        p = tl.interleave(p, p)
        z = tl.load(zeros_ptr + g_cols + group, mask=col_ok, other=0.0).to(tl.float32) + 8388608.0
        s = tl.load(scales_ptr + g_cols + group, mask=col_ok, other=0.0).to(tl.float32)
        w = ((_nibbles(p, shifts[None, :]) - z[:, None]) * s[:, None]).to(x_ptr.dtype.element_ty)
        xt = tl.load(x_rows + (tile * BLOCK_K + ks)[None, :], mask=(rows < M)[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(w), acc)
    launch_next_kernel(PDL)
    store_matmul_outputs(acc, rows, rows_ok, cols, col_ok, out_ptr, bias_ptr, part_ptr, count_ptr, M, N, K,
                         in_sumsq_ptr, in_parts, eps, residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr, slot,
                         cos, sin, k_cache_ptr, v_cache_ptr, cache_stride_slot, cache_stride_h, num_heads,
                         num_kv_heads, HAS_BIAS, SPLIT_K, FEW, SILU_MUL, NORM_IN, ADD_NORM, ROPE, BLOCK_M, BLOCK_N,
                         HALF)


@triton.jit
def _int4_dequantize_kernel(w_ptr, zeros_ptr, scales_ptr, out_ptr, N, K, stride_w, stride_g, group_size,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """W [N, K] in out's dtype from the runtime layout, a [BLOCK_N, BLOCK_K] tile per program."""
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    words = tl.program_id(1) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    row_ok = (rows < N)[:, None]
    p = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + words[None, :], mask=row_ok & (words < K // 8)[None, :],
                other=0)
    p = tl.interleave(p, p)  # as in the GEMM: each word 8 times along K, so the stores are contiguous
    p = tl.interleave(p, p)
    p = tl.interleave(p, p)
    ok = row_ok & (ks < K)[None, :]
    g = rows.to(tl.int64)[:, None] * stride_g + (ks // group_size)[None, :]
    z = tl.load(zeros_ptr + g, mask=ok, other=0.0).to(tl.float32) + 8388608.0
    s = tl.load(scales_ptr + g, mask=ok, other=0.0).to(tl.float32)
    w = (_nibbles(p, ((ks % 8) * 4)[None, :]) - z) * s
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], w.to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_int4_triton(weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                           dtype: torch.dtype) -> torch.Tensor:
    """Triton version of `dequantize_int4`: W [N, K] in `dtype`."""
    out_features, words = weight.shape
    out = torch.empty(out_features, words * 8, dtype=dtype, device=weight.device)
    block_n, block_k = 32, 256
    pdl = programmatic_launch(weight)
    _int4_dequantize_kernel[(triton.cdiv(out_features, block_n), triton.cdiv(words * 8, block_k))](
        weight, zeros, scales, out, out_features, words * 8, weight.stride(0), zeros.stride(0), group_size,
        BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, **launch_options(pdl))
    return out


def gemv_config(out_features: int, in_features: int, group_size: int) -> dict[str, int]:
    """_int4_gemv_kernel's tiling for a weight [out_features, in_features] (kernels/split_k.py's
    large_tiling): rows a program, words a step (whole groups; no wider than K for a small weight),
    warps. A small weight: 8 rows a program of 2 warps, 2,048 input features a step; a large one:
    16 rows a program of one warp."""
    if not large_tiling(out_features, in_features):
        words = min(256, triton.next_power_of_2(in_features // 8))
        return dict(ROWS=8, BLOCK_W=max(words, group_size // 8), num_warps=2, num_stages=1)
    return dict(ROWS=16, BLOCK_W=max(64, group_size // 8), num_warps=1, num_stages=1)


def _checked(weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, zeros, scales) contiguous, as repack_awq makes them, once their shapes and the group
    size are checked (ValueError)."""
    out_features, words = weight.shape
    in_features = words * 8
    if group_size < 16 or group_size & (group_size - 1) or in_features % group_size:
        raise ValueError(f"the group size ({group_size}) must be a power of two >= 16 dividing K ({in_features})")
    if zeros.shape != (out_features, in_features // group_size) or scales.shape != zeros.shape:
        raise ValueError(f"zeros {tuple(zeros.shape)} and scales {tuple(scales.shape)} must both be "
                         f"[N, K / G] = [{out_features}, {in_features // group_size}]")
    return weight.contiguous(), zeros.contiguous(), scales.contiguous()


def int4_linear_triton(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                       group_size: int, bias: torch.Tensor | None = None, silu_mul: bool = False,
                       norm_in: NormScale | None = None) -> torch.Tensor:
    """Triton version of `int4_linear_ref`, same contract (x [..., K] in fp32, fp16 or bf16); up to
    FUSED_ROWS rows a norm_in's factors scale the kernels' outputs (x itself, first, above)."""
    weight, zeros, scales = _checked(weight, zeros, scales, group_size)
    x2 = x.reshape(-1, weight.shape[1] * 8)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if few_rows(x2):
        out, _, _ = _rows(x2, weight, zeros, scales, group_size, bias, silu_mul, norm_in, None)
    else:
        out, _, _ = _int4_matmul(x2 if norm_in is None else norm_in.apply(x2), weight, zeros, scales, group_size,
                                 bias)
        if silu_mul:
            out = activation.silu_mul(out)
    return out.view(*x.shape[:-1], out.shape[-1])


def _rows(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
          bias: torch.Tensor | None, silu_mul: bool, norm_in: NormScale | None,
          add_norm: tuple[torch.Tensor, torch.Tensor] | None, rope: RopeKV | None = None
          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [M, K] (M <= FEW_ROWS, contiguous) through the GEMV (one row) or the few-row tile GEMM,
    with the epilogues: outputs as _one_row's, with M rows."""
    kernel = _one_row if x.shape[0] == 1 else _int4_matmul
    return kernel(x, weight, zeros, scales, group_size, bias, silu_mul, norm_in, add_norm, rope)


def _one_row(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             bias: torch.Tensor | None, silu_mul: bool, norm_in: NormScale | None,
             add_norm: tuple[torch.Tensor, torch.Tensor] | None, rope: RopeKV | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [1, K] through the GEMV, tiled by weight size (gemv_config): out [1, N] ([1, N / 2]
    with silu_mul); with add_norm (residual [1, N], norm weight [N]), out is h * norm weight, and
    the new residual h and the sums of squares per row tile come too (else None, None); with rope,
    out is the rotated q [1, heads, head_dim] and k and v are in the caches."""
    out_features, words = weight.shape
    in_features = words * 8
    cfg = gemv_config(out_features, in_features, group_size)
    outputs = out_features // 2 if silu_mul else out_features
    paired = silu_mul or rope is not None  # a program's rows are ROWS / 2 pairs
    tiles = triton.cdiv(out_features // 2 if paired else out_features, cfg["ROWS"] // 2 if paired else cfg["ROWS"])
    q, rope_args = rope_arguments(x, rope)
    out = torch.empty(1, outputs, dtype=x.dtype, device=x.device) if q is None else q
    norm_args, residual_out, sumsq = norm_arguments(out, tiles, norm_in, add_norm)
    pdl = programmatic_launch(x)
    split_k, per_split = gemv_split(tiles, words, cfg["BLOCK_W"], x.device)
    part, counts = split_workspace(out.view(1, -1), split_k, tiles, out_features)
    _int4_gemv_kernel[(tiles, split_k)](
        x, weight, zeros, scales, bias, out, part, counts, out_features, in_features, weight.stride(0),
        zeros.stride(0), per_split, ONE_BITS, *norm_args, *rope_args, HAS_BIAS=bias is not None, GROUP=group_size,
        SPLIT_K=split_k, SILU_MUL=silu_mul, NORM_IN=norm_in is not None, ADD_NORM=add_norm is not None,
        ROPE=rope is not None, HALF=rope.head_dim // 2 if rope else 1, PDL=pdl, **cfg, **launch_options(pdl))
    return out, residual_out, sumsq


def _int4_matmul(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None, silu_mul: bool = False, norm_in: NormScale | None = None,
                 add_norm: tuple[torch.Tensor, torch.Tensor] | None = None, rope: RopeKV | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [M, K] @ W.T + bias → [M, N] for M > 1: the tile GEMM (up to TILE_GEMM_MAX_ROWS rows) or
    the weight dequantized once and cuBLAS (prefill); up to FUSED_ROWS rows with the epilogues,
    outputs as _one_row's."""
    out_features, words = weight.shape
    in_features = words * 8
    rows = x.shape[0]
    few = few_rows(x)
    assert few or not (silu_mul or norm_in or add_norm or rope), "the epilogues take up to FUSED_ROWS rows"
    if rows == 0:
        return x.new_empty(0, out_features), None, None
    if rows > TILE_GEMM_MAX_ROWS:  # prefill: the weight once in x's dtype, then the tensor cores at full K depth
        w = dequantize_int4_triton(weight, zeros, scales, group_size, x.dtype)
        return torch.nn.functional.linear(x, w, bias), None, None
    q, rope_args = rope_arguments(x, rope)
    out = torch.empty(rows, out_features // 2 if silu_mul else out_features, dtype=x.dtype, device=x.device) \
        if q is None else q
    pdl = programmatic_launch(x)
    cfg = matmul_config(rows)
    block_k = min(group_size, 64)
    paired = silu_mul or rope is not None  # a program's weight rows are BLOCK_N / 2 pairs
    num_tiles = (triton.cdiv(out_features // 2, cfg["BLOCK_N"] // 2) if paired
                 else triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(out_features, cfg["BLOCK_N"]))
    split_k, per_split = split_k_for(rows, num_tiles, in_features // block_k, in_features, x.device)
    part, counts = split_workspace(out.view(rows, -1), split_k, num_tiles, out_features)
    norm_args, residual_out, sumsq = norm_arguments(out, num_tiles, norm_in, add_norm)
    _int4_matmul_kernel[(num_tiles, split_k)](
        x, weight, zeros, scales, bias, out, part, counts, rows, out_features, in_features, x.stride(0),
        weight.stride(0), zeros.stride(0), group_size, per_split, *norm_args, *rope_args,
        HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK_K=block_k, GROUP_M=8, IEEE=x.dtype == torch.float32,
        FEW=few, SILU_MUL=silu_mul, NORM_IN=norm_in is not None, ADD_NORM=add_norm is not None,
        ROPE=rope is not None, HALF=rope.head_dim // 2 if rope else 1, PDL=pdl, **cfg, **launch_options(pdl))
    return out, residual_out, sumsq


def int4_linear(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None, silu_mul: bool = False,
                norm_in: NormScale | None = None) -> torch.Tensor:
    """y = x @ W.T + bias for W in the runtime layout (see repack_awq); with silu_mul, W is a merged
    gate/up weight and the result SiLU(gate) * up over y's two halves [..., N / 2] (in the one-row
    kernel's epilogue: a kernel less per decode layer). norm_in: x is one row still to be
    normalized (an add-norm epilogue's output), whose factor the one-row kernels apply to their
    outputs. Triton where `use_triton` says so, else the reference."""
    if use_triton(x):
        return int4_linear_triton(x, weight, zeros, scales, group_size, bias, silu_mul, norm_in)
    x = x if norm_in is None else norm_in.apply(x)
    return int4_linear_ref(x, weight, zeros, scales, group_size, bias, silu_mul)


def int4_linear_add_norm(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                         group_size: int, bias: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
    """y = x @ W.T + bias for up to FUSED_ROWS rows x [M, K], then the residual add and RMSNorm that
    follow it, as kernels/rmsnorm.py's add_norm_ref: (y + residual) * norm_weight, the new residual
    y + residual, and the NormScale the next projection applies (int4_linear's norm_in). It is the
    kernels' epilogue: no norm kernel between two projections. Under PDL the one-row kernel reads
    `residual` before waiting for the kernel before it, so that kernel must not be what wrote it
    (in the decoder an add-norm's residual comes from the add-norm two or more kernels back).
    Elsewhere (more rows, or inside unfolded_norms()) the projection, then the norm kernel:
    (normalized, new residual, None)."""
    if folds_norms(x) and few_rows(x):
        out, h, sumsq = _rows(x.reshape(-1, x.shape[-1]).contiguous(), *_checked(weight, zeros, scales, group_size),
                              group_size, bias, False, None, (residual.reshape(-1, residual.shape[-1]), norm_weight))
        return out.view(residual.shape), h.view(residual.shape), NormScale(sumsq, eps)
    return (*rms_norm(int4_linear(x, weight, zeros, scales, group_size, bias), norm_weight, eps, residual), None)


def int4_linear_rope_kv(x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                        group_size: int, bias: torch.Tensor | None, norm_in: NormScale | None, rope: RopeKV
                        ) -> torch.Tensor:
    """A merged QKV projection of up to FUSED_ROWS rows x [M, K], then RoPE and the KV write, in the
    kernels' epilogue (kernels/float_linear.py's float_linear_rope_kv): the rotated q [M, heads,
    head_dim]. Elsewhere the projection, then rope_store_kv."""
    if use_triton(x) and few_rows(x) and rope.head_dim % 2 == 0:
        q, _, _ = _rows(x.reshape(-1, x.shape[-1]).contiguous(), *_checked(weight, zeros, scales, group_size),
                        group_size, bias, False, norm_in, None, rope)
        return q
    return rope_store_qkv(int4_linear(x, weight, zeros, scales, group_size, bias, norm_in=norm_in), rope)
