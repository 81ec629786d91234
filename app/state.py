"""What the routes share: the engine (once loaded), settings, metrics, and the server's phase."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from app.errors import APIError
from app.metrics import Metrics
from app.settings import ServerSettings
from engine.async_engine import AsyncEngine
from engine.errors import EngineDeadError


@dataclass
class AppState:
    settings: ServerSettings
    metrics: Metrics
    tracer_provider: object | None = None
    engine: AsyncEngine | None = None
    ready: bool = False  # loaded and warmed
    draining: bool = False  # SIGTERM received: finishing in-flight requests
    load_error: BaseException | None = None
    in_flight: int = 0  # generation calls being served (what a shutdown drains)
    created: int = field(default_factory=lambda: int(time.time()))

    def live_engine(self) -> AsyncEngine:
        """The engine, or the right error: 503 while loading or draining, engine_dead once it died."""
        if self.engine is None or not self.ready:
            raise APIError(503, "The model is still loading.", "service_unavailable", code="loading",
                           headers={"Retry-After": "5"})
        if not self.engine.is_alive:
            raise EngineDeadError("The engine is not running.")
        if self.draining:
            raise APIError(503, "The server is shutting down.", "service_unavailable", code="draining",
                           headers={"Retry-After": "1"})
        return self.engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise APIError(404, f"The model '{model}' does not exist. This server serves '{self.settings.model_name}'.",
                           "not_found_error", param="model", code="model_not_found")

    @contextmanager
    def admit(self, engine: AsyncEngine, num_seqs: int) -> Iterator[None]:
        """Hold num_seqs places among the sequences waiting for the engine (a call's prompts × n)
        while its prompts are tokenized and queued: 429 if more than --max-queue would wait, 400 if
        the call alone is more."""
        limit = self.settings.max_queue
        if 0 < limit < num_seqs:
            raise APIError(400, f"This call asks for {num_seqs} sequences (prompts × n), more than the {limit} that "
                           "may wait at once (--max-queue).", "invalid_request_error", code="too_many_sequences")
        if not engine.reserve(num_seqs, limit):
            raise APIError(429, "Too many requests are waiting; retry shortly.", "rate_limit_exceeded",
                           code="queue_full", headers={"Retry-After": "1"})
        try:
            yield
        finally:
            engine.release(num_seqs)
