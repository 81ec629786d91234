"""Registers and spills of a decode step's kernels at the benchmark's shapes, compiled for Hopper
(sm_90) on a machine without a GPU (bench/sm90.py). Each kernel is launched as a layer launches it
in a decode step (the projections with their epilogues in bf16, INT4 and FP8, decode attention, and
at one row o_proj merging attention's splits), and compiled instead of run. Not a timing: it shows
where a kernel spills or holds so many registers that few programs fit an SM, under the installed
Triton; point PYTHONPATH at the GPU machine's Triton version (3.6) to see what runs there.

    python bench/kernel_registers.py                                  # the three shapes, rows 1 and 8
    PYTHONPATH=/tmp/triton36 python bench/kernel_registers.py --models qwen2.5-0.5b --rows 1
    python bench/kernel_registers.py --set kernels.attention_projection.MERGE_WARPS=8   # as bench/graph_ab.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JITFunctions, not interpreted ones

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels.attention_projection as attention_projection  # noqa: E402
import kernels.fp8_linear as fp8_linear  # noqa: E402
import kernels.int4_linear as int4_linear  # noqa: E402
from bench.graph_ab import parse_variant  # noqa: E402
from bench.sm90 import compile_launch, resources  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.shapes import shape_config  # noqa: E402
from kernels.decode_attention import AttentionSplits, decode_attention_splits, num_splits_for  # noqa: E402
from kernels.float_linear import float_linear, float_linear_add_norm, float_linear_rope_kv  # noqa: E402
from kernels.rope import RopeKV, rope_cos_sin, rope_inv_freq  # noqa: E402

MODELS = ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b")
FORMATS = ("bf16", "int4", "fp8")
GROUP_SIZE = 128  # INT4's
BF16 = torch.bfloat16
rows_seen: list[dict] = []
_launch = {"what": ""}  # the launch being compiled, for its row


def _compile_instead(self: JITFunction, *args, grid, warmup, **kwargs) -> None:
    kernel, _, options = compile_launch(self, args, kwargs)
    used = resources(kernel)
    rows_seen.append(dict(what=_launch["what"], kernel=self.fn.__name__, grid=str(tuple(grid)),
                          warps=options.get("num_warps", 4), registers=used.registers, spill_stores=used.spill_stores))


def _weight(fmt: str, in_features: int, out_features: int) -> tuple:
    """A projection's weight arguments after x, in its format's runtime layout (never read)."""
    if fmt == "bf16":
        return (torch.zeros(out_features, in_features, dtype=BF16),)
    if fmt == "int4":
        groups = torch.zeros(out_features, in_features // GROUP_SIZE, dtype=torch.float16)
        return torch.zeros(out_features, in_features // 8, dtype=torch.int32), groups, groups.clone(), GROUP_SIZE
    return torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn), torch.ones(out_features)


# A format's (projection, add-norm projection, RoPE projection, merging o_proj) as the layers call them.
OPS: dict[str, tuple[Callable, ...]] = {
    "bf16": (float_linear, float_linear_add_norm, float_linear_rope_kv, attention_projection.merge_o_add_norm),
    "int4": (int4_linear.int4_linear, int4_linear.int4_linear_add_norm, int4_linear.int4_linear_rope_kv,
             attention_projection.int4_merge_o_add_norm),
    "fp8": (fp8_linear.fp8_linear, fp8_linear.fp8_linear_add_norm, fp8_linear.fp8_linear_rope_kv,
            attention_projection.fp8_merge_o_add_norm),
}


def decode_layer(model: str, fmt: str, rows: int) -> None:
    """One decode layer's launches at `rows` rows: down with the add-norm (whose NormScale the next
    layer's QKV and gate/up take), QKV with RoPE and the KV write, gate/up with SiLU·up, decode
    attention, then o_proj, merging the splits itself where the engine's o_proj does."""
    c = ModelConfig.from_hf(shape_config(model))
    hidden, inter, heads, kv, head_dim = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    project, add_norm, rope_kv, merge_o = OPS[fmt]
    norm, residual = torch.ones(hidden, dtype=BF16), torch.zeros(rows, hidden, dtype=BF16)

    def launch(what: str, fn: Callable, *args, **kwargs):
        _launch["what"] = f"{model} {fmt} {rows} {what}"
        return fn(*args, **kwargs)

    u, _, scale = launch("down", add_norm, torch.zeros(rows, inter, dtype=BF16), *_weight(fmt, inter, hidden), None,
                         residual, norm, 1e-5)
    cache = torch.zeros(64, 16, kv, head_dim, dtype=BF16)
    slots = torch.zeros(rows, dtype=torch.int64)
    rope = RopeKV(slots, rope_cos_sin(rope_inv_freq(head_dim, 500000.0, {}), 4096), cache, cache, slots, heads, kv,
                  head_dim)
    launch("qkv", rope_kv, u, *_weight(fmt, hidden, (heads + 2 * kv) * head_dim), None, scale, rope)
    launch("gate_up", project, u, *_weight(fmt, hidden, 2 * inter), silu_mul=True, norm_in=scale)
    splits = num_splits_for(rows, kv, torch.device("cpu"))
    lens = torch.full((rows,), 130, dtype=torch.int64)
    if splits > 1:
        launch("attention", decode_attention_splits, torch.zeros(rows, heads, head_dim, dtype=BF16), cache, cache,
               torch.zeros(rows, 16, dtype=torch.int32), lens, head_dim**-0.5, splits)
    w_o = _weight(fmt, heads * head_dim, hidden)
    parts = AttentionSplits(torch.zeros(rows, heads, splits, head_dim), torch.zeros(rows, heads, splits), lens, kv, 64,
                            BF16)
    if splits > 1 and attention_projection.merges_splits(parts, hidden, w_o[0]):
        launch("o (merging)", merge_o, parts, *w_o, None, residual, norm, 1e-5)
        return
    attn = launch("merge", parts.merged) if splits > 1 else torch.zeros(rows, heads * head_dim, dtype=BF16)
    launch("o", add_norm, attn, *w_o, None, residual, norm, 1e-5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="named shapes, comma-separated")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 8])
    p.add_argument("--set", action="append", default=[], help="module.NAME=value[,...], as bench/graph_ab.py's --variant")
    p.add_argument("--json", type=Path, help="the rows as JSON too")
    args = p.parse_args(argv)
    for module, name, value in (s for text in args.set for s in parse_variant(text)):
        setattr(module, name, value)
    JITFunction.run = _compile_instead
    os.environ["TRITON_INTERPRET"] = "1"  # use_triton() sends CPU tensors to the (compiled-instead) kernels
    for module in [m for name, m in sys.modules.items() if name.startswith("kernels.")]:
        if hasattr(module, "programmatic_launch"):  # as in a decode step's CUDA graph on Hopper
            module.programmatic_launch = lambda t: True
    fp8_linear.has_e4m3_cvt = lambda device: True  # the GPU's e4m3 decode
    for model in args.models.split(","):
        for rows in args.rows:
            for fmt in args.formats.split(","):
                decode_layer(model, fmt, rows)
    print(f"Triton {triton.__version__}, sm_90\n")
    print("| shape | format | rows | launch | kernel | grid | warps | registers | spill stores |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows_seen:
        model, fmt, rows, what = r["what"].split(" ", 3)
        print(f"| {model} | {fmt} | {rows} | {what} | {r['kernel']} | {r['grid']} | {r['warps']} | {r['registers']} "
              f"| {r['spill_stores']} |")
    if args.json:
        args.json.write_text(json.dumps(rows_seen, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
