"""A/B of kernel choices made by module settings, in one process: per model and batch size, each
variant's settings applied in turn, the decode graph of that batch re-captured, then engine steps
and graph replays timed, the variants alternating round by round. For choices that a module
constant makes (kernels/float_linear.py's ROWS_GEMV_MOST, kernels/split_k.py's FUSED_ROWS, ...):
one engine, one lease, no second tree. Throwaway A/B runs, never a record (the JSON says partial).

    python3 bench/graph_ab.py --models smollm2-135m,llama-3.2-1b --batches 2,8 \\
        --variant kernels.float_linear.ROWS_GEMV_MOST=1 --variant kernels.float_linear.ROWS_GEMV_MOST=2
    python3 bench/graph_ab.py --quantization int4 --batches 8 \\
        --variant kernels.split_k.FUSED_ROWS=1 --variant kernels.split_k.FUSED_ROWS=16 --out $OUT/ab.json

A variant is `module.NAME=value[,module.NAME=value...]`, each value a Python literal, set over the
defaults (what another variant sets, this one leaves at its default). Steps are
greedy decodes of 128-token prompts. On CPU (--device cpu, the smoke test) there are no graphs:
only engine steps are timed. A batch replays the graph of the next captured size (each row names
its graph_batch); --graph-sizes captures other sizes for a run, which a second run compares:

    python3 bench/graph_ab.py --models qwen2.5-0.5b --batches 5,6 --graph-sizes 1,2,4,8,16 \
        --variant kernels.float_linear.ROWS_GEMV_MOST=2
"""
from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu import int4_checkpoint, log, sync  # noqa: E402
from bench.provenance import git_commit  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader import RANDOM_PREFIX  # noqa: E402
import engine.model_runner as model_runner  # noqa: E402
from engine.model_runner import _DecodeGraph  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

Setting = tuple[Any, str, Any]  # (module, attribute, value)


def parse_variant(text: str) -> list[Setting]:
    """`kernels.split_k.FUSED_ROWS=16,kernels.float_linear.ROWS_GEMV_MOST=1` → its settings."""
    settings = []
    for part in text.split(","):
        target, value = part.split("=", 1)
        module_name, attribute = target.strip().rsplit(".", 1)
        module = importlib.import_module(module_name)
        if not hasattr(module, attribute):
            raise SystemExit(f"{module_name} has no {attribute}")
        settings.append((module, attribute, ast.literal_eval(value.strip())))
    return settings


def timed_steps(engine: LLMEngine, steps: int) -> float:
    """ms a step over `steps` engine steps, after 5 untimed ones."""
    for _ in range(5):
        engine.step()
    sync(engine.runner.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.runner.device)
    return (time.perf_counter() - start) / steps * 1e3


def replay_ms(graph: torch.cuda.CUDAGraph, steps: int) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / steps


def summary(values: list[float]) -> dict[str, Any]:
    return dict(median=round(statistics.median(values), 4), min=round(min(values), 4), max=round(max(values), 4),
                runs=[round(v, 4) for v in values])


def run_model(model: str, name: str, args: argparse.Namespace, variants: list[tuple[str, list[Setting]]]
              ) -> list[dict]:
    """Every batch size of one model (rows named `name`), the variants alternating within each round."""
    kv = "4GiB" if args.device == "cuda" else "256MiB"
    engine = LLMEngine(EngineConfig(model=model, device=args.device, dtype=args.dtype, kv_cache_memory=kv,
                                    max_num_seqs=max(args.batches),
                                    quantization=args.quantization if args.quantization == "fp8" else None))
    engine.warm_up()
    runner, kept, rows = engine.runner, [], []
    # Enough tokens for every timed step (each variant's 5 untimed and `steps` timed, every round).
    params = SamplingParams(temperature=0, max_tokens=args.rounds * len(variants) * (args.steps + 5) + 8,
                            ignore_eos=True)
    for batch in args.batches:
        for i in range(batch):
            engine.add_request([(7 * i + j) % 1000 + 1 for j in range(128)], params)
        while any(not r.sequences[0].output_token_ids for r in engine.requests.values()):
            engine.step()  # prefill
        graph_batch = next((b for b in sorted(runner.graphs) if b >= batch), None)
        steps: dict[str, list[float]] = {variant: [] for variant, _ in variants}
        replays: dict[str, list[float]] = {variant: [] for variant, _ in variants}
        for _ in range(args.rounds):
            for variant, settings in variants:
                for module, attribute, value in settings:
                    setattr(module, attribute, value)
                if graph_batch is not None:
                    torch.cuda.synchronize()
                    kept.append(runner.graphs[graph_batch])  # a step in flight may still read its buffers
                    runner.graphs[graph_batch] = _DecodeGraph(runner, graph_batch, torch.cuda.graph_pool_handle())
                steps[variant].append(timed_steps(engine, args.steps))
                if graph_batch is not None:
                    replays[variant].append(replay_ms(runner.graphs[graph_batch].graph, args.steps))
        for variant, _ in variants:
            rows.append(dict(model=name, quantization=args.quantization, batch=batch, variant=variant,
                             graph_batch=graph_batch, engine_step_ms=summary(steps[variant]),
                             graph_replay_ms=summary(replays[variant]) if replays[variant] else None))
            log(f"{name} batch {batch} [{variant}]: step {rows[-1]['engine_step_ms']['median']:.3f} ms"
                + (f", replay {rows[-1]['graph_replay_ms']['median']:.3f} ms" if replays[variant] else ""))
        for request_id in list(engine.requests):
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
    return rows


def table(doc: dict[str, Any]) -> str:
    names = doc["variants"]
    lines = ["| model | batch | " + " | ".join(f"{n}: step / replay ms" for n in names) + " |",
             "|---|---:|" + "---|" * len(names)]
    by_key: dict[tuple[str, int], dict[str, dict]] = {}
    for row in doc["rows"]:
        by_key.setdefault((row["model"], row["batch"]), {})[row["variant"]] = row
    for (model, batch), cells in by_key.items():
        shown = []
        for name in names:
            row = cells[name]
            replay = row["graph_replay_ms"]
            shown.append(f"{row['engine_step_ms']['median']:.3f} / " + (f"{replay['median']:.3f}" if replay else "-"))
        lines.append(f"| {model} | {batch} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama-3.2-1b", help="named shapes, comma-separated (random weights)")
    parser.add_argument("--quantization", choices=["fp8", "int4"], help="fp8 as it loads; int4 an RTN checkpoint")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[2, 8])
    parser.add_argument("--variant", action="append", required=True, help="module.NAME=value[,...]; two or more")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--graph-sizes", type=lambda s: tuple(int(b) for b in s.split(",")),
                        help="the decode graphs' batch sizes for this run (engine.model_runner.GRAPH_BATCH_SIZES), "
                             "e.g. 1,2,4,5,6,8,16: a batch replays the graph of the next size")
    args = parser.parse_args()
    graph_sizes = model_runner.GRAPH_BATCH_SIZES
    variants = [(text, parse_variant(text)) for text in args.variant]
    saved = {(module, attribute): getattr(module, attribute) for _, settings in variants
             for module, attribute, _ in settings}
    # Each variant over the defaults: what another variant sets and it does not goes back to its default.
    variants = [(name, [(module, attribute, value) for (module, attribute), value in saved.items()
                        if not any(m is module and a == attribute for m, a, _ in settings)] + settings)
                for name, settings in variants]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.models.split(","):
            model = RANDOM_PREFIX + shape
            if args.quantization == "int4":  # a checkpoint a shape, its rows named by the shape
                model = str(int4_checkpoint(shape, 0, torch.device(args.device), Path(tmp) / shape))
            try:
                model_runner.GRAPH_BATCH_SIZES = args.graph_sizes or graph_sizes  # read when the engine captures
                rows += run_model(model, RANDOM_PREFIX + shape, args, variants)
            finally:
                for (module, attribute), value in saved.items():
                    setattr(module, attribute, value)
                model_runner.GRAPH_BATCH_SIZES = graph_sizes
            if args.device == "cuda":
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    doc = dict(bench="graph_ab", device=device, date=datetime.date.today().isoformat(), commit=git_commit(),
               partial=True, rounds=args.rounds, steps=args.steps, variants=[name for name, _ in variants],
               graph_sizes=list(args.graph_sizes or graph_sizes), rows=rows)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
