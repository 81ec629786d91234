"""/openapi.json: the API as served, request bodies generated from the pydantic models."""
from __future__ import annotations

from functools import cache
from typing import Any

from pydantic.json_schema import models_json_schema

from app.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from app.responses_protocol import ResponsesRequest

_ERROR = {"description": "An OpenAI-shaped error", "content": {"application/json": {"schema": {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}}}}
_JSON_OK = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
_ERRORS = {str(code): _ERROR for code in (400, 401, 404, 413, 429, 503)}
# Before OpenAPI 3.2 (itemSchema), an event stream's schema describes one event, not the whole stream.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "A JSON chunk, or [DONE] after the last one"}}}


_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}


def _post(summary: str, model: str, streams: bool = False) -> dict[str, Any]:
    ok = dict(_JSON_OK)
    if streams:
        ok = {"description": "JSON, or server-sent events when stream is true",
              "content": {"application/json": {"schema": {"type": "object"}},
                          "text/event-stream": {"schema": _SSE_EVENT}}}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model}"}}}}, "responses": {"200": ok, **_ERRORS}}}


def _get(summary: str, errors: tuple[int, ...] = ()) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": _JSON_OK, **{str(c): _ERROR for c in errors}}}}


@cache
def openapi_schema() -> dict[str, Any]:
    models = [ChatCompletionRequest, CompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest]
    _, schemas = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    return {
        "openapi": "3.1.0",
        "info": {"title": "minillm", "version": "0.1.0",
                 "description": "OpenAI-compatible LLM inference. With --api-key set, /v1/* and the tokenizer "
                                "routes need 'Authorization: Bearer <key>'; /health, /ready and /metrics stay open."},
        "components": {"schemas": schemas.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/chat/completions": _post("Create a chat completion", "ChatCompletionRequest", streams=True),
            "/v1/completions": _post("Create a text completion", "CompletionRequest", streams=True),
            "/v1/responses": _post("Create a response (typed server-sent events when stream is true)",
                                   "ResponsesRequest", streams=True),
            "/v1/responses/{response_id}": {
                "get": {**_get("Retrieve a stored response", (401, 404))["get"], "parameters": [_RESPONSE_ID]},
                "delete": {**_get("Delete a stored response", (401, 404))["get"], "parameters": [_RESPONSE_ID]}},
            "/v1/models": _get("List models", (401,)),
            "/v1/models/{model_id}": {"get": {**_get("Retrieve a model", (401, 404))["get"], "parameters": [
                {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]}},
            "/tokenize": _post("Tokenize a prompt or chat", "TokenizeRequest"),
            "/detokenize": _post("Turn token ids into text", "DetokenizeRequest"),
            "/health": _get("Liveness: 200 while the engine loop is alive", (503,)),
            "/ready": _get("Readiness: 200 once the model is loaded and warmed", (503,)),
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
                "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
    }
