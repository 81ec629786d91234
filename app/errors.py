"""Every error the server returns, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Handlers here are the one place typed errors become HTTP responses; ENGINE_ERRORS is the one table
from an engine error class to its HTTP status and OpenAI error type.
"""
from __future__ import annotations

import logging
import re

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from app.json import JSONResponse
from engine.errors import (ContextLengthError, EngineDeadError, EngineFailedError, InvalidRequestError, MinillmError,
                           ModelLoadError, RequestAbortedError)

log = logging.getLogger("minillm.app")

# Engine error class -> (HTTP status, OpenAI error type), looked up along the class's MRO.
ENGINE_ERRORS: dict[type[MinillmError], tuple[int, str]] = {
    ContextLengthError: (400, "invalid_request_error"),
    InvalidRequestError: (400, "invalid_request_error"),
    ModelLoadError: (500, "model_load_error"),
    EngineDeadError: (503, "service_unavailable"),
    EngineFailedError: (500, "internal_error"),
    RequestAbortedError: (499, "request_aborted"),
    MinillmError: (500, "internal_error"),
}


class APIError(MinillmError):
    """An HTTP-level error raised by the app itself (auth, routing, limits): it carries its own status."""

    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.status = status
        self.type = type
        self.headers = headers or {}


def status_and_type(exc: MinillmError) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of a typed error."""
    if isinstance(exc, APIError):
        return exc.status, exc.type
    return next(ENGINE_ERRORS[cls] for cls in type(exc).__mro__ if cls in ENGINE_ERRORS)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def typed_error_body(exc: MinillmError) -> dict:
    """A typed error's OpenAI body (also sent as the last event of a stream that failed midway)."""
    return error_body(exc.message, status_and_type(exc)[1], exc.param, exc.code)


def error_response(status: int, message: str, type: str, param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


_UNION_MEMBER = re.compile(r"[^a-z0-9_]|^(str|int|float|bool|dict|list|none)$")


def param_of(loc: tuple) -> str:
    """pydantic's location ('messages', 0, 'role') as OpenAI writes it: messages[0].role. It ends
    where pydantic names a union's member ("literal['auto']", "list[TextPart]", "str"): not a field."""
    out = ""
    for part in loc:
        if isinstance(part, str) and _UNION_MEMBER.search(part):
            break
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


async def handle_minillm_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, MinillmError)
    status, _ = status_and_type(exc)
    headers = exc.headers if isinstance(exc, APIError) else None
    if status >= 500 and not isinstance(exc, EngineDeadError):  # a dead loop was logged when it died
        log.error("request %s failed: %s", getattr(request.state, "request_id", "-"), exc.message)
    return JSONResponse(typed_error_body(exc), status_code=status, headers=headers)


async def handle_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ValidationError)
    first = exc.errors(include_url=False)[0]
    param = param_of(tuple(first["loc"]))
    return error_response(400, f"Invalid value for {param or 'the body'}: {first['msg']}.", "invalid_request_error", param or None)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kinds = {404: ("not_found_error", "Not found: " + request.url.path),
             405: ("invalid_request_error", f"Method {request.method} is not allowed on {request.url.path}.")}
    type_, message = kinds.get(exc.status_code, ("invalid_request_error", str(exc.detail)))
    return error_response(exc.status_code, message, type_, headers=getattr(exc, "headers", None))


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    """A bug: log it with the request id, answer 500 without internals."""
    request_id = getattr(request.state, "request_id", "-")
    log.exception("request %s failed with an unexpected error", request_id)
    return error_response(500, f"Internal server error (request id {request_id}).", "internal_error")


EXCEPTION_HANDLERS = {
    MinillmError: handle_minillm_error,
    ValidationError: handle_validation_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
