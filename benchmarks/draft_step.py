"""A batch-1 draft step's time with each `VERICACHE_DRAFT_LAYERS` choice, alternated.

A draft pass's layer products over the model's weight blocks take their input in two int8
parts (`auto`, where the CPU has AVX512-VNNI) or are the exact block product (`exact`). Each
round runs one subprocess per choice, in turn: it prefills `--context` tokens into a
drafter's cache (the runner's `draft_dtype`), then times `--steps` one-token draft steps over
it (the cache cropped back after each), and prints the median. The summary gives each
choice's medians per thread count and exact / auto of their medians (above 1: auto is
faster). Outputs are not checked here (drafts are lossy and verified): the suite checks the
drafts' logits (tests/test_kernels.py) and `vericache bench` the outputs and τ.

    PYTHONPATH=. .venv/bin/python benchmarks/draft_step.py --threads 1,2 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def child(context: int, steps: int, threads: int) -> None:
    import torch

    from vericache.model import load_model

    lm = load_model(None, dtype="float32", device="cpu")
    r = lm.runner
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (context + 1,), generator=g).tolist()
    c = r.new_cache(context + 8, dtype=r.draft_dtype)
    r.step(ids[:context], 0, c, logits="none")
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        r.step(ids[context:], context, c)
        times.append(time.perf_counter() - t)
        c.crop(context)
    print(f"{r.draft_layers_form()} {statistics.median(times[1:]) * 1e3:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=2000, help="keys in the drafter's cache")
    ap.add_argument("--steps", type=int, default=40, help="timed steps a run (first dropped)")
    ap.add_argument("--threads", default="1,2", help="comma list of intra-op thread counts")
    ap.add_argument("--rounds", type=int, default=3, help="alternated runs per choice")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.context, args.steps, int(args.threads))
        return 0
    results: dict[tuple[int, str], list[float]] = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        for rnd in range(args.rounds):
            for choice in ("exact", "auto"):
                env = {**os.environ, "VERICACHE_DRAFT_LAYERS": choice}
                out = subprocess.run([sys.executable, __file__, "--child", "--context",
                                      str(args.context), "--steps", str(args.steps),
                                      "--threads", str(threads)],
                                     env=env, check=True, capture_output=True, text=True).stdout
                form, ms = out.split()[-2:]
                results.setdefault((threads, choice), []).append(float(ms))
                print(f"threads {threads} round {rnd + 1} {choice:5} ({form}): {ms} ms",
                      flush=True)
    for threads in sorted({t for t, _ in results}):
        ex, au = results[(threads, "exact")], results[(threads, "auto")]
        print(f"threads {threads}: exact {', '.join(f'{v:.2f}' for v in ex)} ms; "
              f"auto {', '.join(f'{v:.2f}' for v in au)} ms; exact / auto of the medians "
              f"{statistics.median(ex) / statistics.median(au):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
