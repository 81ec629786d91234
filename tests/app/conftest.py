"""A real server for the API tests: `minillm serve` (Granian) in a subprocess on a free port."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(model_dir: Path, log: Path, *flags: str, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "app.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", MODEL_NAME, "--kv-cache-memory", "256MiB", *flags]
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    server = Server(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited early:\n{server.log_text()}")
        try:
            if httpx.get(server.url + "/ready", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not ready in time:\n{server.log_text()}")


@pytest.fixture(scope="session")
def keyed_server(default_model_dir, tmp_path_factory) -> Iterator[Server]:
    """A server that needs an API key (two keys accepted) and queues no waiting requests."""
    s = start_server(default_model_dir, tmp_path_factory.mktemp("keyed") / "server.log",
                     env={"MINILLM_API_KEY": "key-one,key-two", "MINILLM_MAX_QUEUE": "0"})
    yield s
    s.stop()


@pytest.fixture(scope="session")
def random_server(default_model_dir, tiny_model_dir, tmp_path_factory) -> Iterator[Server]:
    """A tiny random-weight Llama with the embedded model's tokenizer and template: a token costs ~1 ms
    rather than ~60, and what it says is noise (so what comes back valid, a grammar made valid). Its
    short context bounds what any request can cost; the shared server's metrics and queue stay alone."""
    model_dir = tiny_model_dir("tiny-llama3", vocab_size=49152)[0]
    s = start_server(model_dir, tmp_path_factory.mktemp("random") / "server.log", "--max-model-len", "1024",
                     "--tokenizer", str(default_model_dir))
    yield s
    s.stop()
