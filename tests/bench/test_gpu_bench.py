"""bench/gpu.py's smoke run on the CPU: it runs end to end and writes JSON of the agreed shape."""
from __future__ import annotations

import json
from pathlib import Path

ROW_KEYS = {"model", "system", "metric", "batch", "prompt_tokens", "value", "floor_fraction", "min", "max", "runs"}


def test_gpu_bench_smoke_writes_the_agreed_json(tmp_path: Path, run_script, capsys) -> None:
    out = tmp_path / "gpu.json"
    code = run_script("gpu.py", "--smoke", "--skip-transformers", "--device", "cpu", "--out", str(out))
    captured = capsys.readouterr()
    assert code == 0, captured.err[-4000:]
    doc = json.loads(out.read_text())
    assert set(doc) == {"bench", "gpu", "date", "time", "commit", "partial", "reps", "floor_bytes_per_s", "host",
                        "rows", "comparison", "failed", "skipped"}
    assert doc["host"]["cpu"] and doc["host"]["python_loop_ms"] > 0
    assert doc["gpu"] == "cpu" and doc["commit"] and doc["date"] and doc["time"]
    assert doc["bench"] == "gpu" and doc["partial"] and doc["reps"] == 3 and doc["comparison"] is None
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
        if r["metric"] == "kv_bytes":  # one reading
            assert r["runs"] is None
        else:  # the median of three repetitions, each kept
            assert len(r["runs"]) == 3 and r["min"] <= r["value"] <= r["max"]
            assert r["value"] == sorted(r["runs"])[1] and {r["min"], r["max"]} <= set(r["runs"])
        if r["metric"] == "ttft_ms":
            assert r["floor_fraction"] is None
        else:
            assert r["floor_fraction"] > 0
    # One sequence's KV is at most theory plus one block: floor_fraction = theory / value.
    assert by_metric["kv_bytes"][0]["floor_fraction"] > 0.9
    assert captured.out.rstrip().splitlines()[-1] == "(a partial run: not compared with the record)"
    assert captured.out.rstrip().splitlines()[-3].startswith("| random:tiny-llama3 | minillm |")
    assert "| random:tiny-llama3 | minillm-int4 | decode_tok_s | 1 |" in captured.out
    assert "| model | system | metric | batch | prompt tokens | value | % of floor | × transformers-static |" in captured.out


def record(path: Path, gpu: str, date: str, rows: list[dict], **extra) -> Path:
    path.write_text(json.dumps({"gpu": gpu, "date": date, "commit": "c", "floor_bytes_per_s": 1.0, "rows": rows,
                                **extra}))
    return path


def decode_row(value: float, metric: str = "decode_tok_s", batch: int = 1) -> dict:
    return {"model": "random:m", "system": "minillm", "metric": metric, "batch": batch, "prompt_tokens": 128,
            "value": value, "floor_fraction": None}


def test_the_previous_record_is_the_newest_full_run_of_the_same_gpu(tmp_path: Path) -> None:
    from bench.gpu import previous_record

    rows = [decode_row(100.0)]
    record(tmp_path / "2026-11-29-h200.json", "NVIDIA H200", "2026-11-29", rows)  # before "bench": "gpu"
    newest = record(tmp_path / "2026-12-01-h200.json", "NVIDIA H200", "2026-12-01", rows)
    record(tmp_path / "2026-12-03-h200-quant.json", "NVIDIA H200", "2026-12-03", rows)  # another script's
    record(tmp_path / "2026-12-03-h100.json", "NVIDIA H100", "2026-12-03", rows)  # another GPU
    record(tmp_path / "2026-12-04-x.json", "NVIDIA H200", "2026-12-04", rows, bench="gpu", partial=True)  # an A/B
    record(tmp_path / "2026-12-04-y.json", "NVIDIA H200", "2026-12-04", rows, bench="gpu", partial=False,
           skipped=["llama-3.1-8b minillm: decode"])  # past its budget
    (tmp_path / "2026-12-05-h200.json").write_text("not json")
    assert previous_record(tmp_path, "NVIDIA H200") == newest
    later = record(tmp_path / "2026-12-02-h200-abc1234.json", "NVIDIA H200", "2026-12-02", rows, bench="gpu",
                   partial=False, time="2026-12-02T10:00:00+00:00")
    assert previous_record(tmp_path, "NVIDIA H200") == later
    assert previous_record(tmp_path, "NVIDIA H200", exclude=later) == newest
    assert previous_record(tmp_path, "cpu") is None


def test_figures_more_than_five_percent_worse_are_marked() -> None:
    from bench.gpu import Row, compare

    previous = {"rows": [decode_row(100.0), decode_row(100.0, batch=8), decode_row(10.0, "ttft_ms"),
                         decode_row(10.0, "ttft_ms", batch=8)]}
    now = [Row("random:m", "minillm", "decode_tok_s", 1, 128, 94.0, None),  # 6% fewer tok/s: worse
           Row("random:m", "minillm", "decode_tok_s", 8, 128, 96.0, None),  # 4%: within the noise allowed
           Row("random:m", "minillm", "ttft_ms", 1, 128, 10.6, None),  # 6% slower first token: worse
           Row("random:m", "minillm", "ttft_ms", 8, 128, 9.0, None),  # faster
           Row("random:m", "minillm", "decode_tok_s", 64, 128, 1.0, None)]  # not in the previous record
    changes = compare(previous, now)
    assert [(c["metric"], c["batch"], c["worse"]) for c in changes] == [
        ("decode_tok_s", 1, True), ("decode_tok_s", 8, False), ("ttft_ms", 1, True), ("ttft_ms", 8, False)]
    assert changes[0]["previous"] == 100.0 and changes[0]["value"] == 94.0 and changes[0]["change"] == -0.06
