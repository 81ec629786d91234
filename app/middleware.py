"""Pure-ASGI middleware: request ids, API keys, body-size limits, the cap on requests served at once,
write timeouts, the access log and status counts."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any, Callable

from app.errors import error_body
from app.json import dumps
from app.metrics import Metrics
from app.settings import ServerSettings

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[..., Any]
access_log = logging.getLogger("minillm.access")
log = logging.getLogger("minillm.app")

# Paths that need the API key when one is set; /health, /ready and /metrics stay open for probes.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
PROBES = ("/health", "/ready", "/metrics")
CLIENT_GONE = 499  # nginx's "client closed request": logged and counted when the client left before the end
DISCONNECT: Message = {"type": "http.disconnect"}


async def _send_error(send: Callable, status: int, message: str, type: str, code: str | None,
                      headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = dumps(error_body(message, type, None, code))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class Exchange:
    """One request's view of its connection: the status sent, whether the response ended, and
    whether the client left. A client that reads nothing for the write timeout counts as gone: its
    receive() says http.disconnect (so a stream is cancelled as if it had left) and the rest of what
    the app sends is dropped, so nothing piles up for it."""

    def __init__(self, receive: Callable, send: Callable, request_id: str, write_timeout: float) -> None:
        self._receive, self._send = receive, send
        self.request_id = request_id
        self.write_timeout = write_timeout
        self.status = 500  # until a response starts
        self.ended = False  # the response's last part went to the server
        self.client_gone = False
        self.body_read = False
        self.stalled = asyncio.Event()

    @property
    def outcome(self) -> int:
        """The status to log and count: 499 when the client left before the response ended."""
        return CLIENT_GONE if self.client_gone else self.status

    async def receive(self) -> Message:
        if self.stalled.is_set():
            return DISCONNECT
        if self.body_read:  # past the body, receive() only waits for the client to leave, or to stall
            message = await _first(self._receive(), self.stalled.wait()) or DISCONNECT
        else:
            message = await self._receive()
        if message["type"] == "http.disconnect":
            # Mid-body the server says this of a malformed body too: the body's reader answers that.
            self.client_gone = self.body_read and not self.ended
        elif not message.get("more_body", False):
            self.body_read = True
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            message["headers"] = [*message.get("headers", []), (b"x-request-id", self.request_id.encode())]
        if self.stalled.is_set():
            return
        sending = self._send(message)
        if asyncio.isfuture(sending) and not sending.done():
            # The server's buffer for this response is full: the client reads slower than we write.
            try:
                async with asyncio.timeout(self.write_timeout):
                    await sending
            except TimeoutError:
                log.warning("request %s: the client read nothing for %g s; its response is aborted",
                            self.request_id, self.write_timeout)
                self.client_gone = True
                self.stalled.set()
                return
        else:
            await sending
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True


async def _first(message: Awaitable[Message], stalled: Awaitable[Any]) -> Message | None:
    """The message, or None if `stalled` is done first; whichever is left is cancelled."""
    tasks = [asyncio.ensure_future(message), asyncio.ensure_future(stalled)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
    return tasks[0].result() if tasks[0] in done else None


class ServerMiddleware:
    def __init__(self, app: ASGIApp, settings: ServerSettings, metrics: Metrics) -> None:
        self.app = app
        self.api_keys = [k.encode() for k in settings.api_keys]
        self.max_body_bytes = settings.max_body_bytes
        self.max_connections = settings.max_connections
        self.write_timeout = settings.write_timeout
        self.metrics = metrics
        self.active = 0  # requests being served, probes aside

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        value = headers.get(b"authorization", b"")
        token = value[7:].strip() if value[:7].lower() == b"bearer " else b""
        # Compare against every key in constant time, so timing says nothing about which matched.
        return any([hmac.compare_digest(token, key) for key in self.api_keys])

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        exchange = Exchange(receive, send, request_id, self.write_timeout)
        path = scope["path"]
        try:
            if sum(name == b"authorization" for name, _ in scope["headers"]) > 1:
                # A proxy may check the first and we the last: refuse rather than pick one.
                await _send_error(exchange.send, 400, "Send one Authorization header, not several.",
                                  "invalid_request_error", "duplicate_authorization")
                return
            if self.api_keys and path.startswith(PROTECTED_PREFIXES) and not self._authorized(headers):
                await _send_error(exchange.send, 401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                  "invalid_request_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                return
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                # The body is never read, so the connection cannot be reused: tell the client.
                await _send_error(exchange.send, 413, f"Request body larger than {self.max_body_bytes} bytes.",
                                  "invalid_request_error", "body_too_large", [(b"connection", b"close")])
                return
            if path in PROBES:
                await self.app(scope, exchange.receive, exchange.send)
            elif self.active >= self.max_connections:
                await _send_error(exchange.send, 503, f"The server is serving its limit of {self.max_connections} "
                                  "requests; retry shortly.", "service_unavailable", "too_many_connections",
                                  [(b"retry-after", b"1"), (b"connection", b"close")])
            else:
                await self._serve(scope, exchange)
        finally:
            status = exchange.outcome
            self.metrics.observe_status(status)
            if path not in PROBES:
                access_log.info(dumps({
                    "request_id": request_id, "method": scope["method"], "path": path,
                    "status": status, "duration_ms": round((time.monotonic() - started) * 1000, 1),
                    "prompt_tokens": state.get("prompt_tokens"), "completion_tokens": state.get("completion_tokens"),
                    "ttft_ms": state.get("ttft_ms"),
                }).decode())

    async def _serve(self, scope: Scope, exchange: Exchange) -> None:
        self.active += 1
        self.metrics.http_active.inc()
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except Exception as e:
            if not exchange.client_gone:
                raise
            # Nobody is left to answer: an abort (499), not a server error.
            log.info("request %s: %r after its client left", exchange.request_id, e)
        finally:
            self.active -= 1
            self.metrics.http_active.dec()
