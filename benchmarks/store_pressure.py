"""The prefix cache under store pressure: the four services over a Redis of their own whose
`maxmemory` (allkeys-lru) is far below the prompts' prefix chunks, against the same stack with
the Redis unbounded, in one run (the limit is set with CONFIG SET between the phases, the keys
flushed). A third phase deletes half the keys every 50 ms while requests run (chunks vanish
between longest_prefix and get, and during a drafter's attach).

Per phase: requests, completed identical to the full-greedy reference (computed once in this
process), failed cleanly, wrong and unverified tokens (must be 0), the kvstore's hit rate
(hits / (hits + misses) of its gets), Redis's evicted keys and peak memory.

    PYTHONPATH=. .venv/bin/python benchmarks/store_pressure.py --maxmemory-mb 32 \
        --json benchmarks/results/2026-12-01e/store_pressure.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from chaos_stack import Stack, deleting_keys, references, stream_chat, wait_drained  # noqa: E402

MODULES = ("json/decoder.py", "argparse.py", "textwrap.py", "json/encoder.py", "csv.py",
           "string.py")


def prompts(n: int, chars: int) -> list[str]:
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return [f"Here is a Python module:\n```python\n{(lib / m).read_text()[:chars]}\n```\n"
            f"What does it do?" for m in MODULES[:n]]


def phase(stack: Stack, name: str, texts: list[str], refs: dict, rounds: int, clients: int,
          max_tokens: int, evict: bool = False) -> dict:
    r = stack.redis.client()
    r.config_resetstat()
    before = stack.store_stats()
    order = [text for _ in range(rounds) for text in texts]
    t0 = time.monotonic()
    with deleting_keys(r) if evict else nullcontext():
        with ThreadPoolExecutor(clients) as pool:
            outs = list(pool.map(lambda text: (text, stream_chat(stack.gateway, text, max_tokens,
                                                                 timeout=300)), order))
    seconds = time.monotonic() - t0
    after = stack.store_stats()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    info = r.info()
    return {
        "phase": name, "requests": len(outs), "seconds": round(seconds, 1),
        "completed_identical": sum(o.completed and o.ids == refs[x] for x, o in outs),
        "completed_not_identical": sum(o.completed and o.ids != refs[x] for x, o in outs),
        "failed_clean": sum(o.failed_clean for _, o in outs),
        "failed_unclean": sum(not o.completed and not o.failed_clean for _, o in outs),
        "wrong_tokens": sum(o.wrong(refs[x]) for x, o in outs),
        "unverified_tokens": sum(o.unverified() for _, o in outs),
        "store_gets": hits + misses, "hits": hits, "misses": misses,
        "hit_rate": round(hits / max(1, hits + misses), 3),
        "redis_evicted_keys": info["evicted_keys"],
        "redis_peak_mb": round(info["used_memory_peak"] / 2**20, 1),
        "errors": sorted({o.errors[0]["error"]["message"][:120] for _, o in outs if o.errors})[:3],
        "sessions_after": wait_drained(stack),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--maxmemory-mb", type=int, default=32)
    p.add_argument("--prompts", type=int, default=4, help="distinct long prompts (<= 6)")
    p.add_argument("--chars", type=int, default=1700, help="characters of source per prompt "
                   "(1700: about 550 tokens, two 256-token chunks of 11.8 MB fp32 KV each)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    t0 = time.monotonic()
    from vericache.model.loader import load_model

    texts = prompts(a.prompts, a.chars)
    lm = load_model(None, dtype="float32", device="cpu")
    refs = references(lm, texts, a.max_tokens)
    del lm
    stack = Stack(max_tokens=a.max_tokens).start()
    results = []
    try:
        r = stack.redis.client()
        results.append(phase(stack, "unbounded", texts, refs, a.rounds, a.clients, a.max_tokens))
        print(json.dumps(results[-1]), flush=True)
        r.flushall()
        r.config_set("maxmemory", f"{a.maxmemory_mb}mb")
        r.config_set("maxmemory-policy", "allkeys-lru")
        results.append(phase(stack, f"maxmemory {a.maxmemory_mb} MB", texts, refs, a.rounds,
                             a.clients, a.max_tokens))
        print(json.dumps(results[-1]), flush=True)
        results.append(phase(stack, f"maxmemory {a.maxmemory_mb} MB + random deletes", texts,
                             refs, a.rounds, a.clients, a.max_tokens, evict=True))
        print(json.dumps(results[-1]), flush=True)
    finally:
        stack.stop()
    out = {"maxmemory_mb": a.maxmemory_mb, "prompts": a.prompts, "rounds": a.rounds,
           "clients": a.clients, "max_tokens": a.max_tokens,
           "seconds": round(time.monotonic() - t0, 1), "phases": results}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    bad = sum(x["wrong_tokens"] + x["unverified_tokens"] + x["failed_unclean"]
              + x["completed_not_identical"] for x in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
