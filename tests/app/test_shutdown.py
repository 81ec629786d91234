"""SIGTERM: /ready turns 503 while in-flight streams finish (the listener stays open until then), then
connections are refused and the server exits 0; streams still running after the grace period are ended
with finish_reason "abort". tests/chaos/test_lifecycle.py has the second SIGTERM and SIGKILL."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from app.json import loads
from tests.app.conftest import start_server


def stream_chat(url: str, max_tokens: int, events: list[dict], first: threading.Event) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append({"done": True} if line == "data: [DONE]" else loads(line[6:]))
                first.set()


def run_until_sigterm(server, max_tokens: int) -> tuple[list[dict], float]:
    events: list[dict] = []
    first = threading.Event()
    client = threading.Thread(target=stream_chat, args=(server.url, max_tokens, events, first))
    client.start()
    assert first.wait(30)
    sent = time.monotonic()
    server.process.terminate()
    probes: list[int | None] = []  # /ready from the signal to the exit: 503 while draining, then refused
    deadline = time.monotonic() + 60
    while server.process.poll() is None and time.monotonic() < deadline:
        try:
            status = httpx.get(server.url + "/ready", timeout=2).status_code
        except httpx.HTTPError:
            status = None
        if probes or status != 200:  # 200 until the worker has the signal
            probes.append(status)
        time.sleep(0.05)
    client.join(60)
    assert server.process.wait(60) == 0
    assert 200 not in probes  # never ready again once draining
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
    return events, time.monotonic() - sent


def test_sigterm_lets_in_flight_streams_finish(default_model_dir, tmp_path) -> None:
    server = start_server(default_model_dir, tmp_path / "server.log", "--shutdown-grace", "30")
    events, _ = run_until_sigterm(server, max_tokens=24)
    assert events[-1] == {"done": True}
    reasons = [e["choices"][0]["finish_reason"] for e in events[:-1] if e.get("choices")]
    assert reasons[-1] == "length" and reasons.count("length") == 1
    assert sum(len(e["choices"][0]["delta"].get("content", "")) > 0 for e in events[:-1]) >= 20
    assert "draining 1 in-flight" in server.log_text()


def test_grace_period_bounds_the_drain(default_model_dir, tmp_path) -> None:
    server = start_server(default_model_dir, tmp_path / "server.log", "--shutdown-grace", "1")
    events, took = run_until_sigterm(server, max_tokens=4000)
    assert events[-1] == {"done": True}
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e.get("choices")][-1] == "abort"
    assert took < 15
