"""Kernel-test helpers: outputs that start out as NaN (the triton_interpreter fixture is in tests/conftest.py)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


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
