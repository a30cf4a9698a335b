"""Chaos under load: the four services over a Redis of their own, N streaming clients, and a
fault injector that SIGKILLs one service at a time and starts it again on its port —
drafter, verifier, kvstore, then Redis (which comes back empty).

Per fault kind: requests started (in that phase), completed, failed cleanly (an OpenAI error
body or an SSE error chunk then [DONE]), failed otherwise; unverified tokens emitted (the
stream's provenance kind is not prefill/draft/bonus/plain); wrong tokens (emitted ids that
depart from the full-greedy reference, computed once in this process); seconds from the
kill to the restarted service answering, and from then to the first request that started
after it and completed; the sessions every service still holds once the clients pause and
the in-flight requests end (leaked: any left after 15 s).

    PYTHONPATH=. .venv/bin/python benchmarks/chaos.py --clients 16 \
        --json benchmarks/results/2026-12-01e/chaos.json

Bounded: `--budget-s` (default 540) stops the injector early if the run would go past it.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from chaos_stack import Outcome, Stack, references, stream_chat, wait_drained  # noqa: E402

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a KV cache is in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of a hash map.",
    "Summarise this list in one sentence: " + ", ".join(f"item {i}" for i in range(120)),
    "Return a JSON object with the fields name, age and city for a fictional person.",
]


class Load:
    """`clients` threads streaming PROMPTS in turn; each outcome is recorded with the phase
    it started in. `pause()` stops new requests and waits for the ones in flight."""

    def __init__(self, stack: Stack, clients: int, max_tokens: int):
        self.stack, self.max_tokens = stack, max_tokens
        self.phase = "warm-up"
        self.records: list[tuple[str, str, Outcome]] = []
        self._lock = threading.Lock()
        self._go, self._stop = threading.Event(), threading.Event()
        self._busy = 0
        self._go.set()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        n = i
        while not self._stop.is_set():
            self._go.wait()
            if self._stop.is_set():
                break
            with self._lock:
                if not self._go.is_set():
                    continue
                self._busy += 1
                phase = self.phase
            text = PROMPTS[n % len(PROMPTS)]
            n += 1
            try:
                out = stream_chat(self.stack.gateway, text, self.max_tokens)
            finally:
                with self._lock:
                    self._busy -= 1
                    self.records.append((phase, text, out))
            if not out.completed:
                time.sleep(0.5)  # a refused client backs off a little, as a real one would

    def pause(self, timeout_s: float = 180.0) -> None:
        with self._lock:
            self._go.clear()
        deadline = time.monotonic() + timeout_s
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.1)

    def resume(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        for t in self.threads:
            t.join(180)


def summarise(kind: str, recs: list[tuple[str, Outcome]], refs: dict[str, list[int]],
              cycles: list[dict], leaked: dict[str, int]) -> dict:
    outs = [o for _, o in recs]
    errors = Counter()
    for o in outs:
        if not o.completed:
            msg = o.exception or (o.errors[0]["error"].get("message", "") if o.errors else "no [DONE]")
            errors[msg[:140]] += 1
    completed = sum(o.completed for o in outs)
    clean = sum(o.failed_clean for o in outs)
    return {
        "fault": kind,
        "kills": len(cycles),
        "requests_started": len(outs),
        "completed": completed,
        "failed_clean": clean,
        "failed_unclean": len(outs) - completed - clean,
        "tokens_emitted": sum(len(o.ids) for o in outs),
        "unverified_tokens": sum(o.unverified() for o in outs),
        "wrong_tokens": sum(o.wrong(refs[t]) for t, o in recs),
        "completed_not_identical": sum(o.completed and o.ids != refs[t] for t, o in recs),
        "restart_s": [round(c["restart_s"], 2) for c in cycles],
        "recovery_s": [None if c["recovery_s"] is None else round(c["recovery_s"], 2)
                       for c in cycles],
        "sessions_after": leaked,
        "leaked_sessions": sum(leaked.values()),
        "errors": dict(errors.most_common(4)),
    }


def first_success_after(load: Load, t: float, wait_s: float) -> float | None:
    """Seconds from `t` to the end of the first request started after `t` that completed."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with load._lock:
            ends = [o.ended for _, _, o in load.records if o.started >= t and o.completed]
        if ends:
            return min(ends) - t
        time.sleep(0.1)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--faults", default="drafter,verifier,kvstore,redis")
    p.add_argument("--kills", type=int, default=2, help="kill+restart cycles per fault kind")
    p.add_argument("--before-s", type=float, default=3.0, help="load before each kill")
    p.add_argument("--down-s", type=float, default=1.0, help="time a killed service stays down")
    p.add_argument("--after-s", type=float, default=3.0, help="load after each restart")
    p.add_argument("--redis-maxmemory-mb", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    t_start = time.monotonic()

    from vericache.model.loader import load_model

    lm = load_model(None, dtype="float32", device="cpu")
    refs = references(lm, PROMPTS, a.max_tokens)
    del lm
    stack = Stack(max_tokens=a.max_tokens, redis_maxmemory_mb=a.redis_maxmemory_mb).start()
    print(f"stack up after {time.monotonic() - t_start:.0f} s", flush=True)
    results, load = [], None
    try:
        for text in PROMPTS:  # the warm stack answers every prompt identically
            o = stream_chat(stack.gateway, text, a.max_tokens)
            assert o.completed and o.ids == refs[text], (o, stack.logs())
        load = Load(stack, a.clients, a.max_tokens)
        time.sleep(a.before_s)
        load.pause()
        base = wait_drained(stack)
        results.append(summarise("none", [(t, o) for ph, t, o in load.records], refs, [], base))
        print(json.dumps(results[-1]), flush=True)
        kinds = a.faults.split(",")
        for j, kind in enumerate(kinds):
            load.resume(kind)
            cycles = []
            for i in range(a.kills):
                # every kind gets its first kill; later ones only while the budget leaves
                # about a minute for each kind still to come
                reserve = 60.0 * (len(kinds) - j)
                if i and time.monotonic() - t_start + reserve > a.budget_s:
                    print(f"budget: no more kills of {kind}", flush=True)
                    break
                time.sleep(a.before_s)
                t_kill = time.monotonic()
                stack.kill(kind)
                time.sleep(a.down_s)
                stack.restart(kind)
                t_up = time.monotonic()
                rec = first_success_after(load, t_up, max(a.after_s, min(
                    60.0, a.budget_s - 60.0 * (len(kinds) - j) - (time.monotonic() - t_start))))
                cycles.append({"restart_s": t_up - t_kill, "recovery_s": rec})
                time.sleep(max(0.0, a.after_s - (rec or 0.0)))
            load.pause()
            leaked = wait_drained(stack)
            recs = [(t, o) for ph, t, o in load.records if ph == kind]
            results.append(summarise(kind, recs, refs, cycles, leaked))
            print(json.dumps(results[-1]), flush=True)
            _write(a, t_start, results, {})  # what is done so far, should the run be cut
    finally:
        if load is not None:
            load.stop()
        stats = {}
        try:
            stats = stack.store_stats()
        except Exception as e:  # noqa: BLE001 -- reported, the stack still stops
            stats = {"error": str(e)}
        stack.stop()
    out = _write(a, t_start, results, stats, complete=True)
    print(_table(results))
    print(f"total {out['seconds']} s")
    bad = sum(r["wrong_tokens"] + r["unverified_tokens"] + r["failed_unclean"] + r["leaked_sessions"]
              for r in results)
    return 1 if bad else 0


def _write(a, t_start: float, results: list[dict], stats: dict, complete: bool = False) -> dict:
    out = {"clients": a.clients, "max_tokens": a.max_tokens, "kills_per_fault": a.kills,
           "down_s": a.down_s, "redis_maxmemory_mb": a.redis_maxmemory_mb,
           "seconds": round(time.monotonic() - t_start, 1), "complete": complete,
           "faults": results,
           "kvstore_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


def _table(results: list[dict]) -> str:
    cols = ["fault", "requests_started", "completed", "failed_clean", "failed_unclean",
            "wrong_tokens", "unverified_tokens", "recovery_s", "leaked_sessions"]
    rows = [cols] + [[str(r[c]) for c in cols] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    return "\n".join(" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows)


if __name__ == "__main__":
    sys.exit(main())
