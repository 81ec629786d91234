"""A/B of two trees on one GPU: bench/gpu.py from each, alternating, medians per figure.

For a change that must not move the numbers (a refactor) or one whose gain is small: both sides run
in the same call on the same machine, interleaved (A B A B ...), so clock and thermal drift hit both.

    python3 bench/ab.py --base /tmp/base --base-commit 2963d47 --head . --head-commit HEAD \
        --rounds 3 --out $OUT/ab.json -- --models llama-3.2-1b --batches 1,64 --skip-transformers

Arguments after `--` go to bench/gpu.py on both sides. The JSON holds every round's rows and the
medians; a markdown table of the medians prints last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_side(tree: Path, commit: str, gpu_args: list[str], timeout_s: float, log: Path) -> dict:
    """One bench/gpu.py run from `tree`; its JSON (rows and floor)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gpu.json"
        # The tree first, then whatever the caller put on the path (the device's carried wheels).
        path = os.pathsep.join(p for p in (str(tree.resolve()), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, MINILLM_COMMIT=commit, PYTHONPATH=path)
        with log.open("a") as f:
            f.write(f"\n==== {tree} ({commit}) ====\n")
            f.flush()
            proc = subprocess.run([sys.executable, "bench/gpu.py", "--out", str(out), *gpu_args], cwd=tree, env=env,
                                  stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"bench/gpu.py failed in {tree} (rc {proc.returncode}); see {log}")
        return json.loads(out.read_text())


def medians(rounds: list[dict], side: str) -> dict[tuple[str, str, str, int, int], float]:
    """Median value of each (model, system, metric, batch, prompt tokens) over the side's rounds."""
    values: dict[tuple[str, str, str, int, int], list[float]] = {}
    for r in rounds:
        if r["side"] != side:
            continue
        for row in r["rows"]:
            key = (row["model"], row["system"], row["metric"], row["batch"], row["prompt_tokens"])
            values.setdefault(key, []).append(row["value"])
    return {k: statistics.median(v) for k, v in values.items()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    gpu_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True, help="the tree to compare against")
    p.add_argument("--base-commit", required=True)
    p.add_argument("--head", type=Path, default=Path("."), help="the tree under test (default .)")
    p.add_argument("--head-commit", required=True)
    p.add_argument("--rounds", type=int, default=3, help="runs of each side (default 3)")
    p.add_argument("--timeout-s", type=float, default=240.0, help="one bench/gpu.py run's limit (default 240)")
    p.add_argument("--out", type=Path, required=True, help="JSON path")
    p.add_argument("--log", type=Path, help="bench/gpu.py's output (default: --out with .log)")
    args = p.parse_args(own)
    log = args.log or args.out.with_suffix(".log")
    sides = {"base": (args.base.resolve(), args.base_commit), "head": (args.head.resolve(), args.head_commit)}
    rounds = []
    for i in range(args.rounds):
        for side in ("base", "head") if i % 2 == 0 else ("head", "base"):
            tree, commit = sides[side]
            result = run_side(tree, commit, gpu_args, args.timeout_s, log)
            rounds.append({"round": i + 1, "side": side, "commit": commit, "gpu": result.get("gpu"),
                           "floor_bytes_per_s": result.get("floor_bytes_per_s"), "rows": result["rows"]})
            print(f"round {i + 1} {side}: " + ", ".join(f"{r['system']} {r['metric']} b{r['batch']} {r['value']:,.1f}"
                                                      for r in result["rows"]), flush=True)
    base, head = medians(rounds, "base"), medians(rounds, "head")
    table = [{"model": k[0], "system": k[1], "metric": k[2], "batch": k[3], "prompt_tokens": k[4],
              "base": base[k], "head": head.get(k), "ratio": head[k] / base[k] if k in head and base[k] else None}
             for k in base]
    args.out.write_text(json.dumps({
        "gpu": rounds[0]["gpu"], "date": datetime.date.today().isoformat(), "base_commit": args.base_commit,
        "head_commit": args.head_commit, "rounds_per_side": args.rounds, "bench_args": gpu_args,
        "medians": table, "rounds": rounds}, indent=1))
    print(f"\n{rounds[0]['gpu']}: medians of {args.rounds} alternating runs, base {args.base_commit} vs head "
          f"{args.head_commit}\n")
    print("| model | system | metric | batch | prompt | base | head | head / base |\n|---|---|---|---:|---:|---:|---:|---:|")
    for t in table:
        ratio = f"{t['ratio']:.3f}" if t["ratio"] is not None else "-"
        head_value = f"{t['head']:,.1f}" if t["head"] is not None else "-"
        print(f"| {t['model']} | {t['system']} | {t['metric']} | {t['batch']} | {t['prompt_tokens']} | {t['base']:,.1f} | {head_value} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
