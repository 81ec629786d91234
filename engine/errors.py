"""Typed errors raised by the engine: what went wrong and which input is at fault. The app maps each
class to its HTTP response in one table (app/errors.py)."""
from __future__ import annotations


class MinillmError(Exception):
    """Base of every error minillm raises on purpose.

    `param` names the offending input (a request field such as "messages", or a setting); `code` is a
    machine-readable reason where there is one (e.g. "context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(MinillmError):
    """A request the engine cannot serve as asked (bad parameter, bad prompt)."""


class ContextLengthError(InvalidRequestError):
    """The prompt (plus max_tokens) does not fit the model's context."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelLoadError(MinillmError):
    """A model directory or named shape that cannot be loaded: says what is wrong."""


class EngineDeadError(MinillmError):
    """The engine loop has died; no request can be served."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="engine_dead")


class EngineFailedError(MinillmError):
    """A step raised: the request in flight fails (500, naming it) and the engine stops."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="engine_failed")


class RequestAbortedError(MinillmError):
    """The request was aborted before it finished."""
