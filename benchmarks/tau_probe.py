"""τ per selection policy and compressor, no timing: one request at a time, k fixed.

Each variant (`COMPRESSOR@RATIO/POLICY`) decodes every prompt with k fixed; τ (tokens per
verify round) depends only on the model, the prompt and the drafter's KV, never on the
machine's load, so this runs beside other work. Prompts are the scenario's shared-document
prompts (`--kind shared`: one code document, a question per prompt about one of its
functions) or the grid's built-in code prompts (`--kind builtin`). Every variant's output
must equal the first variant's (all are lossless); the first is checked against full greedy
decoding with `--check-full`.

`--prefix-cache` serves every decode from an in-memory prefix cache holding each prompt's
prefill (as `vericache bench --scenario long-context` does): the drafter's base set then comes
from the stored chunks, exactly as in the scenario, and prompts that share a document
compute it once, so a probe over 16 shared-document prompts takes minutes, not an hour.

    .venv/bin/python benchmarks/tau_probe.py --prompts 4 --context-tokens 8000 --max-tokens 64 \\
        --variants "snapkv@4/static;snapkv@4/question;snapkv@4/verify"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--context-tokens", type=int, default=8000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=32)
    ap.add_argument("--variants", default="snapkv@4/static;snapkv@4/question;snapkv@4/verify",
                    help="';'-separated COMPRESSOR@RATIO/POLICY")
    ap.add_argument("--kind", choices=("shared", "builtin"), default="shared")
    ap.add_argument("--check-full", action="store_true", help="also decode each prompt in full mode")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prefix-cache", action="store_true",
                    help="decode from an in-memory prefix cache of every prompt's prefill")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import torch

    from vericache.bench.prompts import builtin_prompts, shared_document_prompts
    from vericache.bench.scenario import drop_new_keys
    from vericache.engine.generation import GenParams
    from vericache.compress.registry import make_compressor
    from vericache.engine.local import generate
    from vericache.engine.rounds import LocalBackends
    from vericache.engine.verifier import Verifier
    from vericache.model import load_model
    from vericache.store.memory import MemoryStore

    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load_model()
    make = shared_document_prompts if a.kind == "shared" else builtin_prompts
    prompts = make(lm.tokenizer, a.prompts, a.context_tokens)
    store = MemoryStore() if a.prefix_cache else None
    published: set[str] = set()

    def backends(compressor: str | None, ratio: str):
        """LocalBackends over the prefix cache, every prompt's prefill published (with the
        compressor's chunks) the first time a variant needs it; None without --prefix-cache."""
        if store is None:
            return None
        comp = make_compressor(compressor or "identity", float(ratio) if ratio else None)
        if comp.spec not in published:
            ver = Verifier(lm.runner, store, lm.model_id)
            for i, p in enumerate(prompts):
                ver.prefill(f"publish-{i}", p.ids, 1, 256, comp)
                ver.release(f"publish-{i}")
            published.add(comp.spec)
        keep = set(store.keys())
        return LocalBackends(lm, store), keep

    first: dict[str, list[int]] = {}
    if a.check_full:
        for p in prompts:
            first[p.name] = generate(lm, p.ids, GenParams(max_tokens=a.max_tokens, mode="full")).token_ids
    out = {}
    for v in a.variants.split(";"):
        comp, _, policy = v.partition("/")
        name, _, ratio = comp.partition("@")
        taus, moved, em, rd = [], [], [], []
        for p in prompts:
            b = backends(name, ratio)
            r = generate(lm, p.ids, GenParams(max_tokens=a.max_tokens, compressor=name,
                                              ratio=float(ratio) if ratio else None,
                                              draft_len=a.draft_len, adaptive=False,
                                              selection=policy or "static"),
                         b[0] if b else None)
            if b:  # a decode's own chunks are not the next one's cache
                drop_new_keys(store, b[1])
            if first.setdefault(p.name, r.token_ids) != r.token_ids:
                print(f"{v}: {p.name} differs from the first decoding", file=sys.stderr)
                return 1
            taus.append(r.usage["tokens_per_round"])
            em.append(sum(r.stats.round_emitted))
            rd.append(r.stats.rounds)
            moved.append(r.usage["selection_moved_tokens"])
        out[v] = {"tau_mean": round(sum(taus) / len(taus), 3), "tau": taus,
                  "tau_pooled": round(sum(em) / sum(rd), 3),
                  "moved_tokens_mean": round(sum(moved) / len(moved))}
        print(f"{v}: mean tau {out[v]['tau_mean']} (pooled {out[v]['tau_pooled']})  {taus}  moved {out[v]['moved_tokens_mean']} "
              "tokens a request (over layers and KV heads)", flush=True)
    doc = {"settings": vars(a), "prompts": [len(p.ids) for p in prompts], "variants": out,
           "identical": True}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
