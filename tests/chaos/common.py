"""What every chaos test checks after its fault: the server went back to idle and still serves."""
from __future__ import annotations

import re
import time
from collections.abc import Callable

import httpx

WAIT = 30.0  # how long a test waits for what the server must do soon (a bound, not a timing)
# What must read 0 once nothing is in progress. /metrics is a probe, so the check itself is not an
# active HTTP request; KV used counts blocks held by sequences (cached prefixes are free blocks).
IDLE_GAUGES = ("requests_running", "requests_waiting", "kv_cache_used_bytes", "http_requests_active")
_SAMPLE = re.compile(r"minillm_(\w+?)(?:\{(.*)\})? (\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def chat(content: str, **extra: object) -> dict:
    """A chat completion body of one user message."""
    return {"messages": [{"role": "user", "content": content}], **extra}


def scrape(url: str) -> str:
    """The server's /metrics text: one snapshot, so values read from it are consistent."""
    reply = httpx.get(url + "/metrics", timeout=WAIT)
    assert reply.status_code == 200, reply.text
    return reply.text


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of minillm_`name` whose labels include `labels` (0 if none has yet: a
    labelled counter shows no sample before its first count). Fails on a metric the server does not
    declare at all, so a misspelled name cannot read as 0."""
    if not re.search(rf"^# TYPE minillm_{name}(?:_bucket|_sum|_count)? ", text, re.MULTILINE):
        raise AssertionError(f"/metrics declares no minillm_{name}")
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.fullmatch(line)
        if m and m[1] == name and labels.items() <= dict(_LABEL.findall(m[2] or "")).items():
            total += float(m[3])
    return total


def metric(url: str, name: str, **labels: str) -> float:
    """One value from /metrics: minillm_`name`, summed over the samples that carry `labels`."""
    return sample_sum(scrape(url), name, **labels)


def wait_until(check: Callable[[], object], timeout: float = WAIT, what: str = "the condition") -> None:
    """Poll `check` until it returns something true; fail if it has not within `timeout` seconds.
    Polling keeps a test as fast as the server and still bounded when the server is slow."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not true within {timeout:g} s"
        time.sleep(0.05)


def busy(url: str) -> dict[str, float]:
    """The idle gauges, from one snapshot: all 0 when nothing is in progress."""
    text = scrape(url)
    return {name: sample_sum(text, name) for name in IDLE_GAUGES}


def assert_idle_and_serving(url: str, api_key: str | None = None, timeout: float = WAIT) -> None:
    """After a fault: within `timeout`, nothing running or waiting, no KV block held and no HTTP request
    in progress (the gauges are the engine's as of its last step, and aborts land within a step); then
    a normal chat succeeds, so the fault left the server serving, not just quiet."""
    try:
        wait_until(lambda: not any(busy(url).values()), timeout)
    except AssertionError:
        raise AssertionError(f"not idle within {timeout:g} s: {busy(url)}") from None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.post(url + "/v1/chat/completions", json=chat("Say hi.", max_tokens=4), headers=headers, timeout=WAIT)
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] in ("stop", "length"), reply.text
