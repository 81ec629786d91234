"""What every generating route shares: reading the body, queueing one engine request per prompt,
merging their outputs into one stream of choices, metrics and traces, and client disconnects."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse

from app import tracing
from app.errors import APIError
from app.json import loads
from app.state import AppState
from engine.errors import RequestAbortedError
from engine.outputs import RequestOutput, Usage
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON: 415 if it says it is something else, 413 past the limit (even without
    Content-Length), 408 if it is not all there within --body-timeout, 400 if not JSON."""
    check_json_type(request.headers.get("content-type"))
    timeout = state_of(request).settings.body_timeout
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    # The rest of the body stays unread, so the server will drop the connection: say so, or a
                    # keep-alive client sends its next request into a closing socket.
                    raise APIError(413, f"Request body larger than {limit} bytes.", "invalid_request_error",
                                   code="body_too_large", headers={"Connection": "close"})
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout:g} s.", "invalid_request_error",
                       code="body_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise body_unreadable(request) from None
    try:
        data = loads(bytes(body))
    except ValueError:
        raise APIError(400, "The body is not valid JSON.", "invalid_request_error") from None
    if not isinstance(data, dict):
        raise APIError(400, "The body must be a JSON object.", "invalid_request_error")
    return data


def check_json_type(content_type: str | None) -> None:
    """415 unless the body says it is JSON or says nothing (read as JSON, as vLLM's FastAPI does; vLLM
    refuses other types too, with a validation error)."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(415, f"Content-Type {media_type!r} is not accepted here: send 'Content-Type: application/json'.",
                       "invalid_request_error", code="unsupported_media_type", headers={"Connection": "close"})


def body_unreadable(request: Request) -> APIError:
    """The server gave up on the body: the client left mid-body, or its chunked encoding is broken."""
    if "content-length" in request.headers:  # a body of known length stops short only when the client leaves
        return APIError(499, "The client closed the connection before sending the whole body.", "request_aborted",
                        code="client_closed")
    return APIError(400, "The request body could not be read: its chunked encoding is malformed (or the client "
                    "left before it ended).", "invalid_request_error", code="invalid_body",
                    headers={"Connection": "close"})


def state_of(request: Request) -> AppState:
    return request.app.state.minillm


# ---- one generation: several prompts × n samples, merged into one stream of choices ------------


@dataclass
class Generation:
    """Everything a chat or completions call produces, as it happens."""

    kind: str  # "chat" or "completion"
    id: str
    model: str
    n: int
    num_choices: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)
    ttft: float | None = None
    # Per prompt, the usage its engine request last reported (before its first output: its prompt).
    usages: dict[int, Usage] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(u.prompt_tokens for u in self.usages.values())

    @property
    def completion_tokens(self) -> int:
        return sum(u.completion_tokens for u in self.usages.values())

    def head(self, object: str) -> dict[str, Any]:
        """The fields every response body and chunk of this generation starts with."""
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def usage(self) -> dict[str, Any]:
        """The engine's usage summed over the prompts (each prompt counted once, every choice's tokens)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in self.usages.values())}}


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the prompt's index. Closing this
    iterator cancels every stream, which aborts their requests in the engine."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def start(request: Request, gen: Generation, prompts: list[Any], params: SamplingParams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Admit the call (its prompts × n sequences), validate every prompt off the event loop (errors
    before any byte is sent), then queue them all. A client that leaves meanwhile stops the work."""
    state = state_of(request)
    engine = state.live_engine()
    with state.admit(engine, len(prompts) * params.n):
        prepared = await unless_gone(request, engine.prepare_all(
            [(p, replace(params, stop=list(params.stop)), f"{gen.id}-{i}") for i, p in enumerate(prompts)]))
        gen.usages = {i: Usage(r.num_prompt_tokens, 0) for i, r in enumerate(prepared)}
        gen.num_choices = len(prepared) * gen.n
        return merged([engine.stream(r) for r in prepared])  # queued now: waiting in the engine's count


T = TypeVar("T")


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """work's result, unless the client goes away first: then work is cancelled (499)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise RequestAbortedError("The client went away before its prompts were queued.")
    return task.result()


async def observed(request: Request, gen: Generation,
                   outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Pass outputs through while recording TTFT, inter-token gaps, usage and finish reasons; at
    the end, metrics, the trace and the access log learn about the request."""
    state = state_of(request)
    state.in_flight += 1
    last = None
    times = None
    try:
        async with aclosing(outputs):  # stopping early closes the source: aborts at once
            async for i, out in outputs:
                now = time.monotonic()
                if any(d.token_ids for d in out.deltas):
                    if gen.ttft is None:
                        gen.ttft = now - gen.started
                    elif last is not None:
                        state.metrics.observe_itl(now - last)
                    last = now
                if out.usage is not None:
                    gen.usages[i] = out.usage
                for d in out.deltas:
                    if d.finish_reason:
                        gen.finish_reasons[i * gen.n + d.index] = d.finish_reason
                if out.finished:
                    times = out.times if times is None or (out.times and out.times.total > times.total) else times
                yield i, out
    finally:
        state.in_flight -= 1
        # Choices that never finished were aborted (client gone, or the shutdown grace ran out).
        reasons = [gen.finish_reasons.get(k, "abort") for k in range(gen.num_choices)]
        state.metrics.observe_finished(times, time.monotonic() - gen.started, gen.ttft, gen.prompt_tokens,
                                       gen.completion_tokens, reasons)
        if state.tracer_provider is not None and (span := tracing.current_span()):
            tracing.record_request(span, gen.kind, gen.model, times, gen.ttft, gen.prompt_tokens,
                                   gen.completion_tokens, reasons)
        request.scope.setdefault("state", {}).update(
            prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
            ttft_ms=None if gen.ttft is None else round(gen.ttft * 1000, 1))


async def until_disconnect(request: Request) -> None:
    """Returns when the client goes away, or reads nothing past --write-timeout (the body is already
    read, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> list[tuple[int, RequestOutput]] | None:
    """All outputs of a non-streamed call; None if the client left first (the requests are aborted)."""
    async def gather() -> list[tuple[int, RequestOutput]]:
        return [item async for item in outputs]

    work = asyncio.ensure_future(gather())
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            await outputs.aclose()  # type: ignore[attr-defined]
    return work.result() if work in done else None


@dataclass
class Choice:
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


def join_choices(items: list[tuple[int, RequestOutput]], n: int, prefix: dict[int, str]) -> list[tuple[int, Choice]]:
    """A non-streamed call's choices, by index (prompt i's sample j is choice i * n + j); prefix
    holds the echoed prompt text of each prompt, if any."""
    choices: dict[int, Choice] = {}
    for i, out in items:
        for d in out.deltas:
            c = choices.setdefault(i * n + d.index, Choice(prefix.get(i, "")))
            c.text += d.text
            c.logprobs += d.logprobs or []
            c.finish_reason = d.finish_reason or c.finish_reason
    return sorted(choices.items())


def event_stream(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    """A streamed answer: server-sent events, never cached by a proxy."""
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
