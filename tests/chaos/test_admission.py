"""Admission, fairness and engine faults against a real Granian server: --max-queue holds under a
burst and counts sequences; n cannot pass --max-num-seqs; a call of long prompts does not hold a
short chat behind it, and leaves nothing running once its client gives up; a prompt too long to fit
is refused before it is tokenized; clients that give up leave nothing behind. An engine fault
(in-process: the forward is broken on purpose) fails the requests in flight and marks the server dead."""
from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

import app.server as server_module
from app.json import loads
from app.server import create_app
from app.settings import ServerSettings
from engine.config import EngineConfig
from tests.app.conftest import Server, start_server
from tests.chaos.common import assert_idle_and_serving, chat, metric, wait_until

MAX_QUEUE, MAX_NUM_SEQS, MAX_MODEL_LEN = 8, 4, 1024
LONGEST_TOKEN = 81  # SmolLM2's longest vocabulary entry, in characters: a newline and 80 spaces


@pytest.fixture(scope="module")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Small limits, and prefill chunks of 64 tokens so that CPU steps are short."""
    s = start_server(default_model_dir, tmp_path_factory.mktemp("admission") / "server.log",
                     "--max-queue", str(MAX_QUEUE), "--max-num-seqs", str(MAX_NUM_SEQS),
                     "--max-num-batched-tokens", "64", "--max-model-len", str(MAX_MODEL_LEN))
    yield s
    s.stop()


def test_a_burst_cannot_pass_max_queue(server: Server) -> None:
    """24 chats at the same moment, each held open once answered: only what the queue holds gets in
    (the 8 places, and those freed as the first ones start running), the rest get 429 at once."""
    count, statuses, hold = 24, [], threading.Event()
    start = threading.Barrier(count)

    def one(i: int) -> None:
        with httpx.Client(timeout=60) as client:
            start.wait()
            body = chat(f"Count to {i}.", max_tokens=900, ignore_eos=True, stream=True)
            with client.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
                statuses.append((response.status_code, response.headers.get("retry-after")))
                hold.wait(60)  # an answered stream stays open until every status is in

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(statuses) == count, what="every status")
    finally:
        hold.set()
        for t in threads:
            t.join(60)
    accepted = [s for s in statuses if s[0] == 200]
    assert MAX_QUEUE <= len(accepted) <= MAX_QUEUE + MAX_NUM_SEQS
    assert sorted(statuses)[len(accepted):] == [(429, "1")] * (count - len(accepted))
    assert_idle_and_serving(server.url)


def test_sequences_are_counted_and_n_cannot_pass_max_num_seqs(server: Server) -> None:
    url = server.url
    many = httpx.post(url + "/v1/completions", timeout=60,
                      json={"prompt": [f"Item {i}:" for i in range(MAX_QUEUE + 1)], "max_tokens": 2})
    assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_sequences"
    wide = httpx.post(url + "/v1/chat/completions", timeout=60, json=chat("Hi.", n=MAX_NUM_SEQS + 1, max_tokens=2))
    assert wide.status_code == 400 and wide.json()["error"]["param"] == "n"
    # Two calls of 3 samples each: they take turns, never 6 sequences running at once.
    replies, running = [], []

    def one() -> None:
        replies.append(httpx.post(url + "/v1/chat/completions", timeout=120,
                                  json=chat("Tell a story.", n=3, max_tokens=12, ignore_eos=True)))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        running.append(metric(url, "requests_running"))
        time.sleep(0.02)
    assert [r.status_code for r in replies] == [200, 200] and all(len(r.json()["choices"]) == 3 for r in replies)
    assert max(running) == 3  # one call's samples at a time: 3 + 3 would pass the limit of 4
    fits = httpx.post(url + "/v1/completions", timeout=120,
                      json={"prompt": [f"Item {i}:" for i in range(4)], "n": 2, "max_tokens": 2})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 8  # 8 sequences: the whole queue
    assert_idle_and_serving(url)


def test_a_call_of_long_prompts_does_not_hold_a_short_chat(server: Server) -> None:
    """One call of six 600-token prompts, then a one-token chat: the chat is served while the call's
    first prompt is still prefilling, not after all six. The call's client then gives up: the
    prompts it left are never started."""
    url = server.url
    finished: list[int] = []  # the call's choices, as they finish
    started, stop = threading.Event(), threading.Event()

    def big_call() -> None:
        body = {"prompt": [f"{i} " + "word " * 600 for i in range(6)], "max_tokens": 1, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            started.set()
            for line in response.iter_lines():
                if stop.is_set():
                    return  # the client gives up
                if line.startswith("data: {"):
                    finished.extend(c["index"] for c in loads(line[6:])["choices"] if c["finish_reason"])

    looked_up = metric(url, "prefix_cache_queries_total")  # prompt tokens of every sequence admitted
    thread = threading.Thread(target=big_call)
    thread.start()
    assert started.wait(60)
    wait_until(lambda: metric(url, "requests_running"), what="the first prompt prefilling")
    reply = httpx.post(url + "/v1/chat/completions", json=chat("Hi.", max_tokens=1), timeout=120)
    done_before_chat = len(finished)
    stop.set()
    thread.join(120)
    assert reply.status_code == 200
    assert done_before_chat <= 2  # first come, first served would have prefilled all six first
    assert_idle_and_serving(url)
    assert metric(url, "prefix_cache_queries_total") - looked_up < 5 * 600  # the last two never started


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(server: Server) -> None:
    huge = "x" * (MAX_MODEL_LEN * LONGEST_TOKEN + 1)
    for path, body in (("/v1/completions", {"prompt": huge}), ("/v1/chat/completions", chat(huge))):
        reply = httpx.post(server.url + path, json=body, timeout=60)
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["code"] == "context_length_exceeded"
        assert f"at most {MAX_MODEL_LEN * LONGEST_TOKEN}" in error["message"]  # counted, not tokenized
    assert_idle_and_serving(server.url)


def test_clients_that_give_up_leave_nothing_behind(server: Server) -> None:
    """Rounds of clients that give up half a second into long generations: each is aborted (or
    refused), and the server is idle and serving right after."""
    outcomes: list[str] = []

    def one() -> None:
        try:
            reply = httpx.post(server.url + "/v1/chat/completions", timeout=0.5,
                               json=chat("Write a long story.", max_tokens=900, ignore_eos=True))
            outcomes.append(str(reply.status_code))
        except httpx.TimeoutException:
            outcomes.append("gave up")

    for _ in range(3):
        threads = [threading.Thread(target=one) for _ in range(MAX_QUEUE)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert set(outcomes) <= {"gave up", "429"} and outcomes.count("gave up") >= MAX_QUEUE
    assert_idle_and_serving(server.url)
    generated = metric(server.url, "tokens_generated_total")
    time.sleep(0.5)
    assert metric(server.url, "tokens_generated_total") == generated  # nothing left generating


def test_an_engine_fault_fails_requests_in_flight_and_marks_the_server_dead(default_model_dir, monkeypatch) -> None:
    """As vLLM's test_forward_error, through the app: the forward raises while a stream and a
    non-streamed call are in flight. The stream ends with an error event and [DONE], the other gets
    a 500 naming its request; /health turns 503 and new requests get 503."""
    built = []
    real = server_module.LLMEngine
    monkeypatch.setattr(server_module, "LLMEngine", lambda config: built.append(real(config)) or built[-1])
    asgi = create_app(ServerSettings(engine=EngineConfig(model=str(default_model_dir), kv_cache_memory="32MiB")))
    long = chat("Write a long story.", max_tokens=500, ignore_eos=True)
    with TestClient(asgi) as client:
        wait_until(lambda: client.get("/ready").status_code == 200, what="ready")
        [llm] = built
        events, plain, first = [], [], threading.Event()

        def stream() -> None:
            with client.stream("POST", "/v1/chat/completions", json=long | {"stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        threads = [threading.Thread(target=stream),
                   threading.Thread(target=lambda: plain.append(client.post("/v1/chat/completions", json=long)))]
        for t in threads:
            t.start()

        def broken(*args):
            raise RuntimeError("device lost")

        try:
            assert first.wait(60)
            wait_until(lambda: llm.stats().running == 2, what="both in flight")
        finally:
            llm.runner.forward = broken  # even when the wait fails: it ends the requests, so the test ends
        for t in threads:
            t.join(60)
        error = loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and error["code"] == "engine_failed" and "request chatcmpl-" in error["message"]
        [reply] = plain
        assert reply.status_code == 500 and reply.json()["error"]["code"] == "engine_failed"
        assert re.search(r"request chatcmpl-\w+-0 ", reply.json()["error"]["message"])
        assert client.get("/health").status_code == 503
        after = client.post("/v1/chat/completions", json=chat("Hi.", max_tokens=1))
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"


def test_streams_nobody_reads_do_not_hold_the_queue(server: Server) -> None:
    """Streams whose clients stopped reading are not waiting for the engine: with more of them open,
    unread, than --max-queue holds, normal requests still get in."""
    clients = [httpx.Client(timeout=60) for _ in range(MAX_QUEUE + 2)]
    streams = []
    try:
        for i, client in enumerate(clients):  # one at a time: none of them waits for the engine
            request = client.build_request("POST", server.url + "/v1/chat/completions",
                                           json=chat(f"Say {i}.", max_tokens=2, stream=True))
            streams.append(client.send(request, stream=True))  # its headers read, its body never
            assert streams[-1].status_code == 200
            wait_until(lambda: metric(server.url, "requests_running") == metric(server.url, "requests_waiting") == 0,
                       what="the unread stream done in the engine, and not counted as waiting")
        for _ in range(3):
            reply = httpx.post(server.url + "/v1/chat/completions", json=chat("Hi", max_tokens=2), timeout=60)
            assert reply.status_code == 200, reply.text
    finally:
        for stream in streams:
            stream.close()
        for client in clients:
            client.close()
    assert_idle_and_serving(server.url)


@pytest.mark.parametrize("body", [{}, {"max_tokens": None}], ids=["omitted", "null"])
def test_legacy_completions_stop_at_16_tokens_by_default(server: Server, body: dict) -> None:
    """As OpenAI's and vLLM's: without max_tokens a completion is 16 tokens, not the context."""
    reply = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": "Once upon a time", "ignore_eos": True, **body})
    assert reply.status_code == 200, reply.text
    result = reply.json()
    assert result["usage"]["completion_tokens"] == 16 and result["choices"][0]["finish_reason"] == "length"
    assert_idle_and_serving(server.url)
