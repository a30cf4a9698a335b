"""What a batch's first decode pass costs against its later ones, fast and invariant.

`--batch` (16) caches of about `--context-tokens` tokens (random K/V, ragged lengths:
attention's cost does not depend on the values), then `--steps` decode passes of one row
each, in the fast pass (`exact=fast`: one attention call per layer over a `KVPool`, which
copies every cache in at the batch's first pass) and the invariant pass (`exact=bitwise`:
one SDPA call per row, each cache read where it is), alternating, twice. Prints each pass's
milliseconds.

    .venv/bin/python benchmarks/pool_first_pass.py --context-tokens 7600
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from vericache.model import load_model
from vericache.model.runner import SeqBatchItem


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context-tokens", type=int, default=7600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args(argv)
    runner = load_model().runner
    caches = []
    for i in range(a.batch):
        c = runner.new_cache(a.context_tokens + a.steps * 4)
        c.k[:, :, : a.context_tokens].normal_()
        c.v[:, :, : a.context_tokens].normal_()
        c.length = a.context_tokens - 37 * i
        caches.append(c)
    out = []
    for bitwise in (False, True, False, True):
        ms = []
        for _ in range(a.steps):
            items = [SeqBatchItem(torch.tensor([5]), torch.tensor([c.length]), c, bitwise=bitwise)
                     for c in caches]
            t = time.perf_counter()
            runner.forward(items)
            ms.append(round((time.perf_counter() - t) * 1e3, 1))
        out.append({"pass": "invariant" if bitwise else "fast", "ms": ms})
        print(json.dumps(out[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
