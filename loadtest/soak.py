"""Soak test for minillm (or any server with its /metrics): a mixed workload for a fixed time, then
checks that the server went back to idle with nothing leaked.

    python loadtest/soak.py --url http://127.0.0.1:8000 --duration 10m [--api-key KEY] \\
        [--concurrency 8] [--out report.json]

The workload: chat and legacy completions, streamed and not, with random sampling params
(temperature, top_p, max_tokens, n, stop, logprobs, seed, include_usage), a shared system prompt on
some chats (so prefix-cache blocks are shared and released), clients that drop their stream at a
random point (before the headers, right after them, or after some events), and a few non-streamed
requests cancelled while the server works on them.

Every --sample-every seconds it reads /metrics: the server's RSS (process_resident_memory_bytes, or
the resident memory of --pid and its children read from /proc when the server does not export it),
minillm_kv_cache_used_bytes, minillm_requests_running and minillm_requests_waiting.

After the run it waits (up to --idle-timeout) for the server to go idle, then checks:
- idle: running = waiting = 0;
- kv_idle: KV bytes in use back to what they were when idle before the run;
- rss_growth: RSS at the end minus RSS at the run's midpoint at most --max-rss-growth-mib (default
  64 MiB: the first half absorbs warm-up and the allocator's growth, so what still grows in the
  second half is a leak; a flat CPU server drifts by tens of MiB either way, and a leak of a few
  KiB a request adds more than 64 MiB over the second half of a 10-minute GPU run);
- no_5xx: no 5xx seen by the client, nor counted by the server (minillm_http_requests_total, which
  also sees the 5xx of requests whose client had already left);
- responses_ok: every finished reply is well formed (all n choices finished, streams end with
  [DONE], no error events), no 4xx other than 429, no transport errors or timeouts we did not cause;
- served: at least one request succeeded; final_request: a plain chat succeeds at the end.
It prints a summary, writes the whole report (samples included) as JSON with --out, and exits 1 if
a check failed (2 if the server could not be reached at the start). A check whose metric the server
does not export is reported as skipped.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

MIB = 1024 * 1024
OK_FINISH = ("stop", "length")

_WORDS = ("the river cache batch engine token paper quiet silver market winter signal garden machine "
          "number harbour letter planet music theory bridge forest orbit engineer question").split()
_TOPICS = ("a paged KV cache", "continuous batching", "the water cycle", "a hash table", "inflation",
           "photosynthesis", "plate tectonics", "compound interest", "jazz", "the printing press")
# Shared by a third of the chats: their prompts begin with the same blocks, which the prefix cache
# shares between concurrent requests and must release when they end.
_SYSTEM = ("You are a careful assistant. Answer briefly and plainly. " * 12).strip()
_STOPS = ("\n\n", ".", " the", "###", "!", "\n")


@dataclass
class Sample:
    """One scrape of /metrics (None: the server does not export it, or the scrape failed)."""

    t: float  # seconds since the run started
    rss: float | None
    kv_used: float | None
    kv_capacity: float | None
    running: float | None
    waiting: float | None
    http_5xx: float | None  # the server's own count of 5xx responses so far
    scraped: bool = True  # False: /metrics did not answer (a dead server fails the checks, not skips them)


@dataclass
class Plan:
    """One request of the workload, and where (if anywhere) its client gives up."""

    kind: str  # "chat/stream", "completions/plain", ...
    path: str
    body: dict[str, Any]
    n: int
    cut_after_s: float | None = None  # give up after this many seconds, wherever the request is
    cut_after_events: int | None = None  # streams: give up after this many SSE events (0: right after the headers)
    headers_seen: bool = False  # where a timed cut landed: before the headers or mid-stream


@dataclass
class Tally:
    """What happened to the requests: outcome counts by kind, and where clients gave up."""

    outcomes: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    disconnects: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # the first few, for the report

    def add(self, kind: str, outcome: str, problem: str = "") -> None:
        self.outcomes[kind][outcome] += 1
        if problem and len(self.problems) < 20:
            self.problems.append(f"{kind}: {outcome}: {problem}")


def parse_duration(text: str) -> float:
    """'10m', '90s', '1m30s', '1h' or plain seconds -> seconds."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 10m, 90s, 1m30s)")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text format -> {name: [(labels, value), ...]}."""
    found: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        try:
            found[m.group(1)].append((labels, float(m.group(3))))
        except ValueError:
            continue
    return found


def process_tree_rss(pid: int) -> float | None:
    """Resident bytes of pid and all its descendants (Granian's main process, its worker and the
    worker's helpers), read from /proc: for a local server that does not export its RSS."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))  # comm may hold ") "
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        total += int(m.group(1)) * 1024 if m else 0
        todo.extend(children.get(p, []))
    return float(total) if total else None


def make_prompt(rng: random.Random) -> str:
    """A question, after a paragraph of filler words in about a quarter of cases (longer prefills)."""
    question = f"{rng.choice(('Explain', 'Describe', 'Give three facts about'))} {rng.choice(_TOPICS)}."
    if rng.random() < 0.25:
        filler = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(50, 400)))
        return f"Read this:\n\n{filler}\n\n{question}"
    return question


def plan_request(rng: random.Random, max_tokens: int, model: str | None) -> Plan:
    """A random request of the mix: 60% chat, 60% streamed, mostly n = 1, params drawn at random."""
    chat, stream = rng.random() < 0.6, rng.random() < 0.6
    n = rng.choices((1, 2, 3), weights=(8, 1, 1))[0]
    body: dict[str, Any] = {"max_tokens": rng.randint(1, max_tokens), "n": n, "stream": stream}
    if model:
        body["model"] = model
    if rng.random() < 0.7:
        body["temperature"] = round(rng.uniform(0.0, 1.5), 2)
    if rng.random() < 0.5:
        body["top_p"] = round(rng.uniform(0.1, 1.0), 2)
    if rng.random() < 0.3:
        body["stop"] = rng.sample(_STOPS, rng.randint(1, 2))
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2**31)
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if chat:
        messages = [{"role": "user", "content": make_prompt(rng)}]
        if rng.random() < 0.33:
            messages.insert(0, {"role": "system", "content": _SYSTEM})
        body["messages"] = messages
        if rng.random() < 0.3:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
    else:
        body["prompt"] = make_prompt(rng)
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
    plan = Plan(f"{'chat' if chat else 'completions'}/{'stream' if stream else 'plain'}",
                "/v1/chat/completions" if chat else "/v1/completions", body, n)
    # A quarter of the streams and a twentieth of the plain requests lose their client.
    if stream and rng.random() < 0.25:
        if rng.random() < 0.5:
            plan.cut_after_events = rng.randint(0, max(1, body["max_tokens"] // 2))
        else:
            plan.cut_after_s = rng.uniform(0.01, 2.0)
    elif not stream and rng.random() < 0.05:
        plan.cut_after_s = rng.uniform(0.05, 2.0)
    return plan


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.url = args.url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.samples: list[Sample] = []
        self.t0 = time.monotonic()
        self.idle_kv: float | None = None  # KV bytes in use when idle before the run
        self.rss_source: str | None = None  # "metrics" or "pid", once a scrape found it
        limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency)
        timeout = httpx.Timeout(args.request_timeout, connect=10.0)
        self.client = httpx.AsyncClient(base_url=self.url, headers=self.headers, limits=limits, timeout=timeout)
        # Its own client, so a scrape never queues behind the workload's connections.
        self.probe = httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=10.0)

    async def close(self) -> None:
        await self.client.aclose()
        await self.probe.aclose()

    async def scrape(self) -> Sample:
        """One sample of /metrics; every field None if the scrape failed."""
        t = time.monotonic() - self.t0
        try:
            r = await self.probe.get("/metrics")
            r.raise_for_status()
        except httpx.HTTPError:
            return Sample(t, self.pid_rss(), None, None, None, None, None, scraped=False)
        m = parse_metrics(r.text)

        def total(name: str) -> float | None:
            return sum(v for _, v in m[name]) if name in m else None

        rss = total("process_resident_memory_bytes")
        if rss is not None:
            self.rss_source = "metrics"
        http = m.get("minillm_http_requests_total")
        fives = sum(v for labels, v in http if labels.get("status", "").startswith("5")) if http else None
        return Sample(t, rss if rss is not None else self.pid_rss(), total("minillm_kv_cache_used_bytes"),
                      total("minillm_kv_cache_capacity_bytes"), total("minillm_requests_running"),
                      total("minillm_requests_waiting"), fives)

    def pid_rss(self) -> float | None:
        if not self.args.pid:
            return None
        self.rss_source = self.rss_source or "pid"
        return process_tree_rss(self.args.pid)

    async def sampler(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.samples.append(await self.scrape())
            try:
                await asyncio.wait_for(stop.wait(), self.args.sample_every)
            except asyncio.TimeoutError:
                pass

    async def wait_idle(self, timeout: float) -> Sample:
        """Polls until nothing runs or waits and the KV cache is back to idle_kv (the gauges are the
        engine's as of its last step, and aborts land within a step), or the timeout passes."""
        deadline = time.monotonic() + timeout
        while True:
            s = await self.scrape()
            idle = not s.running and not s.waiting and (self.idle_kv is None or (s.kv_used or 0) <= self.idle_kv)
            if idle or time.monotonic() >= deadline:
                return s
            await asyncio.sleep(0.5)

    async def run_one(self, plan: Plan) -> str:
        """Sends one request, tallies and returns its outcome; gives up where the plan says."""
        try:
            if plan.cut_after_s is None:
                outcome, problem = await self.send(plan)
            else:
                try:
                    outcome, problem = await asyncio.wait_for(self.send(plan), plan.cut_after_s)
                except asyncio.TimeoutError:
                    where = ("stream:mid_stream" if plan.headers_seen else "stream:before_headers") \
                        if plan.body["stream"] else "plain:cancelled"
                    self.tally.disconnects[where] += 1
                    outcome, problem = "disconnect", ""
        except httpx.TimeoutException as e:
            outcome, problem = "timeout", repr(e)
        except httpx.HTTPError as e:  # resets and protocol errors we did not cause
            outcome, problem = "transport", repr(e)
        self.tally.add(plan.kind, outcome, problem)
        return outcome

    async def send(self, plan: Plan) -> tuple[str, str]:
        """(outcome, what was wrong): the status code, 'disconnect', or 'bad' for a malformed 200."""
        if not plan.body["stream"]:
            r = await self.client.post(plan.path, json=plan.body)
            if r.status_code != 200:
                return str(r.status_code), r.text[:200]
            choices = r.json().get("choices", [])
            if len(choices) != plan.n or any(c.get("finish_reason") not in OK_FINISH for c in choices):
                return "bad", r.text[:200]
            return "200", ""
        async with self.client.stream("POST", plan.path, json=plan.body) as r:
            if r.status_code != 200:
                return str(r.status_code), (await r.aread()).decode(errors="replace")[:200]
            plan.headers_seen = True
            if plan.cut_after_events == 0:
                self.tally.disconnects["stream:after_headers"] += 1
                return "disconnect", ""
            events, done, finished, error = 0, False, set(), ""
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True  # read on to the end of the body: leaving now would be a disconnect
                    continue
                event = json.loads(data)
                if "error" in event:
                    error = data[:200]
                for c in event.get("choices", []):
                    if c.get("finish_reason") is not None:
                        finished.add((c["index"], c["finish_reason"]))
                events += 1
                if plan.cut_after_events is not None and events >= plan.cut_after_events and not done:
                    self.tally.disconnects["stream:mid_stream"] += 1
                    return "disconnect", ""
        if error:
            return "stream_error", error
        if not done or sorted(i for i, _ in finished) != list(range(plan.n)) \
                or any(f not in OK_FINISH for _, f in finished):
            return "bad", f"done={done} finished={sorted(finished)}"
        return "200", ""

    async def worker(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            plan = plan_request(self.rng, self.args.max_tokens, self.args.model)
            if await self.run_one(plan) == "429":
                await asyncio.sleep(self.rng.uniform(0.1, 0.5))  # a full queue: back off, as a client would

    async def final_request(self) -> tuple[bool, str]:
        """A plain chat after everything: the server still serves."""
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
        if self.args.model:
            body["model"] = self.args.model
        try:
            r = await self.client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as e:
            return False, repr(e)
        ok = r.status_code == 200 and r.json().get("choices", [{}])[0].get("finish_reason") in OK_FINISH
        return ok, f"HTTP {r.status_code}" + ("" if ok else f": {r.text[:200]}")

    async def run(self) -> dict[str, Any]:
        args = self.args
        first = await self.scrape()
        if first.running is None and first.rss is None:
            raise ConnectionError(f"no metrics from {self.url}/metrics")
        start = await self.wait_idle(args.idle_timeout)  # someone else's traffic may still be finishing
        self.idle_kv = start.kv_used
        self.t0 = time.monotonic()
        self.samples = [replace(start, t=0.0)]
        stop = asyncio.Event()
        sampler = asyncio.create_task(self.sampler(stop))
        deadline = self.t0 + args.duration
        await asyncio.gather(*(self.worker(deadline) for _ in range(args.concurrency)))
        run_s = time.monotonic() - self.t0
        stop.set()
        await sampler
        end = await self.wait_idle(args.idle_timeout)
        self.samples.append(end)
        final_ok, final_detail = await self.final_request()
        after = await self.scrape()  # the final request's own 5xx, if any, counts too
        return self.report(start, end, after, run_s, final_ok, final_detail)

    def report(self, start: Sample, end: Sample, after: Sample, run_s: float, final_ok: bool,
               final_detail: str) -> dict[str, Any]:
        args, tally = self.args, self.tally
        rss = [s.rss for s in self.samples if s.rss is not None]
        # The midpoint: the first sample of the second half of the run.
        mid = next((s.rss for s in self.samples if s.t >= args.duration / 2 and s.rss is not None), None)
        growth = end.rss - mid if end.rss is not None and mid is not None else None
        outcomes = {kind: dict(c) for kind, c in sorted(tally.outcomes.items())}
        every = Counter()
        for c in tally.outcomes.values():
            every.update(c)
        client_5xx = sum(v for k, v in every.items() if k.startswith("5"))
        server_5xx = None if after.http_5xx is None or start.http_5xx is None else after.http_5xx - start.http_5xx
        unexpected_4xx = sum(v for k, v in every.items() if k.startswith("4") and k != "429")
        broken = sum(v for k, v in every.items() if k in ("bad", "stream_error", "timeout", "transport"))

        def check(ok: bool | None, detail: str) -> dict[str, Any]:
            return {"ok": ok, "detail": detail}

        def gauge_check(ok: bool | None, detail: str) -> dict[str, Any]:
            """None (skipped) only when the server does not export the gauge, not when it stopped answering."""
            return check(ok if end.scraped else False, detail if end.scraped else "/metrics did not answer")

        checks = {
            "idle": gauge_check(None if end.running is None or end.waiting is None
                                else end.running == end.waiting == 0, f"running={num(end.running)} waiting={num(end.waiting)}"),
            "kv_idle": gauge_check(None if end.kv_used is None or self.idle_kv is None
                                   else end.kv_used <= self.idle_kv, f"idle={mib(self.idle_kv)} end={mib(end.kv_used)}"),
            "rss_growth": check(None if growth is None else growth <= args.max_rss_growth_mib * MIB,
                                "n/a" if growth is None else
                                f"{growth / MIB:+.1f} MiB over the second half (limit {args.max_rss_growth_mib} MiB)"),
            "no_5xx": check(client_5xx == 0 and not server_5xx,
                            f"client saw {client_5xx}, server counted {num(server_5xx)}"),
            "responses_ok": check(unexpected_4xx == 0 and broken == 0,
                                  f"{unexpected_4xx} unexpected 4xx, {broken} malformed/errored/timed out"),
            "served": check(every["200"] > 0, f"{every['200']} succeeded"),
            "final_request": check(final_ok, final_detail),
        }
        return {
            "url": self.url, "duration_s": args.duration, "run_s": round(run_s, 1), "concurrency": args.concurrency, "seed": args.seed,
            "requests": outcomes, "total_requests": sum(every.values()), "disconnects": dict(tally.disconnects),
            "rss": {"source": self.rss_source,
                    "start": start.rss, "mid": mid, "peak": max(rss) if rss else None, "end": end.rss,
                    "growth_second_half": growth, "limit": args.max_rss_growth_mib * MIB},
            "kv": {"idle": self.idle_kv, "end": end.kv_used, "peak": max((s.kv_used or 0 for s in self.samples),
                                                                         default=None),
                   "capacity": end.kv_capacity},
            "end": {"running": end.running, "waiting": end.waiting},
            "server_5xx": server_5xx, "problems": tally.problems, "checks": checks,
            "passed": all(c["ok"] is not False for c in checks.values()),
            "samples": [asdict(s) for s in self.samples],
        }


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f} MiB"


def num(value: float | None) -> str:
    """A gauge or counter as Prometheus gives it (always a float), shown as the count it is."""
    return "n/a" if value is None else f"{value:g}"


def print_summary(report: dict[str, Any]) -> None:
    """The short table: requests by kind and outcome, disconnects, RSS, KV, then each check."""
    outcomes = sorted({o for c in report["requests"].values() for o in c}, key=lambda o: (not o.isdigit(), o))
    width = max([len(k) for k in report["requests"]] + [len("kind")])
    print(f"soak of {report['url']}: {report['duration_s']:g} s of load ({report['run_s']:g} s with the last "
          f"replies), {report['concurrency']} clients, {report['total_requests']} requests, seed {report['seed']}")
    print(f"{'kind':<{width}}" + "".join(f" {o:>12}" for o in outcomes))
    for kind, counts in report["requests"].items():
        print(f"{kind:<{width}}" + "".join(f" {counts.get(o, 0):>12}" for o in outcomes))
    print("disconnects: " + (", ".join(f"{k} {v}" for k, v in sorted(report["disconnects"].items())) or "none"))
    rss = report["rss"]
    print(f"RSS ({rss['source']}): start {mib(rss['start'])}, mid {mib(rss['mid'])}, peak {mib(rss['peak'])}, "
          f"end {mib(rss['end'])}")
    kv = report["kv"]
    print(f"KV used: idle {mib(kv['idle'])}, peak {mib(kv['peak'])}, end {mib(kv['end'])} "
          f"(capacity {mib(kv['capacity'])})")
    for name, c in report["checks"].items():
        print(f"  {'PASS' if c['ok'] else 'skip' if c['ok'] is None else 'FAIL'}  {name}: {c['detail']}")
    for problem in report["problems"][:5]:
        print(f"  e.g. {problem}")
    print("PASSED" if report["passed"] else "FAILED")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Soak a minillm server: mixed load, then check it went back to idle.")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--duration", type=parse_duration, default=parse_duration("10m"), help="e.g. 10m, 90s (10m)")
    p.add_argument("--api-key", default=os.environ.get("MINILLM_API_KEY", "").split(",")[0],
                   help="sent as a Bearer token (default: the first of $MINILLM_API_KEY)")
    p.add_argument("--concurrency", type=int, default=8, help="clients sending at once (8)")
    p.add_argument("--out", type=Path, help="write the report, samples included, as JSON here")
    p.add_argument("--model", default="", help="model name to send (default: none, the served model)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens is drawn from 1 to this (64)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between /metrics samples (5)")
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0,
                   help="fail if RSS grows more than this over the second half of the run (64)")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds to wait for the server to go idle, before and after the run (60)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take (300)")
    p.add_argument("--pid", type=int, default=0,
                   help="a local server's pid: its RSS (children included) from /proc, if /metrics has none")
    p.add_argument("--seed", type=int, default=None, help="the workload's random seed (default: a random one)")
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(2**31)
    return args


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    runner = Soak(args)
    try:
        return await runner.run()
    finally:
        await runner.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(soak(args))
    except (ConnectionError, httpx.HTTPError) as e:
        print(f"soak: cannot start: {e}", file=sys.stderr)
        return 2
    print_summary(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
