"""Which implementation of a kernel runs (Triton on CUDA, the torch reference elsewhere), and how
our Triton kernels are launched (programmatic dependent launch)."""
from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


_reference_only = False


def use_triton(t: torch.Tensor) -> bool:
    """True when `t` is on a CUDA device, or when TRITON_INTERPRET=1 (read at each call), which lets
    CPU tests run the Triton kernels through Triton's interpreter; False inside reference_kernels()."""
    return not _reference_only and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


@contextmanager
def reference_kernels() -> Iterator[None]:
    """Inside, every kernel runs its torch reference, on any device: what autograd differentiates
    (engine/quantize.py's end-to-end tuning), where the Triton kernels have no backward."""
    global _reference_only
    previous, _reference_only = _reference_only, True
    try:
        yield
    finally:
        _reference_only = previous


def to_device(values: list, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """A tensor of host values on `device`, queued behind the device's work instead of waiting for
    it: torch.tensor(..., device="cuda") copies from pageable memory, which waits for the stream."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


# ---- programmatic dependent launch (PDL) ----------------------------------------------------------
# On Hopper and later a kernel launched with PDL may start while the kernel before it is still
# finishing: its programs are placed on the SMs and wait, at their first line, for the previous
# kernel's writes. That hides part of the launch-to-start gap between two short kernels, where a
# batch-1 decode step of ~170 kernels spends much of its time. H200, Llama-3.2-1B shape, decode
# tok/s at batch 1 without and with it (one commit, 3c88170's kernels): bf16 873 and 900, FP8 964 and
# 1,042, INT4 1,113 and 1,171 (cuBLAS's GEMMs never let their successor start early, hence the
# smaller bf16 gain). It is used
# where it was measured, inside the decode steps' CUDA graphs; eager launches (prefill) stay plain.
_programmatic_launch = False


@contextmanager
def programmatic_launches() -> Iterator[None]:
    """Inside, our kernels on a Hopper (or later) GPU launch with PDL, unless MINILLM_PDL=0."""
    global _programmatic_launch
    previous = _programmatic_launch
    _programmatic_launch = os.environ.get("MINILLM_PDL", "1") != "0"
    try:
        yield
    finally:
        _programmatic_launch = previous


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
    """Called early in every kernel that takes PDL: wait until the previous kernel's writes are
    visible (nothing it may write can be read, and nothing written, before; the one-row GEMVs read
    their first weights before it, decode attention its older keys and values), then let the next
    kernel launch. Letting it
    launch before waiting lets a chain of kernels fill the SMs with waiting programs, which then
    crowd out the running kernel's later waves (12% slower decode at batch 8 on the H200)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
