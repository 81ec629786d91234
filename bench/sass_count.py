"""What the INT4 one-row GEMV compiles to for the H200 (sm_90), without a GPU: the installed Triton
compiles the kernel for compute capability 9.0 with the bundled ptxas, cuobjdump disassembles it,
and the loop (the longest backward branch) is counted. Instructions a weight = the loop's count
over the weights one thread reads a step. Not a timing: the GPU machine's Triton (3.6) may lay the
kernel out otherwise than another version does (see kernels/int4_linear.py's _int4_gemv_kernel), so
compare with PYTHONPATH pointing at the same Triton version as the GPU's.

    python bench/sass_count.py                       # group sizes 32 and 128, plain / SiLU·up / add-norm
    PYTHONPATH=/tmp/triton36 python bench/sass_count.py --group-sizes 128
    python bench/sass_count.py --json counts.json   # the counts as JSON too
    python bench/sass_count.py --check              # exit 1 if a loop is over MAX_PER_WEIGHT a weight
    python bench/sass_count.py --tiling 16x32x1 --maxnreg 168   # another tiling, registers capped
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import triton
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sm90 import INSTRUCTION, TARGET, cuobjdump, resources  # noqa: E402
from kernels.int4_linear import _int4_gemv_kernel, gemv_config  # noqa: E402

# The kernel's arguments as the decode step passes them: bf16 activations, pointers and the integer
# arguments divisible by 16, which Triton's launcher specializes on as it does at run time.
SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*i32", "zeros_ptr": "*fp16", "scales_ptr": "*fp16", "bias_ptr": "*bf16",
    "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "N": "i32", "K": "i32", "stride_w": "i32",
    "stride_g": "i32", "words_per_split": "i32", "one_bits": "i32", "in_sumsq_ptr": "*fp32", "in_parts": "i32",
    "eps": "fp32", "residual_ptr": "*bf16", "norm_w_ptr": "*bf16", "residual_out_ptr": "*bf16", "sumsq_ptr": "*fp32",
    "positions_ptr": "*i64", "slot_mapping_ptr": "*i64", "cos_sin_ptr": "*fp32", "cos_sin_stride": "i32",
    "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "cache_stride_slot": "i32", "cache_stride_h": "i32",
    "num_heads": "i32", "num_kv_heads": "i32",
}
LARGE = (16384, 2048)  # Llama-3.2-1B's gate/up [N, K]: the large weights' tiling, the issue-bound one
NOT_DIVISIBLE = {"in_parts", "eps"}
VARIANTS = {"plain": {}, "silu-mul": {"SILU_MUL": True}, "add-norm": {"ADD_NORM": True, "SPLIT_K": 8}}
# The loop's budget: each thread on 8 rows of 4 adjacent words, each x value serving 8 rows (the
# kernel's tiling does that; a tiling that gives a thread fewer rows goes well over it).
MAX_PER_WEIGHT = 4.3


@dataclass
class Count:
    loop: int  # instructions in the loop
    weights: int  # weights one thread reads a step
    registers: int
    spills: int  # local-memory loads and stores in the loop
    mix: list[tuple[str, int]]  # the loop's most frequent opcodes

    @property
    def per_weight(self) -> float:
        return self.loop / self.weights


def loop_of(sass: str) -> list[str]:
    """The opcodes of the longest loop in a cuobjdump -sass listing (a branch back to an earlier address)."""
    code = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines() if (m := INSTRUCTION.match(line))]
    best = (0, 0)
    for addr, op, line in code:
        target = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", line)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            best = max(best, (start, addr), key=lambda span: span[1] - span[0])
    return [op for addr, op, _ in code if best[0] <= addr <= best[1]]


def count(group_size: int, constants: dict[str, object], tiling: tuple[int, int, int] | None = None,
          maxnreg: int | None = None) -> Count:
    cfg = gemv_config(*LARGE, group_size)
    if tiling is not None:  # rows a program, words a step, warps
        cfg = dict(ROWS=tiling[0], BLOCK_W=max(tiling[1], group_size // 8), num_warps=tiling[2])
    constexprs = dict(HAS_BIAS=False, GROUP=group_size, ROWS=cfg["ROWS"], BLOCK_W=cfg["BLOCK_W"], SPLIT_K=1,
                      SILU_MUL=False, NORM_IN=False, ADD_NORM=False, ROPE=False, HALF=1, PDL=True) | constants
    signature = SIGNATURE | {name: "constexpr" for name in constexprs}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(SIGNATURE) if name not in NOT_DIVISIBLE}
    kernel = triton.compile(ASTSource(fn=_int4_gemv_kernel, signature=signature, constexprs=constexprs,
                                      attrs=attrs),
                            target=TARGET, options=dict(num_warps=cfg["num_warps"], num_stages=1, maxnreg=maxnreg))
    ops = loop_of(cuobjdump(kernel.asm["cubin"], "-sass"))
    registers = resources(kernel).registers
    weights = cfg["ROWS"] * cfg["BLOCK_W"] * 8 // (32 * cfg["num_warps"])
    opcodes = collections.Counter(op.split(".")[0] for op in ops)
    return Count(len(ops), weights, registers, opcodes["LDL"] + opcodes["STL"], opcodes.most_common(6))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group-sizes", type=lambda s: [int(g) for g in s.split(",")], default=[32, 128])
    p.add_argument("--json", type=Path, help="also write the counts here")
    p.add_argument("--tiling", type=lambda s: tuple(int(v) for v in s.split("x")),
                   help="ROWSxWORDSxWARPS instead of gemv_config's large-weight tiling")
    p.add_argument("--maxnreg", type=int, help="cap the registers a thread (ptxas' maxnreg)")
    p.add_argument("--check", action="store_true",
                   help=f"exit 1 if a loop takes over {MAX_PER_WEIGHT} instructions a weight, or is not the GEMV's")
    args = p.parse_args(argv)
    rows, failed = [], []
    print(f"triton {triton.__version__}, sm_90\n")
    print("| group size | variant | loop instructions | weights a thread a step | per weight | registers | spills "
          "| most frequent |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for group_size in args.group_sizes:
        for name, constants in VARIANTS.items():
            c = count(group_size, constants, args.tiling, args.maxnreg)
            rows.append({"group_size": group_size, "variant": name, "triton": triton.__version__} | asdict(c))
            mix = ", ".join(f"{op} {n}" for op, n in c.mix)
            print(f"| {group_size} | {name} | {c.loop} | {c.weights} | {c.per_weight:.2f} | {c.registers} | {c.spills} "
                  f"| {mix} |")
            if dict(c.mix).get("FFMA", 0) < c.weights:  # an FMA a weight, else the loop found is not the GEMV's
                failed.append(f"group size {group_size}, {name}: fewer FFMAs than weights in the loop found")
            elif c.per_weight >= MAX_PER_WEIGHT:
                failed.append(f"group size {group_size}, {name}: {c.per_weight:.2f} instructions a weight")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.check and failed:
        print(f"\nover budget (MAX_PER_WEIGHT = {MAX_PER_WEIGHT}):", *failed, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
