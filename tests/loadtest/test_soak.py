"""loadtest/soak.py: a short soak of the real CPU server passes and reports its figures; against a
stub server that breaks one promise each (a request left waiting, RSS that keeps growing, a 500) it
fails that check alone and exits non-zero. The script runs as a user runs it, in a subprocess."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.app.conftest import Server

ROOT = Path(__file__).resolve().parents[2]
SOAK = ROOT / "loadtest" / "soak.py"
CHECKS = {"idle", "kv_idle", "rss_growth", "no_5xx", "responses_ok", "served", "final_request"}
MIB = 1024 * 1024


def run_soak(url: str, out: Path, *flags: str) -> tuple[int, dict, str]:
    result = subprocess.run([sys.executable, str(SOAK), "--url", url, "--out", str(out), "--seed", "1", *flags],
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    return result.returncode, json.loads(out.read_text()) if out.exists() else {}, output


@pytest.mark.slow  # the shared server and 6 s of load
def test_soak_of_the_real_server_passes(server: Server, tmp_path: Path) -> None:
    rc, report, output = run_soak(server.url, tmp_path / "report.json", "--duration", "6s", "--concurrency", "4",
                                  "--max-tokens", "16", "--sample-every", "1")
    assert rc == 0, output
    assert report["passed"] and set(report["checks"]) == CHECKS, output
    assert all(c["ok"] for c in report["checks"].values()), output  # none skipped: RSS from /metrics
    assert report["total_requests"] > 0 and report["requests"], output
    assert report["rss"]["source"] == "metrics" and report["rss"]["peak"] >= report["rss"]["start"] > 0
    assert report["kv"]["end"] == report["kv"]["idle"] and report["kv"]["capacity"] > 0
    assert report["end"] == {"running": 0, "waiting": 0}
    assert len(report["samples"]) >= 3 and "requests" in output and "PASSED" in output


class Stub(BaseHTTPRequestHandler):
    """Answers chat and completions at once (every choice finishes after a few SSE events) and serves
    /metrics; `fault` says which promise it breaks."""

    fault = "none"  # "none", "waiting" (one request never leaves the queue), "rss" (grows each scrape), "500"
    posts = scrapes = fives = 0
    lock = threading.Lock()

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        with Stub.lock:
            Stub.scrapes += 1
            waiting = 1 if self.fault == "waiting" and Stub.posts else 0
            rss = (200 + (Stub.scrapes * 50 if self.fault == "rss" else 0)) * MIB
            fives = Stub.fives
        body = (f"process_resident_memory_bytes {rss}\n"
                f'minillm_requests_running{{model="m"}} 0\nminillm_requests_waiting{{model="m"}} {waiting}\n'
                f'minillm_kv_cache_used_bytes{{model="m"}} 0\nminillm_kv_cache_capacity_bytes{{model="m"}} {MIB}\n'
                f'minillm_http_requests_total{{model="m",status="200"}} 1\n'
                f'minillm_http_requests_total{{model="m",status="500"}} {fives}\n').encode()
        self.reply(200, "text/plain", body)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with Stub.lock:
            Stub.posts += 1
            # Some completions, never the soak's last request (a chat): only no_5xx may fail.
            fail = self.fault == "500" and "prompt" in request and Stub.posts % 3 == 0
            Stub.fives += fail
        time.sleep(0.01)  # a few hundred requests in the run, not thousands
        if fail:
            return self.reply(500, "application/json", b'{"error": {"message": "boom"}}')
        choices = [{"index": i, "finish_reason": "length"} for i in range(request.get("n", 1))]
        if not request.get("stream"):
            return self.reply(200, "application/json", json.dumps({"choices": choices}).encode())
        events = [{"choices": [{"index": c["index"], "finish_reason": None}]} for c in choices for _ in range(4)]
        events += [{"choices": [c]} for c in choices]
        self.reply(200, "text/event-stream", b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)
                   + b"data: [DONE]\n\n")

    def reply(self, status: int, content_type: str, body: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the soak's own disconnects
            pass


@pytest.fixture
def stub_url() -> Iterator[str]:
    Stub.fault, Stub.posts, Stub.scrapes, Stub.fives = "none", 0, 0, 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize(("fault", "failing"), [("none", set()), ("waiting", {"idle"}), ("rss", {"rss_growth"}),
                                                ("500", {"no_5xx"})])
def test_soak_fails_the_broken_check(stub_url: str, tmp_path: Path, fault: str, failing: set[str]) -> None:
    Stub.fault = fault
    rc, report, output = run_soak(stub_url, tmp_path / "report.json", "--duration", "1.5s", "--concurrency", "4",
                                  "--sample-every", "0.2", "--idle-timeout", "1")
    assert rc == (1 if failing else 0), output
    assert {name for name, c in report["checks"].items() if c["ok"] is False} == failing, output
    assert all(c["ok"] for name, c in report["checks"].items() if name not in failing), output  # none skipped
    assert ("FAILED" if failing else "PASSED") in output
    if fault == "none":  # the mix: every kind, and clients that left mid-stream and right after the headers
        assert set(report["requests"]) == {"chat/stream", "chat/plain", "completions/stream", "completions/plain"}
        assert report["disconnects"].get("stream:mid_stream", 0) > 0, output
