"""4-bit weight-only linear layers in AutoAWQ's GEMM layout, and the layout itself.

For a linear layer y = x @ W with W [in_features K, out_features N], quantized in groups of G input
rows per output column:
  qweight  int32 [K, N // 8]       eight 4-bit weights of one input row, packed in AWQ's order
  qzeros   int32 [K // G, N // 8]  the groups' zero points, packed the same way
  scales   fp16  [K // G, N]       the groups' scales
and W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]. Packing puts column 8c + AWQ_ORDER[i] of a
pack into bits 4i..4i+3 of its int32.

Two Triton kernels compute x @ W; each reads a packed int32 once, unpacks its nibbles in registers,
and accumulates in float32:
  - decode at one row: a GEMV on CUDA cores; a program owns BLOCK_N output columns;
  - a few rows (decode, M <= 16: one 16-row tensor-core tile) and prefill (M > 16: 64 or 128-row
    tiles, grouped along M so that weight tiles are reused from L2): a tl.dot GEMM whose B tile
    [BLOCK_K, BLOCK_N] is dequantized in registers from qweight.
Both split K when the output tiles alone would leave SMs idle; a second kernel then sums the
splits' float32 partials (and adds the bias). A K tile never straddles a quantization group
(BLOCK_K divides G), so it needs one row of zeros and scales.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.dispatch import use_triton

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its pack
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of a pack sits in nibble AWQ_REVERSE_ORDER[j]


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, N] integers in 0..15 → [R, N // 8] int32 in AWQ's packing order."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).view(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    packed = (grouped << shifts).sum(dim=-1)  # below 2**32: nibbles do not overlap
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # as a signed int32


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, N // 8] int32 → [R, N] int32 in 0..15 (the inverse of pack_awq)."""
    rows, packs = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[:, :, None] >> shifts) & 0xF  # [R, N // 8, 8], nibble order
    return nibbles[:, :, list(AWQ_REVERSE_ORDER)].reshape(rows, packs * 8)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [K, N] in the scales' dtype."""
    q = unpack_awq(qweight)
    z = unpack_awq(qzeros).repeat_interleave(group_size, dim=0)
    s = scales.repeat_interleave(group_size, dim=0)
    return ((q - z).to(scales.dtype) * s)


def int4_linear_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: dequantize, then x [M, K] @ W → [M, N] in x's dtype."""
    w = dequantize_awq(qweight, qzeros, scales, group_size).to(x.dtype)
    y = x @ w
    return y if bias is None else y + bias


@triton.jit
def tile_coords(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program_id(0), GROUP_M row tiles at a time so that neighbouring programs
    share weight tiles in L2 (with one row tile, as in decode, pid_n is the program id)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    in_group = pid % (GROUP_M * num_n)
    return first_m + in_group % rows_in_group, in_group // rows_in_group


@triton.jit
def store_tile(acc, out_ptr, bias_ptr, rows, cols, M, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] float32 result: final (bias added, in out's dtype) without split-K,
    else this split's float32 partial, summed later by _sum_splits_kernel."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + tl.program_id(1).to(tl.int64) * M * N + offs, acc, mask=mask)


@triton.jit
def _nibbles(packed, shifts):
    """The 4-bit values at `shifts` of `packed` as float32 2**23 + q: OR-ing q into the mantissa of
    2**23 (0x4B000000) is cheaper than an int-to-float cvt (quarter rate); 2**23 cancels in q - z."""
    return (((packed >> shifts) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _int4_gemv_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, out_ptr,
    N, K, num_packs, stride_qweight, stride_qzeros, stride_scales, group_size, tiles_per_split,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    # One row. The program's columns are held as [packs, 8] so that each loaded int32 unpacks in
    # place along a new axis (no reshape inside the loop, fewer registers than the GEMM's tile).
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    packs = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    pack_ok = packs < num_packs  # N // 8, passed so that Triton sees its alignment and vectorizes the loads
    column = tl.arange(0, 8)
    shifts = (column // 2 + (column % 2) * 4) * 4  # column j of a pack is nibble AWQ_REVERSE_ORDER[j]
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N // 8, 8], dtype=tl.float32)
    for tile in range(split * tiles_per_split, tl.minimum((split + 1) * tiles_per_split, K // BLOCK_K)):
        k = tile * BLOCK_K + ks
        group = tile * BLOCK_K // group_size
        packed = tl.load(qweight_ptr + k[:, None] * stride_qweight + packs[None, :], mask=pack_ok[None, :], other=0)
        q = _nibbles(packed[:, :, None], shifts[None, None, :])  # [BLOCK_K, packs, 8]
        z_packed = tl.load(qzeros_ptr + group * stride_qzeros + packs, mask=pack_ok, other=0)
        z = _nibbles(z_packed[:, None], shifts[None, :])
        s = tl.load(scales_ptr + group * stride_scales + packs[:, None] * 8 + column[None, :], mask=pack_ok[:, None],
                    other=0.0).to(tl.float32)
        xk = tl.load(x_ptr + k).to(tl.float32)
        acc += tl.sum(xk[:, None, None] * (q - z[None, :, :]), axis=0) * s  # the group's scale once per tile
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    store_tile(tl.reshape(acc, (1, BLOCK_N)), out_ptr, bias_ptr, tl.arange(0, 1), cols, 1, N, HAS_BIAS, SPLIT_K)


@triton.jit
def _int4_matmul_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, K, num_packs, stride_xm, stride_qweight, stride_qzeros, stride_scales, group_size, tiles_per_split,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m, pid_n = tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    packs = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    col_ok = cols < N
    pack_ok = packs < num_packs
    shifts = ((cols % 8) // 2 + (cols % 2) * 4) * 4
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(split * tiles_per_split, tl.minimum((split + 1) * tiles_per_split, K // BLOCK_K)):
        k = tile * BLOCK_K + ks
        group = tile * BLOCK_K // group_size
        packed = tl.load(qweight_ptr + k[:, None] * stride_qweight + packs[None, :], mask=pack_ok[None, :], other=0)
        packed = tl.interleave(packed, packed)  # [BLOCK_K, BLOCK_N]: each int32 repeated 8 times, in
        packed = tl.interleave(packed, packed)  # registers (one load per int32)
        packed = tl.interleave(packed, packed)
        z = _nibbles(tl.load(qzeros_ptr + group * stride_qzeros + cols // 8, mask=col_ok, other=0), shifts)
        s = tl.load(scales_ptr + group * stride_scales + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = ((_nibbles(packed, shifts[None, :]) - z[None, :]) * s[None, :]).to(x_ptr.dtype.element_ty)
        xt = tl.load(x_rows + k[None, :], mask=(rows < M)[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(xt, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, w, acc)
    store_tile(acc, out_ptr, bias_ptr, rows, cols, M, N, HAS_BIAS, SPLIT_K)


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, M, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(SPLIT_K):
        acc += tl.load(part_ptr + split * M * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(part: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """[SPLIT_K, M, N] float32 partial products → their sum (+ bias) [M, N] in `dtype`."""
    split_k, rows, cols = part.shape
    out = torch.empty(rows, cols, dtype=dtype, device=part.device)
    block = 1024
    _sum_splits_kernel[(triton.cdiv(rows * cols, block),)](
        part, bias, out, rows, cols, SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block)
    return out


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def split_k_for(rows: int, num_tiles: int, k_tiles: int, k: int, device: torch.device) -> tuple[int, int]:
    """(SPLIT_K, K tiles per split) for a grid of `num_tiles` output tiles over `k_tiles` K tiles:
    enough splits that about four programs run per SM, while the float32 partials (written and read
    back: 8 * SPLIT_K * rows bytes per column) stay under the weight bytes (k / 2 per column for int4,
    k for fp8, so k / 2 bounds both). Depends on shapes only, so a CUDA graph keeps it."""
    wanted = triton.cdiv(4 * _sm_count(device), num_tiles)
    split_k = max(1, min(wanted, k // (16 * rows), k_tiles, 32))
    per_split = triton.cdiv(k_tiles, split_k)
    return triton.cdiv(k_tiles, per_split), per_split


def matmul_config(rows: int) -> dict[str, int]:
    """Tile sizes of the dot kernels by batch rows: a few rows (decode: one 16-row tensor-core tile,
    split-K) or prefill (a tiled GEMM)."""
    if rows <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4)
    if rows <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def int4_linear_triton(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                       group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of `int4_linear_ref`, same contract (x [..., K] in fp32, fp16 or bf16)."""
    in_features, num_packs = qweight.shape
    out_features = num_packs * 8
    if group_size < 16 or group_size & (group_size - 1) or in_features % group_size:
        raise ValueError(f"the group size ({group_size}) must be a power of two >= 16 dividing K ({in_features})")
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if rows == 0:
        return x.new_empty(*x.shape[:-1], out_features)
    block_k = min(group_size, 64)
    if rows == 1:
        cfg = dict(BLOCK_N=128, num_warps=4)
        num_tiles = triton.cdiv(out_features, cfg["BLOCK_N"])
    else:
        cfg = matmul_config(rows)
        num_tiles = triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(out_features, cfg["BLOCK_N"])
    split_k, per_split = split_k_for(rows, num_tiles, in_features // block_k, in_features, x.device)
    if split_k == 1:
        dest = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    else:
        dest = torch.empty(split_k, rows, out_features, dtype=torch.float32, device=x.device)
    meta = dict(HAS_BIAS=bias is not None, BLOCK_K=block_k, SPLIT_K=split_k, **cfg)
    if rows == 1:
        _int4_gemv_kernel[(num_tiles, split_k)](
            x2, qweight, qzeros, scales, bias, dest, out_features, in_features, num_packs,
            qweight.stride(0), qzeros.stride(0), scales.stride(0), group_size, per_split, **meta)
    else:
        _int4_matmul_kernel[(num_tiles, split_k)](
            x2, qweight, qzeros, scales, bias, dest, rows, out_features, in_features, num_packs, x2.stride(0),
            qweight.stride(0), qzeros.stride(0), scales.stride(0), group_size, per_split,
            GROUP_M=8, IEEE=x.dtype == torch.float32, **meta)
    out = dest if split_k == 1 else sum_splits(dest, bias, x.dtype)
    return out.view(*x.shape[:-1], out_features)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W + bias for AWQ-packed W; Triton where `use_triton` says so, else the reference."""
    if use_triton(x):
        return int4_linear_triton(x, qweight, qzeros, scales, group_size, bias)
    return int4_linear_ref(x, qweight, qzeros, scales, group_size, bias)
