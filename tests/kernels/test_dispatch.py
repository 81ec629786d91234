"""kernels/dispatch.py's launch switch: programmatic dependent launch (CUDA, Hopper and later only)."""
from __future__ import annotations

import pytest
import torch

from kernels import dispatch


@pytest.fixture
def restore_switch():
    yield
    dispatch.set_programmatic_launch(False)


def test_programmatic_launch_is_never_used_off_cuda(restore_switch) -> None:
    dispatch.set_programmatic_launch(True)
    assert not dispatch.programmatic_launch(torch.zeros(1))  # CPU tensors: the interpreter knows no PDL


@pytest.mark.parametrize(("asked", "env", "expected"), [(True, None, True), (False, None, False),
                                                         (True, "0", False), (False, "1", True)])
def test_minillm_pdl_overrides_the_runners_choice(monkeypatch, restore_switch, asked, env, expected) -> None:
    if env is None:
        monkeypatch.delenv("MINILLM_PDL", raising=False)
    else:
        monkeypatch.setenv("MINILLM_PDL", env)
    dispatch.set_programmatic_launch(asked)
    assert dispatch._programmatic_launch is expected


def test_launch_options_go_with_the_kernels_pdl_argument() -> None:
    assert dispatch.launch_options(True) == {"launch_pdl": True}
    assert dispatch.launch_options(False) == {}
