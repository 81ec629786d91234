"""bench/gpu.py's smoke run on the CPU: it runs end to end and writes JSON of the agreed shape."""
from __future__ import annotations

import json
from pathlib import Path

ROW_KEYS = {"model", "system", "metric", "batch", "prompt_tokens", "value", "floor_fraction"}


def test_gpu_bench_smoke_writes_the_agreed_json(tmp_path: Path, run_script, capsys) -> None:
    out = tmp_path / "gpu.json"
    code = run_script("gpu.py", "--smoke", "--skip-transformers", "--device", "cpu", "--out", str(out))
    captured = capsys.readouterr()
    assert code == 0, captured.err[-4000:]
    doc = json.loads(out.read_text())
    assert set(doc) == {"gpu", "date", "commit", "floor_bytes_per_s", "rows"}
    assert doc["gpu"] == "cpu" and doc["commit"] and doc["date"]
    assert doc["floor_bytes_per_s"] > 0
    rows = doc["rows"]
    assert all(set(r) == ROW_KEYS for r in rows)
    assert {r["system"] for r in rows} == {"minillm", "minillm-fp8", "minillm-int4", "minillm-int4-lm-head"}
    assert all(r["model"] == "random:tiny-llama3" for r in rows)
    by_metric = {m: [r for r in rows if r["metric"] == m] for m in ("decode_tok_s", "ttft_ms", "kv_bytes")}
    assert len(rows) == sum(len(v) for v in by_metric.values())
    decode = {s: sorted(r["batch"] for r in by_metric["decode_tok_s"] if r["system"] == s)
              for s in ("minillm", "minillm-fp8", "minillm-int4", "minillm-int4-lm-head")}
    assert decode == {"minillm": [1, 2], "minillm-fp8": [1], "minillm-int4": [1], "minillm-int4-lm-head": [1]}
    assert sorted(r["prompt_tokens"] for r in by_metric["ttft_ms"]) == [16, 64, 256]
    assert [r["prompt_tokens"] for r in by_metric["kv_bytes"]] == [256]
    for r in rows:
        assert r["value"] > 0 and r["batch"] > 0 and r["prompt_tokens"] > 0
        if r["metric"] == "ttft_ms":
            assert r["floor_fraction"] is None
        else:
            assert r["floor_fraction"] > 0
    # One sequence's KV is at most theory plus one block: floor_fraction = theory / value.
    assert by_metric["kv_bytes"][0]["floor_fraction"] > 0.9
    assert captured.out.rstrip().splitlines()[-1].startswith("| random:tiny-llama3 | minillm |")
    assert "| random:tiny-llama3 | minillm-int4 | decode_tok_s | 1 |" in captured.out
    assert "| model | system | metric | batch | prompt tokens | value | % of floor | × transformers-static |" in captured.out
