"""Native CPU kernels, compiled on first use with the machine's C compiler.

`attend()`: the batch attention of the runner's fast path (`attend.c`): every sequence and
KV head of a pass in one call, each row over its own key range, each key block read once
for every row that sees it, split across threads (ctypes drops the GIL for the call). On a
2-vCPU EPYC at 16 sequences of 2k tokens (SmolLM2's 3 KV heads, 3 query heads each, one
decode row), a layer took 6.4 ms on one thread and 3.1-5.4 ms on two, against 9.2 and 6.9
ms for torch's SDPA with the batch's mask (/tmp probe; `benchmarks/attention.py --sdpa-too`
measures both against this machine's read bandwidth).

The library is built once per source, flags and CPU (`-march=native`) into the models'
cache folder (`$VERICACHE_CACHE_DIR`, default `~/.cache/vericache`), under kernels/,
atomically, so that concurrent processes agree. Without a compiler, or with
`VERICACHE_KERNELS=0`, `attend()` is None and the runner uses SDPA; the reason is logged
once. Compiled with -ffast-math (vector expf; linked without it, see FLAGS): results differ
from SDPA's in the last bits, as any two attention kernels do; the invariant pass
(`exact=bitwise`) never uses it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attend.c")
# compiled with -ffast-math (vector expf), linked without it: gcc links a library built with
# it to crtfastmath.o, which on load sets flush-to-zero for the whole process (subnormals
# became 0 in torch and numpy alike; hypothesis refused to run)
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC"]
LIBS = ["-lmvec", "-lm"]

_lock = threading.Lock()
_loaded: dict[str, object] = {}


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build() -> Path:
    from vericache.model.loader import cache_root  # (the loader imports the runner, this)

    cache = cache_root()
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, *FLAGS, "-shared", *LIBS,
                                     _cpu()]).encode())
    out = cache / "kernels" / f"attend-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, so = Path(tmp) / "attend.o", Path(tmp) / out.name
        for cmd in ([cc, *FLAGS, "-c", "-o", str(obj), str(SOURCE)],
                    [cc, "-shared", "-o", str(so), str(obj), *LIBS]):
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(so, out)  # atomic: a concurrent build writes the same bytes
    return out


class Attend:
    """`attend(q, k, v, lo, hi, scale, threads)` -> out: q [B, H, R, D] float32 (any
    layout; made contiguous); k, v [B, H, N, D] float32 views with unit stride within a key
    (a pool's slots); lo, hi [B, R] int64: row r of sequence b attends over keys
    [lo, hi) (none: zeros). `threads` split the B * H tasks."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.vc_attend_f32
        p, i = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [p, p, p, i, i, i, p, p, p, i, i, i, ctypes.c_float, i, i, p]
        self._fn.restype = ctypes.c_int
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor,
                 hi: torch.Tensor, scale: float, threads: int = 1) -> torch.Tensor:
        if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
            raise TypeError("attend: float32 only")
        if k.stride() != v.stride() or k.stride(3) != 1 or q.device.type != "cpu":
            raise ValueError("attend: k and v must share strides, unit within a key, on CPU")
        q = q.contiguous()
        lo, hi = lo.contiguous(), hi.contiguous()
        B, H, R, D = q.shape
        tasks = B * H
        if threads > 1 and tasks < 2 * threads:  # few tasks (batch 1): split the keys instead
            return self._split_keys(q, k, v, lo, hi, scale, threads)
        out = torch.empty_like(q)
        args = self._args(q, k, v, lo, hi, out, scale)
        cuts = [tasks * i // threads for i in range(threads + 1)] if threads > 1 else [0, tasks]
        self._run([(args, cuts[i], cuts[i + 1], None) for i in range(len(cuts) - 1)])
        return out

    def _split_keys(self, q, k, v, lo, hi, scale, n: int) -> torch.Tensor:
        """The keys in `n` even parts, one call each, combined by their rows' log-sum-exps."""
        B, H, R, D = q.shape
        first, last = int(lo.min()), int(hi.max())
        cuts = [first + (last - first) * i // n for i in range(n + 1)]
        outs = torch.empty(n, B, H, R, D)
        lses = torch.empty(n, B, H, R)
        ranges = [(lo.clamp(min=cuts[i]), hi.clamp(max=cuts[i + 1])) for i in range(n)]
        self._run([(self._args(q, k, v, lo_i, hi_i, outs[i], scale), 0, B * H, lses[i].data_ptr())
                   for i, (lo_i, hi_i) in enumerate(ranges)])
        w = torch.exp(lses - lses.max(0).values)  # [n, B, H, R]; a part with no keys: 0
        total = w.sum(0)
        out = (outs * w[..., None]).sum(0) / total.clamp(min=1e-30)[..., None]
        return out

    @staticmethod
    def _args(q, k, v, lo, hi, out, scale) -> tuple:
        """The kernel's arguments up to the task range (pointers into the tensors: the
        caller keeps them alive through the call)."""
        return (q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
                lo.data_ptr(), hi.data_ptr(), out.data_ptr(), q.shape[1], q.shape[2], q.shape[3],
                float(scale))

    def _run(self, calls: list) -> None:
        """Each (args, t0, t1, lse) call on a thread of its own (the first on this one)."""
        futures = []
        if len(calls) > 1:
            pool = self._workers_for(len(calls) - 1)
            futures = [pool.submit(self._fn, *a, t0, t1, lse) for a, t0, t1, lse in calls[1:]]
        a, t0, t1, lse = calls[0]
        rc = [self._fn(*a, t0, t1, lse)] + [f.result() for f in futures]
        if any(rc):
            raise MemoryError("attend: out of memory for its buffers")

    def _workers_for(self, n: int) -> ThreadPoolExecutor:
        with _lock:
            if self._workers < n:
                self._pool = ThreadPoolExecutor(n, thread_name_prefix="vericache-attend")
                self._workers = n
            return self._pool


def attend() -> Attend | None:
    """The compiled kernel, or None (no compiler, a failed build, or VERICACHE_KERNELS=0)."""
    if os.environ.get("VERICACHE_KERNELS", "1") == "0":
        return None
    with _lock:
        if "attend" not in _loaded:
            try:
                _loaded["attend"] = Attend(ctypes.CDLL(str(_build())))
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", "") or e
                log.warning("native attention kernel unavailable (%s); using SDPA", detail)
                _loaded["attend"] = None
        return _loaded["attend"]
