"""kernels/dispatch.py's launch switch: programmatic dependent launch (CUDA, Hopper and later only)."""
from __future__ import annotations

import pytest
import torch

from kernels import dispatch


def test_programmatic_launches_are_on_only_inside_the_context(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINILLM_PDL", raising=False)
    assert not dispatch._programmatic_launch
    with dispatch.programmatic_launches():
        assert dispatch._programmatic_launch
        assert not dispatch.programmatic_launch(torch.zeros(1))  # CPU tensors: the interpreter knows no PDL
    assert not dispatch._programmatic_launch


def test_minillm_pdl_zero_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINILLM_PDL", "0")
    with dispatch.programmatic_launches():
        assert not dispatch._programmatic_launch


def test_launch_options_go_with_the_kernels_pdl_argument() -> None:
    assert dispatch.launch_options(True) == {"launch_pdl": True}
    assert dispatch.launch_options(False) == {}
