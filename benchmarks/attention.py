"""Decode attention's KV read rate against this machine's read bandwidth, before and after the
runner's one-call-per-layer attention, and full decode tokens/s at batch 1 and 16 x 8k.

    PYTHONPATH=. .venv/bin/python benchmarks/attention.py \\
        --json benchmarks/results/2026-12-01e/attn_cpu.json

`before` is the runner of --baseline (a git ref; default: the merge base of HEAD and main)
exported with `git archive` to a temporary folder and run in a subprocess of this script;
`after` is this checkout; with --sdpa-too, `after_sdpa` is this checkout without its native
attention kernel (`VERICACHE_KERNELS=0`, a subprocess). All run the same measurement, one
after the other:

- a decode step: B sequences, one new token each, in one pass (the pass full decoding runs
  for B requests), caches of `ctx` tokens (copies of one cache: a built-in prompt's first 512
  tokens prefilled, their KV tiled to `ctx`; a real 8k prefill takes minutes here and the
  step's time does not depend on the values) and of `--short` tokens; time per step = the
  median of --steps greedy steps (the first dropped);
- decode attention's KV read rate = B * (ctx - short) * KV bytes per token / (step at ctx -
  step at short): the time the step spends on the context it reads;
- full decode tokens/s = B / step at ctx;
- the read bandwidth, in the same process right before and after: sum of a 256 MiB fp32
  tensor, best of 5, at 1 and 2 threads; the peak is the largest (`kv_read_share_of_peak`);
- and the bandwidth while the steps ran (this VM's moves by 2x within minutes): one such sum
  right before each step (at ctx and at short alike), at the step's threads;
  `kv_read_share_of_during` is the KV read rate over their median (`read_gb_s_during` lists
  those before the steps at ctx, the first dropped).

With --profile, the after side prints a torch.profiler table of one batch-16 step at ctx and
the number of SDPA calls in it (one per layer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _sum_rate(big: torch.Tensor) -> float:
    """GB/s of one streaming read of `big` (its sum), at the current threads."""
    t = time.perf_counter()
    big.sum()
    return big.numel() * 4 / (time.perf_counter() - t) / 1e9


def read_bandwidth(threads: int) -> float:
    """GB/s of a streaming read (sum of 256 MiB of fp32) at `threads`, best of 5."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        big = torch.ones(256 << 20 >> 2)
        big.sum()
        return max(_sum_rate(big) for _ in range(5))
    finally:
        torch.set_num_threads(before)


def _prefill(lm, ids: list[int], real: int = 512):
    """A cache of len(ids) tokens: the KV of the first `real` tokens (prefilled), tiled. A
    step's time does not depend on the values it reads, and a real 8k prefill costs minutes
    on this CPU; every point's caches are copies of this one's prefix."""
    from vericache.model.kvcache import KVCache

    r = lm.runner
    c = r.new_cache(real)
    r.step(ids[:real], 0, c, logits="none")
    k, v = c.view()
    reps = -(-len(ids) // real)
    return KVCache.from_tensors(k.repeat(1, 1, reps, 1)[:, :, :len(ids)],
                                v.repeat(1, 1, reps, 1)[:, :, :len(ids)])


def _caches(base, n: int, batch: int, room: int) -> list:
    from vericache.model.kvcache import KVCache

    k, v = base.view(0, n)
    return [KVCache.from_tensors(k, v, room) for _ in range(batch)]


def _steps(lm, caches: list, first: list[int], steps: int, rates: list | None = None,
           big: torch.Tensor | None = None) -> list[float]:
    """Greedy decode steps of every cache in one pass each; seconds per step. With `rates`,
    a read of `big` before each step appends its GB/s there (the bandwidth at that moment)."""
    from vericache.model.runner import SeqBatchItem

    toks, times = list(first), []
    for _ in range(steps):
        if rates is not None:
            rates.append(_sum_rate(big))
        items = [SeqBatchItem(torch.tensor([t]), torch.tensor([c.length]), c) for t, c in zip(toks, caches)]
        t0 = time.perf_counter()
        out = lm.runner.forward(items)
        times.append(time.perf_counter() - t0)
        toks = [int(lg[0].argmax()) for lg in out]
    return times


def measure(lm, base, ids: list[int], batch: int, ctx: int, short: int, steps: int) -> dict:
    """One point: `batch` sequences at `ctx` and at `short` tokens (copies of `base`)."""
    kvt = lm.runner.kv_bytes_per_token()
    bw = {t: read_bandwidth(t) for t in (1, 2)}
    per, rates = {}, {}
    big = torch.ones(256 << 20 >> 2)
    for n in (short, ctx):
        caches = _caches(base, n, batch, steps + 1)
        rates[n] = []
        per[n] = statistics.median(_steps(lm, caches, [ids[n - 1]] * batch, steps, rates[n],
                                          big)[1:])
        del caches
    del big
    bw_after = {t: read_bandwidth(t) for t in (1, 2)}
    kv = batch * (ctx - short) * kvt
    attn_s = per[ctx] - per[short]
    peak = max(max(bw.values()), max(bw_after.values()))
    during = statistics.median(rates[ctx][1:])
    return {"batch": batch, "ctx": ctx, "short": short, "steps": steps,
            "step_s": per[ctx], "step_s_short": per[short], "kv_bytes_read": kv,
            "kv_read_gb_s": kv / attn_s / 1e9, "read_gb_s": {"before": bw, "after": bw_after},
            "peak_read_gb_s": peak, "kv_read_share_of_peak": kv / attn_s / 1e9 / peak,
            "read_gb_s_during": rates[ctx][1:],
            "kv_read_share_of_during": kv / attn_s / 1e9 / during,
            "decode_tok_s": batch / per[ctx], "torch_threads": torch.get_num_threads()}


def profile(lm, base, ids: list[int], ctx: int, batch: int = 16) -> str:
    """A torch.profiler table of one batch-`batch` decode step at `ctx`, and its call counts."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    caches = _caches(base, ctx, batch, 4)
    _steps(lm, caches, [ids[-1]] * batch, 1)  # pools the caches
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        _steps(lm, caches, [ids[-1]] * batch, 1)
    calls = {e.key: e.count for e in prof.key_averages()}
    return (prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14) +
            f"\none batch-{batch} decode step at {ctx}: "
            f"{calls.get('aten::scaled_dot_product_attention', 0)} SDPA calls, "
            f"{calls.get('aten::mm', 0)} mm, {calls.get('aten::linear', 0)} linear "
            f"({lm.runner.num_layers} layers)")


def _worker(args, variants: bool = False) -> list[dict]:
    from vericache.bench.prompts import builtin_prompts
    from vericache.model import load_model

    lm = load_model(None, dtype="float32")
    ids = builtin_prompts(lm.tokenizer, 1, args.ctx + 64)[0].ids[:args.ctx]
    base = _prefill(lm, ids)
    out = [measure(lm, base, ids, b, args.ctx, args.short, args.steps) for b in args.batches]
    if variants and args.profile:
        print(profile(lm, base, ids, args.ctx))
    return out


def _baseline_dir(ref: str, tmp: Path) -> str:
    sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", ref], text=True).strip()
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", sha, "vericache"], check=True,
                          capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=arch, check=True)
    gen = ROOT / "vericache" / "_gen"
    if gen.is_dir():  # generated gRPC stubs are not committed
        subprocess.run(["cp", "-r", str(gen), str(tmp / "vericache")], check=True)
    return sha


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16", help="comma list of batch sizes (default 1,16)")
    ap.add_argument("--ctx", type=int, default=8000, help="context tokens of each sequence "
                    "(default 8000: 8k, with room for the steps in the default model's 8192)")
    ap.add_argument("--short", type=int, default=64, help="the short context the step is taken off")
    ap.add_argument("--steps", type=int, default=6, help="decode steps per point (the first is dropped)")
    ap.add_argument("--baseline", default=None, help="git ref of the 'before' runner "
                    "(default: merge base of HEAD and main); 'none' skips it")
    ap.add_argument("--profile", action="store_true", help="profile a batch-16 step (after)")
    ap.add_argument("--sdpa-too", action="store_true",
                    help="also measure this checkout with VERICACHE_KERNELS=0 (after_sdpa)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)))
        return
    out = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__}, "args": vars(args)}

    def subprocess_worker(pythonpath: str, env: dict) -> list[dict]:
        cmd = [sys.executable, __file__, "--worker", "--batches", ",".join(map(str, args.batches)),
               "--ctx", str(args.ctx), "--short", str(args.short), "--steps", str(args.steps)]
        res = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": pythonpath, **env},
                             capture_output=True, text=True)
        if res.returncode:
            sys.exit(f"a worker failed:\n{res.stderr[-4000:]}")
        line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")][-1]
        return json.loads(line[7:])

    if args.baseline != "none":
        ref = args.baseline or subprocess.check_output(
            ["git", "-C", str(ROOT), "merge-base", "HEAD", "main"], text=True).strip()
        with tempfile.TemporaryDirectory() as tmp:
            sha = _baseline_dir(ref, Path(tmp))
            out["before"] = {"ref": sha, "points": subprocess_worker(tmp, {})}
    head = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "HEAD"], text=True).strip()
    if args.sdpa_too:
        out["after_sdpa"] = {"ref": head, "points": subprocess_worker(str(ROOT),
                                                                      {"VERICACHE_KERNELS": "0"})}
    out["after"] = {"ref": head, "points": _worker(args, variants=True)}
    print(f"{'':11}{'batch':>6}{'ctx':>6}{'step s':>9}{'KV GB/s':>9}{'peak GB/s':>10}{'share':>7}"
          f"{'during':>8}{'share':>7}{'tok/s':>8}")
    for side in ("before", "after_sdpa", "after"):
        for p in out.get(side, {}).get("points", []):
            print(f"{side:11}{p['batch']:>6}{p['ctx']:>6}{p['step_s']:>9.4f}{p['kv_read_gb_s']:>9.2f}"
                  f"{p['peak_read_gb_s']:>10.2f}{p['kv_read_share_of_peak']:>7.0%}"
                  f"{statistics.median(p['read_gb_s_during']):>8.2f}"
                  f"{p['kv_read_share_of_during']:>7.0%}{p['decode_tok_s']:>8.2f}")
    if "before" in out:
        out["speedup"] = {str(a["batch"]): a["decode_tok_s"] / b["decode_tok_s"]
                          for a, b in zip(out["after"]["points"], out["before"]["points"])}
        print("decode tok/s after / before:", {k: round(v, 2) for k, v in out["speedup"].items()})
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
