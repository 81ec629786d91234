"""Compile every Triton kernel the decoder launches for Hopper (sm_90), on a machine without a GPU:
what the interpreter cannot check (layouts, shapes the compiler refuses, inline PTX). Run as a
script in a fresh interpreter (test_sm90_compile.py does), since pytest's conftest puts Triton in
interpreter mode.

The decoder runs as in the interpreter tests (CPU tensors, TRITON_INTERPRET=1 for use_triton), but
each launch is compiled with triton.compile for an H200 instead of run, launched with PDL and
FP8's hardware e4m3 conversion as on the GPU. The outputs are never written: only the launches'
arguments matter. Prints one line per distinct kernel variant compiled.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JITFunctions, not interpreted ones

import torch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.sm90 import TARGET, compile_launch  # noqa: E402

compiled: dict[int, str] = {}


def compile_instead(self: JITFunction, *args, grid, warmup, **kwargs) -> None:
    """JITFunction.run's stand-in: the launch compiled for TARGET as the GPU's launcher would specialize it."""
    kernel, constexprs, _ = compile_launch(self, args, kwargs)
    key = id(kernel)  # compile_launch keeps one kernel a distinct launch
    if key not in compiled:
        flags = " ".join(k if v is True else f"{k}={v}" for k, v in constexprs.items()
                         if v is True or (v not in (None, False) and not isinstance(v, bool)))
        compiled[key] = f"{self.fn.__name__}: {flags}"
        print(compiled[key], flush=True)


def main(shard: int = 0, shards: int = 1) -> int:
    """Compile the decoder's kernels as the models of this shard launch them (every `shards`-th,
    from `shard`; shard 0 also the decode attention's one-pass and split variants)."""
    import kernels.float_linear as float_linear
    import kernels.fp8_linear as fp8_linear  # imported before TRITON_INTERPRET is set: JITFunctions
    import kernels.split_k as split_k
    from bench.gpu import int4_checkpoint
    from engine.loader import RANDOM_PREFIX, load_model
    from engine.packed_prefill import prompt_logits
    from kernels.decode_attention import decode_attention_triton
    from kernels.embedding import embed_rms_norm
    from kernels.sampling import gumbel_argmax_triton
    from kernels.staging import stage

    # The few-row kernels too, which the layers leave to cuBLAS for FP8, INT4 and float32.
    split_k.FUSED_ROWS = split_k.FEW_ROWS
    float_linear.FLOAT_FUSED_ROWS = dict.fromkeys(float_linear.FLOAT_FUSED_ROWS, split_k.FEW_ROWS)

    JITFunction.run = compile_instead
    os.environ["TRITON_INTERPRET"] = "1"  # use_triton() sends CPU tensors to the (compiled-instead) kernels

    for module in [m for name, m in sys.modules.items() if name.startswith("kernels.")]:
        if hasattr(module, "programmatic_launch"):  # as in a decode step's CUDA graph on Hopper
            module.programmatic_launch = lambda t: True
    fp8_linear.has_e4m3_cvt = lambda device: True  # the GPU's e4m3 decode (inline PTX)
    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        int4 = int4_checkpoint("tiny-llama3", 0, cpu, Path(tmp) / "int4")
        models = {"bf16": (RANDOM_PREFIX + "tiny-qwen2", None), "fp8": (RANDOM_PREFIX + "tiny-llama3", "fp8"),
                  "int4": (int4, None), "fp32": (RANDOM_PREFIX + "tiny-llama3", None)}
        for name, (path, quantization) in list(models.items())[shard::shards]:
            model = load_model(path, torch.float32 if name == "fp32" else torch.bfloat16, cpu,
                               quantization=quantization)
            for large in (False, True):  # the one-row kernels' small and large weights' tilings
                split_k.LARGE_TILING_MIN_WEIGHTS = 0 if large else 8 << 20
                for prompt in ([7], [5, 7, 9], list(range(3, 40))):  # one row, a few rows, more (prefill)
                    prompt_logits(model, prompt)
                if name == "bf16" and not large:  # the rows GEMV's sums of 8 rows a step, over every small weight
                    most, float_linear.ROWS_GEMV_MOST = float_linear.ROWS_GEMV_MOST, float_linear.ROWS_GEMV_MAX
                    prompt_logits(model, list(range(3, 9)))
                    float_linear.ROWS_GEMV_MOST = most
    if shard == 0:  # decode attention in one pass (a batch that fills the GPU alone) and in splits, bf16,
        # over lengths in int32 (eager steps) and int64 (decode graphs); the embedding with placeholders
        q = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
        cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
        for splits, lengths in [(1, torch.int32), (4, torch.int32), (1, torch.int64), (4, torch.int64)]:
            decode_attention_triton(q, cache, cache, torch.zeros(2, 4, dtype=torch.int32),
                                    torch.tensor([5, 40], dtype=lengths), 0.125, splits)
        embed_rms_norm(torch.tensor([-1, 3]), torch.tensor([2]), torch.zeros(8, 64, dtype=torch.bfloat16),
                       torch.ones(64, dtype=torch.bfloat16), 1e-5)
        # A decode graph's first kernel (its inputs from host rows) and its draw into a host row.
        stage(torch.zeros(4, 8, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), torch.zeros(4, dtype=torch.int64),
              torch.zeros(8, dtype=torch.int32), 8)
        zeros = torch.zeros(2, dtype=torch.int64)
        for dtype in (torch.float32, torch.bfloat16):  # the sampler's scores; a decode graph's own logits
            gumbel_argmax_triton(torch.zeros(2, 300, dtype=dtype), zeros, zeros, zeros,
                                 host=(torch.zeros(4, 2, dtype=torch.int64), zeros))
    print(f"{len(compiled)} kernel variants compiled for sm_{TARGET.arch}")
    return 0


if __name__ == "__main__":  # [shard shards]: e.g. 0 2 and 1 2 in two processes side by side
    sys.exit(main(*map(int, sys.argv[1:3])))
