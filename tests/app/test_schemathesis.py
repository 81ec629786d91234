"""Property-based API tests: schemathesis generates requests from the server's own /openapi.json
(schema-valid bodies, deliberately invalid ones, and boundary values) and checks every response.

Checks: no 5xx (and no dropped connection: a crashed worker fails the call), and the responses
conform to what /openapi.json documents - status codes, content types, bodies (every 4xx is an
OpenAI error object, every streamed event has data), 405 on undocumented methods. Left out, as
too strict for an LLM server rather than signs of a bug:
- positive_data_acceptance: a schema-valid body may still rightly get a 400 - tools and other
  features not built yet, cross-field rules (stream_options without stream, top_logprobs without
  logprobs), limits that depend on the loaded model (context length, vocabulary), value ranges
  checked by the engine rather than declared in the schema.
- negative_data_rejection: pydantic's lax mode accepts 0/1 for booleans and 2.0 for integers,
  as lenient OpenAI servers do; schemathesis counts those as schema violations let through.
"""
from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)
from schemathesis.core.result import Err

from app.openapi import openapi_schema
from tests.app.conftest import Server

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          unsupported_method]
# Fuzzed cases per operation (the coverage phase adds its boundary cases on top): enough to cross
# the validation branches, few enough that the file runs in under a minute on two CPU cores.
MAX_EXAMPLES = 20
# Up to 128 samples, each filling the context, add up even on a tiny model, so positive max_tokens /
# max_completion_tokens are lowered to this and an absent one ("until the context is full") is set
# to it. Zero, negative and ill-typed values still reach the server, to exercise its 400s. n is left
# alone on purpose: n in [1, 128] with 2 tokens is cheap, and capping it here would hide the server's
# own bound (an unbounded n once let one request get the worker killed for memory).
MAX_TOKENS = 2
TOKEN_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# Each generating route, and the token-count field it reads.
GENERATION_PATHS = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
                    "/v1/responses": "max_output_tokens"}

# Built at collection from the function that serves /openapi.json (the first test checks that the
# served document is this one): schemathesis' fixture-based loader does not run under pytest 9.
schema = schemathesis.openapi.from_dict(openapi_schema(), config=schemathesis.Config.from_dict({"seed": 0}))


def bounded(body: object, key: str = "max_tokens") -> object:
    """A generation body with its token count capped at MAX_TOKENS (see there), set in `key` where it
    has none; all else unchanged."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for k in TOKEN_KEYS:
        value = out.get(k)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_TOKENS:
            out[k] = MAX_TOKENS
    if all(out.get(k) is None for k in TOKEN_KEYS):
        out[key] = MAX_TOKENS
    return out


def test_served_schema_loads_and_validates(random_server: Server) -> None:
    """The served /openapi.json is the one fuzzed below, and every operation in it resolves
    (references, request bodies, parameters) without a schema error."""
    served = schemathesis.openapi.from_url(random_server.url + "/openapi.json")
    assert served.raw_schema == openapi_schema()
    results = list(served.get_all_operations())
    assert [r.err() for r in results if isinstance(r, Err)] == []
    assert sorted(r.ok().label for r in results) == sorted([
        "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /v1/models/{model_id}",
        "POST /v1/responses", "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
        "POST /tokenize", "POST /detokenize", "GET /health", "GET /ready", "GET /metrics",
    ])


def test_bounded_caps_only_token_counts() -> None:
    assert bounded({"messages": [], "max_tokens": 10**6, "n": 10**9}) == {"messages": [], "max_tokens": 2, "n": 10**9}
    assert bounded({"prompt": "x", "max_tokens": None}) == {"prompt": "x", "max_tokens": 2}
    assert bounded({"max_completion_tokens": 1e9}) == {"max_completion_tokens": 2}
    assert bounded({"input": "x"}, "max_output_tokens") == {"input": "x", "max_output_tokens": 2}
    assert bounded({"max_output_tokens": 10**6}, "max_output_tokens") == {"max_output_tokens": 2}
    for kept in ({"max_tokens": -5}, {"max_tokens": 0}, {"max_tokens": "many"}, {"max_completion_tokens": 1}):
        assert bounded(kept) == kept
    assert bounded(b"\x00") == b"\x00"


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          # Generation speed varies on a busy two-core machine; it says nothing about the server.
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_no_server_errors_and_responses_conform(case: schemathesis.Case, random_server: Server) -> None:
    if case.operation.path in GENERATION_PATHS:
        case.body = bounded(case.body, GENERATION_PATHS[case.operation.path])
    case.call_and_validate(base_url=random_server.url, checks=CHECKS, timeout=30)
