"""xgrammar against llguidance on the embedded model's tokenizer: what picking the grammar library
rests on (README, "Why xgrammar").

For each schema, each library compiles it (no cache), then walks 300 tokens: fill the next-token
mask (timed), pick an allowed token at random (seeded: the same walk kind for both), accept it.
JSON without free whitespace on both sides. llguidance is not a dependency:

    .venv/bin/pip install llguidance && .venv/bin/python bench/grammar_backends.py --out bench/results/DATE-cpu-grammar-backends.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.provenance import git_commit  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city"]},
        "score": {"type": "number"}}, "required": ["name", "age", "tags", "address"]},
    "records, maxLength 24": {"type": "object", "properties": {"records": {"type": "array", "minItems": 8, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
                                         "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["x", "y"]}}},
        "required": ["id", "name", "tags"]}}}, "required": ["records"]},
}


def allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def walk(fill: Callable[[], torch.Tensor], accept: Callable[[int], bool], ended: Callable[[], bool], vocab: int,
         steps: int, seed: int) -> list[float]:
    rng, times = random.Random(seed), []
    for _ in range(steps):
        start = time.perf_counter()
        mask = fill()
        times.append(time.perf_counter() - start)
        assert accept(rng.choice(allowed(mask, vocab)))
        if ended():
            break
    return times


def xgrammar_run(hf: Any, schema: dict, steps: int, seed: int) -> tuple[float, list[float]]:
    import xgrammar as xgr
    vocab = len(hf)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab), cache_enabled=False)
    start = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
    compile_s = time.perf_counter() - start
    mask = xgr.allocate_token_bitmask(1, vocab)

    def fill() -> torch.Tensor:
        matcher.fill_next_token_bitmask(mask)
        return mask[0]

    return compile_s, walk(fill, matcher.accept_token, matcher.is_terminated, vocab, steps, seed)


def llguidance_run(hf: Any, schema: dict, steps: int, seed: int) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    vocab = len(hf)
    tokenizer = llguidance.hf.from_tokenizer(hf)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    compile_s = time.perf_counter() - start
    assert not matcher.is_error(), matcher.get_error()
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def fill() -> torch.Tensor:
        llguidance.torch.fill_next_token_bitmask(matcher, mask)
        return mask[0]

    return compile_s, walk(fill, matcher.consume_token, matcher.is_stopped, vocab, steps, seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--reps", type=int, default=3, help="walks per library and schema (seeds 0..reps-1)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    hf = Tokenizer.from_dir(resolve_model("default")).hf
    rows = []
    for name, schema in SCHEMAS.items():
        for library, run in (("xgrammar", xgrammar_run), ("llguidance", llguidance_run)):
            run(hf, schema, 20, 0)  # warm up
            compiles, masks = [], []
            for seed in range(args.reps):
                compile_s, times = run(hf, schema, args.steps, seed)
                compiles.append(compile_s)
                masks += times
            masks.sort()
            row = {"schema": name, "library": library, "version": metadata.version(library),
                   "compile_ms": round(statistics.median(compiles) * 1e3, 2),
                   "mask_us_median": round(statistics.median(masks) * 1e6, 1),
                   "mask_us_mean": round(statistics.mean(masks) * 1e6, 1),
                   "mask_us_p90": round(masks[int(len(masks) * 0.9)] * 1e6, 1),
                   "mask_us_max": round(masks[-1] * 1e6, 1), "masks": len(masks)}
            rows.append(row)
            print(f"| {name} | {library} | {row['compile_ms']} | {row['mask_us_median']} | {row['mask_us_mean']} | "
                  f"{row['mask_us_p90']} | {row['mask_us_max']} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({
            "bench": "grammar_backends", "date": datetime.date.today().isoformat(), "commit": git_commit(),
            "machine": platform.processor() or platform.machine(), "tokenizer": "SmolLM2-135M-Instruct",
            "vocab": len(hf), "method": __doc__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
