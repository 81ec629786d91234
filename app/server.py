"""The Starlette app (routes, lifespan that loads the engine, readiness, metrics, OpenAPI) and the
Granian runner behind `minillm serve`."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app import tracing
from app.errors import EXCEPTION_HANDLERS
from app.json import JSONResponse
from app.metrics import Metrics
from app.middleware import ServerMiddleware
from app.chat import chat_completions
from app.tools import TOOL_FORMATS
from app.openai_api import completions, detokenize, get_model, list_models, tokenize
from app.openapi import openapi_schema
from app.responses import ResponseStore, create_response, delete_response, get_response
from app.settings import ServerSettings, from_env, to_env
from app.state import AppState
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine

log = logging.getLogger("minillm.app")


async def health(request: Request) -> Response:
    """Liveness: 200 while loading or serving; 503 once the engine failed to load or its loop died."""
    state: AppState = request.app.state.minillm
    dead = state.load_error is not None or (state.engine is not None and not state.engine.is_alive)
    return JSONResponse({"status": "dead" if dead else "ok"}, status_code=503 if dead else 200)


async def ready(request: Request) -> Response:
    """Readiness: 200 once the model is loaded and warmed; 503 while loading, draining or dead."""
    state: AppState = request.app.state.minillm
    ok = state.ready and not state.draining and state.engine is not None and state.engine.is_alive
    phase = "ready" if ok else ("draining" if state.draining else "loading" if state.load_error is None else "failed")
    return JSONResponse({"status": phase}, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    return Response(request.app.state.minillm.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_schema())


async def load_engine(state: AppState) -> None:
    """Load the model off the event loop, warm it with one token, then declare readiness."""
    try:
        llm = await asyncio.to_thread(LLMEngine, state.settings.engine)
        await asyncio.to_thread(llm.warm_up)
        engine = state.engine = AsyncEngine(llm).start()
        state.ready = True
        log.info("ready: serving %s (max_model_len %d, %d KV blocks)", state.settings.model_name,
                 engine.max_model_len, engine.stats().kv_blocks_total)
    except Exception as e:  # noqa: BLE001 - a failed load is reported by /health, not raised into the server
        state.load_error = e
        log.exception("loading the model failed")


def watch_shutdown_signals(state: AppState) -> None:
    """On SIGTERM/SIGINT Granian stops accepting connections and waits for in-flight requests before
    the lifespan ends. We only observe the signal (chaining Granian's handler): /ready turns 503 at
    once, and requests still running when the grace period ends are aborted, so the drain is bounded."""
    loop = asyncio.get_running_loop()
    if threading.current_thread() is not threading.main_thread():
        return  # signals reach only the main thread (an in-process test client runs us elsewhere)

    def on_signal(signum: int, frame: object, previous: object) -> None:
        if not state.draining:
            state.draining = True
            log.info("signal %d: draining %d in-flight requests (grace %.0f s)", signum, state.in_flight,
                     state.settings.shutdown_grace)
            loop.call_soon_threadsafe(loop.call_later, state.settings.shutdown_grace, abort_in_flight, state)
        if callable(previous):
            previous(signum, frame)

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)
        signal.signal(sig, lambda signum, frame, previous=previous: on_signal(signum, frame, previous))


def abort_in_flight(state: AppState) -> None:
    if state.engine is not None and state.in_flight:
        log.warning("grace period over: aborting %d requests still in flight", state.in_flight)
        state.engine.abort_all()


def create_app(settings: ServerSettings, tracer_provider: Any | None = None) -> Any:
    """The ASGI app. The engine loads in the background after startup, so /health answers at once."""
    state = AppState(settings, Metrics(settings.model_name, lambda: state.engine.stats() if state.engine else None))
    if tracer_provider is None and tracing.enabled():
        tracer_provider = tracing.otlp_provider()
    state.tracer_provider = tracer_provider

    @asynccontextmanager
    async def lifespan(app: Starlette):
        loading = asyncio.create_task(load_engine(state))
        watch_shutdown_signals(state)
        yield
        state.draining = True  # Granian has already let in-flight requests finish
        loading.cancel()
        if state.engine is not None:
            state.engine.shutdown()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    app.state.minillm = state
    app.state.responses = ResponseStore(settings.responses_store_size)
    asgi: Any = ServerMiddleware(app, settings.api_keys, settings.max_body_bytes, state.metrics)
    if tracer_provider is not None:
        asgi = tracing.instrument(asgi, tracer_provider)
    return asgi


def app_from_env() -> Any:
    """Granian's factory target: the worker process reads its settings from MINILLM_* variables."""
    settings = from_env()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return create_app(settings)


def serve(settings: ServerSettings) -> None:
    """Run the server in the foreground with Granian: one worker (it holds the model), uvloop."""
    from granian import Granian
    from granian.constants import Interfaces, Loops

    if settings.tool_call_parser is not None and settings.tool_call_parser not in TOOL_FORMATS:
        raise SystemExit(f"--tool-call-parser {settings.tool_call_parser!r} is not one of {', '.join(TOOL_FORMATS)}.")
    os.environ.update(to_env(settings))
    Granian(
        "app.server:app_from_env",
        factory=True,
        address=settings.host,
        port=settings.port,
        interface=Interfaces.ASGI,
        workers=1,
        loop=Loops.uvloop,
        log_enabled=True,
        log_level=settings.log_level,  # type: ignore[arg-type]
        log_access=False,  # our own structured access line replaces Granian's
        # Granian waits for in-flight requests on SIGTERM; the app aborts them after the grace
        # period, and this is the hard stop should anything still hang.
        workers_kill_timeout=int(settings.shutdown_grace) + 10,
    ).serve()
