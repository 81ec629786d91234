"""Serving benchmark: replay concurrent streaming chat requests against an OpenAI-compatible server.

`--users` clients share one connection pool and together send `--requests` streaming
/v1/chat/completions requests with a seeded mix of prompt lengths, then report time to first token,
inter-token latency, output tokens/s and errors. Needs only the standard library and httpx (orjson
if present), so it runs on any machine that can reach the server; it never imports app/ or engine/.

    python bench/serve.py --url http://127.0.0.1:8000 --model default --users 16 --requests 64

Inter-token latency (ITL) is measured per SSE content chunk: a server may put several tokens in one
chunk, in which case ITL is the gap between chunks, not between tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import httpx

try:
    import orjson

    _loads: Callable[[Any], Any] = orjson.loads

    def _dumps(obj: Any, indent: bool = False) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_INDENT_2 if indent else 0)
except ImportError:  # GPU machines may lack orjson; json is just slower
    import json

    _loads = json.loads

    def _dumps(obj: Any, indent: bool = False) -> bytes:
        return json.dumps(obj, indent=2 if indent else None).encode()


# Approximate prompt sizes in words (~1.3 tokens each); a plain integer in the mix is a token count.
PROMPT_WORDS = {"short": 12, "medium": 120, "long": 1200}

_TOPICS = ["a paged KV cache", "continuous batching", "the water cycle", "a hash table", "inflation",
           "photosynthesis", "a lighthouse keeper", "the printing press", "plate tectonics",
           "a bicycle", "compound interest", "the immune system", "a suspension bridge", "jazz"]
_SUBJECTS = ["The committee", "Every engineer", "The old report", "A careful reader", "The system",
             "Our team", "The first draft", "The village council", "Most students", "The new design"]
_VERBS = ["reviewed", "described", "questioned", "measured", "rebuilt", "explained", "compared",
          "ignored", "documented", "simplified", "tested", "praised"]
_OBJECTS = ["the budget for the coming year", "how the scheduler admits new requests",
            "the river that floods every spring", "the cost of keeping old machines running",
            "a plan to move the archive to the north wing", "the results of the last experiment",
            "the way memory is shared between tasks", "the long delays at the harbour",
            "a shorter route across the mountains", "the rules for borrowing rare books"]
_CLAUSES = ["before the meeting ended", "although nobody had asked", "with surprising patience",
            "after a long winter", "because the numbers did not add up", "in under an hour",
            "while the rain kept falling", "for the third time that week"]
_QUESTIONS = ["Explain {t} to a new colleague.", "What are the main trade-offs of {t}?",
              "Give three surprising facts about {t}.", "How would you teach {t} in ten minutes?"]


def make_prompt(kind: str, rng: random.Random) -> str:
    """A user message of the given size ('short', 'medium', 'long' or a token count), drawn from rng."""
    words = PROMPT_WORDS[kind] if kind in PROMPT_WORDS else int(int(kind) / 1.3)
    question = rng.choice(_QUESTIONS).format(t=rng.choice(_TOPICS))
    if words <= PROMPT_WORDS["short"]:
        return question
    paragraphs, sentences, count = [], [], 0
    while count < words:
        sentence = (f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                    f"{rng.choice(_CLAUSES)}.")
        sentences.append(sentence)
        count += len(sentence.split())
        if len(sentences) == 6:  # break long contexts into paragraphs, as real documents are
            paragraphs.append(" ".join(sentences))
            sentences = []
    if sentences:
        paragraphs.append(" ".join(sentences))
    return "Read the following notes.\n\n" + "\n\n".join(paragraphs) + f"\n\nThen: {question}"


@dataclass
class RequestResult:
    """What one streaming request saw; times are seconds from just before the request was sent."""

    ttft: Optional[float] = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    completion_tokens: int = 0
    error: Optional[str] = None  # HTTP status, "timeout", "stream_error", ... ; None on success


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100) with linear interpolation between ranks, as numpy's default."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


async def _stream_one(client: httpx.AsyncClient, endpoint: str, body: bytes,
                      result: RequestResult) -> None:
    """Send one request and fill result from its SSE stream."""
    start = time.perf_counter()
    usage_tokens: Optional[int] = None
    async with client.stream("POST", endpoint, content=body) as response:
        if response.status_code != 200:
            await response.aread()  # drain so the connection goes back to the pool
            result.error = str(response.status_code)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments (": ping"), event names
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = _loads(data)
            if "error" in chunk:  # an error raised mid-stream arrives as an SSE event, status 200
                result.error = "stream_error"
                return
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                now = time.perf_counter() - start
                if result.ttft is None:
                    result.ttft = now
                result.chunk_times.append(now)
        else:
            result.error = "no_done"  # the stream ended without [DONE]: the server cut it
            return
    result.completion_tokens = usage_tokens if usage_tokens is not None else len(result.chunk_times)


async def _one_request(client: httpx.AsyncClient, endpoint: str, body: bytes,
                       timeout: float) -> RequestResult:
    """One request with a whole-request deadline; any failure becomes result.error, never raises."""
    result = RequestResult()
    try:
        await asyncio.wait_for(_stream_one(client, endpoint, body, result), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        result.error = "timeout"
    except Exception as exc:  # a benchmark counts failures rather than stopping at the first
        result.error = type(exc).__name__
    return result


async def run(url: str, model: str, users: int, requests: int, max_tokens: int, *,
              api_key: Optional[str] = None, mix: Sequence[str] = ("short", "medium", "long"),
              seed: int = 0, temperature: float = 0.7, timeout: float = 120.0) -> dict[str, Any]:
    """Run the benchmark and return its summary (the keys that `--json` writes)."""
    rng = random.Random(seed)
    bodies = [_dumps({
        "model": model,
        "messages": [{"role": "user", "content": make_prompt(rng.choice(mix), rng)}],
        "max_tokens": max_tokens, "temperature": temperature, "stream": True,
        "stream_options": {"include_usage": True},
    }) for _ in range(requests)]
    endpoint = url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    results: list[RequestResult] = []
    next_index = itertools.count()  # shared by all users; safe since asyncio runs one task at a time

    async def user(client: httpx.AsyncClient) -> None:
        while (i := next(next_index)) < requests:
            results.append(await _one_request(client, endpoint, bodies[i], timeout))

    # One connection per user, so no request waits on the pool and skews TTFT.
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        await asyncio.gather(*(user(client) for _ in range(users)))
        wall = time.perf_counter() - start

    ok = [r for r in results if r.error is None]
    errors_by_status: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors_by_status[r.error] = errors_by_status.get(r.error, 0) + 1
    ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
    itls = [(b - a) * 1000 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    return {
        "users": users, "requests": requests, "errors": len(results) - len(ok),
        "errors_by_status": errors_by_status,
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
        "itl_p50_ms": percentile(itls, 50), "itl_p99_ms": percentile(itls, 99),
        "tok_s": sum(r.completion_tokens for r in ok) / wall,
        "req_s": len(ok) / wall,  # successful requests only: failures are fast and would flatter it
        "wall_s": wall,
    }


def format_table(summary: dict[str, Any]) -> str:
    """The summary as a one-row markdown table."""
    def fmt(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.1f}"

    header = ("| users | requests | errors | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
              "| output tok/s | req/s |")
    row = (f"| {summary['users']} | {summary['requests']} | {summary['errors']} "
           f"| {fmt(summary['ttft_p50_ms'])} | {fmt(summary['ttft_p99_ms'])} "
           f"| {fmt(summary['itl_p50_ms'])} | {fmt(summary['itl_p99_ms'])} "
           f"| {summary['tok_s']:.1f} | {summary['req_s']:.2f} |")
    return "\n".join([header, "|" + "---|" * 9, row])


def _mix(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    for kind in kinds:
        if kind not in PROMPT_WORDS and not (kind.isdigit() and int(kind) > 0):
            raise argparse.ArgumentTypeError(f"{kind!r}: use short, medium, long or a token count")
    if not kinds:
        raise argparse.ArgumentTypeError("empty mix")
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--model", required=True)
    parser.add_argument("--users", type=int, default=16, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=64, help="total requests over all users")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--prompt-tokens-mix", type=_mix, default=["short", "medium", "long"],
                        help="prompt sizes drawn uniformly per request: short, medium, long or a "
                             "token count; repeat one to weight it (default short,medium,long)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()
    if args.users < 1 or args.requests < 1:
        parser.error("--users and --requests must be at least 1")

    summary = asyncio.run(run(args.url, args.model, args.users, args.requests, args.max_tokens,
                              api_key=args.api_key, mix=args.prompt_tokens_mix, seed=args.seed,
                              temperature=args.temperature, timeout=args.timeout))
    print(f"{args.model} at {args.url}: max_tokens={args.max_tokens}, "
          f"mix={','.join(args.prompt_tokens_mix)}, wall {summary['wall_s']:.2f} s\n")
    print(format_table(summary))
    print("\nITL is per SSE content chunk; a chunk may carry more than one token.")
    if summary["errors_by_status"]:
        print(f"errors: {summary['errors_by_status']}", file=sys.stderr)
    if args.json:
        args.json.write_bytes(_dumps(summary, indent=True) + b"\n")


if __name__ == "__main__":
    main()
