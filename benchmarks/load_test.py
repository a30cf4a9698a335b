"""A bounded load test of a running gateway: N concurrent streaming clients for T seconds.

    python benchmarks/load_test.py --url http://127.0.0.1:8000 --streams 8 --seconds 20 \\
        --max-tokens 8 [--api-key KEY] [--pid PID_OF_THE_SERVER] [--json]

Each client loops: POST /v1/chat/completions with stream=true, read the SSE stream to
`data: [DONE]`, start the next request (closed loop). A 429 is counted, its Retry-After header
checked (it must be a number of seconds) and honoured, capped at 1 s so the run stays bounded.
Reported: requests, outcomes by status (`200`, `429`, ..., `stream_error` for an error chunk
inside a 200 stream, `exception` for a transport failure), p50/p99 latency of completed
streams, time to first token, and the server's RSS before and after (from /proc, with --pid).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

QUESTIONS = ["Write a Python function that reverses a list.", "What is a KV cache?",
             "List three colors as JSON.", "Write a haiku about the sea.", "Say hello.",
             "Explain recursion in one sentence.", "Name two sorting algorithms."]


@dataclass
class Results:
    outcomes: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    bad_retry_after: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, outcome: str, latency: float | None = None, ttft: float | None = None):
        with self.lock:
            self.outcomes[outcome] += 1
            if latency is not None:
                self.latencies.append(latency)
            if ttft is not None:
                self.first_token.append(ttft)


def rss_mib(pid: int | None) -> float | None:
    """Resident set size of a process in MiB (Linux /proc), or None."""
    if not pid:
        return None
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def one_request(client: httpx.Client, body: dict, results: Results) -> float:
    """Send one streaming request; record its outcome; return seconds to wait before the next."""
    t0 = time.perf_counter()
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                wait = 0.0
                if r.status_code == 429:
                    ra = r.headers.get("retry-after", "")
                    if not ra.isdigit():
                        with results.lock:
                            results.bad_retry_after += 1
                    wait = min(float(ra) if ra.isdigit() else 1.0, 1.0)
                results.record(str(r.status_code))
                return wait
            ttft, failed, done = None, False, False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    failed = True
                elif ttft is None and chunk.get("choices") and \
                        chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
            outcome = "stream_error" if failed else "200" if done else "no_done"
            results.record(outcome, time.perf_counter() - t0 if outcome == "200" else None, ttft)
    except httpx.HTTPError as e:
        results.record(f"exception:{type(e).__name__}")
    return 0.0


def run(url: str, streams: int, seconds: float, max_tokens: int, api_key: str | None = None,
        pid: int | None = None) -> dict:
    """Run the load; the report as a dict."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results = Results()
    stop_at = time.monotonic() + seconds
    rss_before = rss_mib(pid)

    def worker(i: int):
        with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
            n = 0
            while time.monotonic() < stop_at:
                body = {"messages": [{"role": "user", "content": QUESTIONS[(i + n) % len(QUESTIONS)]}],
                        "max_tokens": max_tokens, "temperature": 0, "stream": True}
                n += 1
                wait = one_request(client, body, results)
                if wait:
                    time.sleep(min(wait, max(0.0, stop_at - time.monotonic())))

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    lat = sorted(results.latencies)

    def pct(xs: list[float], q: float) -> float | None:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None

    return {"url": url, "streams": streams, "seconds": seconds, "wall_s": round(wall, 2),
            "requests": sum(results.outcomes.values()), "outcomes": dict(results.outcomes),
            "completed_per_s": round(len(lat) / wall, 2) if wall else 0.0,
            "latency_p50_s": pct(lat, 0.5), "latency_p99_s": pct(lat, 0.99),
            "ttft_median_s": round(statistics.median(results.first_token), 3)
            if results.first_token else None,
            "bad_retry_after": results.bad_retry_after,
            "rss_mib_before": rss_before, "rss_mib_after": rss_mib(pid)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="N concurrent streaming clients for T seconds "
                                            "against a VeriCache (or any OpenAI) gateway.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    p.add_argument("--streams", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--seconds", type=float, default=20, help="how long to send (default 20)")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens per request (default 8)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--pid", type=int, default=None,
                   help="the server's process id, to report its RSS before and after")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    report = run(a.url, a.streams, a.seconds, a.max_tokens, a.api_key, a.pid)
    if a.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k:>16}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
