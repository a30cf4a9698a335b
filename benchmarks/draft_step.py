"""A batch-1 draft step's time with each `VERICACHE_DRAFT_LAYERS` choice, alternated.

A draft pass's layer products over the model's weight blocks take their input in two int8
parts (`auto`, where the CPU has AVX512-VNNI) or are the exact block product (`exact`). Each
round runs one subprocess per choice, in turn: it prefills `--context` tokens into a
drafter's cache (the runner's `draft_dtype`), then times `--steps` one-token draft steps over
it (the cache cropped back after each), and prints the median. The summary gives each
choice's medians per thread count and exact / auto of their medians (above 1: auto is
faster). `--products` first times each product of one layer and the LM head alone at
batch 1 on one thread (exact, x in one int8 part, x in two), with each one's largest error
against a float64 product as a share of that product's largest value; with `--march`,
over `linear.c` built for that -march instead of this CPU (`--march znver3`: AVX2 without
VNNI, where the runner keeps the exact product). Outputs are not checked here (drafts are lossy and verified): the suite checks the
drafts' logits (tests/test_kernels.py) and `vericache bench` the outputs and τ.

    PYTHONPATH=. .venv/bin/python benchmarks/draft_step.py --products --threads 1,2 --rounds 3
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


def products(march: str | None = None, layer: int = 3, repeats: int = 50) -> None:
    import tempfile
    from pathlib import Path

    import torch

    from attend_ab import build
    from vericache.model import kernels, load_model

    lm = load_model(None, dtype="float32", device="cpu")
    r, lin = lm.runner, kernels.linear()
    if march:
        source = (Path(kernels.__file__).parent / "linear.c").read_text()
        lin = kernels.Linear(build(source, Path(tempfile.mkdtemp()), "linear", march, "linear"))
        print(f"linear.c built for -march={march}: int8 products {'VNNI' if lin.q8x_vnni else 'AVX2'}"
              if lin.q8x else f"linear.c built for -march={march}: no int8 products")
    lyr = r.layers[layer]
    mats = [(n, getattr(lyr, n)) for n in ("w_qkv", "w_o", "w_gate_up", "w_down")]
    g = torch.Generator().manual_seed(0)
    total = {0: 0.0, 1: 0.0, 2: 0.0}
    for name, w in mats + [("lm_head", r.lm_head)]:
        q = r._blocks.get(w.data_ptr())
        if q is None:
            print(f"{name}: no weight blocks (not a GGUF model's)")
            return
        x = torch.randn(1, w.shape[1], generator=g) * 2
        ref = x.double() @ w.double().T
        cells = []
        for parts in (0, 1, 2):
            err = float((lin(x, q, None, 1, parts).double() - ref).abs().max() / ref.abs().max())
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                lin(x, q, None, 1, parts)
                times.append(time.perf_counter() - t)
            ms = statistics.median(times) * 1e3
            if name != "lm_head":
                total[parts] += ms
            cells.append(f"{ms:.3f} ms (err {err:.1e})")
        print(f"{name:9} {tuple(w.shape)} {q.bits}-bit: exact {cells[0]}, int8 {cells[1]}, "
              f"two int8 parts {cells[2]}")
    print(f"layer {layer}'s four products: exact {total[0]:.3f} ms, int8 {total[1]:.3f}, "
          f"two int8 parts {total[2]:.3f} (each call's Python overhead included)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=2000, help="keys in the drafter's cache")
    ap.add_argument("--steps", type=int, default=40, help="timed steps a run (first dropped)")
    ap.add_argument("--threads", default="1,2", help="comma list of intra-op thread counts")
    ap.add_argument("--rounds", type=int, default=3, help="alternated runs per choice")
    ap.add_argument("--products", action="store_true",
                    help="first time one layer's products and the LM head alone")
    ap.add_argument("--march", default=None,
                    help="--products over linear.c built for this -march (e.g. znver3)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.context, args.steps, int(args.threads))
        return 0
    if args.products:
        products(args.march)
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
