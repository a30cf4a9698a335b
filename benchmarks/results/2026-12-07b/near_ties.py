"""Usage: .venv/bin/python benchmarks/results/2026-12-07b/near_ties.py gpu_identity_bf16_cpu.json out.json

For each bfloat16 fast-mode case that differed in gpu_identity_bf16_cpu.json: the first
differing token and, there, the top two log-probabilities of full mode (decode steps) and of
vericache (the verify pass), from each mode's own full-KV logits (`logprobs`)."""
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import torch
import test_architectures as ta
from vericache.engine.generation import GenParams
from vericache.engine.local import generate
from vericache.model.loader import load_model

rows = json.load(open(sys.argv[1]))["rows"]
bad = [(r["arch"], r["case"].split("=", 1)[1].rsplit("/", 1)[0]) for r in rows
       if not r.get("identical", True) and r["case"].startswith("vericache=") and r["case"].endswith("/fast")]
out = []
for arch in sorted({a for a, _ in bad}):
    with tempfile.TemporaryDirectory() as d:
        ta.build(arch, d, max_position_embeddings=256 + 24 + 64)
        lm = load_model(d, dtype="bfloat16")
        prompt = torch.randint(3, ta.VOCAB, (256,), generator=torch.Generator().manual_seed(1)).tolist()
        full = generate(lm, prompt, GenParams(mode="full", max_tokens=24, ignore_eos=True, chunk_size=64, logprobs=2))
        for a, spec in bad:
            if a != arch:
                continue
            vc = generate(lm, prompt, GenParams(mode="vericache", compressor=spec, chunk_size=64, draft_len=8,
                                                max_tokens=24, ignore_eos=True, logprobs=2))
            i = next(i for i, (x, y) in enumerate(zip(full.token_ids, vc.token_ids)) if x != y)
            def top2(res):
                lp = res.logprobs[i]
                return [(t, round(p, 4)) for t, p in lp.top[:2]]
            row = dict(arch=arch, compressor=spec, first_diff=i, full_top2=top2(full), vericache_top2=top2(vc))
            print(json.dumps(row)); out.append(row)
json.dump(out, open(sys.argv[2], "w"), indent=1)
