"""OpenTelemetry: one server span per request (ASGI instrumentation, no per-chunk spans), with
events for queued, prefill, first token and finish, and gen_ai.* attributes. Off unless
OTEL_EXPORTER_OTLP_ENDPOINT or MINILLM_OTEL=1 is set; when off nothing is imported or wrapped."""
from __future__ import annotations

import os
import time
from typing import Any

from engine.outputs import RequestTimes


def enabled() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")) or os.environ.get("MINILLM_OTEL") == "1"


def otlp_provider(service_name: str = "minillm") -> Any:
    """A tracer provider exporting over OTLP/HTTP to $OTEL_EXPORTER_OTLP_ENDPOINT."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def instrument(app: Any, provider: Any) -> Any:
    """Wrap the ASGI app: a server span per request, honouring an incoming traceparent."""
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    return OpenTelemetryMiddleware(app, tracer_provider=provider, exclude_spans=["receive", "send"],
                                   excluded_urls="health,ready,metrics")


def current_span() -> Any | None:
    """The request's server span, or None when tracing is off."""
    from opentelemetry import trace

    span = trace.get_current_span()
    return span if span.is_recording() else None


def record_request(span: Any, operation: str, model: str, times: RequestTimes | None, ttft: float | None,
                   prompt_tokens: int, output_tokens: int, finish_reasons: list[str]) -> None:
    """Lifecycle events (timestamps rebuilt from the engine's durations) and gen_ai attributes."""
    now = time.time_ns()
    if times is not None:
        arrival = now - int(times.total * 1e9)
        span.add_event("queued", timestamp=arrival)
        span.add_event("prefill", timestamp=arrival + int(times.queue * 1e9))
        if ttft is not None:
            span.add_event("first_token", timestamp=arrival + int((times.queue + times.prefill) * 1e9))
    span.add_event("finish", {"gen_ai.response.finish_reasons": finish_reasons}, timestamp=now)
    span.set_attributes({
        "gen_ai.operation.name": operation,
        "gen_ai.system": "minillm",
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
        "gen_ai.usage.input_tokens": prompt_tokens,
        "gen_ai.usage.output_tokens": output_tokens,
        "gen_ai.response.finish_reasons": finish_reasons,
    })
