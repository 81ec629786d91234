"""OpenTelemetry, in process: one server span per request with the request's lifecycle events and
gen_ai.* attributes, an incoming traceparent honoured, probes untraced - and off by default."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.testclient import TestClient

from app.middleware import ServerMiddleware
from app.server import create_app
from app.settings import ServerSettings
from engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "Name three colours."}]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
LIFECYCLE = ["queued", "prefill", "first_token", "finish"]
OTEL_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "MINILLM_OTEL")


@pytest.fixture(scope="module")
def traced(default_model_dir) -> Iterator[tuple[TestClient, InMemorySpanExporter]]:
    """The app with an in-memory exporter, its model loaded and ready."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = ServerSettings(engine=EngineConfig(model=str(default_model_dir), kv_cache_memory="64MiB"))
    with TestClient(create_app(settings, tracer_provider=provider)) as client:
        deadline = time.monotonic() + 120
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load in time"
            time.sleep(0.05)
        yield client, exporter
    provider.shutdown()


def spans_of(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    """The spans finished since the last call (the exporter is cleared)."""
    spans = list(exporter.get_finished_spans())
    exporter.clear()
    return spans


def check_generation_span(span: ReadableSpan, model: str, usage: dict, finish_reasons: list[str]) -> None:
    assert span.name == "POST /v1/chat/completions" and span.kind == SpanKind.SERVER
    names = [e.name for e in span.events]
    assert names == LIFECYCLE, names
    times = [e.timestamp for e in span.events]
    assert times == sorted(times), "lifecycle events out of order"
    assert span.start_time <= times[0] and times[-1] <= span.end_time
    assert list(span.events[-1].attributes["gen_ai.response.finish_reasons"]) == finish_reasons
    attrs = span.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == model and attrs["gen_ai.response.model"] == model
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert list(attrs["gen_ai.response.finish_reasons"]) == finish_reasons
    assert 200 in (attrs.get("http.status_code"), attrs.get("http.response.status_code"))


def test_chat_completion_has_one_span_with_lifecycle_and_usage(traced) -> None:
    client, exporter = traced
    spans_of(exporter)
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    body = r.json()
    [span] = spans_of(exporter)  # exactly one: no per-message receive/send spans
    check_generation_span(span, body["model"], body["usage"], ["length"])
    assert body["usage"]["completion_tokens"] == 5
    assert span.parent is None  # no traceparent sent: a root span


def test_streamed_chat_has_one_span_in_the_callers_trace(traced) -> None:
    client, exporter = traced
    spans_of(exporter)
    body = {"messages": CHAT, "max_tokens": 8, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    r = client.post("/v1/chat/completions", json=body, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 4  # several chunks went out, yet one span
    usage = chunks[-1]["usage"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    [span] = spans_of(exporter)
    check_generation_span(span, chunks[0]["model"], usage, reasons)
    assert reasons == ["length"] and usage["completion_tokens"] == 8
    assert span.context.trace_id == int(TRACE_ID, 16)
    assert span.parent is not None and span.parent.span_id == int(PARENT_ID, 16) and span.parent.is_remote


def test_probes_make_no_spans(traced) -> None:
    client, exporter = traced
    spans_of(exporter)
    for path in ("/health", "/ready", "/metrics"):
        assert client.get(path).status_code == 200
    assert spans_of(exporter) == []
    assert client.get("/v1/models").status_code == 200  # while other routes are traced
    assert [s.name for s in spans_of(exporter)] == ["GET /v1/models"]


def test_tracing_is_off_by_default(monkeypatch, tmp_path) -> None:
    """Without a provider and with the OTEL variables unset, the app is not wrapped, and the
    OpenTelemetry packages are never imported (checked in a fresh interpreter)."""
    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)
    settings = ServerSettings(engine=EngineConfig(model=str(tmp_path)))
    asgi = create_app(settings)
    assert type(asgi) is ServerMiddleware
    assert asgi.app.state.minillm.tracer_provider is None

    monkeypatch.setenv("MINILLM_OTEL", "1")  # and the switch does switch it on
    on = create_app(settings)
    assert type(on) is OpenTelemetryMiddleware
    on.app.app.state.minillm.tracer_provider.shutdown()

    code = ("import sys; from app.server import create_app; from app.settings import ServerSettings; "
            "create_app(ServerSettings()); print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    env = {k: v for k, v in os.environ.items() if k not in OTEL_ENV}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
