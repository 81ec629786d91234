"""Structured-output benchmark: what grammar-constrained decoding (xgrammar JSON schemas) costs
minillm's engine, against the same requests unconstrained.

One run, on the current device (an H200 for the figures we quote), one engine: `random:<shape>`
(default llama-3.2-1b) with bf16 seeded weights as bench/gpu.py builds them, and the tokenizer of
the embedded SmolLM2-135M model (--tokenizer; default: the converted embedded model's directory).
The grammar masks cover that tokenizer's 49,152 ids even where the shape's vocabulary is larger:
llama-3.2-1b still computes its 128,256-row lm_head every step, but ids past the tokenizer are
never sampled. A markdown table is printed last; JSON goes to --out; per-section timings to stderr.

    python3 bench/structured.py --tokenizer .tok --out "$OUT/structured.json"    # GPU machine: 2-3 minutes
    python bench/structured.py --smoke --device cpu --shape tiny-llama3 --vocab-size 49152  # seconds

How each figure is taken. Constrained ("minillm-json") and unconstrained ("minillm") repetitions
alternate, in ABBA order (U C C U U C ...) so that a drift weighs on both alike; --reps of each;
value = the median, with min and max beside it.
  decode tok/s    `batch` requests of --prompt-tokens random token ids (the same prompts for both
                  systems and every repetition), greedy. Constrained: every request carries the
                  decode schema, an object whose required array `records` holds at least 64 records
                  {id: integer 0-999999, name: string of <= 24 characters, score: number 0-100, tags:
                  <= 4 of an enum}, so none can end inside the timed steps; unconstrained: ignore_eos
                  (the same greedy requests otherwise). Prefill runs first, untimed;
                  then the device is synchronized and exactly --decode-steps engine steps are timed
                  with perf_counter up to a final synchronization (as bench/gpu.py times decode).
                  Value = tokens sampled in those steps / seconds. Each batch is warmed up in both
                  systems first (other prompts, a few steps).
  ratio           constrained median / unconstrained median (per-repetition pairs beside it).
                  Goals (the issue): >= 0.95 at batch 8 and 64, >= 0.90 at batch 1.
  mask ms/step    the grammar worker's time (a process beside the engine's) feeding tokens and filling
                  the masks during the timed steps
                  (stats().grammar_mask_seconds delta) / --decode-steps.
  ttft ms         one request alone, from add_request to the step that returns its first token
                  (synchronized), a fresh random prompt each time: unconstrained; constrained by a
                  schema never seen before (the decode schema with its key renamed `records_<n>`, so
                  its compile is inside the time; compile ms = engine.grammars.compile_seconds delta);
                  constrained by the cached decode schema. added ms = its median - unconstrained's.
  samples         request 0's tokens of each batch's last constrained repetition (a prefix of the
                  decode schema's JSON), and one request with the one-record schema run to its end
                  (complete JSON): checks that the masks hold.
"""
from __future__ import annotations

import time

START = time.perf_counter()  # the run's clock includes the imports

import argparse  # noqa: E402
import copy  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# First: bench/gpu.py's sections keep the run's clock from its import.
from bench.gpu import Bench, log, random_prompts, release, slug, spread, sync, with_profile  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.errors import ModelLoadError  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader import RANDOM_PREFIX  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from engine.models.shapes import SHAPES, shape_config  # noqa: E402
from engine.sampling_params import SamplingParams, StructuredOutput  # noqa: E402

SYSTEMS = ("minillm", "minillm-json")  # unconstrained, constrained
GOALS = {1: 0.90}  # constrained / unconstrained decode tok/s; other batches: DEFAULT_GOAL
DEFAULT_GOAL = 0.95
MIN_RECORDS = 64  # the decode schema's minItems: thousands of tokens before it may end

RECORD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999999},
        "name": {"type": "string", "maxLength": 24},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "maxItems": 4,
                 "items": {"enum": ["new", "sale", "featured", "clearance", "limited"]}},
    },
    "required": ["id", "name", "score", "tags"],
    "additionalProperties": False,
}

PROFILES: dict[str, dict[str, Any]] = {
    "full": dict(shape="llama-3.2-1b", batches=[1, 8, 64], prompt_tokens=128, decode_steps=512, reps=5,
                 ttft_runs=5, kv_cache_memory="4GiB"),
    "smoke": dict(shape="tiny-llama3", vocab_size=49152, batches=[1, 2], prompt_tokens=16, decode_steps=8, reps=3,
                  ttft_runs=3, kv_cache_memory="64MiB"),
}


# The same record without length or range bounds: xgrammar expands a bounded string into repetitions
# whose token masks cost up to milliseconds, an unbounded one costs microseconds.
OPEN_RECORD_SCHEMA: dict[str, Any] = {
    **RECORD_SCHEMA,
    "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, "score": {"type": "number"},
                   "tags": RECORD_SCHEMA["properties"]["tags"]},
}
DECODE_RECORDS = {"bounded": RECORD_SCHEMA, "open": OPEN_RECORD_SCHEMA}  # --schema


def records_schema(key: str = "records", kind: str = "bounded") -> dict[str, Any]:
    """The decode schema: an object whose one required array `key` holds at least MIN_RECORDS records."""
    return {"type": "object",
            "properties": {key: {"type": "array", "minItems": MIN_RECORDS, "items": DECODE_RECORDS[kind]}},
            "required": [key], "additionalProperties": False}


@dataclass
class Row:
    model: str
    system: str  # one of SYSTEMS
    metric: str  # decode_tok_s, mask_ms_per_step, ttft_ms or compile_ms
    batch: int
    prompt_tokens: int
    value: float  # the median of runs
    min: float
    max: float
    runs: list[float]
    grammar: str | None  # "cached" (compiled before the timing) or "new" (compiled inside it); None: unconstrained


@dataclass
class Decode:
    """One timed decode: what its steps did."""

    tokens: int  # sampled in the timed steps, all requests together
    seconds: float
    mask_seconds: float  # the grammar worker's time feeding tokens and filling masks in the timed steps
    finished: int  # requests that finished inside the timed steps (the design expects none)
    sample: list[int] = field(default_factory=list)  # request 0's output token ids so far

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def timed_decode(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, steps: int,
                 device: torch.device) -> Decode:
    """Prefill len(prompts) requests untimed, then time exactly `steps` engine steps between
    synchronizations; the requests are aborted after."""
    requests = [engine.add_request(p, params) for p in prompts]
    while any(r.first_token_time is None for r in requests):
        engine.step()
    sampled_before = engine.generation_tokens_total
    mask_before = engine.stats().grammar_mask_seconds
    finished = 0
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        finished += sum(out.finished for out in engine.step())
    sync(device)
    seconds = time.perf_counter() - start
    mask_seconds = engine.stats().grammar_mask_seconds - mask_before
    seq = requests[0].sequences[0]
    sample = seq.token_ids[requests[0].num_prompt_tokens:seq.num_real_tokens]  # trailing placeholders left out
    for r in requests:
        engine.abort(r.request_id)
    return Decode(engine.generation_tokens_total - sampled_before, seconds, mask_seconds, finished, sample)


def ttft(engine: LLMEngine, prompt: list[int], params: SamplingParams, device: torch.device) -> float:
    """Seconds from add_request (a grammar compiles there) to the first sampled token of one request alone."""
    sync(device)
    start = time.perf_counter()
    request = engine.add_request(prompt, params)
    while request.first_token_time is None:
        engine.step()
    sync(device)
    seconds = time.perf_counter() - start
    engine.abort(request.request_id)
    return seconds


def decode_params(structured: StructuredOutput | None, max_tokens: int) -> SamplingParams:
    """Greedy; a constrained request stops as a client's would (its grammar cannot end in time),
    an unconstrained one ignores EOS."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=structured is None, structured=structured)


def abba(reps: int) -> list[str]:
    """U C C U U C ...: reps of each system, in pairs whose order alternates."""
    pairs = [SYSTEMS if k % 2 == 0 else SYSTEMS[::-1] for k in range(reps)]
    return [system for pair in pairs for system in pair]


def shape_with_vocab(shape: str, vocab_size: int) -> str:
    """Register (in this process) `shape` with another vocabulary size, e.g. a tiny shape that holds a
    real tokenizer's ids; returns the new shape's name."""
    name = f"{shape}-vocab{vocab_size}"
    SHAPES[name] = shape_config(shape) | {"vocab_size": vocab_size}
    return name


def default_tokenizer() -> Path:
    """The embedded SmolLM2 model's converted directory (converting it if its package is installed)."""
    try:
        return resolve_model("default")
    except ModelLoadError as e:
        raise SystemExit(f"bench/structured.py: no default tokenizer ({e}); pass --tokenizer DIR") from None


class StructuredBench(Bench):
    """bench/gpu.py's sections and clock, with this benchmark's rows, summary and samples."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        if args.out is None:
            gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            smoke = "-smoke" if args.smoke else ""
            args.out = ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-{slug(gpu)}-structured{smoke}.json"
        super().__init__(args, device)
        self.rows: list[Row] = []  # type: ignore[assignment]
        self.summary: dict[str, Any] = {"decode": [], "ttft": None}
        self.samples: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {}

    def add(self, row: Row) -> None:  # type: ignore[override]
        self.rows.append(row)
        log(f"  {row.system} {row.metric} batch {row.batch}: {row.value:,.3f} "
            f"(min {row.min:,.3f}, max {row.max:,.3f}, runs {row.runs})")

    def save(self) -> None:
        doc = {"bench": "structured", "gpu": self.gpu, "date": self.date, "commit": self.commit,
               "torch": torch.__version__, "transformers": transformers.__version__,
               "xgrammar": importlib.metadata.version("xgrammar"), **self.info,
               "method": __doc__, "rows": [asdict(r) for r in self.rows], "summary": self.summary,
               "samples": self.samples, "failed": self.failed, "skipped": self.skipped}
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(doc, indent=2) + "\n")


def build_engine(args: argparse.Namespace, device: torch.device) -> LLMEngine:
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    engine = LLMEngine(EngineConfig(model=args.model, tokenizer=str(args.tokenizer), dtype=dtype, device=str(device),
                                    weights_seed=args.seed, kv_cache_memory=args.kv_cache_memory,
                                    max_num_seqs=max(args.batches)))
    if engine.grammars is None:
        raise SystemExit("bench/structured.py: the engine has no tokenizer, so no grammars")
    engine.warm_up()
    return engine


def bench_decode(bench: StructuredBench, engine: LLMEngine, batch: int, spec: StructuredOutput) -> None:
    """Alternating constrained and unconstrained timed decodes of the same prompts at one batch size."""
    args, device = bench.args, bench.device
    vocab = engine.sample_vocab_size  # prompts of the tokenizer's ids, so samples detokenize
    max_tokens = args.decode_steps + 16  # the steps, the prefill's token and the one-step lag
    params = {"minillm": decode_params(None, max_tokens), "minillm-json": decode_params(spec, max_tokens)}
    warm = random_prompts(args.seed + 1000 + batch, batch, args.prompt_tokens, vocab)
    for system in SYSTEMS:
        timed_decode(engine, warm, params[system], min(args.decode_steps, 8), device)
    prompts = random_prompts(args.seed + batch, batch, args.prompt_tokens, vocab)
    runs: dict[str, list[Decode]] = {s: [] for s in SYSTEMS}
    for system in abba(args.reps):
        d = timed_decode(engine, prompts, params[system], args.decode_steps, device)
        runs[system].append(d)
        log(f"  {system}: {d.tokens} tokens in {d.seconds * 1e3:.1f} ms = {d.tok_s:,.1f} tok/s, "
            f"masks {d.mask_seconds * 1e3:.2f} ms" + (f", {d.finished} FINISHED EARLY" if d.finished else ""))
    tok_s = {s: [d.tok_s for d in runs[s]] for s in SYSTEMS}
    mask_ms = [d.mask_seconds * 1e3 / args.decode_steps for d in runs["minillm-json"]]
    for system in SYSTEMS:
        bench.add(Row(args.model, system, "decode_tok_s", batch, args.prompt_tokens,
                      **spread(tok_s[system], 2), grammar="cached" if system == "minillm-json" else None))
    bench.add(Row(args.model, "minillm-json", "mask_ms_per_step", batch, args.prompt_tokens, **spread(mask_ms, 4),
                  grammar="cached"))
    plain, constrained = (statistics.median(tok_s[s]) for s in SYSTEMS)
    step_ms = batch / plain * 1e3
    goal = GOALS.get(batch, DEFAULT_GOAL)
    bench.summary["decode"].append({
        "batch": batch, "minillm_tok_s": round(plain, 2), "minillm_json_tok_s": round(constrained, 2),
        "ratio": round(constrained / plain, 4),
        "paired_ratios": [round(c / u, 4) for c, u in zip(tok_s["minillm-json"], tok_s["minillm"])],
        "mask_ms_per_step": round(statistics.median(mask_ms), 4), "unconstrained_step_ms": round(step_ms, 4),
        "mask_share_of_step": round(statistics.median(mask_ms) / step_ms, 4),
        "finished_early": sum(d.finished for d in runs["minillm-json"] + runs["minillm"]),
        "goal_ratio": goal, "meets_goal": constrained / plain >= goal})
    last = runs["minillm-json"][-1].sample
    bench.samples.append({"what": "decode", "batch": batch, "schema": "decode", "finished": False,
                          "token_ids": last, "text": engine.tokenizer.decode(last)})


def bench_ttft(bench: StructuredBench, engine: LLMEngine, spec: StructuredOutput) -> None:
    """TTFT of one request: unconstrained, with a schema never seen (compiled inside the time), with the cached one."""
    args, device = bench.args, bench.device
    vocab = engine.sample_vocab_size
    counter = iter(range(1_000_000))
    seed = args.seed + 10_000  # a fresh prompt every run: the prefix cache must not hit

    def params(grammar: str | None) -> SamplingParams:
        structured = {None: None, "cached": spec,
                      "new": StructuredOutput.json_schema(records_schema(f"records_{next(counter)}",
                                                                       bench.args.schema))}[grammar]
        return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, structured=structured)

    kinds = (None, "new", "cached")
    runs: dict[str | None, list[float]] = {k: [] for k in kinds}
    compile_ms: list[float] = []
    compiles = {k: 0 for k in kinds}
    for rep in range(args.ttft_runs + 1):  # the first is a warm-up
        for kind in kinds:
            seed += 1
            prompt = random_prompts(seed, 1, args.prompt_tokens, vocab)[0]
            p = params(kind)
            n, s = engine.grammars.compiles, engine.grammars.compile_seconds
            seconds = ttft(engine, prompt, p, device)
            if rep == 0:
                continue
            runs[kind].append(seconds * 1e3)
            compiles[kind] += engine.grammars.compiles - n
            if kind == "new":
                compile_ms.append((engine.grammars.compile_seconds - s) * 1e3)
    for kind in kinds:
        log(f"  TTFT {kind or 'unconstrained'} (ms): {', '.join(f'{ms:.2f}' for ms in runs[kind])}")
        bench.add(Row(args.model, "minillm-json" if kind else "minillm", "ttft_ms", 1, args.prompt_tokens,
                      **spread(runs[kind], 3), grammar=kind))
    bench.add(Row(args.model, "minillm-json", "compile_ms", 1, args.prompt_tokens, **spread(compile_ms, 3), grammar="new"))
    base = statistics.median(runs[None])
    bench.summary["ttft"] = {
        "prompt_tokens": args.prompt_tokens, "unconstrained_ms": round(base, 3),
        "new_schema_ms": round(statistics.median(runs["new"]), 3),
        "new_schema_added_ms": round(statistics.median(runs["new"]) - base, 3),
        "compile_ms": round(statistics.median(compile_ms), 3),
        "cached_schema_ms": round(statistics.median(runs["cached"]), 3),
        "cached_schema_added_ms": round(statistics.median(runs["cached"]) - base, 3),
        "compiles": {"unconstrained": compiles[None], "new": compiles["new"], "cached": compiles["cached"]}}


def finite_sample(bench: StructuredBench, engine: LLMEngine) -> None:
    """One request with the one-record schema, run to its end: its text must be that JSON, complete."""
    params = SamplingParams(temperature=0.0, max_tokens=256, structured=StructuredOutput.json_schema(RECORD_SCHEMA))
    prompt = random_prompts(bench.args.seed + 20_000, 1, bench.args.prompt_tokens, engine.sample_vocab_size)[0]
    done = engine.generate([prompt], params)[0]
    text, reason = done.text, done.samples[0].finish_reason
    try:
        json.loads(text)
        valid = True
    except ValueError:
        valid = False
    log(f"  one record, {len(done.token_ids)} tokens, {reason}, {'valid' if valid else 'INVALID'} JSON: {text}")
    bench.samples.append({"what": "finite", "batch": 1, "schema": "record", "finished": reason is not None,
                          "finish_reason": reason, "valid_json": valid, "token_ids": done.token_ids, "text": text})


def markdown_tables(bench: StructuredBench) -> str:
    rows = {(r.system, r.metric, r.batch, r.grammar): r for r in bench.rows}

    def cell(r: Row | None, fmt: str = ",.1f") -> str:
        return "" if r is None else f"{r.value:{fmt}} ({r.min:{fmt}}–{r.max:{fmt}})"

    lines = ["| batch | minillm tok/s (min–max) | minillm-json tok/s (min–max) | json / plain | goal "
             "| mask ms/step |", "|---:|---:|---:|---:|---:|---:|"]
    for s in bench.summary["decode"]:
        b = s["batch"]
        verdict = "met" if s["meets_goal"] else "MISSED"
        lines.append(f"| {b} | {cell(rows.get(('minillm', 'decode_tok_s', b, None)))} | "
                     f"{cell(rows.get(('minillm-json', 'decode_tok_s', b, 'cached')))} | {s['ratio']:.3f} | "
                     f"≥ {s['goal_ratio']:.2f} {verdict} | {s['mask_ms_per_step']:.3f} |")
    t = bench.summary["ttft"]
    if t is not None:
        lines += ["", f"| TTFT, {t['prompt_tokens']}-token prompt | ms (min–max) | added ms | compile ms |",
                  "|---|---:|---:|---:|",
                  f"| unconstrained | {cell(rows.get(('minillm', 'ttft_ms', 1, None)), '.2f')} | | |",
                  f"| new schema | {cell(rows.get(('minillm-json', 'ttft_ms', 1, 'new')), '.2f')} | "
                  f"{t['new_schema_added_ms']:+.2f} | {t['compile_ms']:.2f} |",
                  f"| cached schema | {cell(rows.get(('minillm-json', 'ttft_ms', 1, 'cached')), '.2f')} | "
                  f"{t['cached_schema_added_ms']:+.2f} | |"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=lambda s: s.removeprefix(RANDOM_PREFIX), help="model shape (default llama-3.2-1b)")
    p.add_argument("--vocab-size", type=int,
                   help="give the shape this vocabulary size (a tiny shape must hold the tokenizer's 49,152 ids)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: the embedded SmolLM2 model's)")
    p.add_argument("--batches", type=ints, help="decode batches, comma-separated (default 1,8,64)")
    p.add_argument("--prompt-tokens", type=int, help="random prompt tokens per request, decode and TTFT (default 128)")
    p.add_argument("--decode-steps", type=int, help="timed engine steps per decode repetition (default 512)")
    p.add_argument("--reps", type=int, help="timed decode repetitions of each system per batch (default 5)")
    p.add_argument("--ttft-runs", type=int, help="timed TTFT runs of each kind, after one warm-up (default 5)")
    p.add_argument("--kv-cache-memory", help="the KV pool (default 4GiB; smoke 64MiB)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no section after this many seconds of the run (default 420)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts seed")
    p.add_argument("--schema", choices=sorted(DECODE_RECORDS), default="bounded",
                   help="the decode schema's records: bounded (maxLength, ranges) or open (default bounded)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--smoke", action="store_true", help="tiny shape, small batches, few steps: checks the script")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/<date>-<gpu>-structured.json)")
    args = with_profile(p.parse_args(argv), PROFILES)
    if args.reps < 3 or args.ttft_runs < 3:
        p.error("--reps and --ttft-runs must be at least 3")
    shape = shape_with_vocab(args.shape, args.vocab_size) if args.vocab_size else args.shape
    args.model = RANDOM_PREFIX + shape
    args.tokenizer = args.tokenizer or default_tokenizer()
    return args


def describe(args: argparse.Namespace, engine: LLMEngine, device: torch.device) -> dict[str, Any]:
    """What the run measured, for the JSON: model, tokenizer, vocabularies, options and schemas."""
    mask_vocab, model_vocab = engine.sample_vocab_size, engine.model_config.vocab_size
    return {
        "model": args.model, "tokenizer": str(args.tokenizer), "device": str(device),
        "dtype": str(engine.model.embed_tokens.weight.dtype).removeprefix("torch."),
        "model_vocab": model_vocab, "mask_vocab": mask_vocab,
        "vocab_note": (f"grammar masks cover the tokenizer's {mask_vocab:,} ids; the model's {model_vocab:,}-row "
                       "lm_head is computed in full, ids past the tokenizer are never sampled"),
        "config": {k: getattr(args, k) for k in ("batches", "prompt_tokens", "decode_steps", "reps", "ttft_runs",
                                                 "kv_cache_memory", "seed")},
        "schemas": {"decode": records_schema(kind=args.schema), "decode_kind": args.schema,
                    "record": copy.deepcopy(RECORD_SCHEMA)},
    }


def run_sections(bench: StructuredBench, engine: LLMEngine) -> None:
    """Every measurement on one engine: the decode schema's first compile, decode at each batch, TTFT, a sample."""
    spec = StructuredOutput.json_schema(records_schema(kind=bench.args.schema))

    def compile_decode_schema() -> None:
        start = time.perf_counter()
        engine.grammars.compile(spec)
        bench.info["decode_schema_first_compile_ms"] = round((time.perf_counter() - start) * 1e3, 3)
        log(f"  first compile of the decode schema: {bench.info['decode_schema_first_compile_ms']:.1f} ms")

    bench.section("compile the decode schema", compile_decode_schema)
    for batch in bench.args.batches:
        bench.section(f"decode batch {batch}", lambda b=batch: bench_decode(bench, engine, b, spec))
    bench.section("TTFT", lambda: bench_ttft(bench, engine, spec))
    bench.section("one record to its end", lambda: finite_sample(bench, engine))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    bench = StructuredBench(args, device)
    xgrammar_version = importlib.metadata.version("xgrammar")
    log(f"bench/structured.py on {bench.gpu} ({device}), torch {torch.__version__}, xgrammar {xgrammar_version}, "
        f"commit {bench.commit}; JSON to {args.out}")
    log(f"plan: {args.model}, tokenizer {args.tokenizer}; batches {args.batches}; {args.prompt_tokens}-token prompts; "
        f"{args.decode_steps} timed steps x {args.reps} repetitions of each system; TTFT x {args.ttft_runs}")
    engine: LLMEngine | None = bench.section("load and warm up", lambda: build_engine(args, device))
    if engine is None:
        return 1
    bench.info = describe(args, engine, device)
    log(bench.info["vocab_note"])
    run_sections(bench, engine)
    del engine
    release(device)

    bench.save()
    log("sections (s): " + "; ".join(f"{name} {s:.1f}" for name, s in bench.timings))
    log(f"total {time.perf_counter() - START:.1f} s; failed: {bench.failed or 'none'}; "
        f"skipped: {bench.skipped or 'none'}")
    print(f"\n{bench.gpu}, torch {torch.__version__}, xgrammar {xgrammar_version}, commit {bench.commit}, "
          f"{bench.date}; {args.model} ({bench.info['dtype']}), masks over {bench.info['mask_vocab']:,} ids; "
          f"{args.prompt_tokens}-token prompts, {args.decode_steps} timed steps, medians of {args.reps}; "
          f"{args.schema} decode schema\n")
    print(markdown_tables(bench), flush=True)
    return 1 if bench.failed else 0


if __name__ == "__main__":
    sys.exit(main())
