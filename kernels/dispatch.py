"""Which implementation of a kernel runs (Triton on CUDA, the torch reference elsewhere), and how
our Triton kernels are launched (programmatic dependent launch)."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


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


# ---- programmatic dependent launch (PDL) ----------------------------------------------------------
# On Hopper and later a kernel launched with PDL may start while the kernel before it is still
# finishing: its programs are placed on the SMs and wait, at their first line, for the previous
# kernel's writes. That hides most of the launch-to-start gap between two short kernels, which is
# where a batch-1 decode step of ~170 kernels spends much of its time. It pays only between our
# own kernels (cuBLAS never lets its successor start early), so the model runner turns it on for
# models whose linear layers are ours (quantized) and leaves it off for bf16 (MINILLM_PDL=0/1 overrides).
_programmatic_launch = False


def set_programmatic_launch(enabled: bool) -> None:
    global _programmatic_launch
    override = os.environ.get("MINILLM_PDL")
    _programmatic_launch = enabled if override is None else override == "1"


@functools.lru_cache(maxsize=None)
def _has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def programmatic_launch(t: torch.Tensor) -> bool:
    """Whether a kernel working on `t` is launched with PDL (then its PDL argument must be True)."""
    return _programmatic_launch and t.is_cuda and _has_pdl(t.device)


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launch keyword that goes with a kernel's PDL argument."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """The first line of every kernel that takes PDL: let the next kernel start launching, then wait
    until the previous kernel's writes are visible. Nothing may be read or written before it."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
