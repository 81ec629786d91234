"""Pure-ASGI middleware: request ids, API keys, body-size limits, the access log and status counts."""
from __future__ import annotations

import hmac
import logging
import time
import uuid
from typing import Any, Callable

from app.errors import error_body
from app.json import dumps
from app.metrics import Metrics

Scope = dict[str, Any]
ASGIApp = Callable[..., Any]
access_log = logging.getLogger("minillm.access")

# Paths that need the API key when one is set; /health, /ready and /metrics stay open for probes.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


async def _send_error(send: Callable, status: int, message: str, type: str, code: str | None,
                      headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = dumps(error_body(message, type, None, code))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class ServerMiddleware:
    def __init__(self, app: ASGIApp, api_keys: list[str], max_body_bytes: int, metrics: Metrics) -> None:
        self.app = app
        self.api_keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

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
        status = {"code": 500}

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            path = scope["path"]
            if self.api_keys and path.startswith(PROTECTED_PREFIXES) and not self._authorized(headers):
                await _send_error(send_with_id, 401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                  "invalid_request_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                return
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                # The body is never read, so the connection cannot be reused: tell the client.
                await _send_error(send_with_id, 413, f"Request body larger than {self.max_body_bytes} bytes.",
                                  "invalid_request_error", "body_too_large", [(b"connection", b"close")])
                return
            await self.app(scope, receive, send_with_id)
        finally:
            self.metrics.observe_status(status["code"])
            if scope["path"] not in ("/health", "/ready", "/metrics"):
                access_log.info(dumps({
                    "request_id": request_id, "method": scope["method"], "path": scope["path"],
                    "status": status["code"], "duration_ms": round((time.monotonic() - started) * 1000, 1),
                    "prompt_tokens": state.get("prompt_tokens"), "completion_tokens": state.get("completion_tokens"),
                    "ttft_ms": state.get("ttft_ms"),
                }).decode())
