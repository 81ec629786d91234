"""`minillm serve`: check the flags, then run Granian, whose one worker imports app.server and loads
the model. This process imports neither torch nor the app: Granian forks the worker from it, and the
worker's imports then run beside those of the grammar workers' fork server, not after this one's."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import resource
import signal
from collections.abc import Callable
from typing import Any

from app.settings import TOOL_CALL_PARSERS, ServerSettings, from_env, to_env
from engine.config import LOAD_TIME_QUANTIZATION, parse_bytes
from engine.errors import InvalidRequestError
from engine.fork_server import start_fork_server
from engine.model_store import DEFAULT_MODEL, resolve_model
from engine.models.config import RANDOM_PREFIX, model_config

# Connections Granian accepts beyond --max-connections: room for probes, and for the 503s that refuse the rest.
SPARE_CONNECTIONS = 64
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")  # --device's values


def serve(settings: ServerSettings) -> None:
    """Run the server in the foreground with Granian: one worker (it holds the model), uvloop."""
    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, Loops
    from granian.http import HTTP1Settings

    check_settings(settings)
    raise_open_files_limit(settings.max_connections + SPARE_CONNECTIONS)
    os.environ.update(to_env(settings))
    server = Granian(
        "app.serve:app_from_env",
        factory=True,
        address=settings.host,
        port=settings.port,
        interface=Interfaces.ASGI,
        workers=1,
        loop=Loops.uvloop,
        log_enabled=True,
        log_level=settings.log_level.lower(),  # type: ignore[arg-type]
        log_access=False,  # our own structured access line replaces Granian's
        # Granian waits for in-flight requests on SIGTERM; the app aborts them after the grace
        # period, and this is the hard stop should anything still hang.
        workers_kill_timeout=int(settings.shutdown_grace) + 10,
        # HTTP/1.1 alone: its header timeout then runs from the accept, so connections that never send
        # a byte are closed too (the HTTP/2-detecting reader waits for a first byte with no timeout).
        http=HTTPModes.http1,
        http1_settings=HTTP1Settings(header_read_timeout=round(settings.header_timeout * 1000)),
        # Past this many connections Granian stops accepting: the rest wait in the listen backlog.
        backpressure=settings.max_connections + SPARE_CONNECTIONS,
    )
    server.on_startup(lambda: relay_repeated_signals(server))
    server.serve()


def app_from_env() -> Any:
    """Granian's factory, run in its worker: settings from the MINILLM_* variables serve() set. The
    grammar workers' fork server starts first, so its imports of torch and xgrammar run beside this
    process's of the app."""
    start_fork_server()
    from app.server import create_app

    settings = from_env()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return create_app(settings, granian_worker=True)


def relay_repeated_signals(server: Any) -> None:
    """Granian's main process stops its worker once (SIGTERM) however many signals it gets: pass a
    second SIGINT or SIGTERM on to the worker, where a repeated signal means "stop now". Runs as
    Granian's startup hook, after it installed its own handlers."""
    received = 0

    def on_signal(signum: int, frame: Any, previous: Callable[[int, Any], Any]) -> None:
        nonlocal received
        received += 1
        if received > 1:
            for worker in server.wrks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.inner.pid, signal.SIGTERM)
        previous(signum, frame)

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)
        if callable(previous):
            signal.signal(sig, lambda signum, frame, previous=previous: on_signal(signum, frame, previous))


def check_settings(settings: ServerSettings) -> None:
    """Refuse bad flag values before Granian starts, with the error `minillm generate` would give.
    Nothing here imports torch, loads weights or converts the default model: that is the worker's."""
    config = settings.engine

    def need(ok: bool, flag: str, what: str) -> None:
        if not ok:
            raise InvalidRequestError(f"--{flag} {what}.", param=flag.replace("-", "_"))

    if config.model != DEFAULT_MODEL:
        model_config(config.model if config.model.startswith(RANDOM_PREFIX) else resolve_model(config.model))
    if config.tokenizer not in (None, DEFAULT_MODEL):
        resolve_model(config.tokenizer)
    if config.kv_cache_memory is not None:
        need(parse_bytes(config.kv_cache_memory) > 0, "kv-cache-memory", "must be more than 0 bytes")
    config.check_dtype()
    need(DEVICE.fullmatch(config.device) is not None, "device", f"must be auto, cpu or cuda[:N], not {config.device!r}")
    need(config.quantization in (None, "", *LOAD_TIME_QUANTIZATION), "quantization",
         f"must be {' or '.join(LOAD_TIME_QUANTIZATION)} or unset")
    for flag, value, least in (("block-size", config.block_size, 1), ("max-num-seqs", config.max_num_seqs, 1),
                               ("max-num-batched-tokens", config.max_num_batched_tokens, 1),
                               ("max-model-len", config.max_model_len, 1),
                               ("tensor-parallel-size", config.tensor_parallel_size, 1),
                               ("max-queue", settings.max_queue, 0), ("max-body-bytes", settings.max_body_bytes, 1),
                               ("shutdown-grace", settings.shutdown_grace, 0),
                               ("responses-store-size", settings.responses_store_size, 0),
                               ("max-connections", settings.max_connections, 1)):
        need(value is None or value >= least, flag, f"must be at least {least}")
    for flag, seconds in (("header-timeout", settings.header_timeout), ("body-timeout", settings.body_timeout),
                          ("write-timeout", settings.write_timeout)):
        need(seconds >= 0.001, flag, "must be at least 0.001 seconds")
    need(0 < config.gpu_memory_utilization <= 1, "gpu-memory-utilization", "must be in (0, 1]")
    need(0 <= settings.port < 65536, "port", "must be in [0, 65535]")
    need(settings.tool_call_parser is None or settings.tool_call_parser in TOOL_CALL_PARSERS, "tool-call-parser",
         f"{settings.tool_call_parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}")


def raise_open_files_limit(connections: int) -> None:
    """Raise the soft limit on open files (Granian's worker inherits it) so that `connections`
    sockets fit beside the model's files and the threads' pipes; the hard limit stays."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
