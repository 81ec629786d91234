"""FP8 (e4m3) weight linear layers: weights stored as float8_e4m3fn [N, K] with a float32 scale per
output channel (a per-tensor scale is the same value for every channel), W = w_fp8 * scale[:, None].

Two GPU paths:
  - w8a16 Triton kernels (decode, M <= 16, and prefill where the next path is unavailable): a
    one-row kernel over int32 words of four e4m3 bytes (M = 1), and a tile GEMM with
    kernels/split_k.py's tiling and split-K, as INT4's. Both read the weight once, decode e4m3 in registers
    with integer ops (exact; no fp8 loads, so Triton's CPU interpreter runs them too; on Ada and
    Hopper the one-row kernel uses the hardware's e4m3 conversion instead), accumulate in float32
    and apply the channel scale once at the end.
  - w8a8 for prefill (M > 16) on Hopper/Ada: torch._scaled_mm on fp8 tensor cores, x quantized to
    e4m3 per token. Rounding x to 3 mantissa bits costs about 2-3% relative error per output
    (w8a16 costs only the output rounding), the usual price of FP8 prefill.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import activation
from kernels.dispatch import (folds_norms, launch_next_kernel, launch_options, programmatic_launch, use_triton,
                              wait_for_previous_kernel)
from kernels.rmsnorm import NormScale, rms_norm
from kernels.rope import RopeKV, rope_arguments, rope_store_qkv
from kernels.split_k import (add_norm_operands, few_rows, gemv_split, large_tiling, matmul_config, matmul_outputs,
                             norm_arguments, norm_factor, one_row_outputs, split_k_for, split_workspace,
                             store_matmul_outputs, store_one_row_outputs)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weights → (float8_e4m3fn [N, K], float32 per-channel scale [N]): each row's
    largest magnitude maps to FP8_MAX."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """Torch reference: dequantize the weight, then x [M, K] @ W.T → [M, N] in x's dtype (SiLU·up →
    [M, N / 2])."""
    w = (weight.float() * weight_scale.float()[:, None]).to(x.dtype)
    y = x @ w.t()
    y = y if bias is None else y + bias
    return activation.silu_mul_ref(y) if silu_mul else y


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_wn, tiles_per_split,
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
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(split * tiles_per_split, tl.minimum((split + 1) * tiles_per_split, tl.cdiv(K, BLOCK_K))):
        k = tile * BLOCK_K + ks
        k_ok = k < K
        bits = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0).to(tl.int32)
        # e4m3's sign, exponent and mantissa moved into a float16's fields: exactly the e4m3 value
        # / 2**8, subnormals included (the 2**8 joins the channel scale; e4m3fn's NaN reads as 480).
        w = (((bits & 0x7F) << 7) | ((bits & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        xt = tl.load(x_rows + k[None, :], mask=(rows < M)[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xt, w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, w.to(x_ptr.dtype.element_ty), acc)
    scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0) * 256.0
    acc = acc * scale[None, :]
    launch_next_kernel(PDL)
    store_matmul_outputs(acc, rows, rows_ok, cols, col_ok, out_ptr, bias_ptr, part_ptr, count_ptr, M, N, K,
                         in_sumsq_ptr, in_parts, eps, residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr, slot,
                         cos, sin, k_cache_ptr, v_cache_ptr, cache_stride_slot, cache_stride_h, num_heads,
                         num_kv_heads, HAS_BIAS, SPLIT_K, FEW, SILU_MUL, NORM_IN, ADD_NORM, ROPE, BLOCK_M, BLOCK_N,
                         HALF)


# e4m3 byte j of a word, moved to the top 8 bits and shifted right (arithmetically) by 4: its sign
# stays at bit 31 and its exponent and mantissa land on float32's bits 20..26. Masked with
# SIGN_EXP_MAN that is the e4m3 value / 2**120, subnormals included (as float32 subnormals).
SIGN_EXP_MAN = 0x87F00000 - 2**32  # as a signed int32: a kernel argument, so that ptxas keeps it in a register


@triton.jit
def e4m3x4_to_f32(words):
    """The four e4m3 bytes of each int32 as four float32 tensors (byte j → the j-th), exactly, by
    Hopper's cvt.rn.f16x2.e4m3x2 (two bytes a conversion) and f16 → f32 conversions: less work a
    weight than the shifts-and-mask decode."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi, a, b, c, d;
        .reg .b32 h01, h23;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 h01, lo;
        cvt.rn.f16x2.e4m3x2 h23, hi;
        mov.b32 {a, b}, h01;
        mov.b32 {c, d}, h23;
        cvt.f32.f16 $0, a;
        cvt.f32.f16 $1, b;
        cvt.f32.f16 $2, c;
        cvt.f32.f16 $3, d;
        }""",
        constraints="=r,=r,=r,=r,r", args=[words], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=True, pack=1)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, stride_w, words_per_split, sign_exp_man,
    in_sumsq_ptr, in_parts, eps, residual_ptr, norm_w_ptr, residual_out_ptr, sumsq_ptr,
    positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride, k_cache_ptr, v_cache_ptr, cache_stride_slot,
    cache_stride_h, num_heads, num_kv_heads,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr,
    NORM_IN: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr,
    CVT: tl.constexpr,
):
    """One row of x against ROWS weight rows, read as int32 words of four e4m3 bytes (split along K
    when the rows alone leave SMs idle). Each thread keeps float32 sums per word it reads, reduced
    once at the end; x is read four times with a stride of 4 (from L1), so no cross-thread shuffles
    per step. CVT: decode with the hardware conversion (GPU); else with integer ops (the exact
    same values, and what Triton's CPU interpreter can run). SILU_MUL, NORM_IN, ADD_NORM and ROPE:
    as in the INT4 one."""
    rows, row_ok, slot, cos, sin = one_row_outputs(N, positions_ptr, slot_mapping_ptr, cos_sin_ptr, cos_sin_stride,
                                                   out_ptr.dtype.element_ty, ROWS, SILU_MUL, ROPE, HALF)
    w_begin = tl.program_id(1) * words_per_split
    w_end = tl.minimum(w_begin + words_per_split, K // 4)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    c = w_begin + tl.arange(0, BLOCK_W)
    # Weights are never written, so the first step's may be read before the previous kernel ends.
    p = tl.load(w_rows + c[None, :], mask=row_ok[:, None] & (c < w_end)[None, :], other=0)
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    bias, residual, norm_w = add_norm_operands(rows, row_ok, bias_ptr, residual_ptr, norm_w_ptr, HAS_BIAS, ADD_NORM)
    wait_for_previous_kernel(PDL)
    if NORM_IN:  # its partial sums' latency under the loop's
        factor = norm_factor(in_sumsq_ptr, in_parts, K, eps, 256)
    acc = tl.zeros([ROWS, BLOCK_W], dtype=tl.float32)
    for c0 in range(w_begin, w_end, BLOCK_W):
        c = c0 + tl.arange(0, BLOCK_W)
        c_ok = c < w_end
        if CVT:
            w0, w1, w2, w3 = e4m3x4_to_f32(p)
            acc += w0 * tl.load(x_ptr + c * 4, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            acc += w1 * tl.load(x_ptr + c * 4 + 1, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            acc += w2 * tl.load(x_ptr + c * 4 + 2, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            acc += w3 * tl.load(x_ptr + c * 4 + 3, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        else:
            for j in tl.static_range(4):
                xj = tl.load(x_ptr + c * 4 + j, mask=c_ok, other=0.0).to(tl.float32)
                if j < 3:
                    t = p << (24 - 8 * j)
                else:
                    t = p
                acc += ((t >> 4) & sign_exp_man).to(tl.float32, bitcast=True) * xj[None, :]
        c_next = c + BLOCK_W
        p = tl.load(w_rows + c_next[None, :], mask=row_ok[:, None] & (c_next < w_end)[None, :], other=0)
    if not CVT:
        scale *= 1.329227995784916e36  # 2**120
    if NORM_IN:
        scale *= factor
    # Scaled before the sum, so the epilogue's bias add follows an add: after a multiply the compiler
    # fused the two in some epilogues (RoPE) and not in others (the plain store), and they differed.
    y = tl.sum(acc * scale[:, None], axis=1)
    store_one_row_outputs(y, rows, row_ok, out_ptr, bias_ptr, part_ptr, count_ptr, N, bias, residual, norm_w,
                          residual_out_ptr, sumsq_ptr, slot, cos, sin, k_cache_ptr, v_cache_ptr, cache_stride_slot,
                          cache_stride_h, num_heads, num_kv_heads, HAS_BIAS, SPLIT_K, SILU_MUL, ADD_NORM, ROPE, ROWS,
                          HALF)


@functools.lru_cache(maxsize=None)
def has_e4m3_cvt(device: torch.device) -> bool:
    """cvt.rn.f16x2.e4m3x2 exists from compute capability 8.9 (Ada, Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def channel_scales(weight_scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """float32 [N], from a per-channel [N] or a per-tensor [1] / [] scale."""
    scale = weight_scale.float().reshape(-1)
    return scale if scale.numel() == out_features else scale.expand(out_features).contiguous()


def _one_row_ok(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the one-row kernel takes x2 [M, K] against weight: one row, whole int32 words."""
    return (x2.shape[0] == 1 and weight.shape[1] % 4 == 0 and weight.stride(0) % 4 == 0
            and weight.data_ptr() % 4 == 0)


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, silu_mul: bool = False,
                      norm_in: NormScale | None = None) -> torch.Tensor:
    """Triton w8a16 version of `fp8_linear_ref`, same contract (x [..., K] in fp32, fp16 or bf16);
    up to FUSED_ROWS rows the kernels apply a norm_in's factors and SiLU·up to their outputs."""
    out_features, in_features = weight.shape
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if _one_row_ok(x2, weight):
        out, _, _ = _fp8_gemv(x2, weight, weight_scale, bias, silu_mul, norm_in, None)
    elif few_rows(x2):
        out, _, _ = _fp8_matmul(x2, weight, weight_scale, bias, silu_mul, norm_in)
    else:
        out, _, _ = _fp8_matmul(x2 if norm_in is None else norm_in.apply(x2), weight, weight_scale, bias)
        if silu_mul:
            out = activation.silu_mul(out)
    return out.view(*x.shape[:-1], out.shape[-1])


def gemv_config(out_features: int, in_features: int) -> dict[str, int]:
    """_fp8_gemv_kernel's tiling by weight size, split as the INT4 one-row kernel's is
    (kernels/split_k.py's large_tiling). A small weight (Llama-3.2-1B's QKV and O) takes 4 rows a
    program of 4 warps, 2,048 input features a step and no split: many small programs that load
    their whole rows before the wait for the previous kernel and end without split-K's partial
    sums. A large one takes 16 rows a program of 2 warps, 64 words (256 bytes) of each per step,
    split along K up to ~8 programs per SM. The sweeps behind both: docs/performance.md."""
    if not large_tiling(out_features, in_features):
        return dict(ROWS=4, BLOCK_W=min(512, triton.next_power_of_2(in_features // 4)), num_warps=4, split=False)
    return dict(ROWS=16, BLOCK_W=64, num_warps=2, split=True)


def _fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
              silu_mul: bool, norm_in: NormScale | None, add_norm: tuple[torch.Tensor, torch.Tensor] | None,
              rope: RopeKV | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One row x [1, K] through _fp8_gemv_kernel (tiled by gemv_config): [1, N], or [1, N / 2] with
    silu_mul (and, with add_norm, the new residual and the sums of squares; with rope, the rotated q:
    int4_linear's _one_row)."""
    out_features, in_features = weight.shape
    words = weight.view(torch.uint8).view(torch.int32)
    outputs = out_features // 2 if silu_mul else out_features
    q, rope_args = rope_arguments(x, rope)
    out = torch.empty(1, outputs, dtype=x.dtype, device=x.device) if q is None else q
    cfg = gemv_config(out_features, in_features)
    split = cfg.pop("split")
    paired = silu_mul or rope is not None  # a program's rows are ROWS / 2 pairs
    tiles = triton.cdiv(out_features // 2 if paired else out_features, cfg["ROWS"] // 2 if paired else cfg["ROWS"])
    split_k, per_split = gemv_split(tiles, in_features // 4, cfg["BLOCK_W"], x.device) if split else (1, in_features // 4)
    part, counts = split_workspace(out.view(1, -1), split_k, tiles, out_features)
    norm_args, residual_out, sumsq = norm_arguments(out, tiles, norm_in, add_norm)
    pdl = programmatic_launch(x)
    _fp8_gemv_kernel[(tiles, split_k)](
        x, words, channel_scales(weight_scale, out_features), bias, out, part, counts, out_features,
        in_features, words.stride(0), per_split, SIGN_EXP_MAN, *norm_args, *rope_args, HAS_BIAS=bias is not None,
        SPLIT_K=split_k, SILU_MUL=silu_mul, NORM_IN=norm_in is not None, ADD_NORM=add_norm is not None,
        ROPE=rope is not None, HALF=rope.head_dim // 2 if rope else 1, PDL=pdl, CVT=has_e4m3_cvt(x.device),
        num_stages=1, **cfg, **launch_options(pdl))
    return out, residual_out, sumsq


def _fp8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                silu_mul: bool = False, norm_in: NormScale | None = None,
                add_norm: tuple[torch.Tensor, torch.Tensor] | None = None, rope: RopeKV | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [M, K] @ W.T + bias → [M, N] by the tile GEMM (any M; one row too where the GEMV's word
    loads do not align); up to FUSED_ROWS rows with the epilogues, outputs as _fp8_gemv's."""
    out_features, in_features = weight.shape
    rows = x.shape[0]
    few = few_rows(x)
    assert few or not (silu_mul or norm_in or add_norm or rope), "the epilogues take up to FUSED_ROWS rows"
    if rows == 0:
        return x.new_empty(0, out_features), None, None
    q, rope_args = rope_arguments(x, rope)
    out = torch.empty(rows, out_features // 2 if silu_mul else out_features, dtype=x.dtype, device=x.device) \
        if q is None else q
    cfg = matmul_config(rows)
    block_k = 64
    paired = silu_mul or rope is not None  # a program's weight rows are BLOCK_N / 2 pairs
    num_tiles = (triton.cdiv(out_features // 2, cfg["BLOCK_N"] // 2) if paired
                 else triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(out_features, cfg["BLOCK_N"]))
    split_k, per_split = split_k_for(rows, num_tiles, triton.cdiv(in_features, block_k), in_features, x.device)
    part, counts = split_workspace(out.view(rows, -1), split_k, num_tiles, out_features)
    norm_args, residual_out, sumsq = norm_arguments(out, num_tiles, norm_in, add_norm)
    pdl = programmatic_launch(x)
    _fp8_matmul_kernel[(num_tiles, split_k)](
        x, weight.view(torch.uint8), channel_scales(weight_scale, out_features), bias, out, part, counts,
        rows, out_features, in_features, x.stride(0), weight.stride(0), per_split, *norm_args, *rope_args,
        HAS_BIAS=bias is not None, BLOCK_K=block_k, GROUP_M=8, SPLIT_K=split_k, IEEE=x.dtype == torch.float32,
        FEW=few, SILU_MUL=silu_mul, NORM_IN=norm_in is not None, ADD_NORM=add_norm is not None,
        ROPE=rope is not None, HALF=rope.head_dim // 2 if rope else 1, PDL=pdl, **cfg, **launch_options(pdl),
    )
    return out, residual_out, sumsq


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations → (float8_e4m3fn [M, K], float32 scale [M, 1]): each row's largest
    magnitude maps to FP8_MAX."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """w8a8 `fp8_linear` on fp8 tensor cores (CUDA, compute capability >= 8.9; K and N multiples of
    16): x quantized per token, torch._scaled_mm with row-wise scales, output in x's dtype."""
    out_features, in_features = weight.shape
    xq, scale_a = quantize_per_token(x.reshape(-1, in_features))
    scale_b = channel_scales(weight_scale, out_features).view(1, out_features)
    # Row-wise scaling outputs bf16 on every backend (some accept nothing else), then x's dtype.
    y = torch._scaled_mm(xq, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], out_features)


@functools.lru_cache(maxsize=None)
def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9)


def use_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Prefill-sized (more than 16 rows) fp16/bf16 x on a GPU with fp8 tensor cores, a weight
    _scaled_mm takes (contiguous [N, K], both multiples of 16)."""
    out_features, in_features = weight.shape
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and x.numel() > 16 * in_features
            and out_features % 16 == 0 and in_features % 16 == 0 and weight.is_contiguous()
            and _has_fp8_tensor_cores(x.device))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, silu_mul: bool = False,
               norm_in: NormScale | None = None) -> torch.Tensor:
    """y = x @ W.T + bias for an FP8 weight: _scaled_mm for prefill where it runs, the Triton kernel
    for decode (and under the interpreter), else the torch reference. With silu_mul, W is a merged
    gate/up weight and the result SiLU(gate) * up [..., N / 2] (in the one-row kernel's epilogue).
    norm_in: as int4_linear's (the one-row kernel scales its outputs; elsewhere x is scaled first)."""
    if use_triton(x) and not use_scaled_mm(x, weight):
        return fp8_linear_triton(x, weight, weight_scale, bias, silu_mul, norm_in)
    x = x if norm_in is None else norm_in.apply(x)
    if not use_triton(x):
        return fp8_linear_ref(x, weight, weight_scale, bias, silu_mul)
    y = fp8_linear_scaled_mm(x, weight, weight_scale, bias)
    return activation.silu_mul(y) if silu_mul else y


def fp8_linear_add_norm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                        residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
    """As int4_linear_add_norm, for an FP8 weight: our kernels' add-norm epilogue up to FUSED_ROWS rows
    where norms fold, else fp8_linear and the norm kernel."""
    x2 = x.reshape(-1, weight.shape[1])
    if folds_norms(x) and weight.stride(1) == 1 and few_rows(x2):
        kernel = _fp8_gemv if _one_row_ok(x2, weight) else _fp8_matmul
        out, h, sumsq = kernel(x2.contiguous(), weight, weight_scale, bias, False, None,
                               (residual.reshape(x2.shape[0], -1), norm_weight))
        return out.view(residual.shape), h.view(residual.shape), NormScale(sumsq, eps)
    return (*rms_norm(fp8_linear(x, weight, weight_scale, bias), norm_weight, eps, residual), None)


def fp8_linear_rope_kv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                       norm_in: NormScale | None, rope: RopeKV) -> torch.Tensor:
    """As int4_linear_rope_kv, for an FP8 weight: the rotated q [tokens, heads, head_dim] from our
    kernels' RoPE epilogue up to FUSED_ROWS rows, else fp8_linear and rope_store_kv."""
    x2 = x.reshape(-1, weight.shape[1])
    if use_triton(x) and weight.stride(1) == 1 and few_rows(x2) and rope.head_dim % 2 == 0:
        kernel = _fp8_gemv if _one_row_ok(x2, weight) else _fp8_matmul
        q, _, _ = kernel(x2.contiguous(), weight, weight_scale, bias, False, norm_in, None, rope)
        return q
    return rope_store_qkv(fp8_linear(x, weight, weight_scale, bias, norm_in=norm_in), rope)
