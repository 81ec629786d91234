"""CPU benchmark: our engine against transformers `generate` on the same weights, in one run.

Decode throughput (generated tokens / wall seconds) for 1 and 8 concurrent streams on the embedded
SmolLM2-135M-Instruct in float32. Not a test: figures for the README and the issue notes.

    make bench            # or: python bench/cpu.py --new-tokens 128
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

QUESTIONS = [
    "Explain how a bicycle stays upright.", "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?", "Describe the water cycle for a ten-year-old.",
    "Give me three tips for learning a new language.", "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.", "How does a hash table work?",
]


def bench_minillm(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed


def _hf_generate(model, pad: int, prompts: list[list[int]], new_tokens: int) -> int:
    """One generate() call over prompts (left-padded); returns the tokens generated."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=pad)
    return (out.shape[1] - width) * len(prompts)


def bench_transformers(model, tokenizer, prompts: list[list[int]], new_tokens: int, batched: bool) -> float:
    """transformers serving the streams: one padded generate() over all of them (batched, which needs
    them all up front), or one generate() after another (how a plain transformers server serves
    requests that arrive on their own)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with torch.no_grad():
        _hf_generate(model, pad, prompts[:1], 4)  # warm-up
        start = time.perf_counter()
        groups = [prompts] if batched else [[p] for p in prompts]
        tokens = sum(_hf_generate(model, pad, group, new_tokens) for group in groups)
        elapsed = time.perf_counter() - start
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    path = resolve_model(args.model)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    rows = []
    for streams in (1, 8):
        ours = bench_minillm(engine, prompts[:streams], args.new_tokens)
        one_by_one = bench_transformers(model, tokenizer, prompts[:streams], args.new_tokens, batched=False)
        batched = one_by_one if streams == 1 else bench_transformers(
            model, tokenizer, prompts[:streams], args.new_tokens, batched=True)
        rows.append({"streams": streams, "minillm_tok_s": round(ours, 1),
                     "transformers_one_by_one_tok_s": round(one_by_one, 1),
                     "transformers_padded_batch_tok_s": round(batched, 1),
                     "x_one_by_one": round(ours / one_by_one, 2), "x_padded_batch": round(ours / batched, 2)})
    print(f"\nCPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, SmolLM2-135M float32, "
          f"{args.new_tokens} new tokens\n")
    print("| streams | minillm tok/s | transformers one by one | × | transformers padded batch | × |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['streams']} | {r['minillm_tok_s']} | {r['transformers_one_by_one_tok_s']} | "
              f"{r['x_one_by_one']} | {r['transformers_padded_batch_tok_s']} | {r['x_padded_batch']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
