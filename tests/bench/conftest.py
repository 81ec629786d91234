"""What the bench smoke tests share: running a bench script as a script, in this process."""
from __future__ import annotations

import runpy
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_script(monkeypatch: pytest.MonkeyPatch) -> Callable[..., int]:
    """run_script("perplexity.py", *args): bench/<name> run as `__main__` with these arguments, as
    `python bench/<name>` would (its sys.path line and main guard included); returns its exit code.
    In this process rather than a subprocess, which would spend most of a smoke run importing torch
    and transformers again. Its stdout and stderr go to capsys."""

    def run(name: str, *args: str) -> int:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch path, not the interpreter
        monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / name), *args])
        monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the repo first; undone after the test
        with pytest.raises(SystemExit) as ended:
            runpy.run_path(str(ROOT / "bench" / name), run_name="__main__")
        return ended.value.code

    return run
