"""SiLU(gate) * up over the merged gate/up projection's output."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference: x is [..., 2 * I] holding gate then up; returns [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU·mul; dispatches to the best implementation for the device."""
    return silu_mul_ref(x)
