"""Batch decode with and without group pools (`Runner.new_cache(arena=...)`), in one run.

`--batch` (16) requests of about `--context-tokens` tokens (code and prose alternating, as in
`benchmarks/exactness.py`) at once through one `BatchEngine` with the embedded server's
memory:// prefix store, `--tokens` greedy tokens each, in each `--modes` mode, two ways:
- `pools`: what the engine does now: a request's caches are made in a pool (one a side with
  the native kernel, else its scheduler group's: `vericache.engine.rounds.arena`), so a
  batch's passes find them pooled and copy nothing;
- `own`: caches of their own (`runner.arena_slots = 0`), copied into a pool at the first
  pass that batches them (`KVPool.hold`), the engine before this benchmark's commit.
A first run (not timed) fills the prefix store, so every timed run prefills from it alike.
Variants alternate `--repeats` times, `own` first in even repeats and `pools` first in odd
ones (the engine's cost model, which chooses `vericache`'s draft lengths, learns from every
run: a mode's first run plans from less). Reports, per run: decode seconds (from the last
request's first token to the end) and tok/s, pools formed by copying and their seconds and
bytes, and whether every output equals the first run's (`full`, with the
default `--modes`).

    .venv/bin/python benchmarks/batch_pool.py --context-tokens 2000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vericache.engine.batch import BatchEngine
from vericache.engine.generation import GenParams
from vericache.engine.rounds import ARENA_SLOTS, LocalBackends
from vericache.model import kvcache, load_model
from vericache.store.registry import open_store

sys.path.insert(0, str(Path(__file__).parent))
from exactness import prompts_for, read_streams  # noqa: E402


class PoolCopies:
    """Counts the pools `KVPool.of` forms by copying caches in, and their seconds and bytes."""

    def __init__(self):
        self.count, self.seconds, self.bytes = 0, 0.0, 0
        self._of = kvcache.KVPool.of.__func__
        kvcache.KVPool.of = classmethod(self._wrap)

    def _wrap(self, cls, caches, *a, **k):
        t = time.perf_counter()
        pool = self._of(cls, caches, *a, **k)
        self.count += 1
        self.seconds += time.perf_counter() - t
        self.bytes += sum(c.nbytes() for c in caches)
        return pool

    def take(self) -> dict:
        out = {"pools_copied": self.count, "pool_copy_s": round(self.seconds, 3),
               "pool_copy_bytes": self.bytes}
        self.count, self.seconds, self.bytes = 0, 0.0, 0
        return out


def run_batch(eng: BatchEngine, prompts: list[list[int]], params: GenParams) -> dict:
    t0 = time.perf_counter()
    firsts, end, outs = read_streams(eng, prompts, params)
    decode = end - max(firsts)
    return {"wall_s": round(end - t0, 2), "decode_s": round(decode, 2),
            "decode_tok_s": round(sum(len(o) - 1 for o in outs) / decode, 2), "outputs": outs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context-tokens", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--modes", default="full,vericache")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    lm = load_model()
    prompts = prompts_for(lm, a.batch, a.context_tokens)
    backends = LocalBackends(lm, open_store("memory://"))
    eng = BatchEngine(lm, max_batch=a.batch, backends=backends)
    copies = PoolCopies()
    runs, first = [], {}
    try:
        run_batch(eng, prompts, GenParams(mode="full", max_tokens=1))  # fills the prefix store
        copies.take()
        for rep in range(a.repeats):
            for mode in a.modes.split(","):
                # alternate which goes first: the engine's cost model learns from every run
                for way in ("own", "pools") if rep % 2 == 0 else ("pools", "own"):
                    lm.runner.arena_slots = ARENA_SLOTS if way == "pools" else 0
                    params = GenParams(mode=mode, max_tokens=a.tokens, ignore_eos=True)
                    r = run_batch(eng, prompts, params)
                    outs = r.pop("outputs")
                    r.update(copies.take(), mode=mode, way=way, repeat=rep,
                             identical_to_first_run=outs == first.setdefault("ref", outs))
                    runs.append(r)
                    print(json.dumps(r), flush=True)
    finally:
        eng.close()
    out = {"context_tokens": a.context_tokens, "batch": a.batch, "tokens": a.tokens,
           "prompt_tokens": [len(p) for p in prompts], "runs": runs}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
