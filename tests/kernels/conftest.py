"""Kernel-test helpers: Triton's interpreter on CPU, and outputs that start out as NaN."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from kernels import rmsnorm


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """For one test, send CPU tensors to the Triton kernels, run by Triton's interpreter.

    tests/conftest.py imports triton in interpreter mode when there is no GPU; this only sets
    TRITON_INTERPRET=1 (which use_triton() reads) until the test ends.
    """
    if not isinstance(rmsnorm._rms_norm_kernel, InterpretedFunction):
        pytest.skip("Triton is compiling for the GPU here; tests/gpu/test_kernels_cuda.py runs these kernels")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@contextmanager
def nan_poisoned_allocations() -> Iterator[None]:
    """Inside it, torch.empty and torch.empty_like hand out NaN-filled float tensors, so a kernel that
    leaves any element of an output it allocates unwritten fails the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))
        mp.setattr(torch, "empty_like", lambda *args, **kwargs: poison(empty_like(*args, **kwargs)))
        yield
