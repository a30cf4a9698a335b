"""A decode step with the runner's fused layer stack (`Runner._fused`: every layer in one
native call) against its layer loop, at batch 1, interleaved in one process.

    PYTHONPATH=. .venv/bin/python benchmarks/fused_layers.py --contexts 1024,7168 --json out.json

Each repeat runs both (fused first, then the loop): the built-in code prompt of about `ctx`
tokens (`vericache bench`'s first) prefilled, then --steps greedy decode steps timed; per
context, the median ms per step of each, their
ratio, and the median of each repeat's ratio (this VM's speed drifts between repeats). The
outputs of both are checked identical, token for token.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,7168", help="comma list of prompt tokens")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per run")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved runs of each")
    ap.add_argument("--threads", type=int, default=2, help="torch and kernel threads")
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
        runs, outs = {"fused": [], "loop": []}, {}
        for _ in range(args.repeats):
            for name in runs:
                r._fused_w = fused_w if name == "fused" else None
                try:
                    s, outs[name] = decode(r, ids, args.steps)
                finally:
                    r._fused_w = fused_w
                runs[name].append(s * 1e3)
            if outs["fused"] != outs["loop"]:
                raise SystemExit(f"outputs differ at {ctx} tokens")
        med = {k: statistics.median(v) for k, v in runs.items()}
        pairs = statistics.median(lp / fu for fu, lp in zip(runs["fused"], runs["loop"]))
        points.append({"context": ctx, "ms_per_step": med, "runs_ms": runs,
                       "fused_speedup": med["loop"] / med["fused"],
                       "fused_speedup_pairs": pairs, "outputs_identical": True})
        print(f"ctx {ctx}: fused {med['fused']:.2f} ms/step, loop {med['loop']:.2f} "
              f"({med['loop'] / med['fused']:.3f}x; median of the pairs' ratios {pairs:.3f}x)",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "points": points}, f, indent=1)


if __name__ == "__main__":
    main()
