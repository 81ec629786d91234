"""bench/spec.py's smoke run on the CPU: both engines on the embedded model, the same tokens, and
JSON of the agreed shape."""
from __future__ import annotations

import json
from pathlib import Path


def test_spec_bench_smoke_writes_the_agreed_json(tmp_path: Path, run_script, capsys, default_model_dir) -> None:
    out = tmp_path / "spec.json"
    code = run_script("spec.py", "--smoke", "--model", str(default_model_dir), "--out", str(out))
    captured = capsys.readouterr()
    assert code == 0, captured.err[-4000:]
    doc = json.loads(out.read_text())
    assert doc["bench"] == "spec" and doc["partial"] and doc["commit"] and doc["device"] == "cpu"
    plain, spec = doc["rows"]
    assert (plain["system"], spec["system"]) == ("minillm", "minillm-spec-ngram")
    assert plain["workload"] == spec["workload"] == "code_edit" and plain["batch"] == spec["batch"] == 1
    assert 0 < plain["tokens"] == spec["tokens"] <= 8 and spec["value"] > 0 and plain["value"] > 0
    assert 0 <= spec["acceptance"] <= 1 and spec["speedup"] == round(spec["value"] / plain["value"], 3)
    assert "| code_edit | 1 |" in captured.out


def test_spec_bench_overlap_adds_a_system_with_steps_going_ahead(tmp_path: Path, run_script, capsys,
                                                                   default_model_dir) -> None:
    out = tmp_path / "spec.json"
    code = run_script("spec.py", "--smoke", "--overlap", "--model", str(default_model_dir), "--out", str(out))
    captured = capsys.readouterr()
    assert code == 0, captured.err[-4000:]
    doc = json.loads(out.read_text())
    assert doc["overlap"] and [r["system"] for r in doc["rows"]] == [
        "minillm", "minillm-spec-ngram", "minillm-spec-ngram-overlap"]
    plain, _, ahead = doc["rows"]
    assert ahead["same_tokens"] and ahead["speedup"] == round(ahead["value"] / plain["value"], 3)
    assert captured.out.count("| code_edit | 1 |") == 2
