"""bench/graph_ab.py's smoke run on the CPU (no graphs there: engine steps only): each variant's
settings applied in its turn and restored after, and JSON of the agreed shape."""
from __future__ import annotations

import json
from pathlib import Path

import engine.model_runner as model_runner
import kernels.float_linear as float_linear
from engine.llm_engine import LLMEngine


def test_graph_ab_smoke_times_each_variant_and_restores_the_settings(tmp_path: Path, run_script, capsys,
                                                                      monkeypatch) -> None:
    seen, sizes_seen, step = [], set(), LLMEngine.step

    def recording(self: LLMEngine) -> list:  # which settings each step ran under
        seen.append(float_linear.ROWS_GEMV_MOST)
        sizes_seen.add(model_runner.GRAPH_BATCH_SIZES)
        return step(self)
    monkeypatch.setattr(LLMEngine, "step", recording)
    before = float_linear.ROWS_GEMV_MOST
    out = tmp_path / "ab.json"
    sizes = model_runner.GRAPH_BATCH_SIZES
    code = run_script("graph_ab.py", "--device", "cpu", "--models", "tiny-llama3", "--batches", "2", "--rounds", "2",
                      "--steps", "2", "--variant", "kernels.float_linear.ROWS_GEMV_MOST=1",
                      "--variant", "kernels.float_linear.ROWS_GEMV_MOST=5", "--graph-sizes", "1,2,3",
                      "--out", str(out))
    captured = capsys.readouterr()
    assert code == 0, captured.err[-4000:]
    assert float_linear.ROWS_GEMV_MOST == before and model_runner.GRAPH_BATCH_SIZES == sizes
    assert sizes_seen == {(1, 2, 3)}
    assert {1, 5} <= set(seen)
    doc = json.loads(out.read_text())
    assert doc["bench"] == "graph_ab" and doc["partial"] and doc["commit"] and doc["device"] == "cpu"
    assert doc["graph_sizes"] == [1, 2, 3]
    assert doc["variants"] == ["kernels.float_linear.ROWS_GEMV_MOST=1", "kernels.float_linear.ROWS_GEMV_MOST=5"]
    assert [(r["model"], r["batch"], r["variant"]) for r in doc["rows"]] == [
        ("random:tiny-llama3", 2, name) for name in doc["variants"]]
    for row in doc["rows"]:
        assert len(row["engine_step_ms"]["runs"]) == 2 and row["engine_step_ms"]["median"] > 0
        assert row["graph_replay_ms"] is None and row["graph_batch"] is None  # no graphs on the CPU
    assert "| random:tiny-llama3 | 2 |" in captured.out


def test_int4_rows_are_named_by_their_shapes(tmp_path: Path, run_script, capsys) -> None:
    """Each shape's INT4 checkpoint in its own folder, its rows under the shape's name (not the
    checkpoint's temporary path, which the shapes shared)."""
    out = tmp_path / "ab.json"
    code = run_script("graph_ab.py", "--device", "cpu", "--quantization", "int4", "--models", "tiny-llama3,tiny-qwen2",
                      "--batches", "1", "--rounds", "1", "--steps", "1", "--out", str(out),
                      "--variant", "kernels.float_linear.ROWS_GEMV_MOST=1",
                      "--variant", "kernels.float_linear.ROWS_GEMV_MOST=5")
    captured = capsys.readouterr()
    assert code == 0, captured.err[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["quantization"]) for r in rows] == [("random:tiny-llama3", "int4")] * 2 + [
        ("random:tiny-qwen2", "int4")] * 2
    assert "| random:tiny-llama3 | 1 |" in captured.out and "| random:tiny-qwen2 | 1 |" in captured.out
