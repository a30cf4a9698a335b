"""Start-up calibration: timed rounds of synthetic requests through the engine's own backends,
so that the cost model (`vericache.spec.costmodel`) plans the first real rounds from measured
costs instead of exploring.

A round's cost depends on the machine, on the backends (in this process or over gRPC) and on
where the full KV lives (resident, or loaded over a link for every verify pass), so the
calibration runs real rounds over the engine's real backends, with k chosen by hand: at each
(batch, context) of `SHAPES`, one round at each k of `KS` (0: a plain full-KV step). Only the
times are kept. Synthetic text says nothing about how real prompts draft, so the acceptance
the model pools, its round counters and its k histogram are reset afterwards
(`CostModel.calibrated`); real requests then start from the prior acceptance rate.

Every calibration request has the same prompt (seeded token ids, the longer contexts
extending the shorter), in its own namespace, so a prefix store holds it once and the batch's
other requests load it from there. The first rounds of each shape (k = 1 until every
drafter is attached) carry the drafter's attach (loaded when a request first drafts, or in
the background): not a draft step's cost, they price only a drafter's start
(`CostModel.start`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from vericache.engine.backends import Backends
from vericache.engine.generation import Generation, GenParams
from vericache.engine.rounds import run_round, start
from vericache.spec.costmodel import CostModel

log = logging.getLogger(__name__)

# (batch, context tokens): one-row passes at two contexts (the per-context cost: the KV a pass
# reads, or loads over a link) and a many-row pass at the second's total context (the cost of
# rows, which on a CPU jumps from one row to several), so the verify fit can tell these apart
# and its per-token cost from its per-token-and-context cost (attention). With only 1 x 1k and
# 4 x 512 the jump from one row to four was read as context: a plain step of 4 x 4k was
# priced at 3.3 times its time, and drafting looked cheap next to it.
SHAPES = ((1, 1024), (1, 2048), (4, 512))
KS = (0, 1, 2, 4, 8)  # each shape's timed rounds (0: a plain step)
NAMESPACE = "vericache-calibration"
SEED = 20261201
ATTACH_WAIT_S = 30.0  # how long the untimed first rounds wait for a background drafter load
FIRST_ROUNDS = 64  # ... and at most this many of them (each emits a token)


def synthetic_prompt(vocab_size: int, tokens: int, eos: set[int]) -> list[int]:
    """`tokens` seeded token ids, none of them an end-of-sequence token."""
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab_size, (tokens,), generator=g).tolist()
    return [t if t not in eos else (t + 1) % vocab_size for t in ids]


def calibrate(backends: Backends, lm, costs: CostModel, params: GenParams,
              shapes=SHAPES, ks=KS) -> dict:
    """Time rounds of synthetic requests (see the module docstring) into `costs`; `params`:
    the requests' settings (the engine's defaults: compressor, ratio, selection), run in
    vericache mode. Returns what it did (seconds, rounds, shapes, ks, whether the model is now
    fitted), also kept as `costs.calibration`. Call before serving: it drives `backends` from
    the calling thread."""
    t0 = time.perf_counter()
    p = dataclasses.replace(params, mode="vericache", adaptive=False, draft_len=max(ks),
                            ignore_eos=True, stop=[], temperature=0.0, logprobs=None, grammar="",
                            namespace=NAMESPACE, max_tokens=sum(k + 1 for k in ks) + FIRST_ROUNDS + 1)
    # a model with a short context calibrates at what fits (the shapes may then coincide)
    fits = lm.max_context - p.max_tokens - 1
    if fits < 16:
        raise ValueError(f"a {lm.max_context}-token context leaves no room to calibrate in")
    shapes = [(batch, min(context, fits)) for batch, context in shapes]
    prompt = synthetic_prompt(lm.vocab_size, max(c for _, c in shapes), set(lm.eos_token_ids))
    rounds = 0
    for batch, context in shapes:
        gens = [Generation(lm, prompt[:context], p, request_id=f"calibration-{context}x{batch}-{i}-{time.time_ns()}")
                for i in range(batch)]
        admitted: list[Generation] = []
        try:
            for g in gens:
                start(backends, g)
                admitted.append(g)
            _first_draft(backends, gens, costs)
            for k in ks:
                for g in gens:
                    g.draftlen.k = k
                run_round(backends, gens, costs)
                rounds += 1
        finally:
            for g in admitted:
                backends.release(g)
    seconds = time.perf_counter() - t0
    info = {"seconds": round(seconds, 3), "rounds": rounds,
            "shapes": [list(s) for s in shapes], "ks": list(ks)}
    costs.calibrated(info)
    log.info("cost model calibrated in %.1f s (%d rounds)", seconds, rounds)
    return costs.calibration


def _first_draft(backends: Backends, gens: list[Generation], costs: CostModel) -> None:
    """Rounds of k = 1 until every request has drafted once (its drafter side is attached),
    waiting at most ATTACH_WAIT_S and FIRST_ROUNDS rounds for a background load. Their draft
    phases price only the drafters' start, and the pass that pools the new requests' caches
    is not learned (`vericache.engine.rounds`): the start is what `CostModel.start` needs."""
    deadline = time.monotonic() + ATTACH_WAIT_S
    for _ in range(FIRST_ROUNDS):
        for g in gens:
            g.draftlen.k = 1
        run_round(backends, gens, costs)
        if all(g.stats.draft_steps for g in gens) or time.monotonic() > deadline:
            return
        time.sleep(0.05)
