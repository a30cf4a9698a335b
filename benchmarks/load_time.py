"""A model load's time, and its block search native against torch's, on one thread.

What a service's start costs, as the suite and `docker compose` start them; the block search
is `qweights.blocks_of`.

    PYTHONPATH=. .venv/bin/python benchmarks/load_time.py \\
        --json benchmarks/results/2026-12-07j/load_time.json

Each load runs in a fresh process (imports included): `load_model` of --model (default: the
default GGUF, whose products are Q4_1 blocks) with the block search on (`auto`) and off
(`VERICACHE_WEIGHT_BLOCKS=off`), and with --baseline (a git ref, exported with `git archive`;
one untimed load first builds its kernels) that ref's `load_model` with the search on,
--repeats times each, in turns (this VM's speed moves within minutes); then, in this
process, the search over the model's product matrices by the native kernel (`blocks_of`)
and by torch (`blocks_of_torch`), each --repeats times, and whether they found the same
blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import time, torch
t = time.perf_counter()
torch.set_num_threads(1)
from vericache.model.loader import load_model
lm = load_model({model!r})
print(time.perf_counter() - t)
"""


def load_seconds(model: str | None, blocks: str, root: Path = ROOT) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VERICACHE_WEIGHT_BLOCKS": blocks,
           "PYTHONPATH": str(root)}
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD.format(model=model)], env=env, cwd=root,
                         check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - t
    return {"load_model_s": float(out.strip().splitlines()[-1]), "process_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each (default 3)")
    ap.add_argument("--baseline", default=None,
                    help="git ref whose load_model to time beside this checkout's")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        roots = {"auto": (ROOT, "auto"), "off": (ROOT, "off")}
        if args.baseline:
            archive = subprocess.run(["git", "archive", args.baseline], cwd=ROOT, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            load_seconds(args.model, "auto", Path(tmp))  # (builds its kernels)
            roots["baseline_auto"] = (Path(tmp), "auto")
        loads = {name: [] for name in roots}
        for _ in range(args.repeats):
            for name, (root, blocks) in roots.items():
                loads[name].append(load_seconds(args.model, blocks, root))
    import torch

    from vericache.model import qweights
    from vericache.model.loader import load_model

    torch.set_num_threads(1)
    os.environ["VERICACHE_WEIGHT_BLOCKS"] = "off"
    r = load_model(args.model).runner
    mats = r._layer_mats() + [r.lm_head]
    search, found = {}, {}
    for name, fn in (("native", qweights.blocks_of), ("torch", qweights.blocks_of_torch)):
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            found[name] = [fn(w) for w in mats]
            times.append(time.perf_counter() - t)
        search[name] = times
    same = all((a is None) == (b is None) and (a is None or (
        a.bits == b.bits and torch.equal(a.q, b.q) and torch.equal(a.d, b.d)
        and (a.m is None or torch.equal(a.m, b.m)))) for a, b in zip(found["native"], found["torch"]))
    doc = {"model": args.model or "default", "baseline": args.baseline, "threads": 1, "matrices": len(mats),
           "weights": sum(w.numel() for w in mats),
           "with_blocks": sum(q is not None for q in found["native"]),
           "load": loads, "blocks_of_s": search, "same_blocks": same,
           "cpu": next((ln.split(":", 1)[1].strip() for ln in
                        Path("/proc/cpuinfo").read_text().splitlines()
                        if ln.startswith("model name")), "")}
    print(json.dumps(doc, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
