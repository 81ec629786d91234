"""Hostile and broken clients against a real Granian server: clients that leave at any point, bodies
that are malformed or never end, two Authorization headers, connections that send nothing, more
requests than the cap. Each test checks the server's answer, then that the engine is idle again
(nothing running or waiting, no KV block held) and that a normal request succeeds."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.serve import SPARE_CONNECTIONS
from tests.app.conftest import Server, start_server
from tests.chaos.common import WAIT, assert_idle_and_serving, chat, metric, wait_until

KEY = "chaos-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONNECTIONS = 4
TIMEOUT = 2.0  # the test server's header, body and write timeouts, in seconds
CHAT = chat("Tell me a long story.")
LONG = {"max_tokens": 2000, "ignore_eos": True}  # streams that cannot end by themselves during a test


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory) -> Iterator[Server]:
    s = start_server(default_model_dir, tmp_path_factory.mktemp("chaos-connections") / "server.log",
                     "--max-connections", str(MAX_CONNECTIONS), "--header-timeout", str(TIMEOUT),
                     "--body-timeout", str(TIMEOUT), "--write-timeout", str(TIMEOUT), env={"MINILLM_API_KEY": KEY})
    yield s
    s.stop()


# ---- helpers ------------------------------------------------------------------------------------


def address(server: Server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def request_bytes(path: str, body: bytes | None = None, *headers: str, length: int | None = None,
                  keys: tuple[str, ...] = (KEY,)) -> bytes:
    """A raw HTTP/1.1 request's bytes: an Authorization header per key, JSON, a Content-Length unless
    a header says how the body ends, and Connection: close (so reading to EOF reads one response)."""
    lines = [f"POST {path} HTTP/1.1" if body is not None else f"GET {path} HTTP/1.1", "Host: chaos",
             *(f"Authorization: Bearer {key}" for key in keys), "Connection: close", *headers]
    if body is not None:
        lines.append("Content-Type: application/json")
        if not any(h.lower().startswith("transfer-encoding") for h in headers):
            lines.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def read_to_eof(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    sock.settimeout(WAIT)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def exchange(server: Server, data: bytes) -> bytes:
    with socket.create_connection(address(server)) as sock:
        sock.sendall(data)
        return read_to_eof(sock)


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def error_of(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]


def access_statuses(server: Server, prefix: str) -> dict[str, int]:
    """Access-log status by request id, for the ids that start with `prefix`."""
    found = {}
    for line in server.log_text().splitlines():
        if "minillm.access" in line and f'"request_id":"{prefix}' in line:
            entry = json.loads(line[line.index("{"):])
            found[entry["request_id"]] = entry["status"]
    return found


# ---- 1. clients that leave ----------------------------------------------------------------------


def leave(server: Server, mode: str, request_id: str) -> None:
    """One client that goes away at the point `mode` names."""
    body = json.dumps(CHAT | LONG | {"stream": True, "n": 2 if mode == "after-first-bytes-n2" else 1}).encode()
    path = "/v1/chat/completions"
    if mode == "completions-two-prompts":
        path, body = "/v1/completions", json.dumps({"prompt": ["Once", "Twice"], "stream": True, **LONG}).encode()
    data = request_bytes(path, body, f"X-Request-Id: {request_id}")
    head, _ = data.split(b"\r\n\r\n", 1)
    with socket.create_connection(address(server)) as sock:
        if mode == "after-headers":
            sock.sendall(head + b"\r\n\r\n")
        elif mode == "mid-body":
            sock.sendall(data[: len(head) + 4 + len(body) // 2])
        elif mode == "after-request":
            sock.sendall(data)
        else:  # after the stream's first bytes
            sock.sendall(data)
            sock.settimeout(WAIT)
            assert sock.recv(64).startswith(b"HTTP/1.1 ")
        time.sleep(0.05)


MODES = ["after-headers", "mid-body", "after-request", "after-first-bytes", "after-first-bytes-n2",
         "completions-two-prompts"]


def test_clients_that_leave_at_any_point_are_aborts_never_500s(server: Server) -> None:
    errors_before = metric(server.url, "http_requests_total", status="500")
    aborted_before = metric(server.url, "requests_finished_total", finish_reason="abort")
    ids = [f"leave-{i}-{MODES[i % len(MODES)]}" for i in range(4 * len(MODES))]
    with ThreadPoolExecutor(MAX_CONNECTIONS - 1) as pool:
        list(pool.map(lambda i: leave(server, MODES[i % len(MODES)], ids[i]), range(len(ids))))
    assert_idle_and_serving(server.url, KEY)
    wait_until(lambda: len(access_statuses(server, "leave-")) == len(ids), what="an access-log line each")
    statuses = access_statuses(server, "leave-")
    # 499 for each; a 503 only where the cap was still held by a client that had just left.
    assert set(statuses.values()) <= {499, 503}, statuses
    assert list(statuses.values()).count(499) >= len(ids) // 2, statuses
    assert metric(server.url, "http_requests_total", status="500") == errors_before
    assert "Application callable raised" not in server.log_text()
    assert metric(server.url, "requests_finished_total", finish_reason="abort") > aborted_before


@pytest.mark.xfail(strict=True, reason="Granian 2.8.9 does not expose hyper's HTTP/1 half_close: a read EOF after "
                                       "the request closes the connection (the request is aborted, 499)")
def test_a_client_that_half_closes_after_its_request_still_gets_the_response(server: Server) -> None:
    body = json.dumps(CHAT | {"max_tokens": 3}).encode()
    with socket.create_connection(address(server)) as sock:
        sock.sendall(request_bytes("/v1/chat/completions", body))
        sock.shutdown(socket.SHUT_WR)
        response = read_to_eof(sock)
    assert response and status_of(response) == 200


# ---- 3. malformed bodies, 4. slow ones ----------------------------------------------------------


def test_a_malformed_chunked_body_is_a_400(server: Server) -> None:
    body = json.dumps(CHAT | {"max_tokens": 2}).encode()
    good = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    response = exchange(server, request_bytes("/v1/chat/completions", good, "Transfer-Encoding: chunked"))
    assert status_of(response) == 200, response  # the same body, well chunked
    bad = b"ZZ\r\n%s\r\n0\r\n\r\n" % body  # not a hexadecimal chunk size
    response = exchange(server, request_bytes("/v1/chat/completions", bad, "Transfer-Encoding: chunked"))
    assert status_of(response) == 400, response
    assert error_of(response)["code"] == "invalid_body"
    assert_idle_and_serving(server.url, KEY)


def test_slow_bodies_time_out_and_partial_headers_are_closed(server: Server) -> None:
    body = json.dumps(CHAT | {"max_tokens": 2}).encode()
    stalled = request_bytes("/v1/chat/completions", body[:10], "X-Request-Id: slow-stalled", length=len(body))
    dripping = request_bytes("/v1/chat/completions", body[:1], "X-Request-Id: slow-dripping", length=len(body))
    partial_head = request_bytes("/v1/models").split(b"\r\n")[0] + b"\r\nHost: chaos\r\n"
    socks = [socket.create_connection(address(server)) for _ in range(3)]
    for sock, data in zip(socks, (stalled, dripping, partial_head)):
        sock.sendall(data)
    drip_stop = threading.Event()

    def drip() -> None:  # a byte at a time: each read is quick, the whole body never arrives in time
        for byte in body[1:-1]:
            if drip_stop.wait(TIMEOUT / 8):
                return
            try:
                socks[1].sendall(bytes([byte]))
            except OSError:
                return

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        responses = [read_to_eof(sock) for sock in socks]  # each closed by the server
    finally:
        drip_stop.set()
        dripper.join()
        for sock in socks:
            sock.close()
    for response in responses[:2]:
        assert status_of(response) == 408 and error_of(response)["code"] == "body_timeout", response
    assert responses[2] == b""  # headers never completed: closed without a word
    assert access_statuses(server, "slow-") == {"slow-stalled": 408, "slow-dripping": 408}
    assert_idle_and_serving(server.url, KEY)


# ---- 9. two Authorization headers ---------------------------------------------------------------


def test_two_authorization_headers_are_refused(server: Server) -> None:
    assert status_of(exchange(server, request_bytes("/v1/models"))) == 200
    # Whichever of the two a proxy in front checked, the server refuses to pick one.
    for keys in ((KEY, KEY), (KEY, "not-the-key"), ("not-the-key", KEY)):
        response = exchange(server, request_bytes("/v1/models", keys=keys))
        assert status_of(response) == 400 and error_of(response)["code"] == "duplicate_authorization", response
    assert_idle_and_serving(server.url, KEY)


# ---- 17. idle connections, the cap --------------------------------------------------------------


def test_idle_connections_are_closed_and_health_keeps_answering(server: Server) -> None:
    budget = MAX_CONNECTIONS + SPARE_CONNECTIONS  # what Granian accepts before the listen backlog
    for count in (budget - 10, budget + 10):
        idle = [socket.create_connection(address(server)) for _ in range(count)]
        try:
            # Under the budget, at once; over it, once the header timeout has closed the idle ones.
            assert httpx.get(server.url + "/health", timeout=WAIT).status_code == 200
            for sock in idle:
                assert read_to_eof(sock) == b""  # closed by the server, never answered
        finally:
            for sock in idle:
                sock.close()
    assert_idle_and_serving(server.url, KEY)


def test_requests_past_the_cap_get_a_clear_503(server: Server) -> None:
    body = json.dumps(CHAT | LONG | {"stream": True}).encode()
    streams = [socket.create_connection(address(server)) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in streams:
            sock.sendall(request_bytes("/v1/chat/completions", body))
            sock.settimeout(WAIT)
            assert sock.recv(64).startswith(b"HTTP/1.1 200")
        wait_until(lambda: metric(server.url, "http_requests_active") == MAX_CONNECTIONS, what="the cap held")
        r = httpx.post(server.url + "/v1/chat/completions", json=CHAT | {"max_tokens": 2}, headers=AUTH, timeout=WAIT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections", r.text
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        assert httpx.get(server.url + "/health", timeout=WAIT).status_code == 200  # probes are not capped
    finally:
        for sock in streams:
            sock.close()
    assert_idle_and_serving(server.url, KEY)
