"""Property-based API tests: schemathesis generates requests from the server's own /openapi.json
(valid bodies and deliberately invalid ones) and checks that none of them gets a 5xx."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.app.conftest import Server, start_server

# Per operation and phase: enough to cross every validation branch at least once, small enough
# that the whole file runs in well under a minute on two CPU cores.
MAX_EXAMPLES = 20
# Generated bodies may ask for a million tokens, choices or best_of; each decoded token costs
# milliseconds on CPU, so positive values above these are lowered before the request is sent.
# Negative, zero and ill-typed values are left alone: they are what exercises the 400 paths.
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "best_of": 2}


@pytest.fixture(scope="module")
def fuzzed_server(default_model_dir, tmp_path_factory) -> Iterator[Server]:
    """A server of our own: fuzzing must not disturb the shared one (its metrics, its queue)."""
    s = start_server(default_model_dir, tmp_path_factory.mktemp("fuzzed") / "server.log", "--max-model-len", "256")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed_server: Server) -> schemathesis.BaseSchema:
    config = schemathesis.Config.from_dict({"seed": 0})
    return schemathesis.openapi.from_url(fuzzed_server.url + "/openapi.json", config=config)


def bounded(body: object) -> object:
    """The body with token and choice counts capped (see CAPS); anything else unchanged."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for key, cap in CAPS.items():
        value = out.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            out[key] = cap
    # Absent or null max_tokens means "until the context is full": bounded by --max-model-len,
    # but a few hundred tokens per case would still dominate the run.
    if out.get("max_tokens") is None and out.get("max_completion_tokens") is None:
        out["max_tokens"] = CAPS["max_tokens"]
    return out


schema = schemathesis.pytest.from_fixture("api_schema")


def test_schema_loads_and_validates(api_schema: schemathesis.BaseSchema) -> None:
    """Every operation in /openapi.json resolves (refs, bodies, parameters) without a schema error."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    labels = sorted(op.label for op in operations)
    assert labels == sorted([
        "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /v1/models/{model_id}",
        "POST /tokenize", "POST /detokenize", "GET /health", "GET /ready", "GET /metrics",
    ])


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case) -> None:
    case.body = bounded(case.body)
    case.call_and_validate(checks=[not_a_server_error], timeout=30)
