"""bench/sass_count.py on the CPU (in a process of its own: the suite imports Triton as its
interpreter, which compiles nothing): the INT4 stream GEMV compiled for sm_90 by the installed
Triton keeps each thread on 8 rows of 4 adjacent words, its x values shared by 8 rows, which is
what its count of instructions a weight shows. The earlier kernel, over [rows, groups, words]
tiles, fails it under Triton 3.6 (the GPU machine's: 2 rows or 1 row a thread, 4.8 and 6.3 a
weight; PYTHONPATH at a Triton 3.6 install) and passes under 3.7 (3.8)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import sass_count  # noqa: E402


def test_loop_of_finds_the_longest_backward_branch() -> None:
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   FFMA R2, R3, R4, R5 ;",
        "        /*0020*/                   LOP3.LUT R6, R7, 0x78000, R8, 0xf8, !PT ;",
        "        /*0030*/               @P0 BRA 0x10 ;",
        "        /*0040*/                   EXIT ;",
    ])
    assert sass_count.loop_of(sass) == ["FFMA", "LOP3.LUT", "BRA"]


def test_stream_gemv_compiles_to_few_instructions_a_weight(tmp_path: Path) -> None:
    out = tmp_path / "counts.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "sass_count.py"), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert {(r["group_size"], r["variant"]) for r in rows} == {(g, v) for g in (32, 128) for v in sass_count.VARIANTS}
    for r in rows:
        assert dict(r["mix"])["FFMA"] >= r["weights"], r  # an FMA a weight: the loop found is the GEMV's
        assert r["loop"] / r["weights"] < 4.3, r
