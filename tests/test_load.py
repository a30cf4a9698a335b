"""Bounded load: benchmarks/load_test.py (8 streaming clients for 20 s) against `vericache serve`
with a small queue (--max-batch 4 --max-waiting 2), so the queue overflows. Every answer must be
a complete stream or a 429 carrying a numeric Retry-After; afterwards nothing is left: no active
or waiting request, no drafter or verifier session."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from service_process import REPO, start_serve

STREAMS, SECONDS = 8, 20


@pytest.fixture(scope="module")
def server():
    service = start_serve(["--max-tokens", "8", "--max-batch", "4", "--max-waiting", "2"],
                          env={"OMP_NUM_THREADS": "1"})
    yield service
    service.stop()
    service.log_path.unlink(missing_ok=True)


def _sessions(metrics: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith("vericache_sessions{"):
            side = line.split('side="')[1].split('"')[0]
            out[side] = float(line.split()[-1])
    return out


def test_overload_gives_only_429_and_leaves_nothing_behind(server):
    r = subprocess.run([sys.executable, "benchmarks/load_test.py", "--url",
                        f"http://{server.address}", "--streams", str(STREAMS), "--seconds",
                        str(SECONDS), "--max-tokens", "8", "--pid", str(server.proc.pid),
                        "--json"], cwd=REPO, capture_output=True, text=True, timeout=SECONDS + 240)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    print(f"\nload report: {report}")
    outcomes = report["outcomes"]
    assert set(outcomes) <= {"200", "429"}, outcomes
    assert outcomes.get("200", 0) > 0 and outcomes.get("429", 0) > 0, outcomes
    assert report["bad_retry_after"] == 0
    assert report["rss_mib_after"] is not None

    deadline = time.monotonic() + 10
    while True:
        health = httpx.get(f"http://{server.address}/health", timeout=5).json()
        sessions = _sessions(httpx.get(f"http://{server.address}/metrics", timeout=5).text)
        idle = health["active"] == 0 and health["queue_depth"] == 0 and \
            sessions == {"drafter": 0, "verifier": 0}
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert health["active"] == 0 and health["queue_depth"] == 0, health
    assert sessions == {"drafter": 0, "verifier": 0}, sessions


def test_a_429_names_when_to_retry(server):
    """Direct: an over-full queue answers 429 in the OpenAI shape with Retry-After."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 8}
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: httpx.post(
            f"http://{server.address}/v1/chat/completions", json=body, timeout=120), range(12)))
    limited = [a for a in answers if a.status_code == 429]
    assert limited and all(a.status_code in (200, 429) for a in answers)
    for a in limited:
        assert a.headers["retry-after"].isdigit()
        assert a.json()["error"]["type"] == "rate_limit_error"
