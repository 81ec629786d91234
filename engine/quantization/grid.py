"""The int4 grid: every group of G consecutive input features of an output feature gets its own
16-level affine grid, scale = (max - min) / 15 and an integer zero point in 0..15, and each weight
is rounded to one of its levels. AutoAWQ's GEMM layout stores the levels, zero points and fp16 scales."""
from __future__ import annotations

import contextlib

import torch

from engine.errors import ModelLoadError
from engine.models.config import ModelConfig
from kernels.int4_layout import pack_awq

MAX_Q = 15  # 4 bits
Grid = tuple[torch.Tensor, torch.Tensor]  # an int4 weight's scales and zero points, [N, K/G] each


def _on_grid(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The levels (0..15) nearest to `values` on the grid (level - zero) * scale (shapes broadcast)."""
    return (torch.round(values / scale) + zero).clamp(0, MAX_Q)


def _levels(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., G] float32 groups → (levels [..., G] in 0..15, scale, zero point) per group, the scale
    rounded to the float16 it is stored as."""
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo).clamp(min=1e-5) / MAX_Q).half().float()
    zero = (-torch.round(lo / scale)).clamp(0, MAX_Q)
    return _on_grid(groups, scale[..., None], zero[..., None]), scale, zero


def fake_quantize(groups: torch.Tensor) -> torch.Tensor:
    """[..., G] float32 groups → the same values quantized to each group's grid and back."""
    levels, scale, zero = _levels(groups)
    return (levels - zero[..., None]) * scale[..., None]


def quantize_weight(weight: torch.Tensor, group_size: int, grid: Grid | None = None) -> dict[str, torch.Tensor]:
    """A float weight [N out, K in] → AutoAWQ's qweight [K, N/8], qzeros [K/G, N/8], fp16 scales [K/G, N],
    on the given grids (scales and zero points [N, K/G]) or on _levels' own."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    if grid is None:
        levels, scale, zero = _levels(groups)
    else:
        scale, zero = grid
        levels = _on_grid(groups, scale[..., None], zero[..., None])
    return {"qweight": pack_awq(levels.reshape(n, k).t().contiguous().cpu()),
            "qzeros": pack_awq(zero.t().contiguous().cpu()), "scales": scale.t().contiguous().half().cpu()}


def _fake_quantize_weight(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = weight.shape
    return fake_quantize(weight.reshape(n, k // group_size, group_size)).reshape(n, k)


def default_group_size(cfg: ModelConfig, source_block: int | None = None) -> int:
    """The block size of the quantized file the float weights were dequantized from, where there is
    one (the embedded SmolLM2: Q4_1, 32; model_store.source_block_size): a group that straddles
    two of its blocks mixes two grids. Else 128 (the usual), or the largest of 64 and 32 that
    fits every layer."""
    if source_block is not None:
        with contextlib.suppress(ModelLoadError):
            cfg.check_awq_group_size(source_block)
            return source_block
    for size in (128, 64, 32):
        try:
            cfg.check_awq_group_size(size)
            return size
        except ModelLoadError:
            continue
    cfg.check_awq_group_size(32)  # raises, naming the layer that does not fit
    return 32
