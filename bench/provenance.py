"""Where a benchmark result comes from: the commit it measured."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """MINILLM_COMMIT if set (the device machine's copy of the tree may carry a stale .git), else HEAD."""
    if os.environ.get("MINILLM_COMMIT"):
        return os.environ["MINILLM_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
