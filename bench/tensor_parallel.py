"""Tensor-parallel benchmark: minillm's decode tok/s at each --tensor-parallel-size on the same
random weights, against the memory-bandwidth floor of one rank's shard, and how far the greedy
tokens of each size agree with one GPU's.

    python3 bench/tensor_parallel.py --out "$OUT/tp.json"        # on a machine of 2 GPUs: about 3-4 minutes
    python bench/tensor_parallel.py --smoke --device cpu          # two CPU ranks (gloo): checks the script

How each figure is taken:
  decode tok/s    as bench/gpu.py: `batch` greedy requests of --prompt-tokens random ids, prefill
                  untimed, decode steps timed until the first request finishes or --decode-cap-s.
  floor fraction  the bytes one rank must read per step (its shard of the weights, its KV heads'
                  cache) over one GPU's copy bandwidth, divided by the measured step time. The
                  ranks read in parallel, so this is the floor of the whole step.
  transformers    with --transformers, transformers-static (bench/gpu.py's: a static cache and a
                  compiled CUDA-graph decode step) on one GPU with the same weights, as the reference.
  agreement       per check prompt, the greedy tokens (of --check-tokens) that match one GPU's
                  before the first difference. bf16 sums the row-parallel partials in another
                  order, so with random weights (flat logits) some prompts part early; where they
                  part, tests/gpu/test_tensor_parallel_cuda.py checks it is a top-5 swap.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu import (Floor, build_hf_model, copy_bandwidth, hf_static_decode, log, minillm_decode,  # noqa: E402
                       model_floor, random_prompts, release, slug, with_profile)
from bench.provenance import git_commit  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader import RANDOM_PREFIX  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

PROFILES = {
    "full": dict(models=["llama-3.2-1b", "llama-3.1-8b"], sizes=[1, 2], batches=[1, 8], new_tokens=256,
                 prompt_tokens=128, kv_cache_memory="4GiB", check_prompts=4, check_tokens=32, copy_bytes=2 << 30),
    "smoke": dict(models=["tiny-llama3"], sizes=[1, 2], batches=[1, 2], new_tokens=8, prompt_tokens=16,
                  kv_cache_memory="16MiB", check_prompts=2, check_tokens=8, copy_bytes=64 << 20),
}


def shard_floor(engine: LLMEngine, bytes_per_s: float) -> Floor:
    """Rank 0's bytes per step: it holds the largest shard where heads split unevenly."""
    model = engine.model
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    return Floor(bytes_per_s, weights, model.kv_bytes_per_token())


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def bench_size(args: argparse.Namespace, shape: str, size: int, bytes_per_s: float | None,
               reference: list[list[int]] | None) -> tuple[list[dict], list[list[int]]]:
    device = args.device
    dtype = "bfloat16" if device == "cuda" else "float32"
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=RANDOM_PREFIX + shape, dtype=dtype, device=device, weights_seed=args.seed,
                                    kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.batches),
                                    tensor_parallel_size=size))
    try:
        engine.warm_up()
        log(f"{shape} tp={size}: loaded and warmed in {time.perf_counter() - t:.1f} s")
        floor = shard_floor(engine, bytes_per_s) if bytes_per_s else None
        vocab = engine.model_config.vocab_size
        rows = []
        for batch in args.batches:
            minillm_decode(engine, random_prompts(args.seed + 1000 + batch, batch, args.prompt_tokens, vocab),
                           4, args.decode_cap_s, torch.device(device))  # warm-up at this batch
            d = minillm_decode(engine, random_prompts(args.seed + batch, batch, args.prompt_tokens, vocab),
                               args.new_tokens, args.decode_cap_s, torch.device(device))
            fraction = floor.fraction(d) if floor else None
            rows.append({"model": RANDOM_PREFIX + shape, "system": "minillm", "tensor_parallel_size": size, "batch": batch,
                         "decode_tok_s": round(d.tok_s, 2),
                         "floor_fraction": None if fraction is None else round(fraction, 5)})
            log(f"  batch {batch}: {d.tok_s:,.1f} tok/s ({d.tokens} tokens in {d.seconds:.3f} s)"
                + (f", {100 * fraction:.1f}% of floor" if fraction else ""))
        prompts = random_prompts(args.seed + 7, args.check_prompts, args.prompt_tokens, vocab)
        greedy = SamplingParams(temperature=0.0, max_tokens=args.check_tokens, ignore_eos=True)
        tokens = [c.token_ids for c in engine.generate(prompts, greedy)]
        if reference is not None:
            agreement = [common_prefix(a, b) for a, b in zip(tokens, reference)]
            log(f"  greedy tokens equal to tp=1 before the first difference: {agreement} of {args.check_tokens}")
            for row in rows:
                row["agreement"] = agreement
        return rows, tokens
    finally:
        engine.close()
        del engine
        release(torch.device(device))


def bench_transformers(args: argparse.Namespace, shape: str, bytes_per_s: float | None) -> list[dict]:
    """transformers-static on one GPU, same weights and prompts: the reference for each batch."""
    device = torch.device(args.device)
    model = build_hf_model(shape, torch.bfloat16 if args.device == "cuda" else torch.float32, device, args.seed)
    try:
        vocab, rows = model.config.vocab_size, []
        floor = model_floor(shape, model.dtype, bytes_per_s) if bytes_per_s else None
        for batch in args.batches:
            d = hf_static_decode(model, random_prompts(args.seed + batch, batch, args.prompt_tokens, vocab),
                                 args.new_tokens, args.decode_cap_s)
            fraction = floor.fraction(d) if floor else None
            rows.append({"model": RANDOM_PREFIX + shape, "system": "transformers-static", "tensor_parallel_size": 1,
                         "batch": batch, "decode_tok_s": round(d.tok_s, 2),
                         "floor_fraction": None if fraction is None else round(fraction, 5)})
            log(f"  transformers-static batch {batch}: {d.tok_s:,.1f} tok/s")
        return rows
    finally:
        del model
        torch._dynamo.reset()
        release(device)


def markdown_table(rows: list[dict]) -> str:
    one = {(r["model"], r["batch"]): r["decode_tok_s"] for r in rows
           if r["tensor_parallel_size"] == 1 and r["system"] == "minillm"}
    lines = ["| model | system | tensor parallel | batch | decode tok/s | % of floor | × minillm tp=1 | greedy tokens equal to tp=1 |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        frac = "" if r["floor_fraction"] is None else f"{100 * r['floor_fraction']:.1f}%"
        base = one.get((r["model"], r["batch"]))
        times = f"{r['decode_tok_s'] / base:.2f}" if base else ""
        agreement = ", ".join(str(a) for a in r.get("agreement", []))
        lines.append(f"| {r['model']} | {r['system']} | {r['tensor_parallel_size']} | {r['batch']} | {r['decode_tok_s']:,.1f} | "
                     f"{frac} | {times} | {agreement} |")
    return "\n".join(lines)


def save(out: Path, gpu: str, gpus: int, date: str, commit: str, bytes_per_s: float, args: argparse.Namespace,
         rows: list[dict]) -> None:
    doc = {"gpu": gpu, "gpus": gpus, "date": date, "commit": commit, "floor_bytes_per_s": bytes_per_s,
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    names = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=names, help="shape names (default llama-3.2-1b,llama-3.1-8b)")
    p.add_argument("--sizes", type=ints, help="tensor-parallel sizes, 1 first (default 1,2)")
    p.add_argument("--batches", type=ints, help="decode batches (default 1,8)")
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--prompt-tokens", type=int)
    p.add_argument("--kv-cache-memory")
    p.add_argument("--decode-cap-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--transformers", action="store_true", help="also transformers-static on one GPU, same weights")
    p.add_argument("--smoke", action="store_true", help="tiny shape, few tokens: checks the script")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/<date>-<gpu>-tp.json)")
    args = with_profile(p.parse_args(argv), PROFILES)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    date, commit = datetime.date.today().isoformat(), git_commit()
    out = args.out or ROOT / "bench" / "results" / f"{date}-{slug(gpu)}-tp{'-smoke' if args.smoke else ''}.json"
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    log(f"bench/tensor_parallel.py on {gpus or 'no'} × {gpu}, torch {torch.__version__}, commit {commit}; "
        f"sizes {args.sizes}, models {args.models}, batches {args.batches}")
    bytes_per_s = copy_bandwidth(torch.device(args.device), args.copy_bytes, 10)
    log(f"copy bandwidth of one device: {bytes_per_s / 1e12:.3f} TB/s")
    rows: list[dict] = []
    failed = []
    for shape in args.models:
        reference = None
        for size in args.sizes:
            try:
                got, tokens = bench_size(args, shape, size, bytes_per_s, reference)
            except Exception as e:  # noqa: BLE001 - one size failing must not cost the others' figures
                log(f"{shape} tp={size} failed: {e!r}")
                failed.append(f"{shape} tp={size}")
                continue
            rows += got
            reference = tokens if size == 1 else reference
            save(out, gpu, gpus, date, commit, bytes_per_s, args, rows)
        if args.transformers:
            try:
                rows += bench_transformers(args, shape, bytes_per_s)
            except Exception as e:  # noqa: BLE001
                log(f"{shape} transformers failed: {e!r}")
                failed.append(f"{shape} transformers")
            save(out, gpu, gpus, date, commit, bytes_per_s, args, rows)
    print(f"\n{gpus or 'no'} × {gpu}, torch {torch.__version__}, commit {commit}, {date}; copy floor "
          f"{bytes_per_s / 1e12:.2f} TB/s per device; {args.prompt_tokens}-token prompts; failed: {failed or 'none'}\n")
    print(markdown_table(rows), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
