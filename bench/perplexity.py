"""Perplexity of the embedded SmolLM2-135M-Instruct under each weight format minillm serves.

The text is bench/data/eval.txt (the articles of the U.S. Constitution, public domain; a different
text from the AWQ calibration text, engine/data/calibration.txt). It is scored with our own
DecoderModel forward (engine/packed_prefill.py) over --window-token windows every --stride tokens; each
token is scored once, in the first window that holds it past the stride's overlap (as Hugging Face's
perplexity guide does), so every scored token but those of the first window sees at least
window - stride tokens of context.

Systems: minillm (float32), minillm-bf16, minillm-fp8 (--quantization fp8, per-channel FP8 rounded
to nearest at load), minillm-fp8-gptq, minillm-int4-rtn and minillm-int4-awq, and the two int4
ones with lm_head int4 too (-lm-head: `minillm quantize --lm-head`), quantized into a
temporary directory by engine/quantization/, the code behind `minillm quantize`. The quantized
systems run in --dtype (default bfloat16, as served on a GPU). A markdown table is printed last; JSON goes to --out.

    python bench/perplexity.py --out bench/results/<date>-cpu-perplexity.json   # CPU: a few minutes
    python bench/perplexity.py --max-tokens 96 --window 64 --stride 32 --calibration-tokens 64  # smoke
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import git_commit  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.model_store import DEFAULT_DIR_NAME, resolve_model  # noqa: E402
from engine.models.llama import DecoderModel  # noqa: E402
from engine.packed_prefill import sequence_logprobs  # noqa: E402
from engine.quantization import CALIBRATION_TOKENS, quantize_checkpoint  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

EVAL_TEXT = ROOT / "bench" / "data" / "eval.txt"
SYSTEMS = ("minillm", "minillm-bf16", "minillm-fp8", "minillm-fp8-gptq", "minillm-int4-rtn", "minillm-int4-awq",
           "minillm-int4-rtn-lm-head", "minillm-int4-awq-lm-head")
# `minillm quantize` method and --lm-head of each quantized system.
QUANTIZE_METHODS = {"minillm-fp8-gptq": ("fp8-gptq", False), "minillm-int4-rtn": ("rtn", False),
                    "minillm-int4-awq": ("awq", False), "minillm-int4-rtn-lm-head": ("rtn", True),
                    "minillm-int4-awq-lm-head": ("awq", True)}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, scored): window tokens[begin:end] scores its last `scored` tokens."""
    out, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        out.append((begin, end, min(end - prev_end, end - begin - 1)))  # the text's first token has no context
        prev_end = end
        if end == num_tokens:
            break
    return out


def perplexity(model: DecoderModel, tokens: list[int], window: int, stride: int, batch: int = 4) -> float:
    spans = windows(len(tokens), window, stride)
    total, count = 0.0, 0
    for i in range(0, len(spans), batch):
        chunk = spans[i:i + batch]
        logprobs = sequence_logprobs(model, [tokens[b:e] for b, e, _ in chunk])
        for (_, _, scored), lp in zip(chunk, logprobs):
            total -= lp[-scored:].double().sum().item()
            count += scored
    return math.exp(total / count)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="a float checkpoint directory, or 'default' (the embedded model)")
    p.add_argument("--text", type=Path, default=EVAL_TEXT)
    p.add_argument("--max-tokens", type=int, default=None, help="score only the text's first tokens (default: all)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=list(_DTYPES), help="dtype of the quantized systems")
    p.add_argument("--group-size", type=int, default=None, help="int4 group size (default: engine/quantization's)")
    p.add_argument("--calibration-tokens", type=int, default=CALIBRATION_TOKENS, help="AWQ and GPTQ calibration tokens")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS))
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/<date>-<device>-perplexity.json)")
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}")
    if not 0 < args.stride <= args.window:
        p.error("--stride must be in 1..--window")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    date, commit = datetime.date.today().isoformat(), git_commit()
    out_path = args.out or ROOT / "bench" / "results" / f"{date}-{'cpu' if gpu == 'cpu' else 'gpu'}-perplexity.json"
    src = resolve_model(args.model)
    model_name = DEFAULT_DIR_NAME if args.model == "default" else src.name
    tokens = Tokenizer.from_dir(src).encode(args.text.read_text())[: args.max_tokens]
    quantized_dtype = _DTYPES[args.dtype]
    log(f"bench/perplexity.py: {model_name} on {gpu}, {len(tokens)} tokens of {args.text.name}, windows of "
        f"{args.window} every {args.stride}; quantized systems in {args.dtype}; commit {commit}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="minillm-ppl-") as tmp:
        for system in args.systems:
            start = time.perf_counter()
            if system == "minillm":
                model = load_model(src, torch.float32, device)
            elif system == "minillm-bf16":
                model = load_model(src, torch.bfloat16, device)
            elif system == "minillm-fp8":
                model = load_model(src, quantized_dtype, device, quantization="fp8")
            else:
                method, lm_head = QUANTIZE_METHODS[system]
                quantized = quantize_checkpoint(str(src), Path(tmp) / system, method,
                                                args.group_size if method != "fp8-gptq" else None,
                                                args.calibration_tokens, device=str(device), lm_head=lm_head)
                log(f"  {system}: quantized in {time.perf_counter() - start:.1f} s")
                model = load_model(quantized, quantized_dtype, device)
            ppl = perplexity(model, tokens, args.window, args.stride)
            del model
            log(f"  {system}: perplexity {ppl:.4f} ({time.perf_counter() - start:.1f} s)")
            rows.append({"model": model_name, "system": system, "metric": "perplexity", "batch": None,
                         "prompt_tokens": len(tokens), "value": round(ppl, 4), "floor_fraction": None})
    doc = {"gpu": gpu, "date": date, "commit": commit, "floor_bytes_per_s": None, "rows": rows}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2) + "\n")
    log(f"JSON written to {out_path}")
    reference = {r["system"]: r["value"] for r in rows}.get("minillm-bf16")
    print(f"\n{model_name}, {len(tokens)} tokens of {args.text.name}, windows of {args.window} every {args.stride}, "
          f"{gpu}, commit {commit}, {date}\n")
    print("| model | system | tokens | perplexity | vs bf16 |\n|---|---|---:|---:|---:|")
    for r in rows:
        versus = f"{100 * (r['value'] / reference - 1):+.2f}%" if reference else ""
        print(f"| {r['model']} | {r['system']} | {r['prompt_tokens']} | {r['value']:.4f} | {versus} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
