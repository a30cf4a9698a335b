"""Decode speed of `full` and `vericache` at about 1k and 7k tokens of context, in one process,
and where a decode step's time goes (torch profiler: matmuls, attention, the rest).

    .venv/bin/python benchmarks/decode_speed.py --contexts 1024,7168 --max-tokens 128 --json out.json

Prompts are the built-in code prompts of `vericache bench`. Speeds are decode-only (prefill
excluded; it is reported apart). Every vericache output is checked identical to full greedy.

Each compressor runs four ways: `fixed` (k = --draft-len every round), `cold` (the cost
model chooses k, starting from nothing: it explores its first rounds), `calibrated` (a new
cost model, first calibrated as `vericache serve` does at start-up, untimed; its
`calibration_s` is reported) and `warm` (the same request again with the cost model the cold
run trained, as in a server that has been up).
Reported per run: the k histogram (rounds at each k; 0 = plain decode steps), the model's
predicted and measured tokens/s, and the rounds it took to leave exploration.

Sequential runs on a shared CPU vary by several percent, so `full`, `calibrated` and `warm`
alternate --repeats times (full, calibrated, full, warm, full, calibrated, ...) and each ratio
is against the median of the `full` runs (one before each of those runs); the calibrated and
warm rows report the median of their repeats (`calibrated_runs`, `warm_runs` list each).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from vericache.bench.prompts import builtin_prompts
from vericache.engine.generation import GenParams
from vericache.engine.calibrate import calibrate
from vericache.engine.local import generate
from vericache.engine.rounds import LocalBackends
from vericache.model import load_model
from vericache.spec.costmodel import CostModel


def runner_loop(lm, ids: list[int], steps: int = 64) -> float:
    """Plain greedy steps on the runner alone (no engine bookkeeping): tokens per second."""
    r = lm.runner
    cache = r.new_cache(len(ids) + steps + 8)
    for s in range(0, len(ids), 256):
        logits, _ = r.step(ids[s:s + 256], s, cache)
    tok = int(logits[0].argmax())
    t = time.perf_counter()
    for i in range(steps):
        logits, _ = r.step([tok], len(ids) + i, cache)
        tok = int(logits[0].argmax())
    return steps / (time.perf_counter() - t)


def profile_step(lm, ids: list[int], steps: int = 8) -> dict:
    """Share of a decode step's time in linear layers, attention GEMMs/softmax, and the rest."""
    from torch.profiler import ProfilerActivity, profile

    r = lm.runner
    cache = r.new_cache(len(ids) + steps + 8)
    logits, _ = r.step(ids, 0, cache)  # one-pass prefill is fine at these lengths
    tok = int(logits[0].argmax())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for i in range(steps):
            logits, _ = r.step([tok], len(ids) + i, cache)
            tok = int(logits[0].argmax())
        wall = (time.perf_counter() - t) / steps
    ev = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(ev.values())
    # aten::mm runs both the projections and the attention GEMMs (both memory-bound at one
    # token): its time is split between them by the bytes each reads per step
    w_bytes = sum(p.numel() for lyr in r.layers for p in (lyr.w_qkv, lyr.w_o, lyr.w_gate_up, lyr.w_down))
    w_bytes = (w_bytes + r.lm_head.numel()) * r.embed.element_size()
    kv_bytes = r.kv_bytes_per_token() * len(ids)
    mm = ev.get("aten::mm", 0) + ev.get("aten::addmm", 0)
    mm_weights = mm * w_bytes / (w_bytes + kv_bytes)
    softmax = ev.get("aten::_softmax", 0)
    return {"step_ms": wall * 1e3, "weights_mb": w_bytes / 2**20, "kv_mb": kv_bytes / 2**20,
            "share_weight_gemm": mm_weights / total, "share_attention_gemm": (mm - mm_weights) / total,
            "share_softmax": softmax / total, "share_other_ops": 1 - (mm + softmax) / total,
            "roofline_steps_per_s_at_27GBps": 27e9 / (w_bytes + kv_bytes)}


def describe(res, ref, spec: str, run: str, costs: CostModel | None) -> dict:
    """One vericache run's figures (ratios against full are filled in by the caller)."""
    s = res.stats
    d = res.seconds - s.prefill_s - s.compress_s
    snap = costs.snapshot() if costs is not None else {}
    return {"compressor": spec, "run": run, "identical": res.token_ids == ref.token_ids,
            "k_hist": dict(sorted(s.k_hist.items())), "plain_share": s.k_hist.get(0, 0) / max(1, s.rounds),
            "predicted_tps": snap.get("predicted_tps"), "measured_tps": snap.get("measured_tps"),
            "explore_rounds": snap.get("explore_rounds"),
            "decode_tokens_per_s": len(res.token_ids) / d,
            "tau": s.tokens_per_round, "acceptance": s.acceptance_rate, "draft_s": s.draft_s,
            "verify_s": s.verify_s, "draft_steps": s.draft_steps, "verify_tokens": s.verify_tokens,
            "rounds": s.rounds, "verify_s_per_round": s.verify_s / max(1, s.rounds),
            "draft_s_per_step": s.draft_s / max(1, s.draft_steps),
            "compression": s.full_kv_bytes / max(1, s.draft_kv_bytes)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,7168")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--specs", default="snapkv@4,streamingllm@8",
                    help="compressors as NAME@RATIO, comma-separated (default: snapkv@4,streamingllm@8)")
    ap.add_argument("--draft-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="calibrated and warm runs each, alternated with full runs; ratios use "
                         "the median full run (default 3)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load_model()
    specs = [s for s in a.specs.split(",") if s]
    out = {"threads": torch.get_num_threads(), "rows": []}
    ok = True
    for ctx in [int(c) for c in a.contexts.split(",")]:
        ids = builtin_prompts(lm.tokenizer, 1, ctx)[0].ids
        def full_run():
            r = generate(lm, ids, GenParams(mode="full", max_tokens=a.max_tokens, ignore_eos=True))
            return r, len(r.token_ids) / (r.seconds - r.stats.prefill_s)

        ref, tps = full_run()
        full_tps = [tps]
        row = {"context": len(ids), "prefill_tokens_per_s": len(ids) / ref.stats.prefill_s, "vericache": []}
        for spec in specs:
            name, _, ratio = spec.partition("@")
            costs = CostModel()
            repeated: dict[str, list[dict]] = {"calibrated": [], "warm": []}
            for run in ["fixed", "cold"] + ["calibrated", "warm"] * a.repeats:
                if run in ("calibrated", "warm"):
                    full_tps.append(full_run()[1])
                params = GenParams(mode="vericache", compressor=name,
                                   ratio=float(ratio) if ratio else None, draft_len=a.draft_len,
                                   max_tokens=a.max_tokens, ignore_eos=True, adaptive=run != "fixed")
                run_costs = None if run == "fixed" else costs
                if run == "calibrated":
                    run_costs = CostModel()
                    calibrate(LocalBackends(lm), lm, run_costs, params)
                res = generate(lm, ids, params, costs=run_costs)
                ok &= res.token_ids == ref.token_ids
                entry = describe(res, ref, spec, run, run_costs)
                if run == "calibrated":
                    entry["calibration_s"] = run_costs.calibration["seconds"]
                if run in repeated:
                    repeated[run].append(entry)
                else:
                    row["vericache"].append(entry)
            for run, entries in repeated.items():
                mid = sorted(entries, key=lambda e: e["decode_tokens_per_s"])[len(entries) // 2]
                row["vericache"].append(dict(mid, **{f"{run}_runs": [e["decode_tokens_per_s"] for e in entries]}))
        full = sorted(full_tps)[len(full_tps) // 2]
        row["full_decode_tokens_per_s"] = full
        row["full_runs"] = full_tps
        for e in row["vericache"]:
            e["speed_vs_full"] = e["decode_tokens_per_s"] / full
            e["verify_pass_in_steps"] = e.pop("verify_s_per_round") * full
            e["draft_step_vs_full_step"] = e.pop("draft_s_per_step") * full
        row["runner_loop_tokens_per_s"] = runner_loop(lm, ids)
        row["profile"] = profile_step(lm, ids)
        out["rows"].append(row)
        print(json.dumps(row, indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
