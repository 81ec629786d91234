"""bench/sass_count.py compiles the INT4 one-row GEMV for sm_90 on the CPU: it must keep up with the
kernel's arguments, and the loop it counts must be the GEMV's (an FMA a weight at least)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def counts(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "counts.json"
    # A process of its own: this one's kernels may be the interpreter's, which cannot compile for sm_90.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, str(ROOT / "bench" / "sass_count.py"), "--group-sizes", "128", "--json", str(out),
                    *args], env=env, check=True, capture_output=True, timeout=300)
    return json.loads(out.read_text())


def test_counts_the_gemv_loop_of_every_variant(tmp_path: Path) -> None:
    rows = counts(tmp_path)
    assert [r["variant"] for r in rows] == ["plain", "silu-mul", "add-norm"]
    for r in rows:
        assert r["group_size"] == 128 and r["weights"] == 256 and 0 < r["registers"] <= 255 and r["spills"] >= 0
        assert dict(map(tuple, r["mix"]))["FFMA"] >= r["weights"] and r["loop"] > r["weights"]


def test_another_tiling_under_a_register_cap(tmp_path: Path) -> None:
    for r in counts(tmp_path, "--tiling", "16x32x1", "--maxnreg", "96"):
        assert r["weights"] == 128 and r["registers"] <= 96  # 16 rows x 32 words x 8 / 32 lanes
        assert r["spills"] > 0  # its loop wants about 120 registers: the spills column sees the cap bite
        assert dict(map(tuple, r["mix"]))["FFMA"] >= r["weights"]
