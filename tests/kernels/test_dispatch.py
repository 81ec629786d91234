"""kernels/dispatch.py's launch switch: programmatic dependent launch (CUDA, Hopper and later only)."""
from __future__ import annotations

import importlib

import pytest
import torch

from kernels import dispatch


@pytest.fixture
def restore_switch():
    yield
    dispatch.set_programmatic_launch(True)


def test_programmatic_launch_is_never_used_off_cuda(restore_switch) -> None:
    dispatch.set_programmatic_launch(True)
    assert not dispatch.programmatic_launch(torch.zeros(1))  # CPU tensors: the interpreter knows no PDL


@pytest.mark.parametrize(("env", "expected"), [(None, True), ("1", True), ("0", False)])
def test_minillm_pdl_zero_turns_it_off(monkeypatch, restore_switch, env, expected) -> None:
    if env is None:
        monkeypatch.delenv("MINILLM_PDL", raising=False)
    else:
        monkeypatch.setenv("MINILLM_PDL", env)
    try:
        assert importlib.reload(dispatch)._programmatic_launch is expected
    finally:
        monkeypatch.delenv("MINILLM_PDL", raising=False)
        importlib.reload(dispatch)


def test_launch_options_go_with_the_kernels_pdl_argument() -> None:
    assert dispatch.launch_options(True) == {"launch_pdl": True}
    assert dispatch.launch_options(False) == {}
