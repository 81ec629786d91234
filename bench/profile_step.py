"""Where a decode step's time goes on the GPU: the whole engine step against the CUDA-graph replay
alone, and the replay's kernels by total time (torch.profiler). With --prefill, where a prompt's
time to first token goes: the whole prefill step against its kernels' summed device time (a step
whose host work outlasts its kernels is launch-bound). Not a benchmark of record.

    python3 bench/profile_step.py --model random:llama-3.2-1b --batches 1 8 64
    python3 bench/profile_step.py --batches 1 --quantization int4 --host-profile   # an RTN checkpoint of the shape
    python3 bench/profile_step.py --batches --prefill 128 2048 --host-profile
    python3 bench/profile_step.py --batches 1 8 64 --drafts 4   # a verify step (k drafts each) against a decode
    python3 bench/profile_step.py --model random:smollm2-135m --dtype float32 --batches 1 --drafts 4
    python3 bench/profile_step.py --batches 1 8 --timeline   # where the device idles between engine steps
    MINILLM_PDL=0 python3 bench/profile_step.py ...   # kernels one after another: with PDL each starts early and its time includes the wait
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu import int4_checkpoint  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.loader import RANDOM_PREFIX  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_runner import StepInputs  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.speculative import DraftState, Proposer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-3.2-1b")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--prefill", type=int, nargs="*", default=[], help="prompt lengths whose prefill to profile")
    parser.add_argument("--drafts", type=int, default=0,
                        help="every decode carries this many draft tokens (a verify step), whatever is accepted")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    parser.add_argument("--rows", type=int, default=8, help="kernels listed per table, by total time")
    parser.add_argument("--host-profile", action="store_true", help="also print the host's hottest functions (cProfile)")
    parser.add_argument("--timeline", action="store_true",
                        help="also trace engine steps: the device's idle gaps between them and what runs outside the graph")
    parser.add_argument("--quantization", choices=["fp8", "int4"], help="fp8 as it loads, or int4 (an RTN checkpoint of a random: shape)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    args = parser.parse_args()
    model, quantization = args.model, args.quantization
    tmp = tempfile.TemporaryDirectory()
    if quantization == "int4":
        model, quantization = str(int4_checkpoint(args.model.removeprefix(RANDOM_PREFIX), 0, torch.device("cuda"),
                                                  Path(tmp.name))), None
    spec = dict(speculative_method="ngram", num_speculative_tokens=args.drafts,
                speculative_max_batch=max(args.batches, default=1)) if args.drafts else {}
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, kv_cache_memory="8GiB",
                                    max_num_seqs=max(args.batches, default=1), quantization=quantization, **spec))
    runs: list[str] = []  # per verify step: the graph it replayed, or eager
    if args.drafts:  # the cost of verifying k drafts, not their luck: k every step, never backing off
        engine.scheduler.proposer = FixedDrafts(args.drafts)
        engine.scheduler.gate = None  # it would stop the drafts where they lose
        DraftState.record = lambda self, drafted, confirmed, most: None
        runner = engine.runner
        forward, find = runner.forward, runner._prefill_graph_for

        def traced(step: StepInputs, prev: torch.Tensor | None, rows: list | None = None) -> torch.Tensor | None:
            runs.append(f"decode graph {step.graph_batch}" if step.graph_batch is not None
                        else "prefill graph" if find(step, prev) is not None else "eager")
            return forward(step, prev, rows)
        runner.forward = traced
    engine.warm_up()
    for batch in args.batches:
        # Timed steps, then profiled ones; a verify step may emit all its drafts.
        params = SamplingParams(temperature=args.temperature, max_tokens=(2 * args.steps + 20) * (args.drafts + 1),
                                ignore_eos=True)
        start_decode(engine, batch, params)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - start) / args.steps * 1000
        host_report = ""
        if args.host_profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
            host_report = text.getvalue()
        if args.timeline:
            print(timeline(engine, args.steps))
        if args.drafts:  # a verify step's graph also depends on its rows: the whole step is timed
            runs.clear()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    engine.step()
                torch.cuda.synchronize()
            averages = prof.key_averages()
            launches = sum(e.count for e in averages) / 5
            device_ms = sum(e.device_time_total for e in averages) / 5 / 1000
            ran = ", ".join(f"{runs.count(r)} x {r}" for r in sorted(set(runs)))
            print(f"\nbatch {batch}, {args.drafts} drafts a sequence: engine step {step_ms:.3f} ms, device work "
                  f"{device_ms:.3f} ms in {launches:.0f} launches a step; ran as {ran}")
            print(averages.table(sort_by="device_time_total", row_limit=args.rows, max_name_column_width=60))
            print(host_report[host_report.find("   ncalls"):] if host_report else "", end="")
            for request_id in list(engine.requests):
                engine.abort(request_id)
            continue
        graph = engine.runner.graphs[next(b for b in sorted(engine.runner.graphs) if b >= batch)]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(args.steps):
            graph.graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_ms = begin.elapsed_time(end) / args.steps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.graph.replay()
            torch.cuda.synchronize()
        averages = prof.key_averages()
        kernels = sum(e.count for e in averages) / 5  # the replay's launches (kernels, memsets, copies)
        print(f"\nbatch {batch}: engine step {step_ms:.3f} ms, graph replay {replay_ms:.3f} ms, "
              f"host and sampling {step_ms - replay_ms:.3f} ms ({(step_ms - replay_ms) / step_ms:.0%}), "
              f"{kernels:.0f} kernels a step")
        print(host_report[host_report.find("   ncalls"):] if host_report else "", end="")
        try:
            print(averages.table(sort_by="device_time_total", row_limit=args.rows, max_name_column_width=60))
        except (AttributeError, KeyError):  # older torch names it cuda_time_total
            print(averages.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        for request_id in list(engine.requests):
            engine.abort(request_id)
    for length in args.prefill:
        profile_prefill(engine, length, args.host_profile, args.rows)


def start_decode(engine: LLMEngine, batch: int, params: SamplingParams) -> None:
    """`batch` requests of 128 prompt tokens each, stepped until every one has its first token."""
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 + 1 for j in range(128)], params)
    while any(not r.sequences[0].output_token_ids for r in engine.requests.values()):
        engine.step()  # prefill


def timeline(engine: LLMEngine, steps: int) -> str:
    """Trace `steps` engine steps (host and device) and say where the device idled: its busy share of
    the window, its gaps a step (how many, how long, the operation each gap came before), the device
    work outside the graph replays (copies, sampler kernels), and how long the host waited on it."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(path)
    events = json.loads(Path(path).read_text())["traceEvents"]
    os.unlink(path)
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    if not device:
        return "timeline: no device events traced"
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    waits = sum(e["dur"] for e in runtime if "Synchronize" in e["name"])
    launcher = {e["args"].get("correlation"): e["name"] for e in runtime if "args" in e}

    def launched_by(e: dict) -> str:
        return launcher.get(e.get("args", {}).get("correlation"), "?")

    busy = gap_total = 0.0
    gaps: dict[str, list[float]] = {}
    end = device[0]["ts"]
    for e in device:
        if e["ts"] > end:
            gap = e["ts"] - end
            gap_total += gap
            if gap > 1.0:  # under a microsecond is the launch of one kernel after another
                gaps.setdefault(f'{launched_by(e)}: {e["name"][:40]}', []).append(gap)
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        end = max(end, e["ts"] + e["dur"])
    window = end - device[0]["ts"]
    outside: dict[str, tuple[int, float]] = {}
    for e in device:  # what a graph replay did not launch: copies, memsets, eager kernels
        by = launched_by(e)
        if by != "cudaGraphLaunch":
            key = f'{by}: {e["name"][:40]}'
            count, total = outside.get(key, (0, 0.0))
            outside[key] = (count + 1, total + e["dur"])
    lines = [f"timeline over {steps} steps: {window / steps:.1f} us a step, device busy {busy / window:.1%}, "
             f"idle {gap_total / steps:.1f} us a step; the host waited on the device {waits / steps:.1f} us a step",
             "  gaps over 1 us, by the operation after them: count a step, us a step"]
    for name, values in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:8]:
        lines.append(f"    {len(values) / steps:5.1f} {sum(values) / steps:7.1f}  {name}")
    lines.append("  device work outside the graphs' kernels: count a step, us a step")
    for key, (count, total) in sorted(outside.items(), key=lambda kv: -kv[1][1])[:8]:
        lines.append(f"    {count / steps:5.1f} {total / steps:7.1f}  {key}")
    return "\n".join(lines)


class FixedDrafts(Proposer):
    """Proposes `num_tokens` drafts for every decode (the sequence's last token repeated)."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def propose(self, seq, limit: int) -> list[int]:
        return [seq.token_ids[-1]] * min(self.num_tokens, limit)


def profile_prefill(engine: LLMEngine, length: int, host_profile: bool, rows: int, reps: int = 5) -> None:
    """One prompt of `length` fresh random ids (no prefix hit) to its first token, `reps` times after a
    warm-up: the median time, then one more under cProfile and one under torch.profiler (the step
    after it included, which max_tokens=1 still launches)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = random.Random(length)

    def prefill() -> float:  # to the first token on the host, as bench/gpu.py's TTFT
        prompt = [rng.randrange(1, 1000) for _ in range(length)]
        torch.cuda.synchronize()
        start = time.monotonic()
        request = engine.add_request(prompt, params)
        while request.first_token_time is None:
            engine.step()
        first = request.first_token_time
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        return (first - start) * 1000

    prefill()
    wall = sorted(prefill() for _ in range(reps))[reps // 2]
    host_report = ""
    if host_profile:
        profiler = cProfile.Profile()
        profiler.enable()
        prefill()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
        host_report = text.getvalue()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill()
    averages = prof.key_averages()
    kernels = sum(e.count for e in averages)
    device_ms = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in averages) / 1000
    print(f"\nprefill {length}: first token {wall:.3f} ms, kernels' device time {device_ms:.3f} ms, {kernels} kernels")
    print(host_report[host_report.find("   ncalls"):] if host_report else "", end="")
    try:
        print(averages.table(sort_by="device_time_total", row_limit=rows, max_name_column_width=60))
    except (AttributeError, KeyError):
        print(averages.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
