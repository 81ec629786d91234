"""Triton kernels compiled for Hopper (sm_90) on a machine without a GPU, and what ptxas made of them.

compile_launch compiles a launch `fn[grid](*args, **kwargs)` as Triton's launcher specializes it on
the GPU (its own rule): pointers to 16-byte-aligned data and integers divisible by 16 marked so,
integers equal to 1 folded in as constants. resources reads a compiled kernel's registers a thread and its
spills with the cuobjdump that Triton bundles. Used by bench/kernel_registers.py, bench/sass_count.py
and tests/kernels/sm90_compile.py; run them in a process whose kernels are not the interpreter's.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)  # an H100 / H200
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl", "maxnreg")
# A cuobjdump -sass line: its address and opcode (after any predicate).
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", re.MULTILINE)
_compiled: dict[tuple, Any] = {}  # one compile a distinct launch (a step launches each kernel many times)


def compile_launch(fn: JITFunction, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """fn compiled for TARGET with a launch's arguments: (the compiled kernel, its constexprs, its
    launch options)."""
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
    values = dict(zip((p.name for p in fn.params), args)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = values.get(p.name, p.default)
        kind, attr = ("constexpr", None) if p.is_constexpr or value is None else \
            native_specialize_impl(BaseBackend, value, False, True, True)[:2]  # as the launcher does
        if kind == "constexpr":
            signature[p.name], constexprs[p.name] = "constexpr", value
        else:
            signature[p.name] = kind
            if attr == "D":  # divisible by 16 (a pointer: its address)
                attrs[(i,)] = [["tt.divisibility", 16]]
    key = (fn, repr(signature), repr(constexprs), repr(attrs), repr(sorted(options.items())))
    if key not in _compiled:
        _compiled[key] = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                        target=TARGET, options=options)
    return _compiled[key], constexprs, options


def cuobjdump(cubin: bytes, *args: str) -> str:
    """Triton's bundled cuobjdump run over a cubin, its output."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        Path(path).write_bytes(cubin)
        return subprocess.run([str(tool), *args, path], capture_output=True, text=True, check=True).stdout


@dataclass
class Resources:
    registers: int  # a thread's, as Nsight Compute reports them
    spill_stores: int  # local-memory stores in the code (spills; the kernels keep no local arrays)
    instructions: int  # in the code, not executed


def resources(kernel: Any) -> Resources:
    cubin = kernel.asm["cubin"]
    usage = cuobjdump(cubin, "-res-usage")
    sass = cuobjdump(cubin, "-sass")
    opcodes = [m.group(2) for m in INSTRUCTION.finditer(sass)]
    return Resources(int(re.search(r"REG:(\d+)", usage).group(1)), sum(op.startswith("STL") for op in opcodes),
                     len(opcodes))
