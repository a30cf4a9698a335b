"""Usage: .venv/bin/python benchmarks/results/2026-12-07b/dots1_route.py

dots.llm1 in bfloat16 (the bf16 dry run's model and prompt): the row that predicts token 3,
as a decode step (A) and inside a 3-row pass (B): the top-2 logits and, at each MoE layer,
the experts chosen and each expert's choice score (sigmoid + correction bias)."""
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import test_architectures as ta
from vericache.engine.generation import GenParams
from vericache.engine.local import generate
from vericache.model.loader import load_model

with tempfile.TemporaryDirectory() as d:
    ta.build("dots1", d, max_position_embeddings=256 + 24 + 64)
    lm = load_model(d, dtype="bfloat16")
    prompt = torch.randint(3, ta.VOCAB, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    full = generate(lm, prompt, GenParams(mode="full", max_tokens=24, ignore_eos=True, chunk_size=64))
    r = lm.runner
    seq = prompt + full.token_ids[:4]   # position 256+3 predicts token 3
    log = []
    orig = r._experts
    def rec(x, e, lin, invariant):
        top, idx = e.route(lin(x.to(e.router.dtype), e.router, e.router_b), x.dtype)
        logits = lin(x.to(e.router.dtype), e.router, e.router_b)
        log.append((idx[-1].sort().values.tolist(), (torch.sigmoid(logits.float()[-1]) + e.score_bias).tolist()))
        return orig(x, e, lin, invariant)
    r._experts = rec
    # A: decode steps for the last 4 tokens (one row each)
    c = r.new_cache(8); r.step(seq[:256], 0, c, logits="last")
    for i in range(256, 258): r.step([seq[i]], i, c, logits="last")
    log.clear(); la = r.step([seq[258]], 258, c, logits="last")[0][-1].float(); A = list(log)
    # B: the same 4 tokens in one pass (a verify pass's shape)
    c = r.new_cache(8); r.step(seq[:256], 0, c, logits="last")
    log.clear(); lb = r.step(seq[256:259], 256, c, logits="all")[0][-1].float(); B = list(log)
    print("top2 A", torch.topk(la, 2)); print("top2 B", torch.topk(lb, 2))
    for li, (a, b) in enumerate(zip(A, B)):
        print("layer", li, "experts A", a[0], "B", b[0], "choice scores A", [round(v, 4) for v in a[1]], "B", [round(v, 4) for v in b[1]])
