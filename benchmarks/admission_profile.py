"""Where one long-context admission's time goes: a cProfile of `LocalBackends.admit` and of
the drafter's attach (`draft_later`: done when the request first drafts), for one of the
scenario's shared-document prompts whose document is already in the prefix cache, as in
`vericache bench --scenario long-context` (the prompt's last partial chunk is computed, the
rest loaded). The first admission warms; the second is reported.

    .venv/bin/python benchmarks/admission_profile.py --context-tokens 8000 --selection question

Prints the admission's and the attach's seconds, then the top functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from vericache.bench.prompts import shared_document_prompts
from vericache.bench.scenario import fill_prefix_cache
from vericache.compress.registry import make_compressor
from vericache.engine.generation import Generation, GenParams
from vericache.engine.kvtier import make_tier
from vericache.engine.rounds import LocalBackends
from vericache.model.loader import load_model
from vericache.store.memory import MemoryStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context-tokens", type=int, default=8000)
    ap.add_argument("--compressor", default="snapkv")
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--selection", default="question")
    ap.add_argument("--link-gbps", type=float, default=4.0, help="the offloaded tier's link")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=30, help="functions to list")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(None, dtype="float32", device="cpu")
    prompts = shared_document_prompts(lm.tokenizer, 3, args.context_tokens)
    store = MemoryStore()
    comp = make_compressor(args.compressor, args.ratio)
    fill_prefix_cache(lm, store, [(f"warm-{i}", p.ids) for i, p in enumerate(prompts)], comp)
    params = GenParams(max_tokens=32, mode="vericache", compressor=args.compressor, ratio=args.ratio,
                       draft_len=32, adaptive=False, chunk_size=256, ignore_eos=True,
                       selection=args.selection)
    tier = make_tier("offloaded", args.link_gbps)
    r = lm.runner  # the tier's host memory in place, touched, as the bench's (`preallocate`)
    tier.preallocate(2, max(len(p.ids) for p in prompts) + params.extra_capacity, r.num_layers,
                     r.num_kv_heads, r.head_dim, r.dtype)
    b = LocalBackends(lm, store, tier)
    try:
        for i in range(2):
            g = Generation(lm, prompts[i].ids, params, request_id=f"r{i}")
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            b.admit(g)
            t1 = time.perf_counter()
            b._attached(g, drafts=True)
            prof.disable()
            t2 = time.perf_counter()
            b.release(g)
        print(f"{len(prompts[1].ids)} tokens: admission {t1 - t0:.3f} s, drafter attach {t2 - t1:.3f} s")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    finally:
        b.close()
        tier.close()


if __name__ == "__main__":
    main()
