"""A decode step with the runner's fused layer stack (`Runner._fused`: every layer in one
native call) against its layer loop, at batch 1, interleaved in one process.

    PYTHONPATH=. .venv/bin/python benchmarks/fused_layers.py --contexts 1024,7168 --json out.json

Each repeat runs both (fused first, then the loop): the built-in code prompt of about `ctx`
tokens (`vericache bench`'s first) prefilled, then --steps greedy decode steps timed; per
context, the median ms per step of each, their
ratio, and the median of each repeat's ratio (this VM's speed drifts between repeats). The
outputs of both are checked identical, token for token. With --ragged B, also passes of B
sequences at once feeding 1-4 tokens each (a ragged batch over a pool), their logits checked
equal bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vericache.model import load_model


def decode(r, ids: list[int], steps: int) -> tuple[float, list[int]]:
    """Prefill ids, then `steps` greedy steps: (seconds per step, the tokens)."""
    c = r.new_cache(len(ids) + steps + 8)
    for s in range(0, len(ids), 256):
        logits, _ = r.step(ids[s:s + 256], s, c)
    out = [int(logits[0].argmax())]
    t = time.perf_counter()
    for i in range(steps):
        logits, _ = r.step(out[-1:], len(ids) + i, c)
        out.append(int(logits[0].argmax()))
    return (time.perf_counter() - t) / steps, out


def ragged(r, ids: list[int], batch: int, steps: int) -> tuple[float, list]:
    """`batch` copies of the prompt, then `steps` passes of all of them at once, sequence i
    feeding 1 + i % 4 of the prompt's tokens a pass (decode rows beside short verify passes:
    a ragged, padded batch over their pool; the first pass, which pools the caches, untimed):
    (seconds per pass, every pass's logits)."""
    from vericache.model.runner import SeqBatchItem

    lens = [1 + i % 4 for i in range(batch)]
    caches = []
    for _ in range(batch):
        c = r.new_cache(len(ids) + (steps + 1) * 4 + 8)
        for s in range(0, len(ids), 256):
            r.step(ids[s:s + 256], s, c, logits="none")
        caches.append(c)
    out, times = [], []
    for step in range(steps + 1):
        items = [SeqBatchItem(torch.tensor([ids[(c.length + j) % len(ids)] for j in range(n)]),
                              torch.arange(c.length, c.length + n), c, "all")
                 for c, n in zip(caches, lens)]
        t = time.perf_counter()
        logits = r.forward(items)
        if step:
            times.append(time.perf_counter() - t)
            out.append(logits)
    return statistics.median(times), out


def interleaved(r, fused_w, repeats: int, run, same, what: str) -> dict:
    """run() -> (seconds, output) `repeats` times with the fused stack, then the loop, in
    turn; every repeat's outputs checked by same(fused, loop). Returns ms per run of each."""
    times = {"fused": [], "loop": []}
    for _ in range(repeats):
        outs = {}
        for name in times:
            r._fused_w = fused_w if name == "fused" else None
            try:
                s, outs[name] = run()
            finally:
                r._fused_w = fused_w
            times[name].append(s * 1e3)
        if not same(outs["fused"], outs["loop"]):
            raise SystemExit(f"{what} differ")
    return times


def pairs(times: dict) -> float:
    """The median of each repeat's loop / fused ratio."""
    return statistics.median(lp / fu for fu, lp in zip(times["fused"], times["loop"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,7168", help="comma list of prompt tokens")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per run")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved runs of each")
    ap.add_argument("--threads", type=int, default=2, help="torch and kernel threads")
    ap.add_argument("--ragged", type=int, default=0, metavar="B",
                    help="also time passes of B sequences at once, ragged (1-4 rows each), "
                         "at each context; logits checked equal bit for bit")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from vericache.bench.prompts import builtin_prompts

    lm = load_model(None, dtype="float32", device="cpu")
    r = lm.runner
    if r._fused_w is None:
        raise SystemExit("this runner has no fused layer stack (no native kernels?)")
    fused_w, points = r._fused_w, []
    for ctx in (int(c) for c in args.contexts.split(",")):
        ids = builtin_prompts(lm.tokenizer, 1, ctx)[0].ids  # the built-in code prompt
        runs = interleaved(r, fused_w, args.repeats, lambda: decode(r, ids, args.steps),
                           lambda a, b: a == b, f"outputs at {ctx} tokens")
        point = {}
        if args.ragged:
            rag = interleaved(r, fused_w, args.repeats,
                              lambda: ragged(r, ids, args.ragged, args.steps),
                              lambda a, b: all(torch.equal(x, y) for pa, pb in zip(a, b)
                                               for x, y in zip(pa, pb)),
                              f"ragged logits at {ctx} tokens")
            point = {"ragged_batch": args.ragged, "ragged_ms_per_pass": rag,
                     "ragged_fused_speedup_pairs": pairs(rag)}
            print(f"ctx {ctx}, ragged batch {args.ragged}: fused "
                  f"{statistics.median(rag['fused']):.2f} ms/pass, loop "
                  f"{statistics.median(rag['loop']):.2f} (pairs {pairs(rag):.3f}x)", flush=True)
        med = {k: statistics.median(v) for k, v in runs.items()}
        points.append({"context": ctx, "ms_per_step": med, "runs_ms": runs,
                       "fused_speedup": med["loop"] / med["fused"],
                       "fused_speedup_pairs": pairs(runs), "outputs_identical": True, **point})
        print(f"ctx {ctx}: fused {med['fused']:.2f} ms/step, loop {med['loop']:.2f} "
              f"({med['loop'] / med['fused']:.3f}x; median of the pairs' ratios "
              f"{pairs(runs):.3f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "points": points}, f, indent=1)


if __name__ == "__main__":
    main()
