"""The runner's prefill logits against transformers' own forward, family by family, in a
narrow dtype: how many rows are equal bit for bit, the largest difference, and how often the
two argmaxes agree; then how many of the next decode steps' logits are equal bit for bit
(each side one token a step over its own cache, both fed transformers' argmax).

    .venv/bin/python benchmarks/bf16_logits.py --json bf16_logits.json
    .venv/bin/python benchmarks/bf16_logits.py --archs gpt2,mixtral --dtype float16

Each model is a tiny random-weight one built from its transformers config class with a fixed
seed (tests/test_architectures.py's `build`; nothing is downloaded), loaded by the runner's
loader and by transformers with its defaults (SDPA, grouped experts, where the family takes
them). A row equal bit for bit means the runner computes that family as transformers does, in
the same order, with the same roundings; `full = generate` in that dtype then follows on the
same machine (benchmarks/gpu_identity.py reports that).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def compare(name: str, dtype: torch.dtype, prompt_len: int, steps: int) -> dict:
    """One family's prefill logits, the runner's against transformers', then `steps` decode
    steps' logits."""
    import test_architectures as ta

    from vericache.model.loader import load_model

    with tempfile.TemporaryDirectory() as d:
        ta.build(name, d, max_position_embeddings=prompt_len + 64)
        lm = load_model(d, dtype=str(dtype).removeprefix("torch."))
        ids = torch.randint(3, ta.VOCAB, (prompt_len,),
                            generator=torch.Generator().manual_seed(1)).tolist()
        hf = ta.auto_class(name).from_pretrained(d, dtype=dtype).eval()
        mine, ref, equal_steps, first_diff = ta.prefill_and_steps(lm, hf, ids, steps)
    mine, ref = mine.float(), ref.float()
    return {"arch": name, "rows_bitwise": round((mine == ref).all(-1).float().mean().item(), 4),
            "max_abs": float((mine - ref).abs().max()),
            "argmax_same": round((mine.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4),
            "steps_bitwise": equal_steps, "steps": steps, "first_step_diff": first_diff}


def main(argv: list[str] | None = None) -> int:
    import test_architectures as ta

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", default=None,
                   help="comma-separated test configurations (default: every one in "
                        "tests/test_architectures.py's ARCHS)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--steps", type=int, default=12, help="decode steps compared (default 12)")
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    names = a.archs.split(",") if a.archs else list(ta.ARCHS)
    rows = []
    for name in names:
        try:
            row = compare(name, getattr(torch, a.dtype), a.prompt, a.steps)
        except Exception as e:  # noqa: BLE001 (a family's failure is reported, the run goes on)
            row = {"arch": name, "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    done = [r for r in rows if "error" not in r]
    same = [r["arch"] for r in done if r["rows_bitwise"] == 1.0]
    steps = [r["arch"] for r in done if r["steps_bitwise"] == a.steps]
    print(f"bf16_logits: {len(same)} of {len(done)} families equal transformers' logits bit for "
          f"bit ({a.dtype}, {a.prompt} tokens), {len(steps)} in all {a.steps} decode steps; "
          f"{len(rows) - len(done)} failed to run")
    if a.json:
        Path(a.json).write_text(json.dumps({"dtype": a.dtype, "prompt": a.prompt,
                                            "steps": a.steps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
