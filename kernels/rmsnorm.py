"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference. Returns (normed, new_residual) where new_residual = x + residual (or x).

    Computed in float32 and cast back exactly as Hugging Face's LlamaRMSNorm does, so that float32
    outputs match it bit for bit.
    """
    if residual is not None:
        x = x + residual
    residual = x
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual-add +) RMSNorm; dispatches to the best implementation for the device."""
    return rms_norm_ref(x, weight, eps, residual)
