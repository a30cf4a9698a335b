"""What a verify pass's votes cost: one request's pass of `--rows` new tokens over a cache of
`--context-tokens` (the built-in shared-document prompt, prefilled), without votes, with votes
from the native attention (`Attend.votes`, what a `verify` selection policy's pass runs now),
and with votes without the kernel (`explicit_votes_*`: the runner without its attention
kernel, as where the kernel does not serve a pass: the rows from torch's SDPA, the votes from
the explicit-score path; until 5845b18 the rows came from that path too). Also checks that the
kernel's votes leave the pass's logits as they are without votes, bit for bit, and gives the
largest difference of the pass without the kernel's logits from them.

    PYTHONPATH=. .venv/bin/python benchmarks/votes.py --context-tokens 8000 --rows 33 \\
        --json votes.json

Times: the best and every one of --repeats passes (the first run of each dropped), at the
process's torch threads (--threads).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context-tokens", type=int, default=8000)
    ap.add_argument("--rows", type=int, default=33, help="the pass's new tokens (k + 1)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="", help="write the figures here")
    a = ap.parse_args()

    import torch

    from vericache.bench.prompts import shared_document_prompts
    from vericache.model import load_model
    from vericache.model.runner import SeqBatchItem

    torch.set_num_threads(a.threads)
    lm = load_model()
    r = lm.runner
    ids = shared_document_prompts(lm.tokenizer, 1, a.context_tokens)[0].ids
    n = len(ids)
    cache = r.new_cache(n + 8)
    r.step(ids[:-a.rows], 0, cache, logits="none")
    past = cache.length

    def run(votes: bool) -> torch.Tensor:
        cache.length = past
        it = SeqBatchItem(torch.tensor(ids[-a.rows:]), torch.arange(n - a.rows, n), cache, "all",
                          votes=votes)
        return r.forward([it])[0]

    def timed(votes: bool) -> tuple[list[float], torch.Tensor]:
        out = run(votes)
        ts = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            run(votes)
            ts.append(round((time.perf_counter() - t) * 1e3, 1))
        return ts, out

    res = {"context_tokens": n, "rows": a.rows, "threads": a.threads}
    plain_ms, plain = timed(False)
    kernel_ms, voted = timed(True)
    saved = r.attend_kernel
    r.attend_kernel = None
    try:
        explicit_ms, explicit = timed(True)
    finally:
        r.attend_kernel = saved
    res.update(no_votes_ms=plain_ms, kernel_votes_ms=kernel_ms, explicit_votes_ms=explicit_ms,
               kernel_votes_logits_equal=bool(torch.equal(plain, voted)),
               explicit_votes_max_abs_logit=float((explicit - plain).abs().max()))
    for name in ("no_votes_ms", "kernel_votes_ms", "explicit_votes_ms"):
        print(f"{name[:-3]:16s} best {min(res[name]):7.1f} ms  runs {res[name]}")
    print(f"kernel votes: logits equal to the pass without votes: {res['kernel_votes_logits_equal']}; "
          f"without the kernel: largest logit difference {res['explicit_votes_max_abs_logit']:.3g}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
