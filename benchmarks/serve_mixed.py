"""`vericache` against `full` mode on one server, under concurrent mixed prompts.

Starts `vericache serve` (embedded engine, default flags unless given after `--`), or with
`--target services` the four services (kvstore with Redis behind it, verifier, drafter,
gateway; default flags, the extra flags go to the gateway), warms its
prefix cache with every prompt once per mode (full chunks, and the compressed ones), then runs the same batch of concurrent requests twice per
mode, alternating full, vericache, full, vericache (the engine's cost model keeps what it
learned from one batch to the next, as a server does). Prompts are chat prompts of mixed
lengths (--lengths, tokens of standard-library code followed by a question), one request
each, all sent at once; each mode's figure is completion tokens over the batch's wall time.
Every vericache answer is checked identical to the full answer of the same prompt.
Also reported from /metrics after each batch: rounds at each k, the plain-step share, the
cost model's predicted and measured tokens/s.

    .venv/bin/python benchmarks/serve_mixed.py --lengths 200,600,1000,1800,2600,3400,4200,5000 \\
        --max-tokens 128 --json out.json [--target services] [-- --schedule staggered]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from services_compare import start, wait_grpc, wait_http  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from service_process import free_port  # noqa: E402

QUESTIONS = ["Write one new function that uses the code above.",
             "Explain what the first function above does.",
             "List the names of the functions above as a JSON array.",
             "Write a unit test for one function above."]


def prompts(lengths: list[int]) -> list[str]:
    """Chat messages of about each length in tokens (about 3.5 characters a token)."""
    import argparse as a
    import json as j
    src = Path(j.__file__).read_text() + Path(a.__file__).read_text()
    out = []
    for i, n in enumerate(lengths):
        start_at = (i * 7919) % max(1, len(src) - int(n * 3.5))
        code = src[start_at:start_at + int(n * 3.5)]
        out.append(f"```python\n{code}\n```\n{QUESTIONS[i % len(QUESTIONS)]}")
    return out


def ask(base: str, text: str, mode: str, max_tokens: int) -> dict:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=1800, json={
        "model": "smollm2-135m-instruct", "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": text}],
        "vericache": {"mode": mode}})
    r.raise_for_status()
    body = r.json()
    return {"text": body["choices"][0]["message"]["content"], "usage": body["usage"]}


def metrics(base: str) -> dict:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict = {"k_rounds": {}}
    for line in text.splitlines():
        m = re.match(r'vericache_draft_len_rounds_total\{k="(\d+)"\} (\S+)', line)
        if m:
            out["k_rounds"][int(m.group(1))] = float(m.group(2))
        for name in ("vericache_plain_round_share", "vericache_cost_model_predicted_tokens_per_second",
                     "vericache_cost_model_measured_tokens_per_second", "vericache_cost_model_fitted"):
            if line.startswith(name + " "):
                out[name.replace("vericache_", "")] = float(line.split()[1])
    return out


def batch(base: str, texts: list[str], mode: str, max_tokens: int) -> dict:
    t = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        res = list(pool.map(lambda s: ask(base, s, mode, max_tokens), texts))
    wall = time.perf_counter() - t
    tokens = sum(r["usage"]["completion_tokens"] for r in res)
    return {"mode": mode, "wall_s": round(wall, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 3), "results": res}


def start_target(target: str, port: int, extra: list[str], prefix: str) -> list:
    """The server under test, listening on `port`: `vericache serve`, or the four services
    (their processes, the gateway last)."""
    if target == "serve":
        return [start(["vericache", "serve", *extra], port, threads=2)]
    ports = {k: free_port() for k in ("kv", "ver", "dra")}
    procs = [start(["services.kvstore", "--backend", f"redis://127.0.0.1:6379/0?prefix={prefix}"],
                   ports["kv"], threads=2)]
    wait_grpc(ports["kv"])
    kv = f"127.0.0.1:{ports['kv']}"
    procs.append(start(["services.verifier", "--kvstore", kv], ports["ver"], threads=2))
    procs.append(start(["services.drafter", "--kvstore", kv], ports["dra"], threads=2))
    wait_grpc(ports["ver"], timeout=600)
    wait_grpc(ports["dra"], timeout=600)
    procs.append(start(["services.gateway", "--kvstore", kv, "--drafter", f"127.0.0.1:{ports['dra']}",
                        "--verifier", f"127.0.0.1:{ports['ver']}", *extra], port, threads=2))
    return procs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="200,600,1000,1800,2600,3400,4200,5000")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="batches per mode (default: 2)")
    ap.add_argument("--target", choices=("serve", "services"), default="serve",
                    help="the embedded `vericache serve` (default) or the four services")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("serve_args", nargs="*", help="extra `vericache serve` (or gateway) flags, after --")
    a = ap.parse_args()
    port = free_port()
    prefix = f"vericache-mixed-{os.getpid()}:"
    procs = start_target(a.target, port, a.serve_args, prefix)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(port)
        texts = prompts([int(x) for x in a.lengths.split(",")])
        for s in texts:  # warm the prefix cache: full and compressed chunks (and the runner)
            ask(base, s, "full", 2)
            ask(base, s, "vericache", 2)
        runs = []
        for i in range(a.repeats):
            for mode in ("full", "vericache"):
                r = batch(base, texts, mode, a.max_tokens)
                r["metrics"] = metrics(base)
                r["repeat"] = i
                runs.append(r)
                print(f"{mode:9s} repeat {i}: {r['tokens_per_s']:.2f} tok/s "
                      f"({r['tokens']} tokens in {r['wall_s']:.1f} s); {r['metrics']}", flush=True)
        full = [r for r in runs if r["mode"] == "full"]
        vc = [r for r in runs if r["mode"] == "vericache"]
        identical = all(v["results"][j]["text"] == full[0]["results"][j]["text"]
                        for v in vc for j in range(len(texts)))
        last = {"full": full[-1]["tokens_per_s"], "vericache": vc[-1]["tokens_per_s"]}
        summary = {"target": a.target, "lengths": a.lengths, "max_tokens": a.max_tokens, "serve_args": a.serve_args,
                   "identical": identical, "tokens_per_s_last": last,
                   "ratio_last": round(last["vericache"] / last["full"], 4),
                   "ratio_all": round(sum(r["tokens"] for r in vc) / sum(r["wall_s"] for r in vc)
                                      / (sum(r["tokens"] for r in full) / sum(r["wall_s"] for r in full)), 4)}
        print(json.dumps(summary))
        if a.json:
            for r in runs:
                for x in r["results"]:
                    x.pop("text")
            Path(a.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
        return 0 if identical else 1
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=60)
        if a.target == "services":
            import redis

            r = redis.Redis(host="127.0.0.1", port=6379, db=0)
            keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
            if keys:
                r.delete(*keys)


if __name__ == "__main__":
    sys.exit(main())
