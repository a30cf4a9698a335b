"""A server's memory, as the system counts it: pools committed by use, freed memory given back.

Pools committed by use (`page_size`). PyTorch's CPU allocator asks for transparent huge
pages for every buffer of 2 MB or more (`THP_MEM_ALLOC_ENABLE`, set in `vericache/__init__`),
so the first write anywhere in a 2 MB stretch commits all of it. A KV pool's slot holds each
layer's and KV head's keys in one row of the model's context (8192 tokens x 64 x 4 bytes:
2 MB for SmolLM2), so a slot with 100 tokens committed 360 MB, the whole slot, and a verifier
service whose budget was 300 MB held 3.2-4.1 GB by how many slots its concurrency had
touched. A pool is in small pages, and a slot whose cache will fill at least half of it in
huge pages (`KVPool.advise`), so a slot costs what its tokens take, at most twice.

Freed memory given back once idle (`IdleTrim`).

glibc's malloc keeps what a process frees in its heaps for the next allocation, and a heap
hands memory back only from its top. Model passes free hundreds of MB of transient buffers,
and every thread that allocated under contention may grow a heap of its own (a model
service runs its passes on up to 16 gRPC threads, the engine on one thread a lane), so what
an idle server holds depends on which thread happened to run which pass.

`IdleTrim` calls glibc's `malloc_trim(0)`, which gives back every whole free page of every
heap, once a server has had no request for `after_s` seconds (`VERICACHE_IDLE_TRIM_S`,
default 1; 0 = never). A busy server keeps its memory for the next pass; an idle one holds
only what it uses, which is what a memory-based autoscaler and an operator reading RSS
expect. Where malloc is not glibc's nothing is trimmed.
"""

from __future__ import annotations

import ctypes
import os
import time

import torch

IDLE_TRIM_S = float(os.environ.get("VERICACHE_IDLE_TRIM_S", "1"))


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()
_PAGE = os.sysconf("SC_PAGE_SIZE")
_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15  # <sys/mman.h> on Linux


def _madvise():
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return f if os.uname().sysname == "Linux" else None


_MADVISE = _madvise()


def page_size(t: torch.Tensor, huge: bool) -> None:
    """Have the system commit the memory of `t` (a contiguous CPU tensor or view) in 2 MB
    pages (`huge`: for memory that will be read through, where they read about 10% faster)
    or in small pages as it is first written (for memory most of which may never be
    written), by `madvise`. Pages already committed stay as they are, so advise before the
    first write; nothing happens off Linux."""
    if _MADVISE is None or t.device.type != "cpu" or t.numel() == 0:
        return
    start = t.data_ptr() & ~(_PAGE - 1)
    end = t.data_ptr() + t.numel() * t.element_size()
    _MADVISE(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
             _MADV_HUGEPAGE if huge else _MADV_NOHUGEPAGE)


def resident_mb() -> float:
    """This process's resident memory in MiB (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / (1 << 20)
    except OSError:
        return 0.0


def release_freed_memory() -> bool:
    """Give every whole free page of malloc's heaps back to the system; False where malloc
    is not glibc's or nothing was given back."""
    return bool(_TRIM(0)) if _TRIM is not None else False


class IdleTrim:
    """When to release freed memory: once a server has been idle `after_s` since it last
    had work. The owner calls `busy()` while it has requests (or when one ends) and `poll()`
    when it has none; `poll` trims at most once per idle spell."""

    def __init__(self, after_s: float = IDLE_TRIM_S):
        self.after_s = after_s
        self.last_busy = time.monotonic()
        self.pending = False  # work happened since the last trim
        self.trims = 0

    def busy(self) -> None:
        self.last_busy = time.monotonic()
        self.pending = True

    def poll(self) -> bool:
        """Trim if work happened since the last trim and none for `after_s`; True if it
        trimmed."""
        if not (self.after_s > 0 and self.pending
                and time.monotonic() - self.last_busy >= self.after_s):
            return False
        self.pending = False
        self.trims += 1
        release_freed_memory()
        return True
