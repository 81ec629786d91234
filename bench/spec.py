"""Speculative decoding beside plain decoding, on the same weights, in one run.

The workloads (bench/data/spec_workloads.json, made for this benchmark): a code edit that returns a
given function with one change, a question answered by quoting a long text, an agent loop that
repeats tool-call JSON, and an open chat. Per workload and batch size, both engines generate the
same requests in alternating repetitions (plain, speculative, speculative, plain, ...), after one
untimed run each that also fills the prefix cache; each figure is the median, with min, max and
every run in the JSON. Batch 1 is greedy; batch 8 is 8 seeded samples at temperature 0.7, so the
sequences differ. Outputs are the same with and without speculation by construction, and checked.

tok/s counts generated tokens over each generate call's wall time (prefill of the uncached tail
included, the same for both). Acceptance is accepted / drafted tokens in the timed runs.

  python bench/spec.py --out bench/results/<date>-cpu-spec.json     # CPU, the embedded model
  python bench/spec.py --method draft --speculative-model DIR        # drafts from a small model
  python bench/spec.py --smoke                                         # seconds: checks the script
  python bench/spec.py --device cuda --overlap                         # and with --speculative-overlap
  python bench/spec.py --speculative-max-batch 8                       # batch 8 drafting on CPU too
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu import log, spread  # noqa: E402
from bench.provenance import git_commit  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

WORKLOADS = Path(__file__).resolve().parent / "data" / "spec_workloads.json"
PLAIN = "minillm"


def requests(batch: int, max_tokens: int) -> list[SamplingParams]:
    """Batch 1: greedy. Larger: seeded samples at temperature 0.7, one seed each."""
    if batch == 1:
        return [SamplingParams(temperature=0, max_tokens=max_tokens)]
    return [SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens) for i in range(batch)]


def timed(engine: LLMEngine, prompt: list[dict[str, str]], params: list[SamplingParams]
          ) -> tuple[float, int, list[list[int]], int, int]:
    """One generate call: seconds, tokens generated, their ids, and the drafts verified and accepted.
    Each call starts with no memory of earlier requests: it repeats them, which a proposer that
    remembers other requests (suffix) would otherwise copy."""
    proposer = engine.scheduler.proposer
    if proposer is not None and hasattr(proposer, "forget"):
        proposer.forget()
    before = engine.stats()
    start = time.perf_counter()
    results = engine.generate([prompt] * len(params), params)
    seconds = time.perf_counter() - start
    after = engine.stats()
    ids = [r.token_ids for r in results]
    return (seconds, sum(map(len, ids)), ids, after.draft_tokens - before.draft_tokens,
            after.accepted_draft_tokens - before.accepted_draft_tokens)


def run(args: argparse.Namespace) -> dict[str, Any]:
    workloads: dict[str, list[dict[str, str]]] = json.loads(WORKLOADS.read_text())["workloads"]
    if args.workloads:
        workloads = {name: workloads[name] for name in args.workloads.split(",")}
    method = f"{PLAIN}-spec-{args.method}"
    # With --overlap a third engine: the same drafts, its steps going ahead of steps with drafts.
    variants = {method: False, **({f"{method}-overlap": True} if args.overlap else {})}
    # The engines in one process: on a GPU each takes a fixed KV pool, not a share of free memory.
    config = dict(model=args.model, device=args.device, dtype=args.dtype,
                  kv_cache_memory="4GiB" if args.device.startswith("cuda") else None)
    engines = {PLAIN: LLMEngine(EngineConfig(**config)),
               **{system: LLMEngine(EngineConfig(**config, speculative_method=args.method,
                                                 speculative_model=args.speculative_model,
                                                 num_speculative_tokens=args.num_speculative_tokens,
                                                 speculative_max_batch=args.speculative_max_batch,
                                                 speculative_gate=not args.ungated, speculative_overlap=overlap))
                  for system, overlap in variants.items()}}
    rows: list[dict[str, Any]] = []
    exact = args.device == "cpu"
    for name, prompt in workloads.items():
        for batch in args.batches:
            params = requests(batch, args.max_tokens)
            outputs = {system: timed(engine, prompt, params)[2] for system, engine in engines.items()}  # warm
            order = list(engines)
            runs: dict[str, list[float]] = {system: [] for system in order}
            drafted = dict.fromkeys(order, 0)
            accepted = dict.fromkeys(order, 0)
            tokens: dict[str, int] = {}  # each system's tokens (bf16 on a GPU: their outputs may differ)
            same = {system: outputs[system] == outputs[PLAIN] for system in order}
            for rep in range(args.reps):
                for system in order if rep % 2 == 0 else order[::-1]:
                    seconds, count, ids, d, a = timed(engines[system], prompt, params)
                    same[system] = same[system] and ids == outputs[PLAIN]
                    # On CPU the kernels do not depend on the batch's shape, so the tokens must match; on a
                    # GPU a verify step's rows take other kernels than a decode's (rounding may differ).
                    assert same[system] or not exact, f"{name} batch {batch}: {system}'s tokens differ"
                    runs[system].append(count / seconds)
                    tokens[system] = count
                    drafted[system] += d
                    accepted[system] += a
            plain: dict[str, Any] = {}
            for system in order:
                row = dict(workload=name, batch=batch, system=system, metric="tok_s", tokens=tokens[system],
                           **spread(runs[system]))
                if system == PLAIN:
                    plain = row
                else:
                    row["same_tokens"] = same[system]
                    row["acceptance"] = round(accepted[system] / drafted[system], 3) if drafted[system] else None
                    row["speedup"] = round(row["value"] / plain["value"], 3)
                rows.append(row)
                log(f"{name:12s} batch {batch:2d} {system:32s} {row['value']:8.1f} tok/s"
                    + (f"  acceptance {row['acceptance']}  x{row['speedup']}" if system != PLAIN else ""))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    partial = bool(args.workloads) or args.smoke or not {1, 8} <= set(args.batches)  # a full run has both
    return dict(bench="spec", device=args.device, gpu=gpu, dtype=args.dtype, model=args.model,
                date=datetime.date.today().isoformat(), commit=git_commit(), method=args.method, speculative_model=args.speculative_model,
                num_speculative_tokens=args.num_speculative_tokens, speculative_max_batch=args.speculative_max_batch,
                gated=not args.ungated, overlap=args.overlap,
                batches=args.batches, max_tokens=args.max_tokens, reps=args.reps, partial=partial, rows=rows)


def table(doc: dict[str, Any]) -> str:
    lines = ["| workload | batch | plain tok/s | speculative tok/s | x | acceptance | same tokens | system |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    plain: dict[str, Any] = {}
    for row in doc["rows"]:
        if row["system"] == PLAIN:
            plain = row
            continue
        lines.append(f"| {row['workload']} | {row['batch']} | {plain['value']:,.1f} | {row['value']:,.1f} | "
                     f"{row['speedup']:.2f} | {row['acceptance']} | {'yes' if row.get('same_tokens', True) else 'no'} "
                     f"| {row['system']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--method", default="ngram")
    parser.add_argument("--speculative-model", help="the draft model of --method draft")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--speculative-max-batch", type=int,
                        help="running sequences up to which steps draft (default: by device, 1 on CPU)")
    parser.add_argument("--ungated", action="store_true",
                        help="--speculative-gate false: draft beside a batch even where it measures slower")
    parser.add_argument("--overlap", action="store_true",
                        help="also the same drafts with --speculative-overlap (system minillm-spec-<method>-overlap)")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workloads", default="", help="a comma-separated subset (the run is then partial)")
    parser.add_argument("--smoke", action="store_true", help="one workload, batch 1, 8 tokens, one repetition")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.workloads, args.batches, args.max_tokens, args.reps = "code_edit", [1], 8, 1
    doc = run(args)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
