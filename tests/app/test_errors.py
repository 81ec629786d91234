"""The one table from engine errors to HTTP statuses and OpenAI error types."""
from __future__ import annotations

import inspect

import pytest

import engine.errors
from app.errors import ENGINE_ERRORS, APIError, status_and_type, typed_error_body
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
