"""bench/perplexity.py's smoke run on the CPU: every system, a tiny token budget, the agreed JSON."""
from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.slow  # each test runs the benchmark

ROW_KEYS = {"model", "system", "metric", "batch", "prompt_tokens", "value", "floor_fraction"}


def test_perplexity_smoke_writes_the_agreed_json(default_model_dir, tmp_path, run_script, capsys, monkeypatch) -> None:
    out = tmp_path / "ppl.json"
    monkeypatch.setenv("MINILLM_MODELS_DIR", str(default_model_dir.parent))
    # AWQ on all 30 layers takes a minute even on few tokens; the smoke leaves it out.
    code = run_script("perplexity.py", "--max-tokens", "80", "--window", "48", "--stride", "32", "--systems",
                      "minillm,minillm-bf16,minillm-fp8,minillm-int4-rtn", "--out", str(out))
    captured = capsys.readouterr()
    assert code == 0, captured.err[-4000:]
    doc = json.loads(out.read_text())
    assert set(doc) == {"gpu", "date", "commit", "floor_bytes_per_s", "rows"}
    assert doc["gpu"] == "cpu" and doc["floor_bytes_per_s"] is None and doc["commit"] and doc["date"]
    rows = doc["rows"]
    assert all(set(r) == ROW_KEYS for r in rows)
    assert [r["system"] for r in rows] == ["minillm", "minillm-bf16", "minillm-fp8", "minillm-int4-rtn"]
    for r in rows:
        assert r["model"] == "SmolLM2-135M-Instruct" and r["metric"] == "perplexity" and r["prompt_tokens"] == 80
        assert 1 < r["value"] < 1000 and r["batch"] is None and r["floor_fraction"] is None
    assert "| SmolLM2-135M-Instruct | minillm-int4-rtn | 80 |" in captured.out


def test_perplexity_smoke_runs_awq(tiny_model_dir, default_model_dir, tmp_path, run_script) -> None:
    """The calibrated systems (AWQ, GPTQ) end to end, on a tiny model with the embedded model's tokenizer (quick)."""
    src = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir("tiny-llama3", vocab_size=49152)[0], src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, src)
    out = tmp_path / "ppl.json"
    assert run_script("perplexity.py", "--model", str(src), "--max-tokens", "80", "--window", "48", "--stride", "32",
                      "--group-size", "32", "--calibration-tokens", "64", "--systems",
                      "minillm-int4-rtn,minillm-int4-awq,minillm-fp8-gptq", "--out", str(out)) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["system"]) for r in rows] == [("tiny", "minillm-int4-rtn"), ("tiny", "minillm-int4-awq"),
                                                         ("tiny", "minillm-fp8-gptq")]
    assert all(r["value"] > 1 for r in rows)
