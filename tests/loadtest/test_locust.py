"""loadtest/locustfile.py: a short headless run against the real CPU server gets no failures and
reports TTFT and ITL rows. Locust runs in a subprocess: it monkeypatches the process with gevent."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.app.conftest import Server

pytestmark = pytest.mark.slow  # six seconds of locust against the shared server

ROOT = Path(__file__).resolve().parents[2]
LOCUST = Path(sys.executable).parent / "locust"


def test_six_second_smoke(server: Server, tmp_path: Path) -> None:
    # 4 users: the default ramp (a user every 30 s) must fit the 6 s. Short prompts and 8 tokens a
    # reply keep each request light on a busy machine, and --stop-timeout (a bound, not a wait) lets
    # every request started in the 6 s finish, so each one counts however slow the machine is.
    cmd = [str(LOCUST), "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless", "--only-summary",
           "--host", server.url, "-u", "4", "-r", "4", "-t", "6s", "--prompt-mix", "short:1",
           "--max-tokens", "8", "--stop-timeout", "90", "--csv", "run", "--html", "report.html"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCUST_")}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output

    with (tmp_path / "run_stats.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["Name"] != "Aggregated"]

    def count(kind: str, name: str | None = None) -> int:
        return sum(int(r["Request Count"]) for r in rows if r["Type"] == kind and name in (None, r["Name"]))

    assert all(r["Failure Count"] == "0" for r in rows), output
    assert count("POST", "/v1/chat/completions") > 0 and count("POST", "/v1/completions") > 0, output
    assert count("TTFT") > 0 and count("ITL") > 0, output
    assert all(r["Name"].startswith("chat ") for r in rows if r["Type"] == "TTFT")  # one row per prompt size
    assert "step ramp: 1 more users every 1.0 s up to 4 users, all 4 from 3.0 s of the 6 s run" in output, output
    assert "Shape test updating to 4 users" in output, "the step ramp reached -u"
    assert (tmp_path / "report.html").stat().st_size > 0
