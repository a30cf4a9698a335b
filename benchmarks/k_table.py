"""The draft length k the cost model chooses against context length, batch size and acceptance,
from pass times measured on this machine's runner in the same run.

For each context (--contexts) and batch (--batches) it fills that many full caches (random K/V:
a pass's time depends on shapes, not values) and compressed ones (context / --ratio), times
the runner's draft step (one token per sequence over the compressed caches) and its verify pass
(k + 1 tokens per sequence over the full caches, for several k), and feeds them to a fresh
`CostModel` exactly as the engine's rounds do (`observe_draft`, `observe_verify`; contexts are
the full ones). It then asks that model's `plan` for the group's k at each acceptance rate of
--rates (every draft position accepted with that probability). Reported per cell: the
measured draft step and verify pass times against a plain step; per rate, the chosen k, the
speedup over plain steps the model predicts for it (against its own price of a plain step),
the speedup the measured times give it (E(k) tokens in k draft steps and a verify pass of
k + 1 tokens a sequence, against a plain step's one token; a k between the timed ones is
interpolated), and the best k and speedup by the measured times alone (`best`).

    .venv/bin/python benchmarks/k_table.py --contexts 1024,2048,4096,7168 --batches 1,4,16 \\
        --json out.json

The engine's own rounds add some Python time per step that these runner-only times leave out;
`benchmarks/decode_speed.py` and `benchmarks/serve_mixed.py` report the k the engine chose in
real runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from vericache.model import load_model
from vericache.model.runner import SeqBatchItem
from vericache.spec.costmodel import AcceptanceProfile, CostModel

VERIFY_KS = (0, 1, 2, 4, 8, 16, 32)


def filled(runner, n: int, extra: int, gen: torch.Generator):
    """A cache of `n` tokens of random K/V with room for `extra` more."""
    c = runner.new_cache(n + extra)
    shape = (runner.num_layers, runner.num_kv_heads, n, runner.head_dim)
    c.append(torch.randn(shape, generator=gen, dtype=runner.dtype) * 0.3,
             torch.randn(shape, generator=gen, dtype=runner.dtype) * 0.3)
    return c


def timed_pass(runner, caches, tokens_each: int, repeats: int) -> list[float]:
    """Seconds of `repeats` passes of `tokens_each` new tokens per cache (each rolled back)."""
    times = []
    for _ in range(repeats):
        items = [SeqBatchItem(torch.full((tokens_each,), 42), torch.arange(c.length, c.length + tokens_each),
                              c, logits="all") for c in caches]
        t = time.perf_counter()
        runner.forward(items)
        times.append(time.perf_counter() - t)
        for c in caches:
            c.crop(c.length - tokens_each)
    return times


def profile_at(rate: float, k_max: int) -> AcceptanceProfile:
    """A request that accepted each draft position with probability `rate` over many rounds."""
    p = AcceptanceProfile(k_max)
    p.reached = [1000] * k_max
    p.accepted = [round(1000 * rate)] * k_max
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,2048,4096,7168",
                    help="full contexts, tokens (each + k-max + 1 within the model's positions)")
    ap.add_argument("--batches", default="1,4,16", help="sequences per pass")
    ap.add_argument("--ratio", type=float, default=4.0, help="the draft KV's compression (default 4)")
    ap.add_argument("--k-max", type=int, default=32, help="the largest k (default 32)")
    ap.add_argument("--rates", default="0.5,0.7,0.8,0.9", help="acceptance rates to plan for")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per shape (median)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", help="write the table here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    runner = load_model().runner
    gen = torch.Generator().manual_seed(0)
    rates = [float(r) for r in a.rates.split(",")]
    ks = [k for k in VERIFY_KS if k <= a.k_max]
    rows = []
    for ctx in [int(c) for c in a.contexts.split(",")]:
        for b in [int(x) for x in a.batches.split(",")]:
            full = [filled(runner, ctx, a.k_max + 1, gen) for _ in range(b)]
            draft = [filled(runner, max(1, int(ctx / a.ratio)), 1, gen) for _ in range(b)]
            timed_pass(runner, full[:1], 1, 1)  # warm-up
            costs = CostModel()
            # every timed pass observed, as the engine observes its passes; medians for the rest
            times = timed_pass(runner, draft, 1, 2 * a.repeats)
            for t in times:
                costs.observe_draft(1, b, b * ctx, t)
            t_draft = statistics.median(times)
            t_verify = {}
            for k in ks:
                times = timed_pass(runner, full, k + 1, a.repeats)
                for t in times:
                    costs.observe_verify(b * (k + 1), b * ctx, b * (k + 1) * ctx, t)
                t_verify[k] = statistics.median(times)
            del full, draft
            row = {"context": ctx, "batch": b, "plain_step_s": t_verify[0],
                   "draft_step_vs_plain": t_draft / t_verify[0],
                   "verify_vs_plain": {k: t_verify[k] / t_verify[0] for k in ks}, "plans": {}}
            for r in rates:
                profiles = [profile_at(r, a.k_max) for _ in range(b)]
                plan = costs.plan([a.k_max] * b, [ctx] * b, profiles, [False] * b)
                plain = costs.plan([0] * b, [ctx] * b, profiles, [False] * b)  # its own k = 0 price
                k = max(plan.ks)
                measured = {j: measured_speedup(j, r, t_draft, t_verify) for j in range(a.k_max + 1)}
                best = max(measured, key=measured.get)
                row["plans"][r] = {"k": k, "predicted_speedup": plan.predicted_tps / plain.predicted_tps,
                                   "measured_speedup": measured[k], "best_k": best,
                                   "best_speedup": measured[best]}
            rows.append(row)
            print(f"ctx {ctx:5d} batch {b:2d}: plain {t_verify[0] * 1e3:7.1f} ms, draft step "
                  f"{row['draft_step_vs_plain']:.2f}x, verify k={ks[-1]} {row['verify_vs_plain'][ks[-1]]:.2f}x | "
                  + "  ".join(f"a={r}: k={p['k']:2d} {p['predicted_speedup']:.2f}x/"
                              f"{p['measured_speedup']:.2f}x (best {p['best_k']}: {p['best_speedup']:.2f}x)"
                              for r, p in row["plans"].items()), flush=True)
            if a.json:  # after every cell: a cut run keeps what it measured
                with open(a.json, "w") as f:
                    json.dump({"threads": torch.get_num_threads(), "ratio": a.ratio,
                               "k_max": a.k_max, "rows": rows}, f, indent=1)
    return 0


def measured_speedup(k: int, rate: float, t_draft: float, t_verify: dict[int, float]) -> float:
    """Tokens per second of rounds of k drafts at acceptance `rate`, by the measured times,
    against plain steps: E(k) t_verify(0) / (k t_draft + t_verify(k)), t_verify linear
    between the timed k."""
    lo = max(j for j in t_verify if j <= k)
    hi = min(j for j in t_verify if j >= k)
    tv = t_verify[lo] if hi == lo else \
        t_verify[lo] + (t_verify[hi] - t_verify[lo]) * (k - lo) / (hi - lo)
    tokens = sum(rate ** i for i in range(k + 1))
    return tokens * t_verify[0] / (k * t_draft + tv)


if __name__ == "__main__":
    sys.exit(main())
