"""Which implementation of a kernel runs (Triton on CUDA, the torch reference elsewhere), and how
our Triton kernels are launched (the SM count their grids are sized by, programmatic dependent
launch)."""
from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
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
    (engine/quantization/tuning.py's end-to-end tuning), where the Triton kernels have no backward."""
    global _reference_only
    previous, _reference_only = _reference_only, True
    try:
        yield
    finally:
        _reference_only = previous


_unfolded_norms = False


@contextmanager
def unfolded_norms() -> Iterator[None]:
    """Inside, projections never fold the RMSNorm after them into their one-row kernels (folds_norms
    is False): each norm runs as its own kernel. The decode step the folded one is tested against."""
    global _unfolded_norms
    previous, _unfolded_norms = _unfolded_norms, True
    try:
        yield
    finally:
        _unfolded_norms = previous


def folds_norms(t: torch.Tensor) -> bool:
    """Whether a projection of `t` may end in the add-norm epilogue, leaving the norm's factor to the
    next projection (kernels/rmsnorm.py's NormScale): on Triton, outside unfolded_norms()."""
    return use_triton(t) and not _unfolded_norms


# Off CUDA (Triton's interpreter) grids are sized as on an H200, so CPU tests split as the GPU does.
REFERENCE_SM_COUNT = 132


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors, by which split-K and decode attention size their
    grids; REFERENCE_SM_COUNT off CUDA."""
    if device.type != "cuda":
        return REFERENCE_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


_NUMPY_INTS = {torch.int64: np.int64, torch.int32: np.int32}


def pinned(values: list, dtype: torch.dtype | None) -> torch.Tensor:
    """Host values (ints, or equal-length lists of them) in pinned memory. Integer lists go through
    numpy, about four times faster than torch.tensor over a long prompt's positions and slots."""
    if dtype in _NUMPY_INTS:
        return torch.from_numpy(np.array(values, dtype=_NUMPY_INTS[dtype])).pin_memory()
    return torch.tensor(values, dtype=dtype, pin_memory=True)


def to_device(values: list, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """A tensor of host values on `device`, queued behind the device's work instead of waiting for
    it: torch.tensor(..., device="cuda") copies from pageable memory, which waits for the stream."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return pinned(values, dtype).to(device, non_blocking=True)


# ---- programmatic dependent launch (PDL) ----------------------------------------------------------
# On Hopper and later a kernel launched with PDL may start while the kernel before it is still
# finishing: its programs are placed on the SMs and wait, at their first line, for the previous
# kernel's writes. That hides part of the launch-to-start gap between two short kernels, where a
# batch-1 decode step spends much of its time. It is used inside the decode steps' CUDA graphs,
# where it pays (docs/performance.md, "Kernel notes"); eager launches (prefill) stay plain.
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
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def has_tma(t: torch.Tensor) -> bool:
    """Whether kernels on `t` may stream through the tensor memory accelerator (Hopper and later),
    whose descriptors Triton's interpreter also reads."""
    if t.is_cuda:
        return _is_sm90(t.device)
    return os.environ.get("TRITON_INTERPRET") == "1"


def programmatic_launch(t: torch.Tensor) -> bool:
    """Whether a kernel working on `t` is launched with PDL (then its PDL argument must be True)."""
    return _programmatic_launch and t.is_cuda and _is_sm90(t.device)


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launch keyword that goes with a kernel's PDL argument."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr = True):
    """Called early in every kernel that takes PDL: wait until the previous kernel's writes are
    visible (nothing it may write can be read, and nothing written, before; the one-row GEMVs read
    their first weights before it, decode attention its older keys and values), then, with
    LAUNCH_NEXT, let the next kernel launch (else launch_next_kernel does, later). Letting it launch
    before waiting lets a chain of kernels fill the SMs with waiting programs, which then crowd out
    the running kernel's later waves."""
    if PDL:
        gdc_wait()
        if LAUNCH_NEXT:
            gdc_launch_dependents()


@triton.jit
def launch_next_kernel(PDL: tl.constexpr):
    """Let the next kernel launch, in a kernel that waited with LAUNCH_NEXT=False: after its main
    loop, where the next kernel's waiting programs no longer take SM room from its own."""
    if PDL:
        gdc_launch_dependents()
