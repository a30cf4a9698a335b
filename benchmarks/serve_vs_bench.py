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
from services_compare import start, stream, wait_http  # noqa: E402

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
    from vericache.bench.scenario import (_drop_new_keys, run_long_context_variant,
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
        _drop_new_keys(store, published)
    raw = run_long_context_variant(lm, prompts, cfg, f"vericache_{cfg.schedule}", store)
    row = variant_measures(raw, reference, lm.runner.kv_bytes_per_token())
    store.close()
    return row, reference


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
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import torch

    from vericache.bench.prompts import shared_document_prompts
    from vericache.bench.scenario import ScenarioConfig
    from vericache.engine.budget import MB
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
    draft_mb = max(row["kv_peak_draft_bytes"], 1) / MB
    verify_mb = (total / MB - draft_mb) if total else None
    del lm

    port = free_port()
    flags = ["vericache", "serve", "--schedule", a.schedule, "--kv-tier", "offloaded",
             "--tier-link-gbps", str(a.link_gbps), "--compressor", a.compressor,
             "--ratio", str(a.ratio), "--draft-len", str(a.draft_len),
             "--selection", a.selection, "--max-batch", str(a.concurrency),
             "--draft-kv-budget-mb", f"{draft_mb:.3f}"]
    if verify_mb is not None:
        flags += ["--kv-budget-mb", f"{verify_mb:.3f}"]
    proc = start(flags, port, a.threads)
    try:
        wait_http(port)
        body = {"max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True}
        for p in prompts:  # warm the server's prefix cache (full and compressed chunks)
            stream_ids(port, p.ids, {**body, "max_tokens": 1})
        print(f"serve: {a.concurrency} concurrent streams ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.concurrency) as pool:
            outs = list(pool.map(lambda p: stream_ids(
                port, p.ids, {**body, "vericache": {"adaptive": False}}), prompts))
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    from vericache.model.loader import load_model_info

    tok = load_model_info().tokenizer
    identical = [o["text"] == tok.decode(ref) for o, ref in zip(outs, reference)]
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    rounds = sum(o["usage"]["rounds"] for o in outs)
    serve = {"throughput_tps": round(tokens / wall, 4), "wall_s": round(wall, 3),
             "tau_mean": round((tokens - len(outs)) / rounds, 3) if rounds else None,
             "ttft_mean_s": round(sum(o["ttft_s"] for o in outs) / len(outs), 3),
             "identical": all(identical), "draft_budget_mb": round(draft_mb, 3),
             "verify_budget_mb": None if verify_mb is None else round(verify_mb, 3)}
    bench = {k: row[k] for k in ("throughput_tps", "tau_mean", "ttft_mean_s", "identical",
                                 "kv_peak_draft_bytes", "kv_peak_verify_bytes", "max_active")}
    doc = {"settings": vars(a), "kv_budget_bytes": total, "bench": bench, "serve": serve,
           "serve_over_bench": round(serve["throughput_tps"] / bench["throughput_tps"], 4)}
    print(json.dumps(doc, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))
    return 0 if serve["identical"] and bench["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
