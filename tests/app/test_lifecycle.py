"""Health and readiness through loading, a failed load, and a dead engine loop (in-process app)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from starlette.testclient import TestClient

import app.server as server_module
from app.metrics import Metrics
from app.server import create_app
from app.settings import ServerSettings
from app.state import AppState
from engine.config import EngineConfig


def wait_for(client: TestClient, path: str, status: int) -> None:
    for _ in range(300):
        if client.get(path).status_code == status:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never answered {status}")


def test_loading_then_ready_then_dead(default_model_dir, monkeypatch) -> None:
    release = threading.Event()
    real = server_module.LLMEngine
    built = []

    def slow_engine(config):
        release.wait(30)
        built.append(real(config))
        return built[-1]

    monkeypatch.setattr(server_module, "LLMEngine", slow_engine)
    asgi = create_app(ServerSettings(engine=EngineConfig(model=str(default_model_dir), kv_cache_memory="32MiB")))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with TestClient(asgi) as client:
        assert client.get("/health").status_code == 200  # alive while loading: no restart loop
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json() == {"status": "loading"}
        busy = client.post("/v1/chat/completions", json=body)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "5"
        assert busy.json()["error"]["code"] == "loading"
        release.set()
        wait_for(client, "/ready", 200)
        assert client.post("/v1/chat/completions", json=body).status_code == 200

        [llm] = built  # the engine the server built: break its step
        llm.step = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))
        dead = client.post("/v1/chat/completions", json=body)
        assert dead.status_code in (500, 503)  # the loop dies on this request's first step
        wait_for(client, "/health", 503)
        assert client.get("/ready").status_code == 503
        after = client.post("/v1/chat/completions", json=body)
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"


def test_failed_load_is_reported_by_health(tmp_path) -> None:
    asgi = create_app(ServerSettings(engine=EngineConfig(model=str(tmp_path))))  # no config.json there
    with TestClient(asgi) as client:
        wait_for(client, "/health", 503)
        assert client.get("/ready").json() == {"status": "failed"}
        assert client.get("/health").json() == {"status": "dead"}


@pytest.mark.parametrize("freeze", [True, False])
def test_only_a_server_process_freezes_what_loading_made(monkeypatch, freeze: bool) -> None:
    # gc.freeze keeps full collections off the loaded model's objects; a test process, which builds
    # many engines, must not keep them all from being collected.
    frozen = []
    monkeypatch.setattr(server_module.gc, "freeze", lambda: frozen.append(True))
    settings = ServerSettings(engine=EngineConfig(model="random:tiny-llama3", device="cpu", kv_cache_memory="16MiB"))
    state = AppState(settings, Metrics(settings.model_name, lambda: None))
    asyncio.run(server_module.load_engine(state, freeze=freeze))
    try:
        assert state.ready and state.load_error is None
        assert frozen == ([True] if freeze else [])
    finally:
        state.engine.shutdown()
