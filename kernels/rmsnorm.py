"""RMSNorm, optionally fused with the residual add that precedes it; and the pieces of the norm
that batch-1 decode folds into the projections around it (NormScale, add_norm_ref)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.dispatch import launch_options, programmatic_launch, use_triton, wait_for_previous_kernel


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


@dataclass(frozen=True)
class NormScale:
    """A normalized row still to be scaled, as an add-norm epilogue leaves it (add_norm_ref): the
    norm's output is x * factor(len(x)). The next projection applies the factor to its outputs, so
    no kernel of its own normalizes the row."""

    sumsq: torch.Tensor  # float32 [rows, parts]: partial sums of squares of each row before the norm
    eps: float

    def factor(self, hidden: int) -> torch.Tensor:
        """rsqrt(mean of squares + eps) per row, float32 [rows, 1] (on the device: no sync)."""
        return torch.rsqrt(self.sumsq.sum(-1, keepdim=True) / hidden + self.eps)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x scaled in float32, in x's dtype (what the kernels that take a NormScale do to their outputs)."""
        return (x.float() * self.factor(x.shape[-1])).to(x.dtype)


def add_norm_ref(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor, NormScale]:
    """The add-norm epilogue's reference for rows y [M, H]: (h * weight, h, NormScale of h) with
    h = y + residual, the new residual. (h * weight) scaled by the NormScale is rms_norm(y, weight,
    eps, residual)[0] but for rounding: weight * round(h * r) there, round(h * weight) * r here."""
    h = y + residual
    return h * weight, h, NormScale(h.float().pow(2).sum(-1, keepdim=True), eps)


@triton.jit
def normalized_row(x, weight, hidden, eps):
    """RMSNorm of one row x [BLOCK] held in registers (masked entries zero), as rms_norm_ref: the sum
    of squares in float32, and h rounded to x's dtype before the weight multiply."""
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    return weight * h.to(x.dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    # One program per row; the whole row stays in registers between the sum and the scaling.
    start = tl.program_id(0).to(tl.int64) * hidden
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # never written: read before the wait
    wait_for_previous_kernel(PDL)
    x = tl.load(x_ptr + start + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + start + cols, mask=mask, other=0.0)
        tl.store(new_residual_ptr + start + cols, x, mask=mask)
    tl.store(out_ptr + start + cols, normalized_row(x, weight, hidden, eps), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `rms_norm_ref`, same contract. One program per row of the last dim."""
    hidden = x.shape[-1]
    # The model passes fresh matmul/embedding outputs, so these are no-ops there.
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        new_residual = x
    else:
        residual = residual.contiguous()
        new_residual = torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    pdl = programmatic_launch(x)
    _rms_norm_kernel[(x.numel() // hidden,)](
        x, residual, weight, out, new_residual, hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8), PDL=pdl,
        **launch_options(pdl),
    )
    return out, new_residual


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual-add +) RMSNorm; Triton where `use_triton` says so, else the torch reference."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
