"""The Starlette app (routes, lifespan that loads the engine, readiness, metrics, OpenAPI), which
Granian's worker imports: `minillm serve` itself runs in app/serve.py."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
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
from app.openai_api import completions, detokenize, get_model, list_models, tokenize
from app.openapi import openapi_schema
from app.responses import ResponseStore, create_response, delete_response, get_response
from app.settings import ServerSettings
from app.state import AppState
from engine.async_engine import AsyncEngine
from engine.errors import MinillmError
from engine.fork_server import start_fork_server
from engine.llm_engine import LLMEngine

log = logging.getLogger("minillm.app")

DRAIN_POLL_S = 0.05  # how often a drain looks at the requests in flight
ABORTED_WRITE_S = 5.0  # how long aborted streams get to write their last chunk before the listener closes
EXIT_NOW_S = 8.0  # after "stop now", the worker leaves by this time whatever still runs
PARENT_POLL_S = 0.5  # how often the worker checks that Granian's main process is alive


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


async def load_engine(state: AppState, failed: Callable[[], None] = lambda: None, freeze: bool = False) -> None:
    """Load the model off the event loop, warm it with one token, then declare readiness. On failure
    `failed` runs: under Granian it ends the server, so a bad model is a crash loop with its reason.
    freeze: this process serves this engine for life, so what loading made is moved out of the
    garbage collector's reach (gc.freeze): a full collection walked those objects for 160 ms on
    CPU with the embedded model, stalling every stream."""
    try:
        start_fork_server()  # the grammar worker's imports, beside the model's loading
        llm = await asyncio.to_thread(LLMEngine, state.settings.engine)
        await asyncio.to_thread(llm.warm_up)
        if freeze:
            gc.collect()
            gc.freeze()
        engine = state.engine = AsyncEngine(llm).start()
        state.ready = True
        log.info("ready: serving %s (max_model_len %d, %d KV blocks)", state.settings.model_name,
                 engine.max_model_len, engine.stats().kv_blocks_total)
    except Exception as e:  # noqa: BLE001 - a failed load is reported by /health and ends the server
        state.load_error = e
        if isinstance(e, MinillmError):  # an expected failure: its one line, as `minillm generate` prints it
            print(f"minillm: {e.message}", file=sys.stderr, flush=True)
        else:
            log.exception("loading the model failed")
        failed()


class Shutdown:
    """How the Granian worker stops.

    The first SIGTERM or SIGINT drains: /ready and new generation requests answer 503 while the
    listener stays open; once nothing is in flight, or --shutdown-grace has passed and what still
    runs is aborted, Granian closes the listener and the lifespan ends. The same signal again, or the
    death of Granian's main process, means now: every stream ends at once with finish_reason "abort"
    and `data: [DONE]`, and the worker exits within seconds."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.seen: set[int] = set()
        self.stop_serving: Callable[[], None] | None = None  # Granian's: close the listener, end the worker
        self.hurry = False
        self.stopped = False

    def take_granian_signals(self) -> None:
        """Granian's worker closes its listener on the first signal (connections would be refused
        during the drain) and ignores repeats: handle the worker's signals here instead, holding the
        signal that stops Granian until the drain is over. Must run in the worker before Granian
        installs its own handlers: Granian's factory (app.serve.app_from_env) does."""
        import granian._signals
        from granian._granian import WorkerSignal

        def set_loop_signals(loop: asyncio.AbstractEventLoop) -> WorkerSignal:
            stop = WorkerSignal()
            self.stop_serving = stop.set
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.on_signal, sig)
            watch_parent(loop, self.parent_gone)
            return stop

        granian._signals.set_loop_signals = set_loop_signals

    def on_signal(self, signum: int) -> None:
        # Ctrl-C reaches the worker as SIGINT from the terminal and SIGTERM from Granian's main
        # process: only a repeat of the same signal means "now".
        repeated = signum in self.seen
        self.seen.add(signum)
        if repeated:
            self.now(f"signal {signum} again")
        else:
            self.drain(f"signal {signum}")

    def parent_gone(self) -> None:
        self.now("Granian's main process is gone")

    def drain(self, reason: str) -> None:
        if self.state.draining:
            return
        self.state.draining = True
        log.info("%s: draining %d in-flight requests (grace %.0f s)", reason, self.state.in_flight,
                 self.state.settings.shutdown_grace)
        asyncio.get_running_loop().create_task(self._drain())

    def now(self, reason: str) -> None:
        if self.hurry:
            return
        self.hurry = True
        log.warning("%s: aborting %d in-flight requests now", reason, self.state.in_flight)
        # Should anything hold the exit (a model still loading, a client not reading), leave anyway.
        failsafe = threading.Timer(EXIT_NOW_S, os._exit, args=(1,))
        failsafe.daemon = True
        failsafe.start()
        if not self.state.draining:
            self.state.draining = True
            asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.state.settings.shutdown_grace
        while self.state.in_flight and not self.hurry and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.state.in_flight and self.state.engine is not None:
            if not self.hurry:
                log.warning("grace period over: aborting %d requests still in flight", self.state.in_flight)
            self.state.engine.abort_all()
            deadline = loop.time() + ABORTED_WRITE_S  # the aborted streams' last chunk and [DONE]
            while self.state.in_flight and loop.time() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
        self.stop()

    def stop(self) -> None:
        """Close the listener and end the worker (after its open responses and the lifespan)."""
        if self.stop_serving is not None and not self.stopped:
            self.stopped = True
            self.stop_serving()


def watch_parent(loop: asyncio.AbstractEventLoop, gone: Callable[[], None]) -> None:
    """Call `gone` on the loop once this process's parent has died (Granian's main process killed
    with SIGKILL would otherwise leave this worker serving)."""
    parent = multiprocessing.parent_process()
    expected = parent.pid if parent is not None else os.getppid()

    def watch() -> None:
        while os.getppid() == expected:
            time.sleep(PARENT_POLL_S)
        with contextlib.suppress(RuntimeError):  # the loop already closed: the worker is ending anyway
            loop.call_soon_threadsafe(gone)

    threading.Thread(target=watch, name="minillm-parent-watch", daemon=True).start()


def create_app(settings: ServerSettings, tracer_provider: Any | None = None, granian_worker: bool = False) -> Any:
    """The ASGI app. The engine loads in the background after startup, so /health answers at once.
    granian_worker: this is Granian's worker process, whose signals and exit the app takes over."""
    state = AppState(settings, Metrics(settings.model_name, lambda: state.engine.stats() if state.engine else None))
    if tracer_provider is None and tracing.enabled():
        tracer_provider = tracing.otlp_provider()
    state.tracer_provider = tracer_provider
    shutdown = Shutdown(state)
    if granian_worker:
        shutdown.take_granian_signals()

    @asynccontextmanager
    async def lifespan(app: Starlette):
        loading = asyncio.create_task(load_engine(state, shutdown.stop, freeze=granian_worker))
        yield
        state.draining = True  # the drain is over and Granian has let open responses finish
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
    asgi: Any = ServerMiddleware(app, settings, state.metrics)
    if tracer_provider is not None:
        asgi = tracing.instrument(asgi, tracer_provider)
    return asgi

