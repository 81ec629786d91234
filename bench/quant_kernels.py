"""Micro-benchmark: the INT4 (AWQ) and FP8 linear kernels against bf16 F.linear at Llama-3.2-1B's
projection shapes, at decode row counts (M = 1 and 8).

    python3 bench/quant_kernels.py      # on the GPU machine: a few seconds

Each figure is the median of 50 CUDA-event timings of one call (after warm-up; the host's launch
time is kept out by a sleep kernel queued first), with L2 flushed before each call so that the weights come from HBM as they do in a decode step. Effective GB/s is
the bytes the call must move (the weight with its scales and zeros, x and y) over that time;
"x bf16" is the speed-up over F.linear.
"""
from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.fp8_linear import fp8_linear, quantize_fp8  # noqa: E402
from kernels.int4_linear import int4_linear, pack_int4  # noqa: E402

# (K, N) of Llama-3.2-1B's merged QKV, O, merged gate/up and down projections.
SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}
ROWS = (1, 8)
REPS = 50
GROUP_SIZE = 128


def median_us(fn: Callable[[], torch.Tensor], flush: torch.Tensor) -> float:
    for _ in range(5):  # compile and warm up
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPS)]
    for start, end in events:
        flush.zero_()  # evicts the weights from L2
        torch.cuda._sleep(400_000)  # the GPU waits while the host queues the call: no launch time is timed
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1e3


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench/quant_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # larger than any L2
    print(f"{torch.cuda.get_device_name()}: µs (effective GB/s), median of {REPS}, L2 flushed; "
          f"int4 = AWQ group {GROUP_SIZE}\n")
    print("| projection (K x N) | M | bf16 F.linear | int4_linear | fp8_linear | int4 x bf16 | fp8 x bf16 |")
    print("|---|---|---|---|---|---|---|")
    for name, (k, n) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        groups = k // GROUP_SIZE
        int4_weight = pack_int4(torch.randint(0, 16, (n, k), device="cuda"))  # the runtime layout
        zeros = torch.randint(0, 16, (n, groups), device="cuda").half()
        scales = torch.full((n, groups), 0.3 * k**-0.5, device="cuda", dtype=torch.float16)
        fp8_weight, fp8_scale = quantize_fp8(weight)
        weight_bytes = {"bf16": 2 * n * k, "int4": n * k // 2 + groups * n * 4, "fp8": n * k + 4 * n}
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            calls = {
                "bf16": lambda: F.linear(x, weight),
                "int4": lambda: int4_linear(x, int4_weight, zeros, scales, GROUP_SIZE),
                "fp8": lambda: fp8_linear(x, fp8_weight, fp8_scale),
            }
            us = {label: median_us(fn, flush) for label, fn in calls.items()}
            gb_s = {label: (weight_bytes[label] + 2 * m * (k + n)) / us[label] / 1e3 for label in calls}
            cells = [f"{us[label]:.1f} ({gb_s[label]:.0f})" for label in calls]
            print(f"| {name} ({k} x {n}) | {m} | " + " | ".join(cells)
                  + f" | {us['bf16'] / us['int4']:.2f} | {us['bf16'] / us['fp8']:.2f} |")


if __name__ == "__main__":
    main()
