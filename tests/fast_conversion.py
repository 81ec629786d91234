"""A stand-in for the embedded model's one-time conversion (~20 s of dequantizing), for tests that
start a process which would convert it again: at start-up that process makes the conversion
symlinks to the session's finished one (tests/conftest.py's default_model_dir)."""
from __future__ import annotations

from pathlib import Path

MODULE = "minillm_fast_conversion"
SOURCE = '''
import os
import shutil

from engine import model_store


def convert(target, progress):
    tmp = target.parent / f".{target.name}.tmp-test"
    shutil.copytree(os.environ["MINILLM_TEST_CONVERTED"], tmp, copy_function=os.symlink)
    os.replace(tmp, target)


model_store._convert = convert
'''


def install(directory: Path, converted: Path) -> dict[str, str]:
    """Make every Python process that has `directory` on its path (PYTHONPATH: sitecustomize) or as
    a site directory (a .pth file: a system Python's own sitecustomize would come first) load the
    stand-in; returns the environment variables the processes need besides."""
    (directory / f"{MODULE}.py").write_text(SOURCE)
    (directory / "sitecustomize.py").write_text(f"import {MODULE}\n")
    (directory / f"{MODULE}.pth").write_text(f"import {MODULE}\n")
    return {"MINILLM_TEST_CONVERTED": str(converted)}
