"""bench/structured.py's smoke run on the CPU: it runs end to end, writes JSON of the agreed shape,
and its constrained outputs follow their schemas (a prefix of the decode schema's JSON; the one
record run to its end is that JSON, complete)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import xgrammar as xgr

from engine.sampling_params import StructuredOutput
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"model", "system", "metric", "batch", "prompt_tokens", "value", "min", "max", "runs", "grammar"}


def test_structured_bench_smoke_writes_the_agreed_json(tmp_path: Path, default_model_dir: Path) -> None:
    out = tmp_path / "structured.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the torch path, not the interpreter
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "structured.py"), "--smoke", "--device", "cpu", "--shape", "tiny-llama3",
         "--vocab-size", "49152", "--tokenizer", str(default_model_dir), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["bench"] == "structured" and doc["gpu"] == "cpu" and doc["commit"] and doc["date"]
    assert doc["torch"] and doc["xgrammar"] and "grammar" in doc["method"]
    assert doc["model"] == "random:tiny-llama3-vocab49152"
    assert doc["model_vocab"] == doc["mask_vocab"] == 49152 and "49,152" in doc["vocab_note"]
    assert doc["failed"] == [] and doc["skipped"] == []

    rows = doc["rows"]
    assert all(set(r) == ROW_KEYS for r in rows)
    assert {r["system"] for r in rows} == {"minillm", "minillm-json"}
    for r in rows:
        assert r["min"] <= r["value"] <= r["max"] and len(r["runs"]) == 3
        assert r["value"] > 0 or r["metric"] == "mask_ms_per_step"
        assert (r["grammar"] is None) == (r["system"] == "minillm")
    decode = {(r["system"], r["batch"]) for r in rows if r["metric"] == "decode_tok_s"}
    assert decode == {(s, b) for s in ("minillm", "minillm-json") for b in (1, 2)}
    masks = [r for r in rows if r["metric"] == "mask_ms_per_step"]
    assert sorted(r["batch"] for r in masks) == [1, 2] and all(r["value"] > 0 for r in masks)
    ttft = {(r["system"], r["grammar"]) for r in rows if r["metric"] == "ttft_ms"}
    assert ttft == {("minillm", None), ("minillm-json", "new"), ("minillm-json", "cached")}
    assert [r["grammar"] for r in rows if r["metric"] == "compile_ms"] == ["new"]

    summary = doc["summary"]
    assert [s["batch"] for s in summary["decode"]] == [1, 2]
    for s in summary["decode"]:
        assert s["ratio"] > 0 and len(s["paired_ratios"]) == 3 and s["finished_early"] == 0
        assert s["goal_ratio"] == (0.90 if s["batch"] == 1 else 0.95)
    t = summary["ttft"]
    assert t["compile_ms"] > 0 and t["compiles"] == {"unconstrained": 0, "new": 3, "cached": 0}

    # The samples follow their schemas: the decode ones as a prefix, the one record complete.
    tokenizer = Tokenizer.from_dir(Path(doc["tokenizer"]))
    compiler = GrammarCompiler.for_tokenizer(tokenizer, doc["mask_vocab"], tokenizer.eos_token_ids)
    samples = {(s["what"], s["batch"]): s for s in doc["samples"]}
    assert set(samples) == {("decode", 1), ("decode", 2), ("finite", 1)}
    for batch in (1, 2):
        s = samples["decode", batch]
        assert len(s["token_ids"]) > 3 and not s["finished"]
        matcher = xgr.GrammarMatcher(compiler.compile(StructuredOutput.json_schema(doc["schemas"]["decode"])))
        assert all(matcher.accept_token(t) for t in s["token_ids"]) and not matcher.is_terminated()
        head = '{"records": [{"id": '
        assert s["text"].startswith(head) or head.startswith(s["text"]), s["text"]
    s = samples["finite", 1]
    assert s["finished"] and s["finish_reason"] == "stop" and s["valid_json"]
    record = json.loads(s["text"])
    assert set(record) == {"id", "name", "score", "tags"}
    assert isinstance(record["id"], int) and 0 <= record["id"] <= 999999 and len(record["name"]) <= 24
    assert 0 <= record["score"] <= 100 and len(record["tags"]) <= 4
    assert set(record["tags"]) <= {"new", "sale", "featured", "clearance", "limited"}
    matcher = xgr.GrammarMatcher(compiler.compile(StructuredOutput.json_schema(doc["schemas"]["record"])))
    assert all(matcher.accept_token(t) for t in s["token_ids"]) and matcher.is_terminated()

    lines = proc.stdout.rstrip().splitlines()
    assert ("| batch | minillm tok/s (min–max) | minillm-json tok/s (min–max) | json / plain | goal "
            "| mask ms/step |") in lines
    assert lines[-1].startswith("| cached schema |")
    assert any(line.startswith("| new schema |") for line in lines)
