"""Gather serving measurements into the benchmark JSON shape (system "minillm-server"): summaries
written by `bench/serve.py --json` and a Locust run's `--csv` statistics.

    python3 bench/serve_results.py --model random:llama-3.2-1b --gpu "NVIDIA H200" --commit abc1234 \\
        --serve out/serve-1.json out/serve-16.json --locust out/locust --locust-users 64 --out results.json
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
from pathlib import Path
from typing import Any

METRICS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tok_s", "errors")


def row(model: str, tool: str, metric: str, users: int, value: float | None) -> dict[str, Any]:
    return {"model": model, "system": "minillm-server", "tool": tool, "metric": metric, "users": users,
            "batch": None, "prompt_tokens": None, "value": value, "floor_fraction": None}


def serve_rows(model: str, path: Path) -> list[dict[str, Any]]:
    summary = json.loads(path.read_text())
    return [row(model, "bench/serve.py", m, summary["users"], summary[m]) for m in METRICS]


def locust_rows(model: str, prefix: str, users: int) -> list[dict[str, Any]]:
    """TTFT and ITL from the typed rows (all TTFT rows pooled by request count), failures from all."""
    stats = list(csv.DictReader(open(f"{prefix}_stats.csv")))
    typed = {kind: [s for s in stats if s["Type"] == kind] for kind in ("TTFT", "ITL")}

    def pooled(kind: str, column: str) -> float | None:
        rows = [s for s in typed[kind] if int(s["Request Count"])]
        total = sum(int(s["Request Count"]) for s in rows)
        # Percentiles do not pool exactly; weighting each row's by its count is close for a summary.
        return sum(float(s[column]) * int(s["Request Count"]) for s in rows) / total if total else None

    failures = sum(int(s["Failure Count"]) for s in stats if s["Name"] != "Aggregated")
    return [row(model, "locust", "ttft_p50_ms", users, pooled("TTFT", "50%")),
            row(model, "locust", "ttft_p99_ms", users, pooled("TTFT", "99%")),
            row(model, "locust", "itl_p50_ms", users, pooled("ITL", "50%")),
            row(model, "locust", "itl_p99_ms", users, pooled("ITL", "99%")),
            row(model, "locust", "errors", users, failures)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--gpu", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--serve", type=Path, nargs="*", default=[], help="bench/serve.py --json summaries")
    p.add_argument("--locust", help="a Locust --csv prefix")
    p.add_argument("--locust-users", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    rows = [r for path in args.serve for r in serve_rows(args.model, path)]
    if args.locust:
        rows += locust_rows(args.model, args.locust, args.locust_users)
    doc = {"gpu": args.gpu, "date": datetime.date.today().isoformat(), "commit": args.commit,
           "floor_bytes_per_s": None, "rows": rows}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print("| tool | users | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tok/s | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for (tool, users) in dict.fromkeys((r["tool"], r["users"]) for r in rows):
        got = {r["metric"]: r["value"] for r in rows if r["tool"] == tool and r["users"] == users}
        cells = [f"{got[m]:.1f}" if isinstance(got.get(m), float) else str(got.get(m, "-")) for m in METRICS]
        print(f"| {tool} | {users} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
