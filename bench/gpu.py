"""GPU benchmark: minillm against the memory-bandwidth floor and against transformers on the same weights.

One run, on the current device (an H200 for the figures we quote):
  - the floor: a 2 GiB device-to-device copy, bytes read + written over the median time of 20;
  - per model (`random:<shape>`, bf16, seeded weights; the 0.5B, 1B and 8B shapes): minillm's
    decode tok/s at batch 1, 8, 32 and 64 through LLMEngine.step(); its time to first token for
    128, 2,048 and 8,192-token prompts; the KV bytes one 8,192-token sequence holds against theory;
  - FP8 (quantized as it loads) and INT4 (RTN checkpoints, lm_head bf16 or int4) of the 1B shape
    at batch 1 and 8;
  - transformers on the same 1B weights (engine.loader.random_tensors, copied in by name):
    generate() with a static cache and a compiled CUDA-graph decode step at batch 1, 8 and 64
    (--hf-dynamic adds its dynamic cache).
Every run that writes the record covers that whole matrix (a partial run is an A/B, not a record).
Each figure is the median of --reps repetitions (min, max and every run kept in the JSON), taken
in rounds over the batches (or prompt lengths) of one engine, each round in the reverse order of
the one before, so that a drift weighs on all alike. The run then compares itself with the
previous record of the same GPU in bench/results (or --compare FILE) and marks every figure more
than 5% worse. A markdown table is printed, then the comparison; JSON goes to --out. Per-section
timings go to stderr.

    python3 bench/gpu.py --out "$OUT/gpu.json"                 # on the GPU machine: about 8-9 minutes (estimated)
    python bench/gpu.py --smoke --skip-transformers --device cpu  # seconds: checks the script itself

How each figure is taken:
  decode tok/s   `batch` requests of `--prompt-tokens` random token ids, greedy, ignore_eos,
                 `--new-tokens` each. Prefill is run first and not timed; then the device is
                 synchronized and the decode steps are timed with perf_counter until the first
                 request finishes (so every timed step decodes the whole batch) or --decode-cap-s
                 passes (a rate needs no more). Run = tokens sampled in the timed steps / seconds.
                 transformers: a logits processor synchronizes and starts the clock the first time
                 generate() calls it, i.e. on the prefill's logits; the clock stops when generate()
                 returns (synchronized). Run = batch x (new tokens - 1) / that time.
  floor fraction the decode step's floor time / its measured time, where the floor time is the bytes
                 a step must read (weights, tied embedding once, plus batch x mean context x KV
                 bytes per token) over the copy bandwidth. The same floor serves every system;
                 a row's is its median run's.
  ttft ms        one request alone, from add_request to the moment the engine has its first token
                 on the host (as a server would send it; the next step, already launched, is not
                 waited for); each length warmed up once, then --reps rounds over the lengths;
                 a fresh random prompt each time, so the prefix cache never hits.
  kv bytes       KV blocks held by one sequence of the largest TTFT prompt, right after its first
                 token, x bytes per block; floor fraction = theory (tokens x KV bytes per token) /
                 value. The target is at most theory + one block.
"""
from __future__ import annotations

import time

START = time.perf_counter()  # the run's clock includes the imports

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, TypeVar  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import git_commit  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader import RANDOM_PREFIX, checkpoint_tensor_shapes, load_model, model_config, random_tensors  # noqa: E402
from engine.models.linear import Int4Linear  # noqa: E402
from engine.models.shapes import shape_config  # noqa: E402
from engine.quantization import awq_quantization_config, default_group_size, export_awq, lm_head_weight  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

# minillm-int4-lm-head: INT4 with lm_head int4 too (`minillm quantize --lm-head`; AutoAWQ keeps it float).
SYSTEMS = ("minillm", "minillm-fp8", "minillm-int4", "minillm-int4-lm-head", "transformers-dynamic",
           "transformers-static")
METRICS = ("decode_tok_s", "ttft_ms", "kv_bytes")
COMPILE_GUESS_S = 45.0  # one torch.compile of a decode step on the GPU machine, for the estimate only
CHECK_TOKENS = 8  # greedy tokens compared between minillm and transformers (same-weights check)
WORSE = 0.05  # a figure this much worse than the previous record's is marked

PROFILES: dict[str, dict[str, Any]] = {
    "full": dict(models=["llama-3.2-1b", "qwen2.5-0.5b", "llama-3.1-8b"], hf_models=["llama-3.2-1b"],
                 batches=[1, 8, 32, 64], hf_batches=[1, 8, 64], new_tokens=256, prompt_tokens=128,
                 ttft_prompts=[128, 2048, 8192], reps=3, copy_bytes=2 << 30, copy_reps=20, kv_cache_memory="4GiB",
                 quantized=["llama-3.2-1b"], quant_batches=[1, 8]),
    "smoke": dict(models=["tiny-llama3"], hf_models=["tiny-llama3"], batches=[1, 2], hf_batches=[1, 2], new_tokens=8,
                  prompt_tokens=16, ttft_prompts=[16, 64, 256], reps=3, copy_bytes=64 << 20, copy_reps=5,
                  kv_cache_memory="64MiB", quantized=["tiny-llama3"], quant_batches=[1]),
}


T = TypeVar("T")


def rounds(items: list[T], reps: int) -> Iterator[T]:
    """`reps` rounds over items, each in the reverse order of the one before (1 8 32 64 64 32 8 1 ...)."""
    for k in range(reps):
        yield from (items if k % 2 == 0 else items[::-1])


def spread(runs: list[float], digits: int = 2) -> dict[str, Any]:
    """A row's value (the median), min, max and runs."""
    return dict(value=round(statistics.median(runs), digits), min=round(min(runs), digits),
                max=round(max(runs), digits), runs=[round(r, digits) for r in runs])


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class Row:
    model: str
    system: str  # one of SYSTEMS
    metric: str  # one of METRICS
    batch: int
    prompt_tokens: int
    value: float  # the median of runs
    floor_fraction: float | None  # 1.0 is the floor; None where no floor applies (ttft)
    min: float | None = None
    max: float | None = None
    runs: list[float] | None = None  # in the order taken (kv_bytes: one reading, no runs)


@dataclass
class Decode:
    """One decode measurement: what the timed steps did."""

    tokens: int  # sampled in the timed steps, all sequences together
    seconds: float
    batch: int
    mean_context: float  # mean KV length (tokens) each sequence's attention read per timed step

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class Floor:
    """The least a decode step must move through device memory, and how fast memory moves."""

    bytes_per_s: float
    weight_bytes: int  # every parameter once (a tied embedding is one tensor)
    kv_bytes_per_token: int

    def fraction(self, d: Decode) -> float:
        step_bytes = self.weight_bytes + d.batch * d.mean_context * self.kv_bytes_per_token
        steps_per_s = d.tok_s / d.batch
        return step_bytes / self.bytes_per_s * steps_per_s


def model_floor(shape: str, dtype: torch.dtype, bytes_per_s: float) -> Floor:
    cfg = model_config(RANDOM_PREFIX + shape)
    weights = sum(math.prod(s) for s in checkpoint_tensor_shapes(cfg).values()) * dtype.itemsize
    return Floor(bytes_per_s, weights, cfg.kv_bytes_per_token(dtype.itemsize))


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    """Bytes read + written per second by one large device-to-device copy (median of reps)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)  # not zeros: see METHOD.md
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            dst.copy_(src)
            end.record()
        sync(device)
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def random_prompts(seed: int, batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


# ---- minillm ------------------------------------------------------------------------------------


def minillm_decode(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, cap_s: float,
                   device: torch.device) -> Decode:
    """Time the decode steps of len(prompts) greedy requests (their prefill steps run untimed first)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while any(r.first_token_time is None for r in requests):
        engine.step()
    seqs = [r.sequences[0] for r in requests]
    context_before = statistics.fmean(s.num_tokens for s in seqs)
    sampled_before = engine.generation_tokens_total
    sync(device)
    start = time.perf_counter()
    done = False
    # Stop at the first finished request: every timed step then decodes the whole batch.
    while not done and engine.has_unfinished() and time.perf_counter() - start < cap_s:
        done = any(out.finished for out in engine.step())
    sync(device)
    seconds = time.perf_counter() - start
    context_after = statistics.fmean(s.num_tokens for s in seqs)
    tokens = engine.generation_tokens_total - sampled_before
    for r in requests:
        engine.abort(r.request_id)
    # A step reads each sequence's KV up to and including the token it computes.
    return Decode(tokens, seconds, len(prompts), (context_before + context_after - 1) / 2)


def minillm_ttft(engine: LLMEngine, prompt: list[int], device: torch.device) -> tuple[float, int]:
    """Seconds from add_request to the moment the engine holds the first sampled token of one
    request alone on the host (the step launched after it is not waited for), and the KV blocks it
    holds then."""
    if engine.has_unfinished():
        raise RuntimeError("TTFT needs an idle engine")
    sync(device)
    start = time.monotonic()  # the clock of request.first_token_time
    request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while request.first_token_time is None:
        engine.step()
    seconds = request.first_token_time - start
    sync(device)
    blocks = engine.block_manager.num_used_blocks
    engine.abort(request.request_id)
    return seconds, blocks


# ---- transformers -------------------------------------------------------------------------------


class DecodeClock(LogitsProcessor):
    """Starts the decode clock: generate() first calls its logits processors on the prefill's logits."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.start is None:
            sync(self.device)
            self.start = time.perf_counter()
        return scores


class DecodeCap(StoppingCriteria):
    """Ends generate() once decoding has run cap_s seconds, as minillm's measurement does."""

    def __init__(self, clock: DecodeClock, cap_s: float) -> None:
        self.clock, self.cap_s = clock, cap_s

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        stop = self.clock.start is not None and time.perf_counter() - self.clock.start >= self.cap_s
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def build_hf_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int) -> transformers.PreTrainedModel:
    """transformers' model of the shape, holding exactly minillm's random weights."""
    cfg = shape_config(shape)
    hf_config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.eval().requires_grad_(False)
    params = dict(model.named_parameters())  # a tied lm_head is the embedding, listed once
    copied = set()
    with torch.no_grad():
        for name, tensor in random_tensors(model_config(RANDOM_PREFIX + shape), seed, device):
            params[name].copy_(tensor)
            copied.add(name)
    if copied != set(params):
        raise RuntimeError(f"weights not copied into transformers' model: {sorted(set(params) - copied)[:5]}")
    model.generation_config.eos_token_id = None  # ignore_eos, as for minillm
    return model


def check_same_weights(model: transformers.PreTrainedModel, prompt: list[int], tokens: list[int]) -> None:
    """Teacher-force minillm's greedy tokens through transformers: each should be (nearly) its argmax."""
    ids = torch.tensor([prompt + tokens], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    ours = torch.tensor(tokens, device=model.device)
    gap = (logits.max(-1).values - logits.gather(1, ours[:, None])[:, 0]).max().item()
    agree = int((logits.argmax(-1) == ours).sum())
    spread = logits.std().item()
    log(f"  same-weights check: transformers' argmax is minillm's token at {agree}/{len(tokens)} positions; "
        f"largest logit gap {gap:.4f} (logit std {spread:.3f})")
    if gap > 0.5 * spread:  # rounding moves logits by a few % of their spread; other weights, by several
        raise RuntimeError("transformers does not reproduce minillm's greedy tokens: are the weights the same?")


def hf_decode(model: transformers.PreTrainedModel, prompts: list[list[int]], new_tokens: int, cap_s: float,
              cache: transformers.Cache | None = None, compile_config: Any = None) -> Decode:
    """One generate() over the batch (equal-length prompts, no padding); times its decode steps."""
    ids = torch.tensor(prompts, device=model.device)
    clock = DecodeClock(ids.device)
    kwargs: dict[str, Any] = {}
    if cache is not None:
        cache.reset()  # in place: the compiled step's static addresses stay valid
        kwargs["past_key_values"] = cache
    if compile_config is not None:
        kwargs["compile_config"] = compile_config
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
                             stopping_criteria=StoppingCriteriaList([DecodeCap(clock, cap_s)]), **kwargs)
    sync(ids.device)
    seconds = time.perf_counter() - clock.start
    generated = out.shape[1] - ids.shape[1]
    return Decode((generated - 1) * len(prompts), seconds, len(prompts), ids.shape[1] + generated / 2)


def hf_static_setup(model: transformers.PreTrainedModel, prompts: list[list[int]], new_tokens: int,
                    cap_s: float) -> tuple[transformers.StaticCache, Any]:
    """A StaticCache for this batch and (on CUDA) the decode forward compiled with CUDA graphs
    (transformers 5's auto-compile: mode reduce-overhead, here fullgraph and static shapes), compiled
    and recorded by a short generate(); the timed runs reuse both."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=len(prompts[0]) + new_tokens)
    compile_config = None
    if model.device.type == "cuda":
        compile_config = transformers.CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
    t = time.perf_counter()
    hf_decode(model, prompts, min(new_tokens, 8), cap_s, cache, compile_config)
    log(f"  compile + warm-up: {time.perf_counter() - t:.1f} s")
    return cache, compile_config


def hf_static_decode(model: transformers.PreTrainedModel, prompts: list[list[int]], new_tokens: int,
                     cap_s: float) -> Decode:
    """One timed static-cache decode after its compile and warm-up (hf_static_setup)."""
    return hf_decode(model, prompts, new_tokens, cap_s, *hf_static_setup(model, prompts, new_tokens, cap_s))


# ---- the run ------------------------------------------------------------------------------------


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def host_info() -> dict[str, Any]:
    """The CPU's model and the median time of a fixed pure-Python workload (5 runs): records taken on
    hosts of different speed say so beside their host-bound figures."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    times = []
    for _ in range(5):
        t = time.perf_counter()
        table: dict[int, int] = {}
        for i in range(300_000):  # dict and int work, like a scheduler's
            table[i % 1024] = table.get(i % 1024, 0) + i
        times.append(time.perf_counter() - t)
    return {"cpu": cpu, "python_loop_ms": round(1000 * statistics.median(times), 2)}


class Bench:
    """Rows, the JSON file they are saved to after every section, and the sections' clock."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.date = datetime.date.today().isoformat()
        self.commit = git_commit()
        self.floor_bytes_per_s: float | None = None
        self.host = host_info()  # the host's speed moves every host-bound figure (TTFT, batch 64, transformers)
        self.rows: list[Row] = []
        self.timings: list[tuple[str, float]] = []
        self.failed: list[str] = []
        self.skipped: list[str] = []
        self.time = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.comparison: dict[str, Any] | None = None  # against the previous record (compare_with_previous)
        if args.out is None:
            args.out = ROOT / "bench" / "results" / f"{self.date}-{slug(self.gpu)}{'-smoke' if args.smoke else ''}.json"

    def section(self, name: str, fn: Callable[..., Any], *fn_args: Any) -> Any:
        """Run one part of the benchmark: skipped past the time budget; a failure is logged, not fatal."""
        if time.perf_counter() - START > self.args.budget_s:
            log(f"[skip] {name}: past the {self.args.budget_s:.0f} s budget")
            self.skipped.append(name)
            return None
        log(f"[start] {name}")
        t = time.perf_counter()
        try:
            return fn(*fn_args)
        except Exception:  # one broken part must not cost the rest of a device run
            log(traceback.format_exc())
            self.failed.append(name)
            return None
        finally:
            self.timings.append((name, time.perf_counter() - t))
            log(f"[done] {name}: {time.perf_counter() - t:.1f} s (run total {time.perf_counter() - START:.1f} s)")
            self.save()

    def add(self, row: Row) -> None:
        self.rows.append(row)
        frac = "" if row.floor_fraction is None else f", {100 * row.floor_fraction:.1f}% of floor"
        log(f"  {row.system} {row.metric} batch {row.batch} prompt {row.prompt_tokens}: {row.value:,.2f}{frac}")

    def add_decode(self, model: str, system: str, runs: list[Decode], floor: Floor | None) -> None:
        """One decode row from its repetitions: the median, with the floor fraction of the median run."""
        for d in runs:
            log(f"  batch {d.batch}: {d.tokens} tokens in {d.seconds:.3f} s = {d.tok_s:,.1f} tok/s, "
                f"mean context {d.mean_context:.0f}")
        middle = sorted(runs, key=lambda d: d.tok_s)[(len(runs) - 1) // 2]
        fraction = floor.fraction(middle) if floor else None
        self.add(Row(model, system, "decode_tok_s", middle.batch, self.args.prompt_tokens,
                     floor_fraction=None if fraction is None else round(fraction, 5),
                     **spread([d.tok_s for d in runs])))

    def save(self) -> None:
        doc = {"bench": "gpu", "gpu": self.gpu, "date": self.date, "time": self.time, "commit": self.commit,
               "partial": self.args.partial, "reps": self.args.reps, "floor_bytes_per_s": self.floor_bytes_per_s,
               "host": self.host, "rows": [asdict(r) for r in self.rows], "comparison": self.comparison,
               "failed": self.failed, "skipped": self.skipped}
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(doc, indent=2) + "\n")


def estimate_s(args: argparse.Namespace, device: torch.device) -> float:
    """A rough upper guess of the run's length, for the log: each decode measurement is capped."""
    per_model = (len(args.batches) * (args.reps + 1) * args.decode_cap_s / 3 + len(args.ttft_prompts) * args.reps
                 + 30)  # decode rounds (most end well before the cap), TTFT, load and capture
    total = 30 + len(args.models) * per_model
    total += len(args.quantized or []) * 3 * (20 + len(args.quant_batches) * (args.reps + 1) * args.decode_cap_s / 3)
    if not args.skip_transformers:  # per batch: a compile, then the rounds
        compile_s = COMPILE_GUESS_S if device.type == "cuda" else 0.0
        total += len(args.hf_models) * (len(args.hf_batches) * (compile_s + args.reps * args.decode_cap_s / 3) + 10)
    return total


def decode_rounds(bench: Bench, engine: LLMEngine, batches: list[int]) -> dict[int, list[Decode]]:
    """Each batch warmed up once, then --reps rounds over the batches (alternating order)."""
    args, device = bench.args, bench.device
    vocab = engine.model_config.vocab_size
    for batch in batches:  # other prompts, a few tokens: graphs, allocator and caches at this batch
        minillm_decode(engine, random_prompts(args.seed + 1000 + batch, batch, args.prompt_tokens, vocab),
                       min(args.new_tokens, 4), args.decode_cap_s, device)
    runs: dict[int, list[Decode]] = {b: [] for b in batches}
    for batch in rounds(batches, args.reps):
        runs[batch].append(minillm_decode(engine, random_prompts(args.seed + batch, batch, args.prompt_tokens, vocab),
                                          args.new_tokens, args.decode_cap_s, device))
    return runs


def bench_minillm(bench: Bench, shape: str, floor: Floor | None) -> list[int] | None:
    """minillm's rows for one model; returns its greedy tokens for the same-weights check."""
    args, device = bench.args, bench.device
    model = RANDOM_PREFIX + shape
    engine: LLMEngine | None = bench.section(f"{shape} minillm: load and warm up", lambda: _engine(args, device, model))
    if engine is None:
        return None

    def decode() -> None:
        for batch, runs in decode_rounds(bench, engine, args.batches).items():
            bench.add_decode(model, "minillm", runs, floor)
    bench.section(f"{shape} minillm: decode at batches {args.batches}, {args.reps} rounds", decode)
    bench.section(f"{shape} minillm: TTFT and KV bytes", lambda: _ttft_rows(bench, engine, model))
    vocab = engine.model_config.vocab_size
    check_prompt = random_prompts(args.seed, 1, args.prompt_tokens, vocab)[0]
    tokens = bench.section(f"{shape} minillm: greedy tokens for the same-weights check", lambda: engine.generate(
        [check_prompt], SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS, ignore_eos=True))[0].token_ids)
    del engine
    release(device)
    return tokens


def _engine(args: argparse.Namespace, device: torch.device, model: str, quantization: str | None = None) -> LLMEngine:
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device=str(device), weights_seed=args.seed,
                                    kv_cache_memory=args.kv_cache_memory,
                                    max_num_seqs=max([*args.batches, *args.quant_batches]),  # the quantized runs too
                                    quantization=quantization))
    engine.warm_up()
    return engine


def _ttft_rows(bench: Bench, engine: LLMEngine, model: str) -> None:
    args, device = bench.args, bench.device
    vocab = engine.model_config.vocab_size
    seed = args.seed + 10_000  # a fresh prompt every run: the prefix cache must not hit
    lengths = args.ttft_prompts
    for length in lengths:  # warm-up
        seed += 1
        minillm_ttft(engine, random_prompts(seed, 1, length, vocab)[0], device)
    runs: dict[int, list[tuple[float, int]]] = {n: [] for n in lengths}
    for length in rounds(lengths, args.reps):
        seed += 1
        runs[length].append(minillm_ttft(engine, random_prompts(seed, 1, length, vocab)[0], device))
    for length in lengths:
        log(f"  TTFT {length} tokens, runs (ms): {', '.join(f'{s * 1e3:.1f}' for s, _ in runs[length])}")
        bench.add(Row(model, "minillm", "ttft_ms", 1, length, floor_fraction=None,
                      **spread([s * 1e3 for s, _ in runs[length]], 3)))
    length = max(lengths)
    blocks = runs[length][-1][1]
    value = blocks * engine.kv_bytes_per_block
    theory = length * engine.model_config.kv_bytes_per_token(engine.model.embed_tokens.weight.dtype.itemsize)
    verdict = "within" if value <= theory + engine.kv_bytes_per_block else "OVER"
    log(f"  KV at {length} tokens: {blocks} blocks = {value:,} B; theory {theory:,} B; "
        f"{verdict} theory + one block ({engine.kv_bytes_per_block:,} B)")
    bench.add(Row(model, "minillm", "kv_bytes", 1, length, value, round(theory / value, 5)))


def int4_checkpoint(shape: str, seed: int, device: torch.device, out: Path, lm_head: bool = False) -> Path:
    """The random weights of `shape`, round-to-nearest INT4 in AutoAWQ's layout, as a checkpoint
    directory: what `minillm quantize --method rtn [--lm-head]` writes for a real model."""
    decoder = load_model(RANDOM_PREFIX + shape, torch.float32, device, seed=seed)
    group_size = default_group_size(decoder.cfg)  # 128 where the shapes allow
    head = (lm_head_weight(decoder), None) if lm_head else None
    out.mkdir(parents=True, exist_ok=True)
    save_file(export_awq(decoder, group_size, lm_head=head), str(out / "model.safetensors"))
    config = shape_config(shape) | {"quantization_config": awq_quantization_config(group_size, lm_head),
                                    "torch_dtype": "float16"}
    (out / "config.json").write_text(json.dumps(config))
    del decoder
    release(device)
    return out


def weight_floor(engine: LLMEngine, bytes_per_s: float) -> Floor:
    """The floor of a loaded (quantized) model: every parameter and buffer byte it holds, read once
    (but for a float embedding beside an int4 lm_head: only looked up, a row a token)."""
    model = engine.model
    lookup_only = model.embed_tokens.weight if isinstance(model.lm_head, Int4Linear) else None
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
                  if t is not model.inv_freq and t is not lookup_only)
    return Floor(bytes_per_s, weights, engine.model_config.kv_bytes_per_token(model.embed_tokens.weight.element_size()))


def bench_quantized(bench: Bench, shape: str, tmp: Path) -> None:
    """FP8 (quantized as it loads) and INT4 (an RTN checkpoint) decode at the quantized batches."""
    args, device = bench.args, bench.device
    model = RANDOM_PREFIX + shape
    int4_dir = bench.section(f"{shape} int4: write an RTN checkpoint",
                             lambda: int4_checkpoint(shape, args.seed, device, tmp / "int4"))
    head_dir = bench.section(f"{shape} int4 with an int4 lm_head: write an RTN checkpoint",
                             lambda: int4_checkpoint(shape, args.seed, device, tmp / "int4-lm-head", lm_head=True))
    for system, source, quantization in (("minillm-fp8", model, "fp8"), ("minillm-int4", int4_dir, None),
                                         ("minillm-int4-lm-head", head_dir, None)):
        if source is None:
            continue
        engine = bench.section(f"{shape} {system}: load and warm up",
                               lambda: _engine(args, device, str(source), quantization))
        if engine is None:
            continue
        floor = weight_floor(engine, bench.floor_bytes_per_s) if bench.floor_bytes_per_s else None

        def decode(engine: LLMEngine = engine, system: str = system, floor: Floor | None = floor) -> None:
            for batch, runs in decode_rounds(bench, engine, args.quant_batches).items():
                bench.add_decode(model, system, runs, floor)
        bench.section(f"{shape} {system}: decode at batches {args.quant_batches}, {args.reps} rounds", decode)
        del engine
        release(device)


def bench_transformers(bench: Bench, shape: str, floor: Floor | None, check_tokens: list[int] | None) -> None:
    args, device = bench.args, bench.device
    model_name = RANDOM_PREFIX + shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = bench.section(f"{shape} transformers: build with minillm's weights",
                       lambda: build_hf_model(shape, dtype, device, args.seed))
    if hf is None:
        return
    vocab = hf.config.vocab_size
    if check_tokens is not None:
        check_prompt = random_prompts(args.seed, 1, args.prompt_tokens, vocab)[0]
        bench.section(f"{shape} transformers: same-weights check",
                      lambda: check_same_weights(hf, check_prompt, check_tokens))
    if device.type != "cuda":
        log("  (no CUDA: transformers-static runs its static cache uncompiled)")
    prompts = {b: random_prompts(args.seed + b, b, args.prompt_tokens, vocab) for b in args.hf_batches}
    static: dict[int, tuple[transformers.StaticCache, Any]] = {}
    for batch in args.hf_batches:
        setup = bench.section(f"{shape} transformers-static: compile at batch {batch}",
                              lambda b=batch: hf_static_setup(hf, prompts[b], args.new_tokens, args.decode_cap_s))
        if setup is not None:
            static[batch] = setup

    def static_rounds() -> None:
        runs: dict[int, list[Decode]] = {b: [] for b in static}
        for batch in rounds(list(static), args.reps):
            runs[batch].append(hf_decode(hf, prompts[batch], args.new_tokens, args.decode_cap_s, *static[batch]))
        for batch in static:
            bench.add_decode(model_name, "transformers-static", runs[batch], floor)
    if static:
        bench.section(f"{shape} transformers-static: decode at batches {list(static)}, {args.reps} rounds",
                      static_rounds)

    def dynamic_rounds() -> None:
        for batch in args.hf_batches:
            hf_decode(hf, prompts[batch], min(args.new_tokens, 4), args.decode_cap_s)  # warm-up at this batch
        runs: dict[int, list[Decode]] = {b: [] for b in args.hf_batches}
        for batch in rounds(args.hf_batches, args.reps):
            runs[batch].append(hf_decode(hf, prompts[batch], args.new_tokens, args.decode_cap_s))
        for batch in args.hf_batches:
            bench.add_decode(model_name, "transformers-dynamic", runs[batch], floor)
    if args.hf_dynamic:
        bench.section(f"{shape} transformers-dynamic: decode at batches {args.hf_batches}, {args.reps} rounds",
                      dynamic_rounds)
    static.clear()
    del hf
    torch._dynamo.reset()  # drop this model's compiled graphs before the next model
    release(device)


def markdown_table(rows: list[Row], models: list[str]) -> str:
    static = {(r.model, r.batch): r.value for r in rows
              if r.system == "transformers-static" and r.metric == "decode_tok_s"}

    def key(r: Row) -> tuple:
        return (models.index(r.model) if r.model in models else 99, METRICS.index(r.metric), r.prompt_tokens, r.batch,
                SYSTEMS.index(r.system))

    lines = ["| model | system | metric | batch | prompt tokens | value | % of floor | × transformers-static |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=key):
        value = f"{r.value / 2**20:,.1f} MiB" if r.metric == "kv_bytes" else f"{r.value:,.1f}"
        frac = "" if r.floor_fraction is None else f"{100 * r.floor_fraction:.1f}%"
        times = ""
        if r.metric == "decode_tok_s" and r.system != "transformers-static" and (r.model, r.batch) in static:
            times = f"{r.value / static[(r.model, r.batch)]:.2f}"
        cells = (r.model, r.system, r.metric, r.batch, r.prompt_tokens, value, frac, times)
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def with_profile(args: argparse.Namespace, profiles: dict[str, dict[str, Any]]) -> argparse.Namespace:
    """Options left unset take the run's profile's values ("smoke" with --smoke, else "full")."""
    for key, value in profiles["smoke" if args.smoke else "full"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    names = lambda s: [x.removeprefix(RANDOM_PREFIX) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=names,
                   help="shape names, comma-separated (default llama-3.2-1b,qwen2.5-0.5b,llama-3.1-8b)")
    p.add_argument("--hf-models", type=names, help="shapes transformers runs too (default llama-3.2-1b)")
    p.add_argument("--batches", type=ints, help="minillm decode batches (default 1,8,32,64)")
    p.add_argument("--hf-batches", type=ints, help="transformers decode batches (default 1,8,64)")
    p.add_argument("--new-tokens", type=int, help="new tokens per decode request (default 256)")
    p.add_argument("--prompt-tokens", type=int, help="prompt tokens per decode request (default 128)")
    p.add_argument("--ttft-prompts", type=ints,
                   help="TTFT prompt lengths; KV is read at the largest (default 128,2048,8192)")
    p.add_argument("--reps", type=int, help="repetitions of every figure, median taken (default 3)")
    p.add_argument("--decode-cap-s", type=float, default=3.0, help="stop timing a decode after this (default 3)")
    p.add_argument("--budget-s", type=float, default=520.0,
                   help="start no section after this many seconds of the run (default 520)")
    p.add_argument("--kv-cache-memory", help="minillm's KV pool (default 4GiB; smoke 64MiB)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts seed")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--hf-dynamic", action="store_true", help="also transformers' dynamic cache (not in the record)")
    p.add_argument("--compare", type=Path,
                   help="the record to compare with (default: the newest full record of this GPU in bench/results)")
    p.add_argument("--quantized", type=names, help="shapes to also run as FP8 and INT4 (default llama-3.2-1b; '' for none)")
    p.add_argument("--quant-batches", type=ints, help="decode batches of the quantized runs (default 1,8)")
    p.add_argument("--smoke", action="store_true", help="tiny shape, small batches, few tokens: checks the script")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/<date>-<gpu>.json)")
    args = p.parse_args(argv)
    # The record is the full matrix: any option that narrows it makes a partial run (an A/B, never compared with).
    args.partial = args.smoke or args.skip_transformers or any(
        getattr(args, k, None) not in (None, v) for k, v in PROFILES["full"].items())
    args = with_profile(args, PROFILES)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2: the first token comes from the prefill")
    if args.reps < 1:
        p.error("--reps must be at least 1")
    return args


# ---- against the previous record ------------------------------------------------------------------

LOWER_IS_BETTER = ("ttft_ms", "kv_bytes")
RECORD_NAME = re.compile(r"\d{4}-\d{2}-\d{2}-[a-z0-9]+\.json")  # records from before "bench": "gpu": <date>-h200.json


def previous_record(results: Path, gpu: str, exclude: Path | None = None) -> Path | None:
    """The newest full bench/gpu.py record of this GPU in `results` (by date, then time, then name)."""
    best: tuple[tuple[str, str, str], Path] | None = None
    for path in results.glob("*.json"):
        if exclude is not None and path.resolve() == exclude.resolve():
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (not isinstance(doc, dict) or doc.get("gpu") != gpu or doc.get("partial") or doc.get("failed")
                or doc.get("skipped") or not isinstance(doc.get("rows"), list)):
            continue  # another GPU's, an A/B, or a run that lost sections: not a record
        if doc.get("bench") != "gpu" and not ("bench" not in doc and RECORD_NAME.fullmatch(path.name)):
            continue
        key = (str(doc.get("date", "")), str(doc.get("time", "")), path.name)
        if best is None or key > best[0]:
            best = (key, path)
    return None if best is None else best[1]


KEY_FIELDS = ("model", "system", "metric", "batch", "prompt_tokens")  # one figure of the matrix


def row_key(r: dict[str, Any]) -> tuple:
    return tuple(r[f] for f in KEY_FIELDS)


def compare(previous: dict[str, Any], rows: list[Row]) -> list[dict[str, Any]]:
    """Each figure both runs have: the previous value, this one, the change, and whether it is more
    than WORSE worse (lower tok/s; higher TTFT or KV bytes)."""
    before = {row_key(r): r["value"] for r in previous["rows"]}
    out = []
    for r in rows:
        key = row_key(asdict(r))
        old = before.get(key)
        if not old:
            continue
        change = r.value / old - 1
        worse = change > WORSE if r.metric in LOWER_IS_BETTER else change < -WORSE
        out.append({**dict(zip(KEY_FIELDS, key)), "previous": old, "value": r.value, "change": round(change, 4),
                    "worse": worse})
    return out


def compare_with_previous(bench: Bench) -> str:
    """Fill bench.comparison against the previous record and return its markdown (empty if none)."""
    path = bench.args.compare or previous_record(ROOT / "bench" / "results", bench.gpu, exclude=bench.args.out)
    if path is None:
        log("no previous record of this GPU in bench/results to compare with")
        return ""
    previous = json.loads(Path(path).read_text())
    changes = compare(previous, bench.rows)
    worse = [c for c in changes if c["worse"]]
    missing = sorted({row_key(r) for r in previous["rows"]} - {row_key(asdict(r)) for r in bench.rows})
    bench.comparison = {"file": Path(path).name, "commit": previous.get("commit"), "date": previous.get("date"),
                        "changes": changes, "worse": len(worse), "missing": [list(k) for k in missing]}
    before_host = previous.get("host") or {}
    lines = [f"Against {Path(path).name} (commit {previous.get('commit')}, {previous.get('date')}): "
             f"{len(worse)} of {len(changes)} figures more than {WORSE:.0%} worse"
             + (f"; {len(missing)} of its figures not measured now" if missing else ""), "",
             f"Host: {bench.host['cpu']}, Python loop {bench.host['python_loop_ms']} ms; the previous record's: "
             f"{before_host.get('cpu', 'not recorded')}, {before_host.get('python_loop_ms', '-')} ms", "",
             "| model | system | metric | batch | prompt tokens | previous | now | change |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for c in changes:
        mark = " **worse**" if c["worse"] else ""
        lines.append(f"| {c['model']} | {c['system']} | {c['metric']} | {c['batch']} | {c['prompt_tokens']} | "
                     f"{c['previous']:,.1f} | {c['value']:,.1f} | {c['change']:+.1%}{mark} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        for knob in ("recompile_limit", "cache_size_limit"):  # one compiled decode step per model and batch
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 64)
    # transformers 5.2x renames generate's past_key_values to cache; the GPU machine's 5.17 knows only the old name.
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
    bench = Bench(args, device)
    log(f"bench/gpu.py on {bench.gpu} ({device}, {str(dtype).removeprefix('torch.')}), torch {torch.__version__}, "
        f"transformers {transformers.__version__}, commit {bench.commit}; JSON to {args.out}")
    log(f"plan{' (partial)' if args.partial else ''}: {', '.join(args.models)}; minillm batches {args.batches}; "
        f"{args.reps} repetitions; transformers "
        f"{'skipped' if args.skip_transformers else f'{args.hf_models} at {args.hf_batches}'}; {args.prompt_tokens}-token prompts, "
        f"{args.new_tokens} new tokens (decode timing capped at {args.decode_cap_s:.0f} s); TTFT at {args.ttft_prompts}")
    log(f"estimate: at most about {estimate_s(args, device):.0f} s (each torch.compile guessed at "
        f"{COMPILE_GUESS_S:.0f} s); no section starts after {args.budget_s:.0f} s")

    def floor() -> None:
        bench.floor_bytes_per_s = copy_bandwidth(device, args.copy_bytes, args.copy_reps)
        log(f"  copy bandwidth {bench.floor_bytes_per_s / 1e12:.3f} TB/s "
            f"(read + write, {args.copy_bytes / 2**30:.2f} GiB)")

    bench.section("copy-bandwidth floor", floor)
    floors = {s: model_floor(s, dtype, bench.floor_bytes_per_s) if bench.floor_bytes_per_s else None
              for s in args.models}
    check_tokens = {}
    for shape in args.models:
        if floors[shape]:
            f = floors[shape]
            log(f"{shape}: {f.weight_bytes / 1e9:.3f} GB of weights, {f.kv_bytes_per_token:,} KV bytes per token; "
                f"floor {f.bytes_per_s / f.weight_bytes:,.0f} tok/s at batch 1 (weights only)")
        check_tokens[shape] = bench_minillm(bench, shape, floors[shape])
    if args.quantized:
        for shape in args.quantized:
            with tempfile.TemporaryDirectory() as tmp:
                bench_quantized(bench, shape, Path(tmp))
    if not args.skip_transformers:
        for shape in args.hf_models:
            floor = floors.get(shape) or (model_floor(shape, dtype, bench.floor_bytes_per_s)
                                          if bench.floor_bytes_per_s else None)
            bench_transformers(bench, shape, floor, check_tokens.get(shape))

    comparison = "" if args.partial and args.compare is None else compare_with_previous(bench)
    bench.save()
    log("sections (s): " + "; ".join(f"{name} {s:.1f}" for name, s in bench.timings))
    log(f"total {time.perf_counter() - START:.1f} s; failed: {bench.failed or 'none'}; "
        f"skipped: {bench.skipped or 'none'}")
    floor_text = f"{bench.floor_bytes_per_s / 1e12:.2f} TB/s" if bench.floor_bytes_per_s else "not measured"
    print(f"\n{bench.gpu}, torch {torch.__version__}, transformers {transformers.__version__}, commit {bench.commit}, "
          f"{bench.date}; copy floor {floor_text}; decode: {args.prompt_tokens}-token prompts, up to {args.new_tokens} "
          f"new tokens, timed ≤ {args.decode_cap_s:.0f} s\n")
    print(markdown_table(bench.rows, [RANDOM_PREFIX + s for s in args.models]), flush=True)
    if comparison:
        print("\n" + comparison, flush=True)
    elif args.partial:
        print("\n(a partial run: not compared with the record)", flush=True)
    return 1 if bench.failed else 0


if __name__ == "__main__":
    sys.exit(main())
