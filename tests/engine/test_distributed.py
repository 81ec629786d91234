"""The process group's teardown: NCCL's is collective, so a rank whose peers are gone must not
wait for them forever (the collectives themselves are checked by tests/engine/test_workers.py)."""
from __future__ import annotations

import threading
import time

import pytest

from engine import distributed
from engine.distributed import TensorParallel, close_tensor_parallel


def test_close_gives_up_on_a_group_that_never_closes(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    stuck = threading.Event()
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", stuck.wait)  # a peer that never comes
    start = time.monotonic()
    close_tensor_parallel(TensorParallel(0, 2), timeout_s=0.2)
    assert time.monotonic() - start < 5
    assert "did not close" in caplog.text
    stuck.set()


def test_one_rank_has_nothing_to_close(monkeypatch: pytest.MonkeyPatch) -> None:
    # A process group this process did not make for tensor parallelism is left alone.
    destroyed: list[bool] = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: destroyed.append(True))
    close_tensor_parallel(TensorParallel())
    assert not destroyed
