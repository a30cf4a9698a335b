"""Where a long-context round's compute goes, beside `admission_profile.py`'s admission:

1. a draft step: one pass of B one-token rows over drafter caches (bfloat16 K/V recording
   positions, as the drafter holds them) of `--draft-tokens` tokens, against the same pass
   over 64-token caches: the difference is the attention's share of the step, the rest the
   weights' products;
2. a verify job: `--verify-requests` requests of the scenario's shared-document prompts
   (their documents in the prefix cache, as `vericache bench --scenario long-context` has
   them), each verifying k = `--draft-len` drafts over its full KV, once resident and once
   over the offloaded tier at `--link-gbps` (default: a link so fast that only the working
   copies' memory copies and the layer-by-layer pass remain).

    .venv/bin/python benchmarks/round_profile.py --draft-tokens 2300 --verify-requests 4

Each time is the best of `--repeats` runs, in seconds; the machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import time

import torch

from vericache.bench.prompts import shared_document_prompts
from vericache.bench.scenario import fill_prefix_cache
from vericache.compress.registry import make_compressor
from vericache.engine.generation import Generation, GenParams
from vericache.engine.kvtier import make_tier
from vericache.engine.rounds import LocalBackends, draft_phase, start, verify_phase
from vericache.model.loader import load_model
from vericache.model.runner import Runner, SeqBatchItem
from vericache.store.memory import MemoryStore


def draft_step(runner: Runner, batch: int, tokens: int, repeats: int) -> float:
    """The best seconds of one draft step of `batch` rows over caches of `tokens` tokens."""
    caches = [runner.new_cache(tokens + 8, positions=True, dtype=runner.draft_dtype)
              for _ in range(batch)]
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms (and moves the caches into one pool)
        for c in caches:
            c.length = tokens
        items = [SeqBatchItem(torch.tensor([5]), torch.tensor([tokens]), c) for c in caches]
        t0 = time.perf_counter()
        runner.forward(items)
        best = min(best, time.perf_counter() - t0)
    return best


def verify_job(lm, prompts, tier_name: str, gbps: float, k: int, repeats: int) -> tuple[float, int]:
    """The best seconds of one verify job over every prompt's request (k fixed drafts each,
    question selection), and the tokens its last run emitted."""
    store = MemoryStore()
    fill_prefix_cache(lm, store, [(f"warm-{i}", p.ids) for i, p in enumerate(prompts)],
                      make_compressor("snapkv", 4.0))
    tier = make_tier(tier_name, gbps)
    b = LocalBackends(lm, store, tier)
    params = GenParams(max_tokens=(repeats + 1) * (k + 1) + 1, mode="vericache", compressor="snapkv",
                       ratio=4.0, draft_len=k, adaptive=False, chunk_size=256, ignore_eos=True,
                       selection="question")
    gens = [Generation(lm, p.ids, params, request_id=f"{tier_name}-{i}") for i, p in enumerate(prompts)]
    best, emitted = float("inf"), 0
    try:
        for g in gens:
            start(b, g)
        for _ in range(repeats + 1):
            drafts = draft_phase(b, gens)
            t0 = time.perf_counter()
            out = verify_phase(b, gens, drafts)
            best = min(best, time.perf_counter() - t0)
            emitted = sum(len(v) for v in out.values())
    finally:
        for g in gens:
            b.release(g)
        b.close()
        if tier is not None:
            tier.close()
    return best, emitted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-tokens", type=int, default=2300,
                    help="tokens in each drafter cache (8k at snapkv 4x: about 2300)")
    ap.add_argument("--batches", default="1,4,8,16", help="draft step batch sizes")
    ap.add_argument("--verify-requests", type=int, default=4)
    ap.add_argument("--context-tokens", type=int, default=8000)
    ap.add_argument("--draft-len", type=int, default=32)
    ap.add_argument("--link-gbps", type=float, default=10000.0, help="the offloaded tier's link")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(None, dtype="float32", device="cpu")
    print("draft step (s): batch, over 64-token caches, over "
          f"{args.draft_tokens}-token caches, attention's share")
    for b in (int(x) for x in args.batches.split(",")):
        short = draft_step(lm.runner, b, 64, args.repeats)
        full = draft_step(lm.runner, b, args.draft_tokens, args.repeats)
        print(f"  {b:3d}  {short:.4f}  {full:.4f}  {(full - short) / full:.0%}")
    prompts = shared_document_prompts(lm.tokenizer, args.verify_requests, args.context_tokens)
    print(f"verify job, {args.verify_requests} requests x {args.draft_len} drafts over "
          f"{args.context_tokens} tokens (s, tokens emitted):")
    for tier, gbps in (("resident", 1.0), ("offloaded", args.link_gbps)):
        s, n = verify_job(lm, prompts, tier, gbps, args.draft_len, args.repeats)
        label = tier if tier == "resident" else f"offloaded at {gbps:g} Gbit/s"
        print(f"  {label}: {s:.3f} s ({s / args.verify_requests:.3f} a request), {n} tokens")


if __name__ == "__main__":
    main()
