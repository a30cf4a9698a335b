"""The runner's pass times on a device for a model of a realistic size, from random weights:
the draft step, the verify pass and the full step at several batches and contexts, the
host-to-device copy rate, and how much of an offloaded verify pass's copy its compute hides.
`benchmarks/project_json.py --gpu-times FILE` puts these times in place of the bandwidth
model's (peak x 0.8) when it projects a run measured elsewhere (τ, drafts per round,
compression).

    .venv/bin/python benchmarks/gpu_timing.py --device cuda --json gpu_times.json
    .venv/bin/python benchmarks/gpu_timing.py --device cpu --shape tiny --json t.json  # dry run

Nothing is downloaded: the model is built from a transformers config (`--shape llama3-8b`:
Llama-3-8B's, in bf16 on CUDA; `tiny`: a 2-layer toy for a CPU dry run) with random weights,
which do not change a pass's time. Caches hold random K/V of `context` tokens; a draft step
is a decode step over a cache of context / ratio tokens (a compressed cache of that length).
Points whose caches do not fit `--memory-fraction` of the device's memory are skipped (and
listed). Times are medians of `--repeats` passes after one warm-up (CUDA: synchronised).

The offloaded tier's overlap: a verify pass on the main stream while `batch` caches' worth of
KV is copied host-to-device on a side stream, against each alone:
hidden = (copy + verify - together) / min(copy, verify), 1 = fully overlapped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    # Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json)
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=32768 + 256, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096),
}


def build_runner(shape: str, dtype: torch.dtype, device: torch.device):
    """A Runner over a random-weight Llama of `shape`, made on `device` (fixed seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vericache.model.runner import Runner

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False)
    with torch.device(device):
        hf = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    runner = Runner.from_hf(hf.eval(), device)
    del hf
    return runner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs after one warm-up."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _caches(runner, batch: int, tokens: int, room: int) -> list:
    """`batch` caches of `tokens` random K/V tokens, made in one pool (as the engine's are:
    the first pass copies nothing)."""
    from vericache.model.kvcache import KVPool

    pool = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, tokens + room, batch,
                  runner.dtype, runner.device)
    caches = [pool.claim() for _ in range(batch)]
    for c in caches:
        c.k[:, :, :tokens].normal_()
        c.v[:, :, :tokens].normal_()
        c.length = tokens
    return caches


def _pass(runner, caches: list, rows: int, g: torch.Generator):
    """One pass of `rows` new tokens for every cache; the caches are cropped back after."""
    from vericache.model.runner import SeqBatchItem

    items = [SeqBatchItem(torch.randint(0, runner.vocab_size, (rows,), generator=g),
                          torch.arange(c.length, c.length + rows), c,
                          "all" if rows > 1 else "last") for c in caches]
    lengths = [c.length for c in caches]
    runner.forward(items)
    for c, n in zip(caches, lengths):
        c.crop(n)


def measure_point(runner, batch: int, context: int, ratio: float, k: int, repeats: int) -> dict:
    dev = runner.device
    g = torch.Generator().manual_seed(batch * 7 + context)
    full = _caches(runner, batch, context, k + 1)
    t_full = _timed(lambda: _pass(runner, full, 1, g), dev, repeats)
    t_verify = _timed(lambda: _pass(runner, full, k + 1, g), dev, repeats)
    del full
    short = _caches(runner, batch, max(1, int(context / ratio)), k + 1)
    t_draft = _timed(lambda: _pass(runner, short, 1, g), dev, repeats)
    del short
    kv = context * runner.kv_bytes_per_token()
    weights = runner.weight_bytes()
    # what a full step must read (every weight once, every cache once), over its time
    return {"batch": batch, "context": context, "ratio": ratio, "k": k,
            "full_step_s": t_full, "verify_pass_s": t_verify, "draft_step_s": t_draft,
            "full_kv_bytes_per_request": kv,
            "full_step_read_gb_s": (weights + batch * kv) / t_full / 1e9}


def read_rate(device: torch.device, nbytes: int, repeats: int) -> float:
    """The device's memory rate in GB/s, counting bytes read and written, of a plain
    device-to-device copy (the peak a memory-bound step is held against)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / t / 1e9


def copy_rate(device: torch.device, nbytes: int, repeats: int) -> float:
    """Host-to-device GB/s of a pinned buffer (CPU: a plain copy, for the dry run)."""
    n = nbytes // 2
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    host.fill_(1)
    dst = torch.empty(n, dtype=torch.bfloat16, device=device)
    t = _timed(lambda: dst.copy_(host, non_blocking=True), device, repeats)
    return nbytes / t / 1e9


def overlap(runner, batch: int, context: int, k: int, repeats: int) -> dict:
    """A verify pass with `batch` caches' KV copied host-to-device beside it (a side
    stream; CUDA only)."""
    dev = runner.device
    g = torch.Generator().manual_seed(1)
    caches = _caches(runner, batch, context, k + 1)
    nbytes = batch * context * runner.kv_bytes_per_token()
    host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
    dst = torch.empty_like(host, device=dev)
    side = torch.cuda.Stream(dev)

    def copy():
        with torch.cuda.stream(side):
            dst.copy_(host, non_blocking=True)

    def verify():
        _pass(runner, caches, k + 1, g)

    def both():
        copy()
        verify()

    t_copy = _timed(copy, dev, repeats)
    t_verify = _timed(verify, dev, repeats)
    t_both = _timed(both, dev, repeats)
    hidden = (t_copy + t_verify - t_both) / min(t_copy, t_verify)
    return {"batch": batch, "context": context, "copy_bytes": nbytes, "copy_s": t_copy,
            "verify_s": t_verify, "together_s": t_both, "hidden": max(0.0, min(1.0, hidden))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batches", default="16,32,64")
    p.add_argument("--contexts", default="8192,16384,32768")
    p.add_argument("--ratio", type=float, default=4.0, help="compression of a draft cache")
    p.add_argument("--draft-len", type=int, default=32, help="k: a verify pass has k + 1 rows")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory-fraction", type=float, default=0.8,
                   help="caches of a point at most this share of the device's free memory")
    p.add_argument("--json", type=Path, required=True)
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_timing: no CUDA device here (use --device cpu --shape tiny for a dry run)",
              file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev.type == "cuda"
                                                      else torch.float32)
    t0 = time.perf_counter()
    runner = build_runner(a.shape, dtype, dev)
    built_s = time.perf_counter() - t0
    weights = runner.weight_bytes()
    free = (torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 8 << 30)
    kvt = runner.kv_bytes_per_token()
    points, skipped = [], []
    for B in map(int, a.batches.split(",")):
        for N in map(int, a.contexts.split(",")):
            need = B * (N + a.draft_len + 1) * kvt * 1.25  # the pool, and room for the pass
            if need > a.memory_fraction * free or N + a.draft_len + 1 > runner.max_positions:
                skipped.append({"batch": B, "context": N, "cache_bytes": need})
                continue
            points.append(measure_point(runner, B, N, a.ratio, a.draft_len, a.repeats))
            print(json.dumps(points[-1]), flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    # (on CPU nothing runs beside a pass: no copy engine, no streams)
    ov = overlap(runner, points[0]["batch"], points[0]["context"], a.draft_len,
                 a.repeats) if points and dev.type == "cuda" else None
    doc = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "memory_bytes": torch.cuda.mem_get_info(dev)[1] if dev.type == "cuda" else None,
           "shape": a.shape, "dtype": str(dtype).removeprefix("torch."),
           "weight_bytes": weights, "kv_bytes_per_token": kvt, "build_s": built_s,
           "h2d_gb_s": copy_rate(dev, 1 << 30 if dev.type == "cuda" else 64 << 20, a.repeats),
           "memory_gb_s": read_rate(dev, 4 << 30 if dev.type == "cuda" else 64 << 20, a.repeats),
           "torch": torch.__version__,
           "points": points, "skipped": skipped, "overlap": ov}
    a.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"gpu_timing: {len(points)} points ({len(skipped)} skipped for memory), "
          f"h2d {doc['h2d_gb_s']:.1f} GB/s, memory {doc['memory_gb_s']:.0f} GB/s, overlap hidden "
          f"{'-' if ov is None else format(ov['hidden'], '.2f')}; wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
