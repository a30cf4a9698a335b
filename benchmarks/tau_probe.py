"""τ per selection policy and compressor, no timing: one request at a time, k fixed.

Each variant (`COMPRESSOR@RATIO/POLICY`) decodes every prompt with k fixed; τ (tokens per
verify round) depends only on the model, the prompt and the drafter's KV, never on the
machine's load, so this runs beside other work. Prompts are the scenario's shared-document
prompts (`--kind shared`: one code document, a question per prompt about one of its
functions) or the grid's built-in code prompts (`--kind builtin`). Every variant's output
must equal the first variant's (all are lossless); the first is checked against full greedy
decoding with `--check-full`.

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
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import torch

    from vericache.bench.prompts import builtin_prompts, shared_document_prompts
    from vericache.engine.generation import GenParams
    from vericache.engine.local import generate
    from vericache.model import load_model

    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load_model()
    make = shared_document_prompts if a.kind == "shared" else builtin_prompts
    prompts = make(lm.tokenizer, a.prompts, a.context_tokens)
    first: dict[str, list[int]] = {}
    if a.check_full:
        for p in prompts:
            first[p.name] = generate(lm, p.ids, GenParams(max_tokens=a.max_tokens, mode="full")).token_ids
    out = {}
    for v in a.variants.split(";"):
        comp, _, policy = v.partition("/")
        name, _, ratio = comp.partition("@")
        taus, moved = [], []
        for p in prompts:
            r = generate(lm, p.ids, GenParams(max_tokens=a.max_tokens, compressor=name,
                                              ratio=float(ratio) if ratio else None,
                                              draft_len=a.draft_len, adaptive=False,
                                              selection=policy or "static"))
            if first.setdefault(p.name, r.token_ids) != r.token_ids:
                print(f"{v}: {p.name} differs from the first decoding", file=sys.stderr)
                return 1
            taus.append(r.usage["tokens_per_round"])
            moved.append(r.usage["selection_moved_tokens"])
        out[v] = {"tau_mean": round(sum(taus) / len(taus), 3), "tau": taus,
                  "moved_tokens_mean": round(sum(moved) / len(moved))}
        print(f"{v}: mean tau {out[v]['tau_mean']}  {taus}  moved {out[v]['moved_tokens_mean']} "
              "tokens a request (over layers and KV heads)", flush=True)
    doc = {"settings": vars(a), "prompts": [len(p.ids) for p in prompts], "variants": out,
           "identical": True}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
