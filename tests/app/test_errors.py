"""The one table from engine errors to HTTP statuses and OpenAI error types; and the statuses the
HTTP layer gives its own faults (clients that leave or stop reading, refused headers and bodies)."""
from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

import engine.errors
from app.errors import ENGINE_ERRORS, APIError, status_and_type, typed_error_body
from app.generation import read_json
from app.metrics import Metrics
from app.middleware import ServerMiddleware
from app.settings import ServerSettings
from engine.errors import (ContextLengthError, EngineDeadError, InvalidRequestError, MinillmError, ModelLoadError,
                           RequestAbortedError)


@pytest.mark.parametrize(("error", "status", "type_"), [
    (InvalidRequestError("bad", param="top_p"), 400, "invalid_request_error"),
    (ContextLengthError("too long", param="prompt"), 400, "invalid_request_error"),
    (ModelLoadError("no config.json"), 500, "model_load_error"),
    (EngineDeadError("gone"), 503, "service_unavailable"),
    (RequestAbortedError("aborted"), 499, "request_aborted"),
    (MinillmError("?"), 500, "internal_error"),
    (APIError(429, "slow down", "rate_limit_exceeded", code="queue_full"), 429, "rate_limit_exceeded"),
])
def test_each_error_maps_to_its_status_and_type(error: MinillmError, status: int, type_: str) -> None:
    assert status_and_type(error) == (status, type_)
    body = typed_error_body(error)["error"]
    assert (body["message"], body["type"], body["param"], body["code"]) == (error.message, type_, error.param, error.code)


def test_every_engine_error_class_is_in_the_table_and_carries_no_http() -> None:
    classes = [c for _, c in inspect.getmembers(engine.errors, inspect.isclass) if issubclass(c, MinillmError)]
    assert set(classes) == set(ENGINE_ERRORS)
    for cls in classes:
        assert not hasattr(cls, "status") and not hasattr(cls, "type"), cls


def test_a_subclass_maps_as_its_nearest_listed_base() -> None:
    class PromptTooOdd(ContextLengthError):
        pass

    assert status_and_type(PromptTooOdd("odd")) == (400, "invalid_request_error")
    assert typed_error_body(PromptTooOdd("odd"))["error"]["code"] == "context_length_exceeded"
    assert typed_error_body(EngineDeadError("gone"))["error"]["code"] == "engine_dead"


# ---- request bodies: defaults and ranges that give a 400 naming the param (issue 28, item 10) -------


def test_empty_model_null_max_tokens_and_seed_range() -> None:
    from app.protocol import ChatCompletionRequest, CompletionRequest

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert CompletionRequest.model_validate({"prompt": "x", "model": ""}).model is None  # as if omitted
    assert ChatCompletionRequest.model_validate({**chat, "model": ""}).model is None
    for body in ({"prompt": "x"}, {"prompt": "x", "max_tokens": None}):  # OpenAI's default, null or not
        assert CompletionRequest.model_validate(body).to_engine()[1].max_tokens == 16
    assert ChatCompletionRequest.model_validate(chat).to_engine()[1].max_tokens is None  # the context or a stop
    for seed in (2**63 - 1, -(2**63)):
        CompletionRequest.model_validate({"prompt": "x", "seed": seed}).to_engine()[1].validate()
    # orjson reads integers past 64 bits as floats, rounded: -2**63 - 1 arrives as float(-2**63).
    for seed in (2**63, 2**64 - 1, 2**64, -(2**63) - 1, float(2**64), float(-(2**63))):
        with pytest.raises(InvalidRequestError, match="signed 64-bit integer.*OpenAI's API") as e:
            CompletionRequest.model_validate({"prompt": "x", "seed": seed}).to_engine()[1].validate()
        assert e.value.param == "seed"


# ---- the HTTP layer's own faults: clients that leave or stall, refused headers and bodies (issue 28) ---

Message = dict[str, Any]
BODY_END: Message = {"type": "http.request", "body": b"", "more_body": False}
BOUND = 10.0  # seconds: a call that hangs fails the test instead


def middleware(app: Callable, **settings: Any) -> tuple[ServerMiddleware, Metrics]:
    metrics = Metrics("m", lambda: None)
    return ServerMiddleware(app, ServerSettings(**settings), metrics), metrics


def call(asgi: Callable, receive: Callable, send: Callable, path: str = "/v1/chat/completions",
         headers: list[tuple[bytes, bytes]] | None = None) -> None:
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers or []}
    asyncio.run(asyncio.wait_for(asgi(scope, receive, send), BOUND))


def counted(metrics: Metrics, status: int) -> float:
    return metrics.registry.get_sample_value("minillm_http_requests_total", {"model": "m", "status": str(status)}) or 0


def receiver(*messages: Message) -> Callable:
    """A client that sends `messages` (by default an empty body), then has gone."""
    queue = [*messages] or [BODY_END]

    async def receive() -> Message:
        return queue.pop(0) if queue else {"type": "http.disconnect"}
    return receive


def test_a_client_that_left_before_the_response_ended_is_a_499_even_if_the_app_then_fails() -> None:
    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        await receive()  # the body
        assert (await receive())["type"] == "http.disconnect"
        # What Starlette does with an error: a 500 (to nobody now), and the error raised on.
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b"Internal Server Error"})
        raise RuntimeError("cleanup failed after the client left")

    asgi, metrics = middleware(app)
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    call(asgi, receiver(), send)  # no exception reaches the server
    assert counted(metrics, 499) == 1 and counted(metrics, 500) == 0 and counted(metrics, 200) == 0

    async def failing(scope: dict, receive: Callable, send: Callable) -> None:
        raise RuntimeError("a bug, the client still there")

    asgi, metrics = middleware(failing)
    with pytest.raises(RuntimeError):
        call(asgi, receiver(), send)
    assert counted(metrics, 500) == 1


def test_a_client_that_reads_nothing_is_cut_off_after_the_write_timeout() -> None:
    seen: list[str] = []

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})  # never taken
        seen.append((await receive())["type"])  # what a stream's disconnect listener sees
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})  # dropped

    asgi, metrics = middleware(app, write_timeout=0.05)
    server_got: list[Message] = []

    def send(message: Message) -> Any:
        server_got.append(message)
        if message["type"] == "http.response.start":
            return asyncio.sleep(0)
        return asyncio.get_running_loop().create_future()  # the server's buffer is full and stays full

    async def receive_forever() -> Message:
        if not server_got:
            return BODY_END
        await asyncio.sleep(3600)  # the client neither reads nor leaves
        raise AssertionError

    call(asgi, receive_forever, send)
    assert seen == ["http.disconnect"] and len(server_got) == 2
    assert counted(metrics, 499) == 1


def test_duplicate_authorization_headers_are_refused_before_the_app() -> None:
    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        raise AssertionError("not reached")

    asgi, metrics = middleware(app, api_key="k")
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    call(asgi, receiver(), send, path="/v1/models",
         headers=[(b"authorization", b"Bearer k"), (b"authorization", b"Bearer k")])
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["error"]["code"] == "duplicate_authorization"


def test_requests_past_max_connections_get_503_while_probes_pass() -> None:
    async def scenario() -> list[int]:
        release = asyncio.Event()

        async def app(scope: dict, receive: Callable, send: Callable) -> None:
            if scope["path"] != "/health":
                await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        asgi, _ = middleware(app, max_connections=1)
        statuses: list[int] = []

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        receive = receiver()
        scope = {"type": "http", "method": "POST", "headers": []}
        held = asyncio.create_task(asgi(scope | {"path": "/v1/completions"}, receive, send))
        await asyncio.sleep(0)
        await asgi(scope | {"path": "/v1/completions"}, receive, send)
        await asgi(scope | {"path": "/health"}, receive, send)
        release.set()
        await held
        await asgi(scope | {"path": "/v1/completions"}, receive, send)  # the slot is free again
        return statuses

    assert asyncio.run(scenario()) == [503, 200, 200, 200]


def json_request(headers: dict[str, str], *messages: Message, body_timeout: float = 60.0) -> Request:
    settings = ServerSettings(body_timeout=body_timeout)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "app": SimpleNamespace(state=SimpleNamespace(minillm=SimpleNamespace(settings=settings)))}
    queue = [*messages]

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)  # a client that sends nothing more
        raise AssertionError

    return Request(scope, receive)


def read_error(request: Request) -> APIError:
    with pytest.raises(APIError) as e:
        asyncio.run(asyncio.wait_for(read_json(request, 1000), BOUND))
    return e.value


@pytest.mark.parametrize("content_type", [None, "application/json", "application/json; charset=utf-8",
                                          "application/vnd.api+json", "APPLICATION/JSON"])
def test_json_bodies_with_a_json_type_or_none_are_read(content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    body = {"type": "http.request", "body": b'{"a": 1}', "more_body": False}
    assert asyncio.run(read_json(json_request(headers, body), 1000)) == {"a": 1}


def test_a_body_of_another_type_is_a_415() -> None:
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        e = read_error(json_request({"content-type": content_type}, BODY_END))
        assert (e.status, e.code, e.headers) == (415, "unsupported_media_type", {"Connection": "close"})


def test_a_body_cut_short_is_the_client_leaving_or_a_bad_chunk() -> None:
    part = {"type": "http.request", "body": b'{"a"', "more_body": True}
    gone = {"type": "http.disconnect"}  # what the server says when it gives up on the body
    e = read_error(json_request({"content-length": "100"}, part, gone))
    assert (e.status, e.type, e.code) == (499, "request_aborted", "client_closed")
    e = read_error(json_request({"transfer-encoding": "chunked"}, part, gone))
    assert (e.status, e.code, e.headers) == (400, "invalid_body", {"Connection": "close"})


def test_a_body_that_does_not_arrive_in_time_is_a_408() -> None:
    part = {"type": "http.request", "body": b'{"a"', "more_body": True}
    e = read_error(json_request({"content-length": "100"}, part, body_timeout=0.05))
    assert (e.status, e.code, e.headers) == (408, "body_timeout", {"Connection": "close"})


def test_a_misspelt_prefix_cache_isolation_is_refused_not_ignored() -> None:
    from app.settings import ServerSettings

    assert ServerSettings(prefix_cache_isolation="api-key").prefix_cache_isolation == "api-key"
    with pytest.raises(InvalidRequestError, match="must be none or api-key, not 'apikey'") as e:
        ServerSettings(prefix_cache_isolation="apikey")
    assert e.value.param == "prefix_cache_isolation"
