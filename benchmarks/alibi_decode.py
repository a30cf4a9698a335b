"""Decode with ALiBi: the native attention kernel (which adds ALiBi's bias itself) against
the explicit attention path it replaced, in one run.

A random-weight model of BLOOM-560M's layer shape (hidden 1024, 16 heads; fewer layers than
its 24, so it builds in seconds: attention's share of a step does not depend on the layer
count) or MPT's, float32, on CPU. For each batch size, the caches are prefilled to --ctx
tokens, then --steps decode steps are timed with the kernel and with it set aside (the
first step of each dropped). Outputs of the two agree to float32 rounding
(tests/test_architectures.py's test_alibi_in_the_native_kernel checks that).

    PYTHONPATH=. .venv/bin/python benchmarks/alibi_decode.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def build(family: str, layers: int, folder: str) -> None:
    import transformers

    if family == "bloom":
        cfg = transformers.BloomConfig(vocab_size=4096, hidden_size=1024, n_head=16,
                                       n_layer=layers, seq_length=16384)
    else:
        cfg = transformers.MptConfig(vocab_size=4096, d_model=1024, n_heads=16, n_layers=layers,
                                     max_seq_len=16384)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="bloom", choices=("bloom", "mpt"))
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (BLOOM-560M has 24)")
    ap.add_argument("--ctx", type=int, default=4000, help="context tokens of each sequence")
    ap.add_argument("--batches", default="1,8", help="comma list of batch sizes")
    ap.add_argument("--steps", type=int, default=6, help="decode steps a point (the first dropped)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    from vericache.model.families import extract
    from vericache.model.runner import Runner, SeqBatchItem
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        build(args.family, args.layers, folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        r = Runner(hf.config, extract(hf, torch.device("cpu")))
    del hf
    kernel = r.attend_kernel
    if kernel is None:
        raise SystemExit("the native attention kernel did not build here")
    g = torch.Generator().manual_seed(1)
    results = []
    r.arena_slots = max(int(b) for b in args.batches.split(","))  # pooled, as an engine's
    for batch in [int(b) for b in args.batches.split(",")]:
        caches = [r.new_cache(args.ctx + 4 * args.steps, arena="bench") for _ in range(batch)]
        for c in caches:
            r.step(torch.randint(3, 4096, (args.ctx,), generator=g).tolist(), 0, c, logits="none")
        point = {"batch": batch, "ctx": args.ctx}
        # (each twice, alternating, the better of the two kept: the machine's speed moves)
        for name, attend in (("kernel", kernel), ("explicit", None)) * 2:
            r.attend_kernel = attend
            times = []
            for _ in range(args.steps):
                items = [SeqBatchItem(torch.tensor([5]), torch.tensor([c.length]), c, "last")
                         for c in caches]
                t0 = time.perf_counter()
                r.forward(items)
                times.append(time.perf_counter() - t0)
            step = sum(times[1:]) / len(times[1:])
            if name not in point or step * 1e3 < point[name]["step_ms"]:
                point[name] = {"step_ms": round(step * 1e3, 2), "tok_s": round(batch / step, 2)}
        r.attend_kernel = kernel
        point["speedup"] = round(point["explicit"]["step_ms"] / point["kernel"]["step_ms"], 2)
        print(json.dumps(point), flush=True)
        results.append(point)
        del caches
    out = {"family": args.family, "layers": args.layers, "hidden": 1024, "heads": 16,
           "dtype": "float32", "threads": torch.get_num_threads(), "points": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
