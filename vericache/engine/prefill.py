"""Prefill a prompt in chunks, then make the drafter's lossy cache from the full one."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vericache.compress.base import CompressedChunk, Compressor, KVSpan
from vericache.model.kvcache import KVCache
from vericache.model.runner import Runner


@dataclass
class Prefilled:
    cache: KVCache  # the full KV of the prompt
    logits: torch.Tensor  # [V] after the last prompt token
    obs_q: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk index -> [L, Hq, w, D]


def prefill(runner: Runner, ids: list[int], extra_capacity: int, chunk_size: int = 256,
            window: int = 0, cache: KVCache | None = None) -> Prefilled:
    """Run the prompt through the model `chunk_size` tokens per pass (from cache.length on,
    when a cache with a cached prefix is given). Captures the last `window` queries of every
    complete chunk, for compressors that score tokens by them."""
    n = len(ids)
    if cache is None:
        cache = runner.new_cache(n + extra_capacity)
    else:
        cache.reserve(n - cache.length + extra_capacity)
    if cache.length >= n:
        raise ValueError("prefill needs at least one prompt token past the cached prefix")
    obs: dict[int, torch.Tensor] = {}
    logits = None
    s = cache.length
    while s < n:
        e = min(n, (s // chunk_size + 1) * chunk_size)
        complete = e % chunk_size == 0 and s % chunk_size == 0
        cap = torch.arange(e - s - window, e - s) if window and complete else None
        out, item = runner.step(ids[s:e], s, cache, logits="last" if e == n else "none",
                                capture_q=cap)
        if cap is not None:
            obs[s // chunk_size] = item.captured
        logits = out
        s = e
    return Prefilled(cache, logits[0], obs)


def tail_start(compressor: Compressor, prompt_len: int, chunk_size: int) -> int:
    """First token of the exact tail: a chunk boundary at or before prompt_len - exact_tail."""
    keep = min(prompt_len, compressor.exact_tail(prompt_len))
    return (prompt_len - keep) // chunk_size * chunk_size


def compress_prompt(compressor: Compressor, pre: Prefilled, prompt_len: int,
                    chunk_size: int = 256, first_chunk: int = 0) -> list[CompressedChunk]:
    """Compress every chunk before the exact tail, from `first_chunk` on (the earlier ones
    came from the store already compressed)."""
    chunks = []
    for i in range(first_chunk, tail_start(compressor, prompt_len, chunk_size) // chunk_size):
        k, v = pre.cache.view(i * chunk_size, (i + 1) * chunk_size)
        chunks.append(compressor.compress(KVSpan(k, v, i * chunk_size, pre.obs_q.get(i))))
    return chunks


def build_draft_cache(compressor: Compressor, chunks: list[CompressedChunk], full: KVCache,
                      prompt_len: int, chunk_size: int, extra_capacity: int) -> KVCache:
    """The drafter's cache: decompressed chunks, then the exact tail copied from `full`."""
    k, v = compressor.draft_kv(chunks, *full.view(len(chunks) * chunk_size, prompt_len))
    return KVCache.from_tensors(k, v, extra_capacity)
