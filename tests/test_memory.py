"""Freed memory goes back to the system once a server is idle (`vericache.engine.memory`)."""

from __future__ import annotations

import subprocess
import sys
import time

from vericache.memory import IdleTrim

# a fresh process frees 150 MB of small blocks below one it keeps (the heap's top stays in
# use, so malloc cannot hand the rest back by itself), then trims
_PROBE = """
import ctypes
from vericache.memory import release_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) // 1024
blocks = [libc.malloc(1024) for _ in range(150 * 1024)]
for b in blocks:
    ctypes.memset(b, 1, 1024)
top = libc.malloc(1024)
for b in blocks:
    libc.free(b)
before = rss()
gave = release_freed_memory()
print(before, rss(), gave)
"""


def test_release_gives_a_heaps_free_pages_back():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True).stdout.split()
    before, after, gave = int(out[0]), int(out[1]), out[2]
    assert gave == "True" and before - after >= 100, out


def test_idle_trim_waits_for_an_idle_spell_and_trims_once():
    idle = IdleTrim(after_s=0.2)
    assert not idle.poll()  # nothing happened yet
    idle.busy()
    assert not idle.poll()  # busy a moment ago
    time.sleep(0.3)
    assert idle.poll() and idle.trims == 1
    time.sleep(0.3)
    assert not idle.poll() and idle.trims == 1  # once per idle spell
    idle.busy()
    time.sleep(0.3)
    assert idle.poll() and idle.trims == 2
    never = IdleTrim(after_s=0)
    never.busy()
    time.sleep(0.05)
    assert not never.poll() and never.trims == 0


# a fresh process: a pool of 16 slots of 8192 tokens (SmolLM2's shape, float32); one short
# cache and one that will fill its slot, each written with 100 tokens
_POOL = """
import torch
import vericache
from vericache.model.kvcache import KVPool
def rss(field):
    with open("/proc/self/smaps_rollup") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":")) // 1024
pool = KVPool(30, 3, 64, 8192, 16, torch.float32, "cpu", positions=True)
k = torch.randn(30, 3, 100, 64)
pos = torch.arange(100).expand(30, 3, 100)
r0 = rss("Rss")
short = pool.claim()
pool.advise(short.slot, 100 + 16)
short.append(k, k, pos)
r1, h1 = rss("Rss"), rss("AnonHugePages")
long = pool.claim()
pool.advise(long.slot, 8000)
long.append(k, k, pos)
print(r1 - r0, rss("AnonHugePages") - h1)
"""


def test_a_pools_short_cache_commits_its_tokens_and_a_long_one_huge_pages():
    """A slot's rows are 2 MB each (8192 tokens x 64 x 4 bytes): a short cache's 100 tokens
    commit a few MB, not the slot's 360 MB; a cache that will fill its slot is read from huge
    pages where the kernel gives them (THP not `never`)."""
    out = subprocess.run([sys.executable, "-c", _POOL], capture_output=True, text=True,
                         check=True).stdout.split()
    short_mb, long_huge_mb = int(out[0]), int(out[1])
    assert short_mb < 40, out
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read()
    if "[never]" in thp:
        assert long_huge_mb == 0, out
    else:
        assert long_huge_mb >= 100, (out, thp)
