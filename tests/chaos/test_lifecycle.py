"""Lifecycle faults against a real Granian server: a model that cannot load ends the server with its
reason; a conversion cut short is removed and done again; a second SIGTERM ends every stream at once,
cleanly; SIGKILL of Granian's main process takes the worker with it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.model_store import COMPLETE_MARKER, DEFAULT_DIR_NAME
from tests import fast_conversion
from tests.app.conftest import ROOT, Server, free_port, start_server
from tests.app.test_shutdown import stream_chat
from tests.chaos.common import assert_idle_and_serving, chat, wait_until


def refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.ConnectError:
        return True
    return False


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def start_streams(url: str, count: int) -> tuple[list[threading.Thread], list[list[dict]]]:
    """`count` long streams (they cannot finish on their own during the test), each past its first chunk."""
    threads, streams = [], []
    for _ in range(count):
        events: list[dict] = []
        first = threading.Event()
        thread = threading.Thread(target=stream_chat, args=(url, 4000, events, first), daemon=True)
        thread.start()
        assert first.wait(60)
        threads.append(thread)
        streams.append(events)
    return threads, streams


def assert_aborted_cleanly(threads: list[threading.Thread], streams: list[list[dict]]) -> None:
    for thread, events in zip(threads, streams):
        thread.join(30)
        assert not thread.is_alive()
        assert events[-1] == {"done": True}
        reasons = [e["choices"][0]["finish_reason"] for e in events[:-1] if e.get("choices")]
        assert reasons[-1] == "abort" and reasons.count("abort") == 1


@pytest.fixture(scope="module")
def recovered(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """A server of the default model, and its models directory, which held a conversion cut short: a
    half-written target without its marker, and a killed converter's temporary directory."""
    root = tmp_path_factory.mktemp("recovered")
    models = root / "models"
    target = models / DEFAULT_DIR_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_bytes((default_model_dir / "config.json").read_bytes())
    (target / "model.safetensors").write_bytes(b"\0" * 4096)
    orphan = models / f".{DEFAULT_DIR_NAME}.tmp-killed"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"\0" * 4096)
    # Every Python process of the server loads the stand-in: the test pays for the recovery only.
    env = {"MINILLM_MODELS_DIR": str(models), **fast_conversion.install(root, default_model_dir),
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    server = start_server(Path("default"), root / "server.log", env=env)
    yield server, models
    server.stop()


def test_a_model_that_cannot_load_ends_the_server_with_its_reason(default_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "no-weights"  # its config passes the checks made before Granian starts
    model.mkdir()
    (model / "config.json").write_bytes((default_model_dir / "config.json").read_bytes())
    port = free_port()
    done = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
                           "--port", str(port), "--kv-cache-memory", "256MiB"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "Listening at" in output  # the worker started, and its failed load ended the whole server
    [reason] = [line for line in output.splitlines() if line.startswith("minillm: ")]
    assert str(model) in reason and "Traceback" not in output
    assert refused(f"http://127.0.0.1:{port}")


def test_a_conversion_cut_short_is_done_again(recovered: tuple[Server, Path]) -> None:
    server, models = recovered
    target = models / DEFAULT_DIR_NAME
    assert (target / COMPLETE_MARKER).is_file()
    assert [p.name for p in models.iterdir() if ".tmp-" in p.name] == []
    log = server.log_text()
    assert f"removing {target}, a conversion that did not finish" in log
    assert f".{DEFAULT_DIR_NAME}.tmp-killed, left by a conversion that did not finish" in log
    assert_idle_and_serving(server.url)


def test_a_second_sigterm_aborts_every_stream_at_once(recovered: tuple[Server, Path]) -> None:
    """The server drains on SIGTERM (the listener stays open: /ready 503, new work 503) and stops
    at once on a second one; its grace (30 s) would otherwise hold these streams. Ends the server:
    the module's last test on it."""
    server = recovered[0]
    threads, streams = start_streams(server.url, 2)
    server.process.send_signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(server.url + "/ready", timeout=10).status_code == 503, what="/ready 503")
    assert httpx.get(server.url + "/ready", timeout=10).json() == {"status": "draining"}
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    late = httpx.post(server.url + "/v1/chat/completions", json=chat("hi", max_tokens=2), timeout=10)
    assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
    assert all(thread.is_alive() for thread in threads)  # still streaming: the drain waits for them

    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=15) == 0
    assert_aborted_cleanly(threads, streams)
    assert refused(server.url)


def test_sigkill_of_the_main_process_takes_the_worker_with_it(default_model_dir: Path, tmp_path: Path) -> None:
    server = start_server(default_model_dir, tmp_path / "server.log")
    [worker] = map(int, re.findall(r"Spawning worker-1 with PID: (\d+)", server.log_text()))
    threads, streams = start_streams(server.url, 1)
    server.process.kill()
    server.process.wait()
    wait_until(lambda: gone(worker), what="the worker gone with Granian's main process")
    assert_aborted_cleanly(threads, streams)
    assert refused(server.url)
    assert "main process is gone" in server.log_text()
