"""Typed errors raised by the engine. The app maps each to an OpenAI error body in one place."""
from __future__ import annotations


class MinillmError(Exception):
    """Base of every error minillm raises on purpose."""

    status: int = 500
    type: str = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(MinillmError):
    """A request the engine cannot serve as asked (bad parameter, bad prompt)."""

    status = 400
    type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    """The prompt (plus max_tokens) does not fit the model's context."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelLoadError(MinillmError):
    """A model directory or named shape that cannot be loaded: says what is wrong."""

    status = 500
    type = "model_load_error"


class EngineDeadError(MinillmError):
    """The engine loop has died; no request can be served."""

    status = 503
    type = "engine_dead"


class RequestAbortedError(MinillmError):
    """The request was aborted before it finished."""

    status = 499
    type = "request_aborted"
