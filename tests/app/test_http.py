"""Raw HTTP against a real server (httpx, no SDK): the exact SSE bytes, client disconnects, the
Prometheus numbers, OpenAI error bodies, auth, the tokenizer routes and the access log."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.app.conftest import MODEL_NAME, Server

CHAT = [{"role": "user", "content": "Name three colours."}]
LONG = {"max_tokens": 2000, "ignore_eos": True}  # far longer than any test waits for

# ---- helpers ------------------------------------------------------------------------------------

Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]
Streamed = tuple[dict[int, str], dict[int, str], dict | None]  # text and finish_reason by choice; usage
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')


def scrape(server: Server) -> Metrics:
    """/metrics as {(name, labels): value}, parsed from the Prometheus text format."""
    r = httpx.get(server.url + "/metrics", timeout=5)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples: Metrics = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample: {line!r}"
        samples[(m[1], frozenset(_LABEL.findall(m[2] or "")))] = float(m[3])
    return samples


def metric(samples: Metrics, name: str, **labels: str) -> float:
    """The sum of the samples of `name` (for this model) whose labels include `labels`."""
    want = {"model": MODEL_NAME, **labels}.items()
    return sum(v for (n, ls), v in samples.items() if n == name and want <= dict(ls).items())


def has(samples: Metrics, name: str) -> bool:
    return any(n == name and dict(ls).get("model") == MODEL_NAME for n, ls in samples)


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.02) -> float:
    """Seconds until check() held; raises AssertionError after `timeout`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not true within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start


def engine_idle(server: Server) -> bool:
    m = scrape(server)
    return (metric(m, "minillm_requests_running"), metric(m, "minillm_requests_waiting"),
            metric(m, "minillm_kv_cache_used_bytes")) == (0, 0, 0)


def sse_events(body: bytes) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body that must be `data: <json>\\n\\n`... then one `data: [DONE]\\n\\n`."""
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    events = body.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    chunks = []
    for event in events[:-2]:
        assert event.startswith(b"data: ") and b"\n" not in event, event[:200]
        assert event != b"data: [DONE]", "[DONE] must come exactly once, last"
        chunks.append(json.loads(event[len(b"data: "):]))
    assert chunks, "no data chunk before [DONE]"
    return chunks


def check_stream_response(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return sse_events(r.content)


def check_chunks(chunks: list[dict[str, Any]], obj: str, n: int, include_usage: bool,
                 text_of: Callable[[dict], str | None]) -> Streamed:
    """The rules every stream keeps (chat and completions): one id/object/model/created; no chunk
    after a choice's finish_reason, which comes exactly once; no empty chunks; usage alone in a
    final chunk with choices == [] only when asked for, and no usage key at all otherwise.
    Returns each choice's joined text, its finish_reason, and the usage."""
    head = chunks[0]
    assert head["id"] and head["model"] == MODEL_NAME and head["object"] == obj
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for k, c in enumerate(chunks):
        assert (c["id"], c["object"], c["model"], c["created"]) == (head["id"], obj, MODEL_NAME, head["created"])
        assert ("usage" in c) == include_usage, c
        if not c["choices"]:
            assert include_usage and k == len(chunks) - 1, "choices == [] only in the final usage chunk"
            usage = c["usage"]
            assert usage is not None
            continue
        assert c.get("usage") is None, "usage only in the final chunk"
        for choice in c["choices"]:
            i = choice["index"]
            assert i not in reasons, f"chunk for choice {i} after its finish_reason"
            assert "finish_reason" in choice
            text = text_of(choice)
            assert text or choice["finish_reason"] is not None or (obj == "chat.completion.chunk" and i not in texts), \
                f"empty chunk: {c}"
            texts[i] = texts.get(i, "") + (text or "")
            if choice["finish_reason"] is not None:
                reasons[i] = choice["finish_reason"]
    assert sorted(texts) == sorted(reasons) == list(range(n)), (texts, reasons)
    if include_usage:
        assert chunks[-1]["choices"] == [] and usage is not None
    return texts, reasons, usage


def check_chat_stream(r: httpx.Response, n: int, include_usage: bool) -> Streamed:
    chunks = check_stream_response(r)
    seen: set[int] = set()
    for c in chunks:
        for choice in c["choices"]:
            delta = choice["delta"]
            # Each choice's first chunk says role "assistant"; no later one repeats it.
            assert (delta.get("role") == "assistant") == (choice["index"] not in seen), c
            assert set(delta) <= {"role", "content"}, c
            seen.add(choice["index"])
    return check_chunks(chunks, "chat.completion.chunk", n, include_usage, lambda ch: ch["delta"].get("content"))


def check_completion_stream(r: httpx.Response, n: int, include_usage: bool) -> Streamed:
    return check_chunks(check_stream_response(r), "text_completion", n, include_usage, lambda ch: ch["text"])


def chat_prompt_tokens(client: httpx.Client, messages: list[dict]) -> int:
    r = client.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def check_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None,
                type: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error body, all four keys present, with exact values."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert (error["type"], error["param"], error["code"]) == (type, param, code), error
    return error


def wait_for_access_line(server: Server, request_id: str) -> dict[str, Any]:
    """The access log line of one request (written just after its response), parsed."""
    found: list[dict[str, Any]] = []

    def look() -> bool:
        for line in server.log_text().splitlines():
            if "minillm.access" in line and f'"request_id":"{request_id}"' in line:
                found.append(json.loads(line[line.index("{"):]))
        return bool(found)

    wait_until(look, 2.0, 0.05)
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# ---- 1. streams ---------------------------------------------------------------------------------


def test_sixteen_concurrent_streams_keep_the_sse_rules(server: Server, client: httpx.Client) -> None:
    messages = [[{"role": "user", "content": f"Count to {i}."}] for i in range(16)]
    prompt_tokens = [chat_prompt_tokens(client, m) for m in messages]

    def body(i: int) -> dict[str, Any]:
        b = {"model": MODEL_NAME, "messages": messages[i], "stream": True, "max_tokens": 6 + i % 4 * 3,
             "ignore_eos": True, "temperature": 0.7, "seed": i}
        return b | ({"stream_options": {"include_usage": True}} if i % 2 == 0 else {})

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
            return await asyncio.gather(*(ac.post("/v1/chat/completions", json=body(i)) for i in range(16)))

    responses = asyncio.run(run())
    ids = set()
    for i, r in enumerate(responses):
        texts, reasons, usage = check_chat_stream(r, n=1, include_usage=i % 2 == 0)
        ids.add(sse_events(r.content)[0]["id"])
        assert reasons == {0: "length"}  # ignore_eos: every sample runs to max_tokens
        assert texts[0]
        if i % 2 == 0:
            max_tokens = body(i)["max_tokens"]
            assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == \
                (prompt_tokens[i], max_tokens, prompt_tokens[i] + max_tokens)
    assert len(ids) == 16  # 16 different completion ids
    wait_until(lambda: engine_idle(server), 1.0)


def test_n2_stream_each_choice_opens_with_role_and_finishes_once(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={
        "messages": CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 7,
        "ignore_eos": True, "temperature": 0.9, "seed": 5})
    texts, reasons, usage = check_chat_stream(r, n=2, include_usage=True)
    assert reasons == {0: "length", 1: "length"}
    assert usage["completion_tokens"] == 14 and usage["prompt_tokens"] == chat_prompt_tokens(client, CHAT)
    # Without include_usage: no chunk has a usage key at all.
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "n": 2, "stream": True, "max_tokens": 3})
    check_chat_stream(r, n=2, include_usage=False)


def test_greedy_streamed_text_equals_non_streamed(client: httpx.Client) -> None:
    chat = {"messages": CHAT, "max_tokens": 16, "temperature": 0}
    full = client.post("/v1/chat/completions", json=chat).json()
    texts, reasons, usage = check_chat_stream(
        client.post("/v1/chat/completions", json=chat | {"stream": True, "stream_options": {"include_usage": True}}),
        n=1, include_usage=True)
    assert texts[0] == full["choices"][0]["message"]["content"] and texts[0]
    assert reasons[0] == full["choices"][0]["finish_reason"]
    assert usage["completion_tokens"] == full["usage"]["completion_tokens"]

    comp = {"prompt": ["1, 2, 3, 4,", "The capital of France is"], "max_tokens": 10, "temperature": 0}
    full = client.post("/v1/completions", json=comp).json()
    texts, reasons, usage = check_completion_stream(
        client.post("/v1/completions", json=comp | {"stream": True, "stream_options": {"include_usage": True}}),
        n=2, include_usage=True)
    assert texts == {c["index"]: c["text"] for c in full["choices"]} and all(texts.values())
    assert reasons == {c["index"]: c["finish_reason"] for c in full["choices"]}
    assert usage == full["usage"] | {"prompt_tokens_details": usage["prompt_tokens_details"]}
    check_completion_stream(client.post("/v1/completions", json=comp | {"stream": True, "max_tokens": 3}), n=2,
                            include_usage=False)


# ---- 2. clients that leave ----------------------------------------------------------------------


def test_client_disconnect_mid_stream_aborts_the_request(server: Server) -> None:
    wait_until(lambda: engine_idle(server), 1.0)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "stream": True, **LONG}) as r:
            assert r.status_code == 200
            data = []
            lines = r.iter_lines()  # held: httpx closes the connection when a dropped iterator is collected
            for line in lines:
                if line.startswith("data: "):
                    data.append(json.loads(line[len("data: "):]))
                if len(data) == 3:
                    break
            assert len(data) == 3 and all(d["choices"][0]["finish_reason"] is None for d in data)
            m = scrape(server)
            assert metric(m, "minillm_requests_running") == 1 and metric(m, "minillm_kv_cache_used_bytes") > 0
    # The connection is closed here: the server must abort and free the KV blocks at once.
    wait_until(lambda: engine_idle(server), 1.0)
    generated = metric(scrape(server), "minillm_tokens_generated_total")
    time.sleep(0.2)
    assert metric(scrape(server), "minillm_tokens_generated_total") == generated  # nothing still decoding


def test_abandoned_non_streamed_request_is_aborted(server: Server) -> None:
    wait_until(lambda: engine_idle(server), 1.0)
    before = scrape(server)
    running_seen = threading.Event()

    def watch() -> None:  # the request must really run before the client gives up
        deadline = time.monotonic() + 0.9
        while time.monotonic() < deadline and not running_seen.is_set():
            if metric(scrape(server), "minillm_requests_running") == 1:
                running_seen.set()
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with pytest.raises(httpx.ReadTimeout):  # the server says nothing until done: the read times out
        httpx.post(server.url + "/v1/chat/completions", json={"messages": CHAT, **LONG}, timeout=1.0,
                   headers={"X-Request-Id": "abandoned-1"})
    gave_up = time.monotonic()
    watcher.join()
    assert running_seen.is_set(), "the request never ran"
    wait_until(lambda: engine_idle(server), 1.5)
    assert time.monotonic() - gave_up < 1.5
    after = scrape(server)
    assert 0 < metric(after, "minillm_tokens_generated_total") - metric(before, "minillm_tokens_generated_total") < 200
    time.sleep(0.2)
    assert metric(scrape(server), "minillm_tokens_generated_total") == metric(after, "minillm_tokens_generated_total")
    line = wait_for_access_line(server, "abandoned-1")
    assert line["status"] == 499 and line["completion_tokens"] > 0


# ---- 3. metrics ---------------------------------------------------------------------------------

GAUGES_AND_COUNTERS = [
    "minillm_requests_running", "minillm_requests_waiting", "minillm_kv_cache_used_bytes",
    "minillm_kv_cache_capacity_bytes", "minillm_kv_cache_usage_ratio", "minillm_prompt_tokens_total",
    "minillm_tokens_generated_total", "minillm_prefix_cache_queries_total", "minillm_prefix_cache_hits_total",
    "minillm_preemptions_total", "minillm_requests_finished_total", "minillm_http_requests_total",
]
HISTOGRAMS = [
    "minillm_time_to_first_token_seconds", "minillm_inter_token_latency_seconds", "minillm_request_latency_seconds",
    "minillm_request_queue_time_seconds", "minillm_request_prefill_time_seconds",
    "minillm_request_decode_time_seconds", "minillm_request_prompt_tokens", "minillm_request_generation_tokens",
    "minillm_request_tokens_per_second",
]


def test_metrics_count_exactly_what_the_responses_report(server: Server, client: httpx.Client) -> None:
    wait_until(lambda: engine_idle(server), 1.0)
    before = scrape(server)
    requests = [
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "n": 2, "temperature": 0.8}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "n": 3, "ignore_eos": True}),
        ("/v1/completions", {"prompt": ["Hello", "One, two,"], "max_tokens": 5, "n": 2}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "n": 2, "stream": True,
                                  "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "stream": True,
                             "stream_options": {"include_usage": True}}),
    ]
    prompt_tokens = completion_tokens = choices = 0
    for path, body in requests:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        n = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
        if body.get("stream"):
            check = check_chat_stream if path == "/v1/chat/completions" else check_completion_stream
            _, reasons, usage = check(r, n=n, include_usage=True)
        else:
            usage, reasons = r.json()["usage"], {c["index"]: c["finish_reason"] for c in r.json()["choices"]}
        assert len(reasons) == n
        prompt_tokens += usage["prompt_tokens"]
        completion_tokens += usage["completion_tokens"]
        choices += n
    bad = client.post("/v1/chat/completions", json={"messages": CHAT, "temperature": -1})
    check_error(bad, 400, param="temperature")

    def grew(after: Metrics, name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    # Counters land just after the response is sent: wait for the last one, then compare exactly.
    wait_until(lambda: grew(scrape(server), "minillm_http_requests_total", status="400") >= 1, 1.0)
    wait_until(lambda: grew(scrape(server), "minillm_requests_finished_total") >= choices, 1.0)
    after = scrape(server)
    for name in GAUGES_AND_COUNTERS:
        assert has(after, name), name
    for name in HISTOGRAMS:
        for suffix in ("_bucket", "_sum", "_count"):
            assert has(after, name + suffix), name + suffix
        assert any(n == name + "_bucket" and ("le", "+Inf") in ls for n, ls in after), name
    assert grew(after, "minillm_tokens_generated_total") == completion_tokens
    assert grew(after, "minillm_prompt_tokens_total") == prompt_tokens
    assert grew(after, "minillm_requests_finished_total") == choices
    assert grew(after, "minillm_requests_finished_total", finish_reason="length") >= 6  # the ignore_eos n=3 and more
    assert grew(after, "minillm_http_requests_total", status="400") == 1
    assert grew(after, "minillm_http_requests_total", status="200") >= len(requests)
    # One latency observation per API call (a call with several prompts or n is one request).
    assert grew(after, "minillm_request_latency_seconds_count") == len(requests)
    assert grew(after, "minillm_time_to_first_token_seconds_count") == len(requests)
    assert grew(after, "minillm_request_generation_tokens_sum") == completion_tokens
    assert grew(after, "minillm_request_prompt_tokens_sum") == prompt_tokens
    assert metric(after, "minillm_kv_cache_capacity_bytes") > 0
    assert metric(after, "minillm_kv_cache_usage_ratio") == 0 and metric(after, "minillm_kv_cache_used_bytes") == 0
    assert 0 < metric(after, "minillm_prefix_cache_hits_total") <= metric(after, "minillm_prefix_cache_queries_total")


# ---- 4. errors ----------------------------------------------------------------------------------


def test_http_level_errors_have_openai_bodies(client: httpx.Client) -> None:
    check_error(client.get("/v1/nope"), 404, type="not_found_error")
    r = client.get("/v1/chat/completions")
    check_error(r, 405)
    assert r.headers["allow"] == "POST"
    limit = 10 * 2**20
    r = client.post("/v1/chat/completions", content=b" " * (limit + 1), headers={"content-type": "application/json"})
    check_error(r, 413, code="body_too_large")
    assert r.headers["x-request-id"]  # answered by the middleware, before any route
    # The body was left unread, so the server drops the connection: it must say so, or this
    # keep-alive client would send its next request into the closing socket.
    assert r.headers["connection"] == "close"

    def chunks():
        for _ in range(11):
            yield b" " * 2**20

    r = client.post("/v1/chat/completions", content=chunks())
    assert r.request.headers["transfer-encoding"] == "chunked" and "content-length" not in r.request.headers
    check_error(r, 413, code="body_too_large")
    assert r.headers["connection"] == "close"
    check_error(client.post("/v1/chat/completions", content=b'{"messages": [',
                            headers={"content-type": "application/json"}), 400)
    check_error(client.post("/v1/chat/completions", json=[{"messages": CHAT}]), 400)
    # JSON routes read JSON: a body that says it is something else is refused, one that says nothing is read.
    r = client.post("/v1/chat/completions", content=json.dumps({"messages": CHAT, "max_tokens": 1}),
                    headers={"content-type": "text/plain"})
    check_error(r, 415, code="unsupported_media_type")
    assert client.post("/v1/chat/completions", content=json.dumps({"messages": CHAT, "max_tokens": 1})).status_code == 200
    check_error(client.post("/v1/chat/completions", json={"messages": CHAT, "stream_options": {"include_usage": True}}),
                400, param="stream_options")
    check_error(client.post("/v1/completions", json={"prompt": "Hi", "stream": False,
                                                      "stream_options": {"include_usage": True}}),
                400, param="stream_options")
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    check_error(client.post("/v1/chat/completions", json={"messages": CHAT, "response_format": bad_schema}),
                400, param="response_format.json_schema.schema")
    check_error(client.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2}), 400, param="messages")
    check_error(client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2}), 400, param="messages")


def test_too_long_prompt_in_a_stream_is_a_400_before_any_sse_byte(client: httpx.Client) -> None:
    long = [{"role": "user", "content": "x " * 9000}]
    with client.stream("POST", "/v1/chat/completions", json={"messages": long, "stream": True}) as r:
        body = r.read()
    assert not body.startswith(b"data:")
    check_error(r, 400, param="messages", code="context_length_exceeded")
    with client.stream("POST", "/v1/completions", json={"prompt": "x " * 9000, "stream": True}) as r:
        body = r.read()
    assert not body.startswith(b"data:")
    check_error(r, 400, param="prompt", code="context_length_exceeded")


def test_what_clients_send_that_must_work(client: httpx.Client) -> None:
    def chat(messages: list[dict], **extra: Any) -> dict[str, Any]:
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
        return r.json()["usage"]

    plain = chat(CHAT)["prompt_tokens"]
    assert plain == chat_prompt_tokens(client, CHAT)
    # Unknown fields are ignored, whatever their type.
    assert chat(CHAT, store=False, metadata={"a": "b"}, service_tier="auto", reasoning_effort="low",
                some_future_field=[1, {"x": None}])["prompt_tokens"] == plain
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]}]
    assert chat(parts)["prompt_tokens"] == plain  # the parts are joined into the same prompt
    # "developer" is the system role under its new name: the same prompt, token for token.
    system = [{"role": "system", "content": "You answer briefly."}, *CHAT]
    as_system = chat_prompt_tokens(client, system)
    assert as_system != plain  # (without a system message the template adds its own default one)
    assert chat([{"role": "developer", "content": "You answer briefly."}, *CHAT])["prompt_tokens"] == as_system


def test_api_key_guards_the_api_but_not_the_probes(keyed_server: Server) -> None:
    with httpx.Client(base_url=keyed_server.url, timeout=10) as c:
        r = c.get("/v1/models")
        check_error(r, 401, code="invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer" and r.headers["x-request-id"]
        check_error(c.get("/v1/models", headers={"Authorization": "Bearer key-three"}), 401, code="invalid_api_key")
        assert c.get("/v1/models", headers={"Authorization": "Bearer key-two"}).status_code == 200
        for path in ("/health", "/ready", "/metrics"):
            assert c.get(path).status_code == 200, path
        check_error(c.post("/tokenize", json={"prompt": "Hi"}), 401, code="invalid_api_key")
        check_error(c.post("/detokenize", json={"tokens": [1]}), 401, code="invalid_api_key")
        r = c.post("/tokenize", json={"prompt": "Hi"}, headers={"Authorization": "Bearer key-one"})
        assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0


# ---- 5. tokenizer, probes, request ids, access log ----------------------------------------------


def test_tokenize_detokenize_round_trip(client: httpx.Client) -> None:
    text = "Hello world, how are you? ünïcode ✓"
    r = client.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200
    out = r.json()
    max_model_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
    assert out["count"] == len(out["tokens"]) > 5 and out["max_model_len"] == max_model_len
    assert client.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": text}
    check_error(client.post("/detokenize", json={"tokens": [10**9]}), 400, param="tokens")
    check_error(client.post("/tokenize", json={"prompt": text, "messages": CHAT}), 400, param="prompt")
    # Chat messages tokenize exactly as the chat route counts them.
    usage = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert client.post("/tokenize", json={"messages": CHAT}).json()["count"] == usage["prompt_tokens"]


def test_probes_and_request_ids(client: httpx.Client) -> None:
    for path, status in (("/health", "ok"), ("/ready", "ready")):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json" and r.json() == {"status": status}
    responses = [client.get("/health"), client.get("/metrics"), client.get("/nope"), client.get("/v1/models"),
                 client.post("/v1/chat/completions", content=b"[")]
    with client.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "stream": True}) as r:
        r.read()
        responses.append(r)
    ids = [r.headers["x-request-id"] for r in responses]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids)
    for path in ("/health", "/v1/nope", "/v1/models"):
        assert client.get(path, headers={"X-Request-Id": "my-id-42"}).headers["x-request-id"] == "my-id-42"
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "stream": True},
                    headers={"X-Request-Id": "my-stream-7"})
    assert r.headers["x-request-id"] == "my-stream-7"


def test_access_log_line_is_structured(server: Server, client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "ignore_eos": True},
                    headers={"X-Request-Id": "access-log-1"})
    usage = r.json()["usage"]
    line = wait_for_access_line(server, "access-log-1")
    assert set(line) == {"request_id", "method", "path", "status", "duration_ms", "prompt_tokens",
                         "completion_tokens", "ttft_ms"}
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/chat/completions", 200)
    assert (line["prompt_tokens"], line["completion_tokens"]) == (usage["prompt_tokens"], 3)
    assert 0 < line["ttft_ms"] <= line["duration_ms"]
