"""FP8 (e4m3) weight linear layers: weights stored as float8_e4m3fn [N, K] with a float32 scale per
output channel (a per-tensor scale is the same value for every channel), W = w_fp8 * scale[:, None].

Two GPU paths:
  - w8a16, a Triton kernel with kernels/int4_linear.py's tiling and split-K (decode, M <= 16, and
    prefill where the next path is unavailable): it reads the weight once as bytes, decodes e4m3 in
    registers with integer ops (exact; no fp8 loads, so Triton's CPU interpreter runs it too),
    accumulates in float32 and applies the channel scale once at the end.
  - w8a8 for prefill (M > 16) on Hopper/Ada: torch._scaled_mm on fp8 tensor cores, x quantized to
    e4m3 per token. Rounding x to 3 mantissa bits costs about 2-3% relative error per output
    (w8a16 costs only the output rounding), the usual price of FP8 prefill.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.dispatch import use_triton
from kernels.int4_linear import matmul_config, split_k_for, split_workspace, store_tile, tile_coords

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weights → (float8_e4m3fn [N, K], float32 per-channel scale [N]): each row's
    largest magnitude maps to FP8_MAX."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: dequantize the weight, then x [M, K] @ W.T → [M, N] in x's dtype."""
    w = (weight.float() * weight_scale.float()[:, None]).to(x.dtype)
    y = x @ w.t()
    return y if bias is None else y + bias


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_wn, tiles_per_split,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m, pid_n = tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
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
        if BLOCK_M == 1:
            xk = tl.load(x_ptr + pid_m.to(tl.int64) * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
            acc += tl.sum(xk[:, None] * w.to(tl.float32), axis=0)[None, :]
        else:
            xt = tl.load(x_rows + k[None, :], mask=(rows < M)[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(xt, w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, w.to(x_ptr.dtype.element_ty), acc)
    scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0) * 256.0
    store_tile(acc * scale[None, :], out_ptr, bias_ptr, part_ptr, count_ptr, rows, cols, M, N, HAS_BIAS, SPLIT_K)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, N, K, stride_xm, stride_wn,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row of x against BLOCK_N rows of the weight, each read along K (contiguous) in long
    BLOCK_K runs; the products pile up in a [BLOCK_N, BLOCK_K] tile, summed once at the end."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        bits = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0).to(tl.int32)
        w = (((bits & 0x7F) << 7) | ((bits & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)  # as below
        xk = tl.load(x_ptr + row.to(tl.int64) * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * xk[None, :]
    y = tl.sum(acc, axis=1) * tl.load(scale_ptr + cols, mask=col_ok, other=0.0) * 256.0
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * N + cols, y.to(out_ptr.dtype.element_ty), mask=col_ok)


def _channel_scales(weight_scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """float32 [N], from a per-channel [N] or a per-tensor [1] / [] scale."""
    scale = weight_scale.float().reshape(-1)
    return scale if scale.numel() == out_features else scale.expand(out_features).contiguous()


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton w8a16 version of `fp8_linear_ref`, same contract (x [..., K] in fp32, fp16 or bf16)."""
    out_features, in_features = weight.shape
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if rows == 0:
        return x.new_empty(*x.shape[:-1], out_features)
    if rows == 1:
        # Decode at batch 1: 8 weight rows a program, 512 bytes of each per step (best of a sweep on
        # the H200 at Llama-3.2-1B's projections: 1.1-1.4x bf16 F.linear, where the tiled kernel was 0.3-0.5x).
        out = torch.empty(1, out_features, dtype=x.dtype, device=x.device)
        _fp8_gemv_kernel[(1, triton.cdiv(out_features, 8))](
            x2, weight.view(torch.uint8), _channel_scales(weight_scale, out_features), bias, out,
            out_features, in_features, x2.stride(0), weight.stride(0), HAS_BIAS=bias is not None,
            BLOCK_N=8, BLOCK_K=min(512, triton.next_power_of_2(in_features)), num_warps=8, num_stages=3)
        return out.view(*x.shape[:-1], out_features)
    cfg = dict(BLOCK_M=1, BLOCK_N=128, num_warps=4) if rows == 1 else matmul_config(rows)
    block_k = 64
    num_tiles = triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(out_features, cfg["BLOCK_N"])
    split_k, per_split = split_k_for(rows, num_tiles, triton.cdiv(in_features, block_k), in_features, x.device)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    part, counts = split_workspace(out, split_k, num_tiles)
    _fp8_matmul_kernel[(num_tiles, split_k)](
        x2, weight.view(torch.uint8), _channel_scales(weight_scale, out_features), bias, out, part, counts,
        rows, out_features, in_features, x2.stride(0), weight.stride(0), per_split,
        HAS_BIAS=bias is not None, BLOCK_K=block_k, GROUP_M=8, SPLIT_K=split_k, IEEE=x.dtype == torch.float32,
        **cfg,
    )
    return out.view(*x.shape[:-1], out_features)


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
    scale_b = _channel_scales(weight_scale, out_features).view(1, out_features)
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
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias for an FP8 weight: _scaled_mm for prefill where it runs, the Triton kernel
    for decode (and under the interpreter), else the torch reference."""
    if not use_triton(x):
        return fp8_linear_ref(x, weight, weight_scale, bias)
    if use_scaled_mm(x, weight):
        return fp8_linear_scaled_mm(x, weight, weight_scale, bias)
    return fp8_linear_triton(x, weight, weight_scale, bias)
