"""bench/tensor_parallel.py's smoke run on the CPU: one rank and two (gloo), the JSON and the table."""
from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # two ranks, the second in a process of its own


def test_tensor_parallel_bench_smoke(tmp_path: Path, run_script, capsys) -> None:
    out = tmp_path / "tp.json"
    code = run_script("tensor_parallel.py", "--smoke", "--device", "cpu", "--out", str(out))
    captured = capsys.readouterr()
    assert code == 0, captured.err[-4000:]
    doc = json.loads(out.read_text())
    assert {"gpu", "gpus", "date", "commit", "floor_bytes_per_s", "rows"} <= set(doc)
    rows = doc["rows"]
    assert [(r["tensor_parallel_size"], r["batch"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["decode_tok_s"] > 0 and r["floor_fraction"] > 0 for r in rows)
    # Two float32 ranks on the tiny shape agree with one over every checked token.
    assert all(r["agreement"] == [8, 8] for r in rows if r["tensor_parallel_size"] == 2)
    assert "| random:tiny-llama3 | minillm | 2 | 2 |" in captured.out
    assert {r["system"] for r in rows} == {"minillm"}
    # In this process: rank 1 must be gone, and the group left, before the next test.
    assert not multiprocessing.active_children() and not torch.distributed.is_initialized()
