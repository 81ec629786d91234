"""Linear layers over float weights (bf16, fp16, fp32) W [N, K]: for decode, a one-row Triton GEMV
(batch 1, and a version of it for up to 8 rows over small weights; a wide gate/up weight streamed
through TMA on Hopper) and a few-row tensor-core kernel (up to FEW_ROWS rows), all with the epilogues the
quantized one-row kernels have (kernels/split_k.py): SiLU·up, the add-norm that leaves the next
norm to the next projection, that projection's scaled outputs, and RoPE with the KV write
(kernels/rope.py). Larger batches go to cuBLAS (F.linear).

Against cuBLAS the kernels save more than their own time: their epilogues take the norm, SiLU·up and
RoPE kernels of a decode layer with them, and they launch with PDL (the GEMVs read their first
weights before the previous kernel ends). The few-row kernel lets the next kernel launch only after its
K loop: letting it launch at once filled the SMs with waiting programs, which slowed both it and the
decode attention after it (docs/performance.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import activation
from kernels.dispatch import (folds_norms, has_tma, launch_next_kernel, launch_options, programmatic_launch,
                              use_triton, wait_for_previous_kernel)
from kernels.rmsnorm import NormScale, rms_norm
from kernels.rope import RopeKV, rope_arguments, rope_store_qkv
from kernels.split_k import (FEW_ROWS, add_norm_operands, few_rows, gemv_split, large_tiling, matmul_outputs,
                             norm_arguments, norm_factor, one_row_outputs, split_k_for, split_workspace,
                             store_matmul_outputs, store_one_row_outputs)


def float_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     silu_mul: bool = False) -> torch.Tensor:
    """Torch reference: x [..., K] @ W.T + bias → [..., N] (SiLU·up → [..., N / 2])."""
    y = F.linear(x, weight, bias)
    return activation.silu_mul_ref(y) if silu_mul else y


@triton.jit
def _float_gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, stride_w, k_per_split,
    in_sumsq_ptr, in_parts, eps, residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr,
    positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, k_cache_ptr, v_cache_ptr, cache_stride_slot,
    cache_stride_h, num_heads, num_kv_heads,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr, NORM_IN: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
    PDL: tl.constexpr, AHEAD: tl.constexpr,
):
    """One row of x against ROWS weight rows, BLOCK_K inputs a step (split along K when the rows
    alone leave SMs idle). Each thread keeps float32 sums per weight it reads, reduced once at the
    end. SILU_MUL, NORM_IN and ADD_NORM: as in kernels/int4_linear.py's one-row kernel. ROPE: a
    merged QKV weight whose epilogue is kernels/rope.py's store_rope_kv (out is then q)."""
    rows, row_ok, slot, cos, sin = one_row_outputs(N, positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride,
                                                   out_ptr.dtype.element_ty, ROWS, SILU_MUL, ROPE, HALF)
    k_begin = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    k = k_begin + tl.arange(0, BLOCK_K)
    # Weights are never written, so the first step's may be read before the previous kernel ends.
    w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & (k < k_end)[None, :], other=0.0)
    if AHEAD == 2:  # two steps in flight: more bytes a thread while the SM waits on DRAM
        w2 = tl.load(w_rows + (k + BLOCK_K)[None, :], mask=row_ok[:, None] & (k + BLOCK_K < k_end)[None, :],
                     other=0.0)
    bias, residual, norm_w = add_norm_operands(rows, row_ok, bias_ptr, residual_ptr, norm_w_ptr, HAS_BIAS, ADD_NORM)
    wait_for_previous_kernel(PDL)
    if NORM_IN:  # its partial sums' latency under the loop's
        factor = norm_factor(in_sumsq_ptr, in_parts, K, eps, 256)
    acc = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + k, mask=k < k_end, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * xk[None, :]
        k_next = k + AHEAD * BLOCK_K  # steps ahead: the next weights in flight while these are summed
        w_next = tl.load(w_rows + k_next[None, :], mask=row_ok[:, None] & (k_next < k_end)[None, :], other=0.0)
        if AHEAD == 2:
            w, w2 = w2, w_next
        else:
            w = w_next
    y = tl.sum(acc, axis=1)
    if NORM_IN:
        y *= factor
    store_one_row_outputs(y, rows, row_ok, out_ptr, bias_ptr, part_ptr, count_ptr, N, bias, residual, norm_w,
                          residual_out_ptr, sumsq_ptr, slot, cos, sin, k_cache_ptr, v_cache_ptr, cache_stride_slot,
                          cache_stride_h, num_heads, num_kv_heads, HAS_BIAS, SPLIT_K, SILU_MUL, ADD_NORM, ROPE, ROWS,
                          HALF)


@triton.jit
def _float_gemv_tma_kernel(
    x_ptr, w_desc, out_ptr, half_n, K, in_sumsq_ptr, in_parts, eps,
    PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, EARLY_STEPS: tl.constexpr,
    NORM_IN: tl.constexpr, PDL: tl.constexpr,
):
    """_float_gemv_kernel's SiLU·up over a wide merged gate/up weight, its weights streamed by the
    tensor memory accelerator: each program's PAIRS gate rows and their up rows half_n further on,
    BLOCK_K inputs a step, STAGES steps in flight through shared memory, the first EARLY_STEPS (1 or
    2) read before the wait. Rows and inputs past the weight's edge load as zeros."""
    tl.static_assert(EARLY_STEPS == 1 or EARLY_STEPS == 2)  # the loop starts past them: any other would skip steps
    p0 = tl.program_id(0) * PAIRS
    k = tl.arange(0, BLOCK_K)
    gate_w = w_desc.load([p0, 0])
    up_w = w_desc.load([half_n + p0, 0])
    if EARLY_STEPS == 2:
        gate_w2 = w_desc.load([p0, BLOCK_K])
        up_w2 = w_desc.load([half_n + p0, BLOCK_K])
    wait_for_previous_kernel(PDL)
    if NORM_IN:  # its partial sums' latency under the loop's
        factor = norm_factor(in_sumsq_ptr, in_parts, K, eps, 256)
    xk = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    gate = gate_w.to(tl.float32) * xk[None, :]
    up = up_w.to(tl.float32) * xk[None, :]
    if EARLY_STEPS == 2:
        xk = tl.load(x_ptr + BLOCK_K + k, mask=BLOCK_K + k < K, other=0.0).to(tl.float32)
        gate += gate_w2.to(tl.float32) * xk[None, :]
        up += up_w2.to(tl.float32) * xk[None, :]
    for k0 in tl.range(EARLY_STEPS * BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        gate_w = w_desc.load([p0, k0])
        up_w = w_desc.load([half_n + p0, k0])
        xk = tl.load(x_ptr + k0 + k, mask=k0 + k < K, other=0.0).to(tl.float32)
        gate += gate_w.to(tl.float32) * xk[None, :]
        up += up_w.to(tl.float32) * xk[None, :]
    g = tl.sum(gate, axis=1)
    u = tl.sum(up, axis=1)
    if NORM_IN:
        g *= factor
        u *= factor
    # Gate and up rounded to out's dtype first, as the projection then the SiLU·up kernel would.
    g = g.to(out_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(out_ptr.dtype.element_ty).to(tl.float32)
    pairs = p0 + tl.arange(0, PAIRS)
    tl.store(out_ptr + pairs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=pairs < half_n)


@triton.jit
def _float_rows_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_x, stride_w, k_tiles_per_split,
    in_sumsq_ptr, in_parts, eps, residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr,
    positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, k_cache_ptr, v_cache_ptr, cache_stride_slot,
    cache_stride_h, num_heads, num_kv_heads,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr, NORM_IN: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr,
    HALF: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    """The few-row (decode batches up to FEW_ROWS) version of _float_gemv_kernel: M rows of x
    against BLOCK_N weight rows, a tensor-core dot a BLOCK_K step (split along K when the tiles
    alone leave SMs idle), with the same epilogues per row: the weight rows are the one-row
    kernel's (SiLU·up or RoPE pairs), the norm factors and add-norm sums one per row."""
    m, m_ok, cols, col_ok, slot, cos, sin = matmul_outputs(
        M, N, positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, out_ptr.dtype.element_ty, BLOCK_M, BLOCK_N,
        1, True, SILU_MUL, ROPE, HALF)
    k_begin = tl.program_id(1) * k_tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + k_tiles_per_split * BLOCK_K, K)
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_x
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    wait_for_previous_kernel(PDL, False)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + ks
        k_ok = k < k_end
        xt = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xt, wt, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, wt, acc)
    launch_next_kernel(PDL)
    store_matmul_outputs(acc, m, m_ok, cols, col_ok, out_ptr, bias_ptr, part_ptr, count_ptr, M, N, K, in_sumsq_ptr,
                         in_parts, eps, residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr, slot, cos, sin,
                         k_cache_ptr, v_cache_ptr, cache_stride_slot, cache_stride_h, num_heads, num_kv_heads, HAS_BIAS,
                         SPLIT_K, True, SILU_MUL, NORM_IN, ADD_NORM, ROPE, BLOCK_M, BLOCK_N, HALF)


@triton.jit
def _row_sum(w, x_ptrs, ok, I: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
             VEC: tl.constexpr):
    """w [ROWS, BLOCK_K] times row I of x, summed over each run of VEC inputs: [ROWS, BLOCK_K / VEC]
    (a thread's own runs: no shuffles). A row from x's M on is not multiplied: it is -0.0, which the
    sums' adds drop."""
    if I < M:
        xk = tl.load(x_ptrs, mask=ok, other=0.0).to(tl.float32)
        s = tl.sum(tl.reshape(w * xk[None, :], [ROWS, BLOCK_K // VEC, VEC]), axis=2)
    else:
        s = tl.full([ROWS, BLOCK_K // VEC], -0.0, tl.float32)
    return s


@triton.jit
def _row_sums(w, x_ptrs, stride_x, M: tl.constexpr, ok, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
              VEC: tl.constexpr, BLOCK_M: tl.constexpr):
    """_row_sum for rows 0 .. BLOCK_M of x (2, 4 or 8; only its M rows multiplied), joined along a
    last axis [ROWS, BLOCK_K / VEC, BLOCK_M] that stays in each thread. A join's new axis is the
    minor one, so the even rows are joined first, then with the odd."""
    r0 = _row_sum(w, x_ptrs, ok, 0, M, ROWS, BLOCK_K, VEC)
    r1 = _row_sum(w, x_ptrs + stride_x, ok, 1, M, ROWS, BLOCK_K, VEC)
    if BLOCK_M == 2:
        s = tl.join(r0, r1)
    else:
        r2 = _row_sum(w, x_ptrs + 2 * stride_x, ok, 2, M, ROWS, BLOCK_K, VEC)
        r3 = _row_sum(w, x_ptrs + 3 * stride_x, ok, 3, M, ROWS, BLOCK_K, VEC)
        if BLOCK_M == 4:
            s = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [ROWS, BLOCK_K // VEC, 4])
        else:
            r4 = _row_sum(w, x_ptrs + 4 * stride_x, ok, 4, M, ROWS, BLOCK_K, VEC)
            r5 = _row_sum(w, x_ptrs + 5 * stride_x, ok, 5, M, ROWS, BLOCK_K, VEC)
            r6 = _row_sum(w, x_ptrs + 6 * stride_x, ok, 6, M, ROWS, BLOCK_K, VEC)
            r7 = _row_sum(w, x_ptrs + 7 * stride_x, ok, 7, M, ROWS, BLOCK_K, VEC)
            evens = tl.join(tl.join(r0, r4), tl.join(r2, r6))
            odds = tl.join(tl.join(r1, r5), tl.join(r3, r7))
            s = tl.reshape(tl.join(evens, odds), [ROWS, BLOCK_K // VEC, 8])
    return s


@triton.jit
def _float_rows_gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M: tl.constexpr, N, K, stride_x, stride_w, k_per_split,
    in_sumsq_ptr, in_parts, eps, residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr,
    positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, k_cache_ptr, v_cache_ptr, cache_stride_slot,
    cache_stride_h, num_heads, num_kv_heads,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr, NORM_IN: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr,
    HALF: tl.constexpr, PDL: tl.constexpr,
):
    """_float_rows_kernel for small weights, on the CUDA cores: each program reads its ROWS weight
    rows once, as the one-row GEMV does (BLOCK_K inputs a step, the first before the wait; split
    along K as it splits), and multiplies each weight by all M rows of x in registers. Each thread
    sums its products over the VEC adjacent inputs it holds of a row (no shuffles in the loop), so
    its float32 sums are BLOCK_M x its rows x its runs of VEC, reduced across threads once at the
    end; the few-row epilogues after."""
    VEC: tl.constexpr = 128 // w_ptr.dtype.element_ty.primitive_bitwidth  # inputs in one 16-byte load
    m, m_ok, cols, col_ok, slot, cos, sin = matmul_outputs(
        M, N, positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, out_ptr.dtype.element_ty, BLOCK_M, ROWS,
        1, True, SILU_MUL, ROPE, HALF)
    k_begin = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    k = k_begin + tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & (k < k_end)[None, :], other=0.0)
    wait_for_previous_kernel(PDL, False)  # the next kernel launches after the K loop, as after the dots'
    acc = tl.zeros([ROWS, BLOCK_K // VEC, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        acc += _row_sums(w.to(tl.float32), x_ptr + k, stride_x, M, k < k_end, ROWS, BLOCK_K, VEC, BLOCK_M)
        k_next = k + BLOCK_K  # the next weights in flight while these are summed
        w = tl.load(w_rows + k_next[None, :], mask=col_ok[:, None] & (k_next < k_end)[None, :], other=0.0)
    launch_next_kernel(PDL)
    acc = tl.trans(tl.sum(acc, axis=1))  # [BLOCK_M, ROWS]
    store_matmul_outputs(acc, m, m_ok, cols, col_ok, out_ptr, bias_ptr, part_ptr, count_ptr, M, N, K, in_sumsq_ptr,
                         in_parts, eps, residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr, slot, cos, sin,
                         k_cache_ptr, v_cache_ptr, cache_stride_slot, cache_stride_h, num_heads, num_kv_heads,
                         HAS_BIAS, SPLIT_K, True, SILU_MUL, NORM_IN, ADD_NORM, ROPE, BLOCK_M, ROWS, HALF)


def gemv_config(out_features: int, in_features: int, element_size: int) -> dict[str, int]:
    """_float_gemv_kernel's tiling by weight shape (kernels/split_k.py's large_tiling). A small weight
    takes 4 rows a program of 4 warps, 2 KB of each row a step (the first loaded before the wait); a
    large wide one (gate/up: enough rows to fill the GPU unsplit) 8 rows a program of 2 warps, 1 KB
    a step; a large deep one (down: few rows, long K) 16 rows of 2 warps, 256 bytes a step, two
    steps ahead. Each is split along K where its rows leave SMs idle (gemv_split). Measured fastest
    in bench/quant_kernels.py --float-one-row, then in the engine (docs/performance.md)."""
    if not large_tiling(out_features, in_features):
        return dict(ROWS=4, BLOCK_K=min(2048 // element_size, triton.next_power_of_2(in_features)), num_warps=4,
                    AHEAD=1)
    if out_features >= in_features:
        return dict(ROWS=8, BLOCK_K=1024 // element_size, num_warps=2, AHEAD=1)
    return dict(ROWS=16, BLOCK_K=256 // element_size, num_warps=2, AHEAD=2)


def tma_config(element_size: int, in_features: int) -> dict[str, int]:
    """_float_gemv_tma_kernel's tiling: 8 pairs (16 weight rows) a program of 2 warps, 512 bytes of
    each row a step, 3 steps in flight (the fastest of 80 TMA tilings on the 1B shape's gate/up).
    Two steps are read before the wait where they are half the row or more (the 0.5B shape's
    gate/up gained; deeper rows gained nothing from it; docs/performance.md)."""
    block_k = 512 // element_size
    return dict(PAIRS=8, BLOCK_K=block_k, STAGES=3, EARLY_STEPS=2 if in_features <= 4 * block_k else 1, num_warps=2)


def tma_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether one row of SiLU·up over this merged gate/up weight takes _float_gemv_tma_kernel: a
    wide weight of the large tiling, on a GPU with the tensor memory accelerator (or Triton's
    interpreter), its rows 16-byte aligned as TMA needs."""
    out_features, in_features = weight.shape
    return (large_tiling(out_features, in_features) and out_features >= in_features and out_features % 2 == 0
            and has_tma(x) and weight.data_ptr() % 16 == 0 and weight.stride(0) * weight.element_size() % 16 == 0)


# By dtype, the most rows the float layers send through our kernels (the few-row one at
# rows_config's tiling): faster than cuBLAS and the separate kernels at 2-16 rows of bf16
# in the engine (docs/performance.md, What helped). float32's tensor-core dots are exact (IEEE) and
# 2-3x slower than cuBLAS at a few rows: it takes the one-row GEMV only.
FLOAT_FUSED_ROWS: dict[torch.dtype, int] = {torch.bfloat16: FEW_ROWS, torch.float16: FEW_ROWS, torch.float32: 1}


# Which few rows take _float_rows_gemv_kernel (rows_gemv_fits) rather than the tensor-core kernel: up
# to ROWS_GEMV_MOST rows, any small weight the one-row GEMV reads unsplit; past it, up to
# ROWS_GEMV_MAX rows (the most its sums are written for), such a weight of at most
# ROWS_GEMV_PRODUCTS rows x weights, and past ROWS_GEMV_FILL_PAST rows only one whose rows fill at
# least ROWS_GEMV_FILL of the inputs its K steps read (masked lanes cost FMAs too). There the
# latency the GEMV hides outweighs the FMAs it adds (docs/performance.md).
ROWS_GEMV_MOST = 2
ROWS_GEMV_MAX = 8
ROWS_GEMV_PRODUCTS = 10 << 20
ROWS_GEMV_FILL = 0.8
ROWS_GEMV_FILL_PAST = 6
# Module constants for bench/graph_ab.py and bench/quant_kernels.py: the rows GEMV also over small
# weights the one-row GEMV splits along K (the 1B shape's O), split as it splits them, and over large
# weights. Both measured slower than the tensor-core kernel (docs/performance.md).
ROWS_GEMV_SPLIT = False
ROWS_GEMV_LARGE = False


def rows_gemv_fits(rows: int, out_features: int, in_features: int, element_size: int, device: torch.device) -> bool:
    """Whether `rows` rows of x over this weight take _float_rows_gemv_kernel (ROWS_GEMV_MOST and
    the constants after it)."""
    if rows > ROWS_GEMV_MAX or large_tiling(out_features, in_features) and not ROWS_GEMV_LARGE:
        return False
    cfg = gemv_config(out_features, in_features, element_size)
    if rows > ROWS_GEMV_MOST:
        if rows * out_features * in_features > ROWS_GEMV_PRODUCTS:
            return False
        read = triton.cdiv(in_features, cfg["BLOCK_K"]) * cfg["BLOCK_K"]
        if rows > ROWS_GEMV_FILL_PAST and in_features < ROWS_GEMV_FILL * read:
            return False
    return ROWS_GEMV_SPLIT or gemv_split(triton.cdiv(out_features, cfg["ROWS"]), in_features, cfg["BLOCK_K"],
                                         device)[0] == 1


def rows_config(element_size: int) -> dict[str, int]:
    """_float_rows_kernel's tiling: 32 weight rows a program, 256 bytes of each a K step, 4 warps,
    3 stages, split along K to about `per_sm` programs per SM (the fastest of 35 tilings at 8 rows in
    bench/quant_kernels.py --float-few-rows)."""
    return dict(BLOCK_N=32, BLOCK_K=256 // element_size, num_warps=4, num_stages=3, per_sm=2)


def fused_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [..., K] goes through our kernels (one row: the GEMV; up to FLOAT_FUSED_ROWS of its
    dtype: the few-row kernel), which have the epilogues: on Triton, a unit-stride weight."""
    return use_triton(x) and few_rows(x, FLOAT_FUSED_ROWS.get(x.dtype, 1)) and weight.stride(1) == 1


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
          norm_in: NormScale | None, add_norm: tuple[torch.Tensor, torch.Tensor] | None, rope: RopeKV | None = None
          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One row x [1, K] through _float_gemv_kernel: out [1, N] ([1, N / 2] with silu_mul); with
    add_norm (residual [1, N], norm weight [N]) out is h * norm weight, and the new residual h and
    the sums of squares per row tile come too (else None, None); with rope, out is the rotated q
    [1, heads, head_dim] and k and v are in the caches."""
    if silu_mul and bias is None and tma_fits(x, weight):
        return _gemv_tma(x, weight, norm_in), None, None
    out_features, in_features = weight.shape
    outputs = out_features // 2 if silu_mul else out_features
    cfg = gemv_config(out_features, in_features, weight.element_size())
    paired = silu_mul or rope is not None  # a program's rows are ROWS / 2 pairs
    tiles = triton.cdiv(out_features // 2 if paired else out_features, cfg["ROWS"] // 2 if paired else cfg["ROWS"])
    q, rope_args = rope_arguments(x, rope)
    out = torch.empty(1, outputs, dtype=x.dtype, device=x.device) if q is None else q
    split_k, per_split = gemv_split(tiles, in_features, cfg["BLOCK_K"], x.device)
    part, counts = split_workspace(out.view(1, -1), split_k, tiles, out_features)
    norm_args, residual_out, sumsq = norm_arguments(out, tiles, norm_in, add_norm)
    pdl = programmatic_launch(x)
    _float_gemv_kernel[(tiles, split_k)](
        x, weight, bias, out, part, counts, out_features, in_features, weight.stride(0), per_split, *norm_args,
        *rope_args, HAS_BIAS=bias is not None, SPLIT_K=split_k, SILU_MUL=silu_mul, NORM_IN=norm_in is not None,
        ADD_NORM=add_norm is not None, ROPE=rope is not None, HALF=rope.head_dim // 2 if rope else 1, PDL=pdl,
        num_stages=1, **cfg, **launch_options(pdl))
    return out, residual_out, sumsq


def _gemv_tma(x: torch.Tensor, weight: torch.Tensor, norm_in: NormScale | None) -> torch.Tensor:
    """One row x [1, K] of SiLU·up over a merged gate/up weight (tma_fits) through
    _float_gemv_tma_kernel: [1, N / 2]."""
    out_features, in_features = weight.shape
    cfg = tma_config(weight.element_size(), in_features)
    pairs = cfg.pop("PAIRS")
    out = torch.empty(1, out_features // 2, dtype=x.dtype, device=x.device)
    desc = TensorDescriptor.from_tensor(weight, [pairs, cfg["BLOCK_K"]])
    norm_args, _, _ = norm_arguments(out, 1, norm_in, None)
    pdl = programmatic_launch(x)
    _float_gemv_tma_kernel[(triton.cdiv(out_features // 2, pairs),)](
        x, desc, out, out_features // 2, in_features, *norm_args[:3], PAIRS=pairs, NORM_IN=norm_in is not None,
        PDL=pdl, **cfg, **launch_options(pdl))
    return out


def _rows_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
               norm_in: NormScale | None, add_norm: tuple[torch.Tensor, torch.Tensor] | None, rope: RopeKV | None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [M, K] (2 <= M, a weight rows_gemv_fits) through _float_rows_gemv_kernel at the one-row
    GEMV's tiling and K split; its outputs as _rows'."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    q, rope_args = rope_arguments(x, rope)
    out = torch.empty(rows, out_features // 2 if silu_mul else out_features, dtype=x.dtype, device=x.device) \
        if q is None else q
    cfg = gemv_config(out_features, in_features, weight.element_size())
    cfg.pop("AHEAD")
    per_program = cfg.pop("ROWS")
    paired = silu_mul or rope is not None
    tiles = triton.cdiv(out_features // 2 if paired else out_features, per_program // 2 if paired else per_program)
    split_k, per_split = gemv_split(tiles, in_features, cfg["BLOCK_K"], x.device)
    part, counts = split_workspace(out.view(rows, -1), split_k, tiles, out_features)
    norm_args, residual_out, sumsq = norm_arguments(out, tiles, norm_in, add_norm)
    pdl = programmatic_launch(x)
    _float_rows_gemv_kernel[(tiles, split_k)](
        x, weight, bias, out, part, counts, rows, out_features, in_features, x.stride(0), weight.stride(0), per_split,
        *norm_args, *rope_args, HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(rows), ROWS=per_program,
        SPLIT_K=split_k, SILU_MUL=silu_mul, NORM_IN=norm_in is not None, ADD_NORM=add_norm is not None,
        ROPE=rope is not None, HALF=rope.head_dim // 2 if rope else 1, PDL=pdl, num_stages=1,
        **cfg, **launch_options(pdl))
    return out, residual_out, sumsq


def _rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
          norm_in: NormScale | None, add_norm: tuple[torch.Tensor, torch.Tensor] | None, rope: RopeKV | None = None
          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [M, K] (M <= FEW_ROWS, contiguous) through our kernels: _gemv for one row, else
    _float_rows_kernel; its outputs as _gemv's, with M rows."""
    if x.shape[0] == 1:
        return _gemv(x, weight, bias, silu_mul, norm_in, add_norm, rope)
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if rows_gemv_fits(rows, out_features, in_features, weight.element_size(), x.device):
        return _rows_gemv(x, weight, bias, silu_mul, norm_in, add_norm, rope)
    q, rope_args = rope_arguments(x, rope)
    out = torch.empty(rows, out_features // 2 if silu_mul else out_features, dtype=x.dtype, device=x.device) \
        if q is None else q
    cfg = rows_config(weight.element_size())
    block_n, block_k, per_sm = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("per_sm")
    paired = silu_mul or rope is not None  # a program's weight rows are BLOCK_N / 2 pairs
    tiles = triton.cdiv(out_features // 2 if paired else out_features, block_n // 2 if paired else block_n)
    split_k, per_split = split_k_for(rows, tiles, triton.cdiv(in_features, block_k), in_features, x.device, per_sm)
    part, counts = split_workspace(out.view(rows, -1), split_k, tiles, out_features)
    norm_args, residual_out, sumsq = norm_arguments(out, tiles, norm_in, add_norm)
    pdl = programmatic_launch(x)
    _float_rows_kernel[(tiles, split_k)](
        x, weight, bias, out, part, counts, rows, out_features, in_features, x.stride(0), weight.stride(0), per_split,
        *norm_args, *rope_args, HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, SILU_MUL=silu_mul, NORM_IN=norm_in is not None, ADD_NORM=add_norm is not None,
        ROPE=rope is not None, HALF=rope.head_dim // 2 if rope else 1, IEEE=x.dtype == torch.float32, PDL=pdl,
        **cfg, **launch_options(pdl))
    return out, residual_out, sumsq


class PackedWeight:
    """An MKL-packed copy of a float32 weight on CPU, for x of MIN_ROWS up to `rows` rows (a verify
    step's tokens): from 4 rows on, MKL's GEMM repacks an unpacked weight at every call, which made a
    5-row step cost 1.8 one-row steps on CPU. The packing is for exactly `rows` rows; fewer are
    padded to it. The weight itself stays for other row counts."""

    MIN_ROWS = 4  # below it MKL's small-row path reads the weight once already

    def __init__(self, weight: torch.Tensor, rows: int) -> None:
        self.weight, self.rows = weight, rows
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)

    @classmethod
    def of(cls, weight: torch.Tensor, rows: int) -> PackedWeight | None:
        """A packed copy of `weight` for `rows` rows, or None where it would not help or MKL cannot."""
        if (rows < cls.MIN_ROWS or weight.device.type != "cpu" or weight.dtype != torch.float32
                or not torch.backends.mkl.is_available()):
            return None
        return cls(weight, rows)

    def takes(self, x: torch.Tensor) -> bool:
        return self.MIN_ROWS <= x.numel() // x.shape[-1] <= self.rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        m = rows.shape[0]
        if m < self.rows:
            rows = torch.cat([rows, rows.new_zeros(self.rows - m, rows.shape[1])])
        y = torch.ops.mkl._mkl_linear(rows, self.packed, self.weight, bias, self.rows)[:m]
        return y.view(*x.shape[:-1], y.shape[-1])


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
          packed: PackedWeight | None = None) -> torch.Tensor:
    """F.linear (cuBLAS, or torch's CPU matmul), through `packed` where it takes x."""
    if packed is not None and packed.takes(x):
        return packed(x, bias)
    return F.linear(x, weight, bias)


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
                 norm_in: NormScale | None = None, packed: PackedWeight | None = None) -> torch.Tensor:
    """y = x @ W.T + bias; with silu_mul (a merged gate/up weight) SiLU(gate) * up [..., N / 2].
    norm_in: x's rows are still to be normalized (an add-norm epilogue's output), whose factors our
    kernels apply to their outputs (elsewhere x is scaled first). Our kernels up to FLOAT_FUSED_ROWS rows on
    Triton (fused_rows), else cuBLAS (or torch's CPU matmul, through `packed` where it takes x) and the
    SiLU·up kernel."""
    if fused_rows(x, weight):
        out, _, _ = _rows(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias, silu_mul, norm_in, None)
        return out.view(*x.shape[:-1], out.shape[-1])
    y = dense(x if norm_in is None else norm_in.apply(x), weight, bias, packed)
    return activation.silu_mul(y) if silu_mul else y


def float_linear_add_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float
                          ) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
    """y = x @ W.T + bias, then the residual add and RMSNorm after it, as int4_linear_add_norm: our
    kernels' add-norm epilogue where they run and norms fold (kernels/dispatch.py's folds_norms),
    leaving each row's norm factor to the next projection (h * norm_weight, h, NormScale);
    elsewhere the projection and the norm kernel (normalized, h, None)."""
    if folds_norms(x) and fused_rows(x, weight):
        out, h, sumsq = _rows(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias, False, None,
                              (residual.reshape(-1, residual.shape[-1]), norm_weight))
        return out.view(residual.shape), h.view(residual.shape), NormScale(sumsq, eps)
    return (*rms_norm(float_linear(x, weight, bias), norm_weight, eps, residual), None)


def float_linear_rope_kv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_in: NormScale | None,
                         rope: RopeKV) -> torch.Tensor:
    """A merged QKV projection, then RoPE and the KV write (kernels/rope.py's rope_store_kv): the
    rotated q [tokens, heads, head_dim]. Up to FLOAT_FUSED_ROWS rows on Triton, one kernel with
    store_rope_kv as its epilogue; elsewhere the projection, then rope_store_kv."""
    if fused_rows(x, weight) and rope.head_dim % 2 == 0:
        q, _, _ = _rows(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias, False, norm_in, None, rope)
        return q
    return rope_store_qkv(float_linear(x, weight, bias, norm_in=norm_in), rope)

