"""The 4-bit weight layouts: AutoAWQ's GEMM layout, which checkpoints keep, and the N-major layout
the kernels run on (kernels/int4_linear.py).

For y = x @ W.T with W [out_features N, in_features K], quantized in groups of G input features per
output feature: W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G].

Checkpoints hold AutoAWQ's layout (the quantizer writes it, the loader reads it):
  qweight  int32 [K, N // 8]       eight 4-bit weights of one input feature, packed in AWQ's order
  qzeros   int32 [K // G, N // 8]  the groups' zero points, packed the same way
  scales   fp16  [K // G, N]       the groups' scales
Packing puts column 8c + AWQ_ORDER[i] of a pack into bits 4i..4i+3 of its int32.

Once loaded, `repack_awq` turns it into the runtime layout, the only copy kept:
  weight   int32 [N, K // 8]   nibble j (bits 4j..4j+3) of word c holds k = 8c + j
  zeros    fp16  [N, K // G]   the zero points as floats (0..15, exact)
  scales   fp16  [N, K // G]
G is a multiple of 8, so the eight weights of a word share one group.
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its pack
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of a pack sits in nibble AWQ_REVERSE_ORDER[j]
_REPACK_ROWS = 256  # input features repacked at a time: the unpacked int64s take 16x the packed bytes


def _pack_words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] integers in 0..15 → int32 [...] with element i in bits 4i..4i+3."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=nibbles.device)
    packed = (nibbles.to(torch.int64) << shifts).sum(dim=-1)  # below 2**32: nibbles do not overlap
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # as a signed int32


def _unpack_words(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] → [R, C, 8] int32 in 0..15, nibble i at index i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return (packed[:, :, None] >> shifts) & 0xF


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, N] integers in 0..15 → [R, N // 8] int32 in AWQ's packing order."""
    rows, cols = values.shape
    return _pack_words(values.reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)])


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, N // 8] int32 → [R, N] int32 in 0..15 (the inverse of pack_awq)."""
    rows, packs = packed.shape
    return _unpack_words(packed)[:, :, list(AWQ_REVERSE_ORDER)].reshape(rows, packs * 8)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [K, N] in the scales' dtype, from AutoAWQ's layout."""
    q = unpack_awq(qweight)
    z = unpack_awq(qzeros).repeat_interleave(group_size, dim=0)
    s = scales.repeat_interleave(group_size, dim=0)
    return ((q - z).to(scales.dtype) * s)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[R, K] integers in 0..15 → [R, K // 8] int32, k = 8c + j in nibble j of word c."""
    rows, cols = values.shape
    return _pack_words(values.reshape(rows, cols // 8, 8))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[R, K // 8] int32 → [R, K] int32 in 0..15 (the inverse of pack_int4)."""
    rows, words = packed.shape
    return _unpack_words(packed).reshape(rows, words * 8)


def repack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ's (qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]) → the runtime layout
    (weight int32 [N, K/8], fp16 zeros [N, K/G], fp16 scales [N, K/G]), on the tensors' device."""
    in_features, packs = qweight.shape
    weight = torch.empty(packs * 8, in_features // 8, dtype=torch.int32, device=qweight.device)
    for k0 in range(0, in_features, _REPACK_ROWS):  # K is a multiple of 8: every slice holds whole words
        part = qweight[k0:k0 + _REPACK_ROWS]
        weight[:, k0 // 8:(k0 + part.shape[0]) // 8] = pack_int4(unpack_awq(part).t())
    zeros = unpack_awq(qzeros).t().to(torch.float16).contiguous()
    return weight, zeros, scales.t().to(torch.float16).contiguous()


def dequantize_int4(weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [N, K] in the scales' dtype, from the runtime layout (equal to dequantize_awq's, transposed)."""
    q = unpack_int4(weight)
    z = zeros.repeat_interleave(group_size, dim=1).to(torch.int32)
    s = scales.repeat_interleave(group_size, dim=1)
    return (q - z).to(scales.dtype) * s
