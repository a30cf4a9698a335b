"""One engine: the same long-context workload through `vericache bench --scenario` and through
`vericache serve` under concurrent streaming clients.

Both run `vericache.engine.lanes.LaneRunner`: the scenario through `run_requests` (its
`vericache_<schedule>` variant), the server through `BatchEngine`. The workload is the
scenario's: `--concurrency` prompts of `--context-tokens` sharing one document, k fixed, the
full KV offloaded behind `--link-gbps`, every prompt's prefill cached first (the scenario
warms its in-memory store; the server's prefix cache is warmed by one `full` request per
prompt). The server gets the memory the scenario's variant used: its drafter budget is the
drafter's peak in the scenario run, its verifier budget the rest of the scenario's total.
Reported: throughput (completion tokens over the wall time of the whole batch), τ, TTFT, the
ratio serve / bench, and whether every output equals full greedy decoding.

    .venv/bin/python benchmarks/serve_vs_bench.py --concurrency 8 --context-tokens 2000 \\
        --max-tokens 32 --json out.json

`--targets serve,services` runs the server side twice: `vericache serve`, then the four
services (kvstore on Redis, verifier with the same tier and budget, drafter with the drafter
budget, gateway reading both budgets from their Health). While each runs, the resident set of
its processes and its /metrics (KV bytes per side, requests waiting) are sampled.
`--resident-check` then runs `full` mode on resident full KV under the same total budget
(too small for every request's cache at once): as many are admitted as fit, the others wait,
every output is full greedy, and the verifier's KV bytes stay inside the budget.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from services_compare import start, stream, wait_grpc, wait_http  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from service_process import free_port  # noqa: E402


def stream_ids(port: int, ids: list[int], body: dict) -> dict:
    """One streamed completion of a token-id prompt (`services_compare.stream`)."""
    out = stream(port, {"prompt": ids, **body})
    if out["usage"] is None:
        raise RuntimeError(f"the stream of a {len(ids)}-token prompt ended without usage")
    return out


def bench_side(lm, prompts, cfg) -> tuple[dict, list[list[int]]]:
    """The scenario's own variant run (what `vericache bench --scenario` does for it)."""
    from vericache.bench.scenario import (drop_new_keys, run_long_context_variant,
                                          variant_measures)
    from vericache.compress import make_compressor
    from vericache.engine.local import generate
    from vericache.engine.rounds import LocalBackends
    from vericache.engine.verifier import Verifier
    from vericache.store.memory import MemoryStore

    store = MemoryStore()
    ver = Verifier(lm.runner, store, lm.model_id)
    comp = make_compressor(cfg.compressor, cfg.ratio)
    for i, p in enumerate(prompts):
        ver.prefill(f"warm-{i}", p.ids, 1, cfg.chunk_size, comp)
        ver.release(f"warm-{i}")
    published = set(store.keys())
    reference = []
    for p in prompts:
        reference.append(generate(lm, p.ids, cfg.params("full"), LocalBackends(lm, store)).token_ids)
        drop_new_keys(store, published)
    raw = run_long_context_variant(lm, prompts, cfg, f"vericache_{cfg.schedule}", store)
    row = variant_measures(raw, reference, lm.runner.kv_bytes_per_token())
    store.close()
    return row, reference


class Sampler:
    """Samples, every `period_s`, the RSS of `procs` and of their children, and the server's
    /metrics gauges (KV bytes per side, requests waiting and active)."""

    def __init__(self, procs, port: int, period_s: float = 0.5):
        import threading

        import psutil

        self.procs = [psutil.Process(p.pid) for p in procs]
        self.port, self.period_s = port, period_s
        self.peak_rss, self.peak_kv, self.peak_waiting, self.peak_active = 0, {}, 0, 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _rss(self) -> int:
        total = 0
        for p in self.procs:
            for q in [p, *p.children(recursive=True)]:
                try:
                    total += q.memory_info().rss
                except Exception:  # noqa: BLE001 -- a child that ended
                    pass
        return total

    def _loop(self) -> None:
        import httpx

        while not self._stop.wait(self.period_s):
            self.peak_rss = max(self.peak_rss, self._rss())
            try:
                text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            for line in text.splitlines():
                if line.startswith("vericache_kv_bytes{"):
                    side = line.split('side="')[1].split('"')[0]
                    self.peak_kv[side] = max(self.peak_kv.get(side, 0), float(line.rsplit(" ", 1)[1]))
                elif line.startswith("vericache_queue_depth "):
                    self.peak_waiting = max(self.peak_waiting, float(line.rsplit(" ", 1)[1]))
                elif line.startswith("vericache_active_requests "):
                    self.peak_active = max(self.peak_active, float(line.rsplit(" ", 1)[1]))
            self.samples += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def report(self) -> dict:
        return {"peak_rss_mb": round(self.peak_rss / MB, 1), "samples": self.samples,
                "peak_kv_mb": {k: round(v / MB, 1) for k, v in self.peak_kv.items()},
                "peak_waiting": self.peak_waiting, "peak_active": self.peak_active}


MB = 1 << 20


def start_services(a, ports: dict, budgets: dict, tier_flags: list[str], prefix: str) -> list:
    """kvstore (Redis), verifier (the tier, its budget), drafter (its budget): processes; the
    verifier and drafter keep what they move through the kvstore in their default node cache."""
    procs = [start(["services.kvstore", "--backend", f"redis://127.0.0.1:6379/0?prefix={prefix}"],
                   ports["kv"], a.threads)]
    wait_grpc(ports["kv"])
    kv = f"127.0.0.1:{ports['kv']}"
    ver = ["services.verifier", "--kvstore", kv, *tier_flags]
    if budgets["verifier"] is not None:
        ver += ["--kv-budget-mb", f"{budgets['verifier']:.3f}"]
    procs.append(start(ver, ports["ver"], a.threads))
    procs.append(start(["services.drafter", "--kvstore", kv, "--draft-kv-budget-mb",
                        f"{budgets['drafter']:.3f}"], ports["dra"], a.threads))
    wait_grpc(ports["ver"], timeout=600)
    wait_grpc(ports["dra"], timeout=600)
    return procs


def run_server(a, target: str, prompts, gen_flags: list[str], tier_flags: list[str],
               budgets: dict, body: dict) -> tuple[list[dict], float, dict]:
    """Start `target` ("serve" or "services"), warm its prefix cache, stream every prompt
    at once; returns (outputs, wall seconds, sampled memory)."""
    import uuid

    port = free_port()
    procs, prefix = [], f"vericache-svb-{uuid.uuid4().hex[:8]}:"
    try:
        if target == "serve":
            flags = ["vericache", "serve", *gen_flags, *tier_flags,
                     "--draft-kv-budget-mb", f"{budgets['drafter']:.3f}"]
            if budgets["verifier"] is not None:
                flags += ["--kv-budget-mb", f"{budgets['verifier']:.3f}"]
        else:
            ports = {k: free_port() for k in ("kv", "ver", "dra")}
            procs = start_services(a, ports, budgets, tier_flags, prefix)
            flags = ["services.gateway", *gen_flags, "--kvstore", f"127.0.0.1:{ports['kv']}",
                     "--drafter", f"127.0.0.1:{ports['dra']}",
                     "--verifier", f"127.0.0.1:{ports['ver']}"]
        procs.append(start(flags, port, a.threads))
        wait_http(port, timeout=600)
        warm = {"max_tokens": 1, "temperature": 0, "ignore_eos": True}
        for p in prompts:  # warm the prefix cache (full and compressed chunks)
            stream_ids(port, p.ids, warm)
        print(f"{target}: {len(prompts)} concurrent streams ...", file=sys.stderr, flush=True)
        with Sampler(procs, port) as sampler:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                outs = list(pool.map(lambda p: stream_ids(port, p.ids, body), prompts))
            wall = time.perf_counter() - t0
        return outs, wall, sampler.report()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
        if target == "services":
            import redis

            r = redis.Redis(host="127.0.0.1", port=6379, db=0)
            keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
            if keys:
                r.delete(*keys)


def summarise(outs: list[dict], wall: float, reference, memory: dict) -> dict:
    from vericache.model.loader import load_model_info

    tok = load_model_info().tokenizer
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    rounds = sum(o["usage"]["rounds"] for o in outs)
    return {"throughput_tps": round(tokens / wall, 4), "wall_s": round(wall, 3),
            "tau_mean": round((tokens - len(outs)) / rounds, 3) if rounds else None,
            "ttft_mean_s": round(sum(o["ttft_s"] for o in outs) / len(outs), 3),
            "identical": all(o["text"] == tok.decode(ref) for o, ref in zip(outs, reference)),
            "memory": memory}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--context-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--compressor", default="snapkv")
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--draft-len", type=int, default=32)
    ap.add_argument("--selection", default="question")
    ap.add_argument("--schedule", choices=("lockstep", "staggered"), default="lockstep")
    ap.add_argument("--link-gbps", type=float, default=4.0)
    ap.add_argument("--kv-budget-caches", type=float, default=4.0)
    ap.add_argument("--targets", default="serve", help="serve, services, or both comma-separated")
    ap.add_argument("--resident-check", action="store_true",
                    help="also run full mode on resident KV under the same total budget")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import torch

    from vericache.bench.prompts import shared_document_prompts
    from vericache.bench.scenario import ScenarioConfig
    from vericache.model import load_model

    torch.set_num_threads(a.threads)
    lm = load_model()
    prompts = shared_document_prompts(lm.tokenizer, a.concurrency, a.context_tokens)
    cfg = ScenarioConfig(scenario="long-context", concurrency=a.concurrency, max_tokens=a.max_tokens,
                         compressor=a.compressor, ratio=a.ratio, draft_len=a.draft_len,
                         adaptive=False, link_gbps=a.link_gbps, kv_budget_caches=a.kv_budget_caches,
                         schedule=a.schedule, selections=[a.selection])
    print(f"bench: vericache_{a.schedule} over {a.concurrency} x {a.context_tokens} tokens ...",
          file=sys.stderr, flush=True)
    row, reference = bench_side(lm, prompts, cfg)
    total = cfg.kv_budget(max(len(p.ids) for p in prompts), lm.runner.kv_bytes_per_token())
    del lm
    # the server gets the memory the scenario's variant used: the drafter's peak, the rest
    # of the total for the verifier
    draft_mb = max(row["kv_peak_draft_bytes"], 1) / MB
    budgets = {"drafter": draft_mb, "verifier": (total / MB - draft_mb) if total else None}
    gen_flags = ["--schedule", a.schedule, "--compressor", a.compressor, "--ratio", str(a.ratio),
                 "--draft-len", str(a.draft_len), "--selection", a.selection,
                 "--max-batch", str(a.concurrency), "--max-tokens", str(a.max_tokens)]
    tier_flags = ["--kv-tier", "offloaded", "--tier-link-gbps", str(a.link_gbps)]
    body = {"max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True,
            "vericache": {"adaptive": False}}
    bench = {k: row[k] for k in ("throughput_tps", "tau_mean", "ttft_mean_s", "identical",
                                 "kv_peak_draft_bytes", "kv_peak_verify_bytes", "max_active")}
    doc = {"settings": vars(a), "kv_budget_bytes": total,
           "budgets_mb": {k: None if v is None else round(v, 3) for k, v in budgets.items()},
           "bench": bench}
    ok = bench["identical"]
    for target in [t for t in a.targets.split(",") if t]:
        outs, wall, mem = run_server(a, target, prompts, gen_flags, tier_flags, budgets, body)
        doc[target] = summarise(outs, wall, reference, mem)
        doc[f"{target}_over_bench"] = round(doc[target]["throughput_tps"] / bench["throughput_tps"], 4)
        ok = ok and doc[target]["identical"]
    if a.resident_check:
        # full mode, resident full KV, the whole total for the verifier: fewer fit than asked
        full_body = {"max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True,
                     "vericache": {"mode": "full"}}
        res_budgets = {"drafter": draft_mb, "verifier": total / MB if total else None}
        outs, wall, mem = run_server(a, "serve", prompts, gen_flags, ["--kv-tier", "resident"],
                                     res_budgets, full_body)
        check = summarise(outs, wall, reference, mem)
        check["verify_budget_mb"] = res_budgets["verifier"]
        check["within_budget"] = mem["peak_kv_mb"].get("verifier", 0) <= res_budgets["verifier"]
        check["some_waited"] = mem["peak_waiting"] > 0
        doc["full_resident_under_budget"] = check
        ok = ok and check["identical"] and check["within_budget"]
    print(json.dumps(doc, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
