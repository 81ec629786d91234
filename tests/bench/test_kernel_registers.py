"""bench/kernel_registers.py compiles a decode layer's kernels for sm_90 on the CPU, as the layers
launch them, and reads each one's registers and spills: it must keep up with the kernels' arguments,
and a setting it is given must reach the launches."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def launches(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "registers.json"
    # A process of its own: this one's kernels may be the interpreter's, which cannot compile for sm_90.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_registers.py"), "--models", "qwen2.5-0.5b",
                    "--formats", "bf16", "--rows", "1", "--json", str(out), *args],
                   env=env, check=True, capture_output=True, timeout=600)
    return json.loads(out.read_text())


def test_a_decode_layers_kernels_and_a_setting(tmp_path: Path) -> None:
    rows = launches(tmp_path)
    kernels = {r["what"].split(" ", 3)[3]: r for r in rows}
    assert {k: r["kernel"] for k, r in kernels.items()} == {
        "down": "_float_gemv_kernel", "qkv": "_float_gemv_kernel", "gate_up": "_float_gemv_tma_kernel",
        "attention": "_decode_split_kernel", "o (merging)": "_merge_o_kernel"}
    assert all(0 < r["registers"] <= 255 and r["spill_stores"] >= 0 for r in rows)
    merge = kernels["o (merging)"]
    assert merge["grid"] == "(14, 2)" and merge["warps"] == 4  # 896 rows / 64 a tile, 2 KV groups
    [wider] = [r for r in launches(tmp_path, "--set", "kernels.attention_projection.MERGE_WARPS=16")
               if r["kernel"] == "_merge_o_kernel"]
    assert wider["warps"] == 16 and wider["registers"] < merge["registers"]  # its block over 4x the threads
