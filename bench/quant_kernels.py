"""Micro-benchmark: the INT4 (AWQ) and FP8 linear kernels against bf16 F.linear at Llama-3.2-1B's
projection shapes, at decode row counts (M = 1 and 8).

    python3 bench/quant_kernels.py      # on the GPU machine: a few seconds
    python3 bench/quant_kernels.py --int4-one-row   # the INT4 one-row GEMV's tilings, as decode calls it
    python3 bench/quant_kernels.py --float-one-row  # the bf16 one-row GEMV's tilings, over distinct weights
    python3 bench/quant_kernels.py --float-few-rows # the bf16 few-row kernel's tilings against cuBLAS

With --int4-one-row, each projection runs as batch-1 decode calls it (QKV and gate/up scaling by
the norm factor, gate/up storing SiLU·up, O and down ending in the add-norm epilogue) through the
GEMV at several tilings, 16 calls in a CUDA graph with programmatic dependent launch, µs a call
(median of 20 replays): what kernels/split_k.py's LARGE_TILING_MIN_WEIGHTS and
kernels/int4_linear.py's gemv_config are chosen by.

Each figure is the median of 50 CUDA-event timings of one call (after warm-up; the host's launch
time is kept out by a sleep kernel queued first), with L2 flushed before each call so that the
weights come from HBM as they do in a decode step. Effective GB/s is the bytes the call must move
(the weight with its scales and zeros, x and y) over that time; "x bf16" is the speed-up over
F.linear.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import float_linear as float_module  # noqa: E402
from kernels import int4_linear as int4_module  # noqa: E402
from kernels import split_k as split_k_module  # noqa: E402
from kernels.dispatch import programmatic_launches  # noqa: E402
from kernels.float_linear import float_linear, float_linear_add_norm  # noqa: E402
from kernels.fp8_linear import fp8_linear, quantize_fp8  # noqa: E402
from kernels.int4_layout import pack_int4  # noqa: E402
from kernels.int4_linear import int4_linear, int4_linear_add_norm  # noqa: E402
from kernels.rmsnorm import NormScale  # noqa: E402

# (K, N) of Llama-3.2-1B's merged QKV, O, merged gate/up and down projections.
SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}
ROWS = (1, 8)
REPS = 50
GROUP_SIZE = 128
# The GEMV's tilings timed by --int4-one-row: "ROWSxWORDSxWARPS" (rows a program, words a step,
# warps), then optionally "rN" (a cap of N registers a thread, ptxas' maxnreg: more programs an SM)
# and "sN" (a K split aiming at N programs an SM where the rows alone leave SMs idle; the engine's
# aims at 8). The first two are gemv_config's for large and small weights.
ONE_ROW_TILINGS = ("16x64x1", "8x256x2", "8x256x4", "8x256x8", "16x256x4", "16x256x8", "4x256x2", "16x128x2",
                   "8x128x1", "32x64x2", "16x32x1")

# (K, N) of the bf16 projections of the shapes --float-one-row times (lm_head: the tied or own head).
FLOAT_SHAPES = {
    "llama-3.2-1b": {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048),
                     "lm_head": (2048, 128256)},
    "qwen2.5-0.5b": {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896),
                     "lm_head": (896, 151936)},
    "smollm2-135m": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
                     "lm_head": (576, 49152)},
}
# The bf16 GEMV's tilings --float-one-row times: (rows a program, bytes of a row a step, warps, steps
# read ahead); None is gemv_config's own choice.
FLOAT_TILINGS = (None, (16, 256, 2, 1), (16, 256, 2, 2), (8, 512, 2, 2), (8, 1024, 4, 1), (8, 1024, 4, 2),
                 (16, 1024, 4, 1), (8, 1024, 2, 1), (8, 2048, 8, 1), (4, 2048, 4, 1), (4, 1024, 2, 2))

# The bf16 few-row kernel's tilings --float-few-rows times: (weight rows a program, bytes of a row a
# K step, warps, pipeline stages, programs per SM the K split aims at); None is rows_config's own.
FEW_ROWS_TILINGS = (None, (32, 256, 4, 3, 4), (128, 256, 4, 3, 4), (64, 512, 4, 3, 4), (64, 256, 4, 4, 4),
                    (64, 256, 4, 3, 8), (32, 512, 4, 4, 8), (128, 512, 8, 3, 4), (64, 128, 4, 6, 8), (32, 256, 2, 4, 8))
FEW_ROWS_BATCHES = (2, 8, 16)


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


@contextlib.contextmanager
def one_row_tiling(tiling: str):
    """The INT4 one-row GEMV on one tiling (ONE_ROW_TILINGS' form) for a while, whatever the weight's size."""
    saved = int4_module.gemv_config, int4_module.gemv_split
    shape, *knobs = re.split(r"(?=[rs]\d)", tiling)
    rows, words, warps = map(int, shape.split("x"))
    extra = {k[0]: int(k[1:]) for k in knobs}
    cap = {"maxnreg": extra["r"]} if "r" in extra else {}
    int4_module.gemv_config = lambda out_features, in_features, group_size: dict(
        ROWS=rows, BLOCK_W=max(words, group_size // 8), num_warps=warps, num_stages=1, **cap)
    if "s" in extra:  # the engine's split rule, aiming at extra["s"] programs an SM instead of 8
        int4_module.gemv_split = functools.partial(saved[1], per_sm=extra["s"])
    try:
        yield
    finally:
        int4_module.gemv_config, int4_module.gemv_split = saved


def graph_us(fn, calls: int = 16, reps: int = 20) -> float:
    """µs a call of fn, `calls` of them in a CUDA graph captured with PDL; median of `reps` replays."""
    with programmatic_launches():
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


@contextlib.contextmanager
def float_tiling(tiling: tuple[int, int, int, int] | None):
    """The bf16 one-row GEMV on one tiling for a while (None: gemv_config's), whatever the weight's size."""
    saved = float_module.gemv_config
    if tiling is not None:
        rows, step, warps, ahead = tiling
        float_module.gemv_config = lambda out_features, in_features, element_size: dict(
            ROWS=rows, BLOCK_K=step // element_size, num_warps=warps, AHEAD=ahead)
    try:
        yield
    finally:
        float_module.gemv_config = saved


def float_one_row_tilings(copies: int = 16) -> None:
    """Each projection as batch-1 decode calls it over `copies` distinct weights (as many layers'
    worth, so that L2 does not hold them), one CUDA graph with PDL: µs a call and TB/s of weights."""
    torch.manual_seed(0)
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_us = graph_us(lambda: big[: 1 << 29].copy_(big[1 << 29:]), calls=4)
    print(f"{torch.cuda.get_device_name()}: copy of 512 MiB: {2 * (1 << 29) / copy_us / 1e6:.2f} TB/s (read + write)")
    del big
    labels = ["config" if t is None else "{}x{}x{}x{}".format(*t) for t in FLOAT_TILINGS]
    for shape, projections in FLOAT_SHAPES.items():
        print(f"\n{shape}: bf16 one-row GEMV, µs a call (TB/s), {copies} distinct weights in a CUDA graph; tiling "
              "rows x bytes a step x warps x steps ahead\n")
        print("| projection (K x N) | " + " | ".join(labels) + " |")
        print("|---|" + "---|" * len(labels))
        for name, (k, n) in projections.items():
            layers = 2 if name == "lm_head" else copies
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(layers)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            norm_in = NormScale(torch.rand(64, device="cuda") * k, 1e-5)
            residual = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
            norm_w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5

            def call(name: str = name) -> None:
                for w in weights:
                    if name in ("o", "down"):
                        float_linear_add_norm(x, w, None, residual, norm_w, 1e-5)
                    else:
                        float_linear(x, w, silu_mul=name == "gate_up", norm_in=None if name == "lm_head" else norm_in)
            cells = []
            for tiling in FLOAT_TILINGS:
                with float_tiling(tiling):
                    us = graph_us(call, calls=1, reps=20) / layers
                    cells.append(f"{us:.2f} ({2 * n * k / us / 1e6:.2f})")
            print(f"| {name} ({k} x {n}) | " + " | ".join(cells) + " |", flush=True)
            del weights


@contextlib.contextmanager
def few_rows_tiling(tiling: tuple[int, int, int, int, int] | str | None):
    """Decode batches up to FEW_ROWS on one path for a while: "cublas" is cuBLAS and the norm,
    SiLU·up and RoPE kernels; "dots" the tensor-core few-row kernel for small weights too; "gemv" the
    rows GEMV for every weight up to its most rows (split and large ones too); else the engine's
    choice, the tensor-core kernel on this tiling (None: rows_config's)."""
    saved = (float_module.FLOAT_FUSED_ROWS, float_module.rows_config, float_module.ROWS_GEMV_MOST,
             float_module.ROWS_GEMV_PRODUCTS, float_module.ROWS_GEMV_SPLIT, float_module.ROWS_GEMV_LARGE)
    float_module.FLOAT_FUSED_ROWS = dict.fromkeys(saved[0], 1 if tiling == "cublas" else split_k_module.FEW_ROWS)
    if tiling == "dots":  # every weight through the tensor-core kernel, small ones too
        float_module.ROWS_GEMV_MOST, float_module.ROWS_GEMV_PRODUCTS = 1, 0
    if tiling == "gemv":  # every weight through the rows GEMV, up to its most rows
        float_module.ROWS_GEMV_MOST = float_module.ROWS_GEMV_MAX
        float_module.ROWS_GEMV_SPLIT = float_module.ROWS_GEMV_LARGE = True
    if isinstance(tiling, tuple):
        block_n, step, warps, stages, per_sm = tiling
        float_module.rows_config = lambda element_size: dict(
            BLOCK_N=block_n, BLOCK_K=step // element_size, num_warps=warps, num_stages=stages, per_sm=per_sm)
    try:
        yield
    finally:
        (float_module.FLOAT_FUSED_ROWS, float_module.rows_config, float_module.ROWS_GEMV_MOST,
         float_module.ROWS_GEMV_PRODUCTS, float_module.ROWS_GEMV_SPLIT, float_module.ROWS_GEMV_LARGE) = saved


def float_few_rows_tilings(tilings: tuple = FEW_ROWS_TILINGS, projections: tuple[str, ...] = ("qkv", "o", "gate_up", "down"),
                           batches: tuple[int, ...] = FEW_ROWS_BATCHES, copies: int = 16,
                           shape: str = "llama-3.2-1b") -> None:
    """Each projection of `shape` as a decode batch of M rows calls it over `copies` distinct weights, one CUDA
    graph with PDL: cuBLAS with its separate epilogue kernels against the few-row kernel's tilings."""
    torch.manual_seed(0)
    labels = ["cuBLAS + kernels"] + ["rows_config" if t is None else t if isinstance(t, str) else
                                     "{}x{}x{}x{}x{}".format(*t) for t in tilings]
    print(f"{torch.cuda.get_device_name()}: bf16 decode projections at M rows, µs a call (TB/s of weights), "
          f"{copies} distinct weights in a CUDA graph; tiling rows x bytes a step x warps x stages x programs/SM\n")
    print("| projection (K x N) | M | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for name, (k, n) in FLOAT_SHAPES[shape].items():
        if name not in projections:
            continue
        count = max(copies, -(-(256 << 20) // (2 * n * k)))  # enough distinct weights that L2 holds none
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(count)]
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            norm_in = NormScale(torch.rand(m, 64, device="cuda") * k, 1e-5)
            residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            norm_w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5

            def call(name: str = name, fused: bool = True) -> torch.Tensor:
                for w in weights:
                    if name in ("o", "down"):  # cuBLAS, then the norm kernel; or the add-norm epilogue
                        y = float_linear_add_norm(x, w, None, residual, norm_w, 1e-5)[0]
                    else:  # the norm's factor: a kernel before cuBLAS (in o and down's column), or the epilogue's
                        y = float_linear(x, w, silu_mul=name == "gate_up", norm_in=norm_in if fused else None)
                return y
            cells, first = [], None
            for tiling in ("cublas", *tilings):
                with few_rows_tiling(tiling):
                    if tiling == "cublas":
                        us = graph_us(lambda: call(fused=False), calls=1, reps=20) / count
                        cells.append(f"{us:.2f} ({2 * n * k / us / 1e6:.2f})")
                        continue
                    out = call().float()
                    first = out if first is None else first
                    agrees = (out - first).norm() <= 2e-2 * first.norm()
                    us = graph_us(call, calls=1, reps=20) / count
                    cells.append(f"{us:.2f} ({2 * n * k / us / 1e6:.2f})" + ("" if agrees else " differs!"))
            print(f"| {name} ({k} x {n}) | {m} | " + " | ".join(cells) + " |", flush=True)
        del weights


def one_row_tilings(tilings: tuple[str, ...] = ONE_ROW_TILINGS) -> None:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: INT4 one-row GEMVs as batch-1 decode calls them, µs a call "
          f"(16 in a CUDA graph with PDL, median of 20 replays); group {GROUP_SIZE}\n")
    labels = list(tilings)
    print("| projection (K x N) | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for name, (k, n) in SHAPES.items():
        groups = k // GROUP_SIZE
        weight = (pack_int4(torch.randint(0, 16, (n, k), device="cuda")),
                  torch.randint(0, 16, (n, groups), device="cuda").half(),
                  torch.full((n, groups), 0.3 * k**-0.5, device="cuda", dtype=torch.float16))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        norm_in = NormScale(torch.rand(64, device="cuda") * k, 1e-5)
        residual = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
        norm_w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
        if name in ("o", "down"):  # they end in the add-norm epilogue
            def call() -> torch.Tensor:
                return int4_linear_add_norm(x, *weight, GROUP_SIZE, None, residual, norm_w, 1e-5)[0]
        else:
            def call(silu: bool = name == "gate_up") -> torch.Tensor:
                return int4_linear(x, *weight, GROUP_SIZE, silu_mul=silu, norm_in=norm_in)
        cells, first = [], None
        for tiling in tilings:
            with one_row_tiling(tiling):
                out = call().float()
                first = out if first is None else first
                agrees = (out - first).norm() <= 1e-2 * first.norm()  # against the first tiling's output
                cells.append(f"{graph_us(call):.2f}" + ("" if agrees else " (differs!)"))
        print(f"| {name} ({k} x {n}) | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--int4-one-row", action="store_true", help="time the INT4 one-row kernels' tilings instead")
    p.add_argument("--float-one-row", action="store_true", help="time the bf16 one-row kernel's tilings instead")
    p.add_argument("--float-few-rows", action="store_true", help="time the bf16 few-row kernel's tilings instead")
    p.add_argument("--tilings", help="--float-few-rows' tilings, e.g. default,dots,32x256x4x3x4 (default: a set)")
    p.add_argument("--int4-tilings", help="--int4-one-row's tilings, e.g. 16x64x1,16x64x1r168s12 (default: a set)")
    p.add_argument("--projections", default="qkv,o,gate_up,down", help="--float-few-rows' projections")
    p.add_argument("--rows", default="2,8,16", help="--float-few-rows' batch rows")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(FLOAT_SHAPES), help="--float-few-rows' model shape")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/quant_kernels.py needs a CUDA GPU")
    if args.float_one_row:
        float_one_row_tilings()
        return
    if args.float_few_rows:
        tilings = (tuple(None if t == "default" else t if t in ("dots", "gemv") else tuple(map(int, t.split("x")))
                         for t in args.tilings.split(","))
                   if args.tilings else FEW_ROWS_TILINGS)
        float_few_rows_tilings(tilings, tuple(args.projections.split(",")), tuple(map(int, args.rows.split(","))),
                               shape=args.shape)
        return
    if args.int4_one_row:
        one_row_tilings(tuple(args.int4_tilings.split(",")) if args.int4_tilings else ONE_ROW_TILINGS)
        return
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
