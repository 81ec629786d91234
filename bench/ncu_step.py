"""One decode step's kernels under Nsight Compute: hardware counters for each kernel of the graph.

`step` runs an engine to a steady decode at a batch and profiles exactly one step (the CUDA
profiler is on only around it); `table` reads ncu's CSV and prints each kernel's time, registers,
DRAM throughput and occupancy, then the time summed by kind. ncu replays every kernel alone, so
there is no overlap from programmatic dependent launch: a kernel's time includes its ramp and tail,
which a graph replay partly hides. ncu reads counters on the Firecracker machines (the H100s), not
under gVisor (device/KINDS.md). Not a benchmark of record.

    ncu --profile-from-start off --clock-control none --graph-profiling node --section SpeedOfLight \
        --section LaunchStats --section Occupancy --section WarpStateStats --csv --page details \
        python3 bench/ncu_step.py step --model random:llama-3.2-1b --batch 8 > b8.csv
    python3 bench/ncu_step.py table b8.csv --json bench/results/<date>-<gpu>-ncu-1b-b8.json
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.provenance import git_commit  # noqa: E402

# ncu's metric names, and the short names the table and the JSON give them.
METRICS = {"Registers Per Thread": "registers", "DRAM Throughput": "dram_pct",
           "Achieved Occupancy": "occupancy_pct", "Theoretical Occupancy": "theoretical_occupancy_pct",
           "Warp Cycles Per Issued Instruction": "cycles_per_issue"}
_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def kernels(lines: list[str]) -> list[dict]:
    """The kernels of ncu's `--csv --page details` output (other lines, the program's and ncu's own,
    are skipped), in launch order: name, grid, block, duration_us and METRICS."""
    found: OrderedDict[str, dict] = OrderedDict()
    for row in csv.DictReader(line for line in lines if line.startswith('"')):
        kernel = found.setdefault(row["ID"], {"kernel": row["Kernel Name"], "grid": row["Grid Size"],
                                              "block": row["Block Size"]})
        name, value = row["Metric Name"], row["Metric Value"].replace(",", "")
        if name == "Duration":
            kernel["duration_us"] = float(value) * _TO_US[row["Metric Unit"]]
        elif name in METRICS:
            kernel[METRICS[name]] = float(value)
    return list(found.values())


def _kind(kernel: dict) -> str:
    """A kernel's kind: its name and grid (one projection's launches share both)."""
    return f'{kernel["kernel"][:40]} {kernel["grid"]}'


def by_kind(found: list[dict]) -> list[tuple[str, int, float]]:
    """(kind, calls, µs in all), most time first."""
    sums: dict[str, tuple[int, float]] = {}
    for k in found:
        calls, total = sums.get(_kind(k), (0, 0.0))
        sums[_kind(k)] = (calls + 1, total + k.get("duration_us", 0.0))
    return sorted(((key, calls, total) for key, (calls, total) in sums.items()), key=lambda r: -r[2])


def table(found: list[dict]) -> str:
    lines = [f"{len(found)} kernels, {sum(k.get('duration_us', 0.0) for k in found):.1f} us one after another",
             "| kernel | grid | calls | us a call | us in all | registers | DRAM % | occupancy % |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for key, calls, total in by_kind(found):
        kind = [k for k in found if _kind(k) == key]
        first, (name, grid) = kind[0], key.rsplit(" (", 1)
        dram = sum(k.get("dram_pct", 0.0) for k in kind) / calls
        lines.append(f"| {name} | ({grid} | {calls} | {total / calls:.2f} | {total:.1f} | "
                     f"{first.get('registers', 0):.0f} | {dram:.1f} | {first.get('occupancy_pct', 0.0):.1f} |")
    return "\n".join(lines)


def step(model: str, batch: int) -> None:
    """A steady decode of `batch` sequences, then one step with the CUDA profiler on."""
    import torch

    from bench.profile_step import start_decode
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory="4GiB", max_num_seqs=batch))
    engine.warm_up()
    start_decode(engine, batch, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    for _ in range(20):
        engine.step()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    engine.step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("step", help="one profiled decode step (run under ncu)")
    run.add_argument("--model", default="random:llama-3.2-1b")
    run.add_argument("--batch", type=int, default=1)
    read = sub.add_parser("table", help="ncu's CSV as a table by kernel")
    read.add_argument("csv", type=Path)
    read.add_argument("--json", type=Path, help="also write the kernels here, with the run's provenance")
    read.add_argument("--gpu", default="NVIDIA H100 80GB HBM3", help="the GPU ncu ran on (the CSV does not say)")
    read.add_argument("--model", default="random:llama-3.2-1b")
    read.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    if args.command == "step":
        step(args.model, args.batch)
        return
    found = kernels(args.csv.read_text().splitlines())
    print(table(found))
    if args.json:
        args.json.write_text(json.dumps({
            "gpu": args.gpu, "date": datetime.date.today().isoformat(), "commit": git_commit(), "model": args.model,
            "batch": args.batch, "note": "one decode step under ncu: each kernel alone, no PDL overlap",
            "kernels": found}, indent=1) + "\n")


if __name__ == "__main__":
    main()
