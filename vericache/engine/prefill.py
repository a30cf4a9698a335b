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
    # [L, Hkv, n]: each prompt token's attention mass from the prompt's last `window_rows`
    # queries, summed over them and each KV group's query heads (classic SnapKV's score)
    window_votes: torch.Tensor | None = None
    window_rows: int = 0


def prefill(runner: Runner, ids: list[int], extra_capacity: int, chunk_size: int = 256,
            window: int = 0, cache: KVCache | None = None, question_window: int = 0,
            arena=None) -> Prefilled:
    """Run the prompt through the model `chunk_size` tokens per pass (from cache.length on,
    when a cache with a cached prefix is given). Captures the last `window` queries of every
    complete chunk, for compressors that score tokens by them, and the votes of the prompt's
    last `question_window` queries, for selection policies: the passes that compute those
    rows give them (`SeqBatchItem.vote_from`; votes never change a row's bits), so they cost
    no second pass over the keys. Where the cached prefix reaches into that window, its rows'
    votes come from a pass over them that leaves the cache as it was (`_window_votes`), so a
    cached chunk is never recomputed for them. `arena`: the runner pool key a new cache sits
    in (`Runner.new_cache`)."""
    n = len(ids)
    if cache is None:
        cache = runner.new_cache(n + extra_capacity, arena=arena)
    else:
        cache.reserve(n - cache.length + extra_capacity)
    if cache.length >= n:
        raise ValueError("prefill needs at least one prompt token past the cached prefix")
    obs: dict[int, torch.Tensor] = {}
    logits = None
    s = cache.length
    qlo = max(0, n - question_window) if question_window else n  # the question window's first
    votes = None
    if qlo < s:
        votes = _window_votes(runner, ids, cache, qlo)
    while s < n:
        e = min(n, (s // chunk_size + 1) * chunk_size)
        complete = e % chunk_size == 0 and s % chunk_size == 0
        cap = torch.arange(e - s - window, e - s) if window and complete else None
        out, item = runner.step(ids[s:e], s, cache, logits="last" if e == n else "none",
                                capture_q=cap, vote_from=max(qlo, s) - s if qlo < e else None)
        if window and complete:
            obs[s // chunk_size] = item.captured
        if qlo < e:  # each pass's votes reach its last key: the longer one gathers them
            if votes is not None:
                with torch.inference_mode():  # (the runner's tensors are inference tensors)
                    item.attn_votes[..., :votes.shape[-1]] += votes
            votes = item.attn_votes
        logits = out
        s = e
    pre = Prefilled(cache, logits[0], obs)
    if votes is not None:
        pre.window_votes, pre.window_rows = votes, n - qlo
    return pre


def _window_votes(runner: Runner, ids: list[int], cache: KVCache, lo: int) -> torch.Tensor:
    """The votes ([L, Hkv, cache.length]) of cached positions lo .. cache.length - 1: one
    pass over them as if the cache ended at lo, after which their stored K/V (the prefix
    cache's, which every mode reads) are put back, so the cache is bit for bit what was
    loaded."""
    end = cache.length
    saved = [t[:, :, lo:end].clone() for t in (cache.k, cache.v)]
    pos = cache.pos[:, :, lo:end].clone() if cache.pos is not None else None
    cache.length = lo
    try:
        _, item = runner.step(ids[lo:end], lo, cache, logits="none", vote_from=0)
    finally:
        cache.k[:, :, lo:end], cache.v[:, :, lo:end] = saved
        if pos is not None:
            cache.pos[:, :, lo:end] = pos
        cache.length = end
    return item.attn_votes


def tail_start(compressor: Compressor, prompt_len: int, chunk_size: int) -> int:
    """First token of the exact tail: a chunk boundary at or before prompt_len - exact_tail."""
    keep = min(prompt_len, compressor.exact_tail(prompt_len))
    return (prompt_len - keep) // chunk_size * chunk_size


def drafter_tokens(compressor: Compressor, prompt_len: int, chunk_size: int) -> int:
    """How many prompt tokens the drafter holds: each compressed chunk's kept tokens, then
    the exact tail (a selection policy moves tokens, never adds any)."""
    ts = tail_start(compressor, prompt_len, chunk_size)
    return sum(compressor.kept_in_chunk(i, chunk_size) for i in range(0, ts, chunk_size)) + prompt_len - ts


def compress_prompt(compressor: Compressor, pre: Prefilled, prompt_len: int,
                    chunk_size: int = 256, first_chunk: int = 0) -> list[CompressedChunk]:
    """Compress every chunk before the exact tail, from `first_chunk` on (the earlier ones
    came from the store already compressed). Compressed chunks live in host memory, as the
    store and a remote drafter hold them: a device cache's chunks are copied to the host
    first (on CPU the views are the cache's own)."""
    chunks = []
    for i in range(first_chunk, tail_start(compressor, prompt_len, chunk_size) // chunk_size):
        k, v = pre.cache.view(i * chunk_size, (i + 1) * chunk_size)
        q = pre.obs_q.get(i)
        chunks.append(compressor.compress(KVSpan(k.cpu(), v.cpu(), i * chunk_size,
                                                 None if q is None else q.cpu())))
    return chunks


def build_draft_cache(compressor: Compressor, chunks: list[CompressedChunk], full: KVCache,
                      prompt_len: int, chunk_size: int, extra_capacity: int) -> KVCache:
    """The drafter's cache: decompressed chunks, then the exact tail copied from `full`."""
    k, v = compressor.draft_kv(chunks, *full.view(len(chunks) * chunk_size, prompt_len))
    return KVCache.from_tensors(k, v, extra_capacity)
