"""Which implementation of a kernel runs: Triton on CUDA, the torch reference elsewhere."""
from __future__ import annotations

import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """True when `t` is on a CUDA device, or when TRITON_INTERPRET=1 (read at each call), which lets
    CPU tests run the Triton kernels through Triton's interpreter."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
