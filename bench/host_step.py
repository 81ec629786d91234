"""The engine's host work per decode step, with the forward and the sampler stubbed out (CPU, no
GPU needed): scheduling, the step's inputs, placeholders, collecting the sampled ids and making the
outputs. On the GPU, overlapped scheduling hides this work behind the graph replay only while it is
shorter (docs/performance.md: at batch 64 on a slow host it is not). Not a benchmark of record.

    python3 bench/host_step.py --batches 1 8 64
    python3 bench/host_step.py --batches 64 --profile 16   # the hottest functions (cProfile)

A random tiny model without a tokenizer (no detokenizing, as bench/gpu.py's random shapes), greedy,
128-token prompts; every step's "sampled" id is the same token. What the GPU path adds on the host
(the decode graph's input packing, CUDA calls) is not in it.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_runner import StepInputs  # noqa: E402
from engine.sampler import SampleRow, SamplerOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def stubbed_engine(batch: int, vocab: int = 512) -> LLMEngine:
    """A CPU engine of `batch` running decodes whose forward returns zeros and whose sampler returns
    token 7 for every row."""
    engine = LLMEngine(EngineConfig(model="random:tiny-llama3", device="cpu", kv_cache_memory="256MiB",
                                    max_num_seqs=batch))

    def forward(step: StepInputs, prev: torch.Tensor | None, rows: list[SampleRow] | None = None
                ) -> torch.Tensor | None:
        n = len(step.logit_rows) + len(step.prompt_rows)
        return torch.zeros(n, vocab) if n else None

    engine.runner.forward = forward
    engine.runner.sample = lambda logits, rows, mask=None: SamplerOutput(
        torch.full((len(rows),), 7, dtype=torch.int64))
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - 128, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 500 + 1 for j in range(128)], params)
    while any(not r.sequences[0].output_token_ids for r in engine.requests.values()):
        engine.step()  # prefill
    return engine


def host_step_us(engine: LLMEngine, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=200, help="timed steps a repetition")
    parser.add_argument("--reps", type=int, default=3, help="repetitions, the median printed")
    parser.add_argument("--profile", type=int, default=0, help="also list this many hottest functions")
    args = parser.parse_args()
    print("| batch | host µs a step (median) | min | max |\n|---:|---:|---:|---:|")
    reports = []
    for batch in args.batches:
        engine = stubbed_engine(batch)
        host_step_us(engine, 20)  # warm
        runs = [host_step_us(engine, args.steps) for _ in range(args.reps)]
        print(f"| {batch} | {statistics.median(runs):.1f} | {min(runs):.1f} | {max(runs):.1f} |")
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            host_step_us(engine, args.steps)
            profiler.disable()
            reports.append((batch, pstats.Stats(profiler)))
        engine.close()
    for batch, stats in reports:
        print(f"\nbatch {batch}, {args.steps} steps under cProfile:")
        stats.sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
