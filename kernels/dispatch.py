"""Which implementation of a kernel runs: Triton on CUDA, the torch reference elsewhere."""
from __future__ import annotations

import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """True when `t` is on a CUDA device, or when TRITON_INTERPRET=1 (read at each call), which lets
    CPU tests run the Triton kernels through Triton's interpreter."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def to_device(values: list, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """A tensor of host values on `device`, queued behind the device's work instead of waiting for
    it: torch.tensor(..., device="cuda") copies from pageable memory, which waits for the stream."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
