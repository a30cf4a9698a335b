"""Embedded `vericache serve` against the four services, on loopback, in one run.

Starts kvstore (Redis behind it), verifier, drafter and gateway as processes, and an embedded
server; sends the same prompts to both (greedy), checks the texts are identical, and reports
tokens/s of each. Then the prefix-cache check: a long code prompt, and a second prompt sharing
its prefix: TTFT, cached prompt tokens, store hits and bytes moved for each.

    .venv/bin/python benchmarks/services_compare.py --context-tokens 7000 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from service_process import free_port  # noqa: E402


def start(args: list[str], port: int, threads: int) -> subprocess.Popen:
    log = tempfile.NamedTemporaryFile(prefix="svc-", suffix=".log", delete=False)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "LMCACHE_TRACK_USAGE": "false"}
    return subprocess.Popen([sys.executable, "-m", *args, "--host", "127.0.0.1", "--port", str(port)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_grpc(port: int, timeout: float = 180) -> None:
    import grpc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            grpc.channel_ready_future(grpc.insecure_channel(f"127.0.0.1:{port}")).result(timeout=1)
            time.sleep(1.0)
            return
        except grpc.FutureTimeoutError:
            time.sleep(0.5)
    raise TimeoutError(f"port {port} did not come up")


def wait_http(port: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"gateway on {port} did not come up")


def stream(port: int, body: dict) -> dict:
    """One streamed completion: text, TTFT, total seconds, usage."""
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=3600,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if ttft is None and chunk["choices"][0].get("text"):
                    ttft = time.perf_counter() - t0
                text += chunk["choices"][0].get("text") or ""
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"text": text, "ttft_s": ttft, "seconds": time.perf_counter() - t0, "usage": usage}


def metrics(port: int) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, val = line.rsplit(" ", 1)
            out[name] = float(val)
    return out


def code_prompt(tokens: int) -> str:
    from vericache.bench.prompts import builtin_prompts
    from vericache.model.loader import load_model_info

    info = load_model_info()
    return info.tokenizer.decode(builtin_prompts(info.tokenizer, 1, tokens)[0].ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context-tokens", type=int, default=7000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    ap.add_argument("--compressor", default="snapkv")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    ports = {k: free_port() for k in ("kv", "ver", "dra", "gw", "emb")}
    prefix = f"vericache-bench-{uuid.uuid4().hex[:8]}:"
    procs = [start(["services.kvstore", "--backend", f"redis://127.0.0.1:6379/0?prefix={prefix}"],
                   ports["kv"], a.threads)]
    try:
        wait_grpc(ports["kv"])
        kv = f"127.0.0.1:{ports['kv']}"
        procs.append(start(["services.verifier", "--kvstore", kv], ports["ver"], a.threads))
        procs.append(start(["services.drafter", "--kvstore", kv], ports["dra"], a.threads))
        wait_grpc(ports["ver"])
        wait_grpc(ports["dra"])
        procs.append(start(["services.gateway", "--drafter", f"127.0.0.1:{ports['dra']}", "--verifier",
                            f"127.0.0.1:{ports['ver']}", "--kvstore", kv], ports["gw"], a.threads))
        procs.append(start(["vericache", "serve"], ports["emb"], a.threads))
        wait_http(ports["gw"])
        wait_http(ports["emb"])
        body = {"max_tokens": a.max_tokens, "temperature": 0,
                "vericache": {"compressor": a.compressor, "draft_len": 16}}
        prompts = ["def quicksort(xs):", "class LRUCache:\n    def __init__(self, capacity):",
                   "import json\n\ndef load_config(path):"]
        side = {}
        for name in ("emb", "gw"):
            runs = [stream(ports[name], {**body, "prompt": p}) for p in prompts]
            toks = sum(r["usage"]["completion_tokens"] for r in runs)
            side[name] = {"texts": [r["text"] for r in runs], "tokens": toks,
                          "seconds": sum(r["seconds"] for r in runs),
                          "tokens_per_s": toks / sum(r["seconds"] for r in runs)}
        same = side["emb"]["texts"] == side["gw"]["texts"]
        long_a = code_prompt(a.context_tokens)
        long_b = long_a + "\n# Now write a test for the first function above.\n"
        reuse = []
        for p in (long_a, long_b):
            before = metrics(ports["gw"])
            r = stream(ports["gw"], {**body, "prompt": p})
            after = metrics(ports["gw"])
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in (
                "vericache_cached_prompt_tokens_total", "vericache_store_hits_total",
                "vericache_store_read_bytes_total", "vericache_store_written_bytes_total",
                "vericache_prefill_seconds_total", "vericache_kvstore_hits_total")}
            reuse.append({"prompt_tokens": r["usage"]["prompt_tokens"], "ttft_s": r["ttft_s"],
                          "seconds": r["seconds"], "tau": r["usage"]["tokens_per_round"], **delta})
        emb_long = stream(ports["emb"], {**body, "prompt": long_a})
        out = {"identical_embedded_vs_services": same,
               "long_prompt_identical": emb_long["text"] == stream(ports["gw"], {**body, "prompt": long_a})["text"],
               "embedded": {k: v for k, v in side["emb"].items() if k != "texts"},
               "services": {k: v for k, v in side["gw"].items() if k != "texts"},
               "services_vs_embedded_tokens_per_s": side["gw"]["tokens_per_s"] / side["emb"]["tokens_per_s"],
               "prefix_reuse": reuse, "threads_per_process": a.threads}
        print(json.dumps(out, indent=2))
        if a.json:
            a.json.write_text(json.dumps(out, indent=2))
        return 0 if same and out["long_prompt_identical"] else 1
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        import redis  # the Redis server is shared: drop only this run's keys

        r = redis.Redis(host="127.0.0.1", port=6379, db=0)
        keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            r.delete(*keys)


if __name__ == "__main__":
    sys.exit(main())
