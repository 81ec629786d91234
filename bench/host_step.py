"""The engine's host work per decode step, with the forward and the sampler stubbed out (CPU, no
GPU needed): scheduling, the step's inputs, placeholders, collecting the sampled ids and making the
outputs. On the GPU, overlapped scheduling hides this work behind the graph replay only while it is
shorter (docs/performance.md: at batch 64 on a slow host it is not). Not a benchmark of record.

    python3 bench/host_step.py --batches 1 8 64
    python3 bench/host_step.py --batches 64 --profile 16   # the hottest functions (cProfile)

A random tiny model without a tokenizer (no detokenizing, as bench/gpu.py's random shapes), greedy,
128-token prompts that repeat a 16-token cycle, which the "sampled" ids carry on. What the GPU path
adds on the host (the decode graph's input packing, CUDA calls) is not in it.

    python3 bench/host_step.py --batches 1 8 --speculative ngram   # every step verifies 4 drafts

With --device-us the forward takes that long on a simulated device, a serial queue of forwards
(a step starts once it is launched and the step before it has ended; its ids are read once it
has ended, spinning as a CUDA event's wait does): the host's work then shows where it is on the
critical path, in the tokens a second. --deviate makes the "model" leave the cycle at that share of
positions, so that drafts are rejected from there; --overlap lets steps with drafts go ahead of the
step in flight (--speculative-overlap). A simulation, not a measurement of any GPU.

    python3 bench/host_step.py --batches 1 8 --speculative ngram --device-us 1000 --deviate 0.05 --overlap
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_runner import StepInputs  # noqa: E402
from engine.sampler import SampleRow, SamplerOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

CYCLE = 16  # tokens a prompt repeats
LAUNCHES: list[float] = []  # perf_counter() at each stubbed forward


class SimulatedDevice:
    """A serial queue of forwards of `seconds` each."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.free_at = 0.0  # when the last forward launched ends

    def launch(self) -> None:
        self.free_at = max(time.perf_counter(), self.free_at) + self.seconds


class Landing(SamplerOutput):
    """Sampled ids that can be read once their forward has ended on the simulated device."""

    def __init__(self, token_ids: torch.Tensor, ready_at: float) -> None:
        super().__init__(token_ids)
        self.ready_at = ready_at

    @property
    def token_id_list(self) -> list[int]:
        while time.perf_counter() < self.ready_at:  # a CUDA event's wait spins too
            pass
        return super().token_id_list


def model_token(row: SampleRow, deviate: float) -> int:
    """The stub model's token: its prompt's cycle carried on, left at a `deviate` share of positions
    (the same ones whatever the step: outputs do not depend on speculation)."""
    token = row.prompt_token_ids[row.counter % CYCLE]
    if deviate and zlib.crc32(row.counter.to_bytes(8, "little")) % 10_000 < deviate * 10_000:
        return token + 1
    return token


def stubbed_engine(batch: int, vocab: int = 512, method: str | None = None, tokenizer: str | None = None,
                   device_us: float = 0.0, deviate: float = 0.0, overlap: bool = False) -> LLMEngine:
    """A CPU engine of `batch` running decodes whose forward returns zeros and whose sampler carries
    on each prompt's 16-token cycle (model_token). With a speculative `method` every sequence
    drafts; without `deviate` every draft is confirmed. With a `tokenizer` the outputs are
    detokenized; with `device_us` the forwards run on a SimulatedDevice. The time of each forward's
    launch is kept in LAUNCHES."""
    engine = LLMEngine(EngineConfig(model="random:tiny-llama3", device="cpu", kv_cache_memory="256MiB",
                                    max_num_seqs=batch, speculative_method=method, speculative_max_batch=batch,
                                    speculative_gate=False, tokenizer=tokenizer, speculative_overlap=overlap))
    device = SimulatedDevice(device_us / 1e6)

    def forward(step: StepInputs, prev: torch.Tensor | None, rows: list[SampleRow] | None = None
                ) -> torch.Tensor | None:
        LAUNCHES.append(time.perf_counter())
        device.launch()
        n = len(step.logit_rows) + len(step.prompt_rows)
        return torch.zeros(n, vocab) if n else None

    engine.runner.forward = forward
    engine.runner.sample = lambda logits, rows, mask=None: Landing(
        torch.tensor([model_token(row, deviate) for row in rows], dtype=torch.int64), device.free_at)
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - 128, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j % CYCLE) % 250 + 260 for j in range(8 * CYCLE)], params)  # merged pieces: no special or byte tokens
    while any(not r.sequences[0].output_token_ids for r in engine.requests.values()):
        engine.step()  # prefill
    gc.collect()  # an engine made before this one is not collected while this one is timed
    return engine


def host_step_us(engine: LLMEngine, steps: int) -> tuple[float, float, float]:
    """µs a step, the median µs from a step's start to its forward's launch (all of it on the
    critical path where the step waits for the one before, none while it overlaps), and the
    tokens emitted a second."""
    batch = len(engine.requests)
    starts = []
    LAUNCHES.clear()
    tokens = engine.generation_tokens_total
    start = time.perf_counter()
    for _ in range(steps):
        starts.append(time.perf_counter())
        engine.step()
    seconds = time.perf_counter() - start
    tokens = engine.generation_tokens_total - tokens
    if len(engine.requests) < batch or len(LAUNCHES) != steps:  # a shorter batch would time less work
        raise SystemExit(f"A sequence reached the context's end: time fewer than {steps} steps.")
    return seconds / steps * 1e6, statistics.median(b - a for a, b in zip(starts, LAUNCHES)) * 1e6, tokens / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, help="timed steps a repetition, a fresh engine each (default 150; "
                        "100 with drafts, whose 5 tokens a step reach the context's end sooner)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions, the median printed")
    parser.add_argument("--profile", type=int, default=0, help="also list this many hottest functions")
    parser.add_argument("--speculative", choices=("ngram", "suffix"), help="every step verifies drafts of this method")
    parser.add_argument("--tokenizer", help="detokenize the outputs with this tokenizer (default: the embedded model's)")
    parser.add_argument("--device-us", type=float, default=0.0, help="each forward's time on a simulated device")
    parser.add_argument("--deviate", type=float, default=0.0, help="share of positions where the stub model leaves its cycle")
    parser.add_argument("--overlap", action="store_true", help="steps with drafts go ahead of the step in flight")
    args = parser.parse_args()
    args.steps = args.steps or (100 if args.speculative else 150)
    print("| batch | host µs a step (median) | min | max | µs to the launch (median) | tokens/s (median) |\n"
          "|---:|---:|---:|---:|---:|---:|")
    reports = []
    for batch in args.batches:
        runs, to_launch, rates = [], [], []
        for rep in range(args.reps + bool(args.profile)):
            # A fresh engine each: drafting sequences run out of context.
            engine = stubbed_engine(batch, method=args.speculative, tokenizer=args.tokenizer, device_us=args.device_us,
                                    deviate=args.deviate, overlap=args.overlap)
            host_step_us(engine, 20)  # warm
            if rep < args.reps:
                us, launch_us, rate = host_step_us(engine, args.steps)
                runs.append(us)
                to_launch.append(launch_us)
                rates.append(rate)
            else:
                profiler = cProfile.Profile()
                profiler.enable()
                host_step_us(engine, args.steps)
                profiler.disable()
                reports.append((batch, pstats.Stats(profiler)))
            engine.close()
        print(f"| {batch} | {statistics.median(runs):.1f} | {min(runs):.1f} | {max(runs):.1f} "
              f"| {statistics.median(to_launch):.1f} | {statistics.median(rates):,.0f} |")
    for batch, stats in reports:
        print(f"\nbatch {batch}, {args.steps} steps under cProfile:")
        stats.sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
