"""What the routes share: the engine (once loaded), settings, metrics, and the server's phase."""
from __future__ import annotations

import time
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

    def check_queue(self, engine: AsyncEngine) -> None:
        """Past max_queue requests waiting for the engine, ask the client to retry."""
        if engine.num_waiting >= self.settings.max_queue:
            raise APIError(429, "Too many requests are waiting; retry shortly.", "rate_limit_exceeded",
                           code="queue_full", headers={"Retry-After": "1"})
