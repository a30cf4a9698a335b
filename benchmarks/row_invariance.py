"""Which row counts give a linear layer's rows the same bits: the ground an invariant fast
path would stand on (issue "Exactness by construction").

For each dtype and each of the default model's weight shapes, `torch.nn.functional.linear`
runs the same leading rows inside passes of M rows (M = 1..--max-rows) and reports, per M,
whether those rows' outputs equal bit for bit:
- `same_as_1`: row 0 equals a one-row pass (a decode step at batch 1);
- `same_as_ref`: the first min(M, --ref-rows) rows equal a pass of --ref-rows rows;
- `row_moves`: row 0 moved to another slot of the pass gives the same bits.
Then the row blocks B for which padding every pass to a multiple of B rows would make each
row's result independent of the pass it shares (every M that is a multiple of B agrees).

    .venv/bin/python benchmarks/row_invariance.py --json out.json

The answer belongs to this machine's BLAS and CPU (the kernel a library picks for a shape).
The runner's invariant pass (`exact="bitwise"`) does not rest on which row counts agree: its
GEMM calls always have exactly ROW_BLOCK rows, on one thread, so it needs only that one call
shape gives a row the same bits whatever the other rows hold and wherever it sits in the
block (`row_moves` here; tests/test_exact.py checks the whole pass).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from vericache.model import load_model


def probe(w: torch.Tensor, max_rows: int, ref_rows: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(max_rows, ref_rows), w.shape[1], generator=g).to(w.dtype)
    lin = torch.nn.functional.linear
    one = lin(x[:1], w)
    ref = lin(x[:ref_rows], w)
    rows = {}
    for m in range(1, max_rows + 1):
        y = lin(x[:m], w)
        n = min(m, ref_rows)
        moved = x[:m].clone()
        moved[m - 1], moved[0] = x[0], x[m - 1]
        rows[m] = {"same_as_1": torch.equal(y[0], one[0]), "same_as_ref": torch.equal(y[:n], ref[:n]),
                   "row_moves": torch.equal(lin(moved, w)[m - 1], y[0])}
    blocks = [b for b in (1, 2, 4, 8, 16) if all(rows[m]["same_as_ref"] and rows[m]["row_moves"]
                                                  for m in range(b, max_rows + 1, b))]
    return {"rows": rows, "invariant_row_blocks": blocks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--max-rows", type=int, default=40)
    ap.add_argument("--ref-rows", type=int, default=32)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    runner = load_model().runner
    layer = runner.layers[0]
    weights = {"qkv": layer.w_qkv, "o": layer.w_o, "gate_up": layer.w_gate_up, "down": layer.w_down,
               "lm_head": runner.lm_head}
    out = {"threads": torch.get_num_threads(), "torch": torch.__version__,
           "blas": torch.backends.mkl.is_available() and "mkl" or "other", "cells": []}
    for dt in a.dtypes.split(","):
        for name, w in weights.items():
            r = probe(w.detach().to(getattr(torch, dt)), a.max_rows, a.ref_rows)
            m_same = [m for m, v in r["rows"].items() if v["same_as_ref"]]
            cell = {"dtype": dt, "weight": name, "shape": list(w.shape),
                    "invariant_row_blocks": r["invariant_row_blocks"],
                    "m_same_as_1": [m for m, v in r["rows"].items() if v["same_as_1"]],
                    "m_same_as_ref": m_same, "rows": r["rows"]}
            out["cells"].append(cell)
            print(f"{dt:9} {name:8} {str(list(w.shape)):14} blocks {r['invariant_row_blocks']}; "
                  f"M agreeing with a {a.ref_rows}-row pass: {m_same}; with one row: {cell['m_same_as_1']}",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
