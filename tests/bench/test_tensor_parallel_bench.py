"""bench/tensor_parallel.py's smoke run on the CPU: one rank and two (gloo), the JSON and the table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two ranks in subprocesses

ROOT = Path(__file__).resolve().parents[2]


def test_tensor_parallel_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "tensor_parallel.py"), "--smoke", "--device", "cpu",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert {"gpu", "gpus", "date", "commit", "floor_bytes_per_s", "rows"} <= set(doc)
    rows = doc["rows"]
    assert [(r["tensor_parallel_size"], r["batch"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["decode_tok_s"] > 0 and r["floor_fraction"] > 0 for r in rows)
    # Two float32 ranks on the tiny shape agree with one over every checked token.
    assert all(r["agreement"] == [8, 8] for r in rows if r["tensor_parallel_size"] == 2)
    assert "| random:tiny-llama3 | minillm | 2 | 2 |" in proc.stdout
    assert {r["system"] for r in rows} == {"minillm"}
