"""Prefix caching over a ChunkStore: what the verifier and drafter read and write.

- `load_full(prompt)`: the verifier, once per request before prefill: the longest cached
  prefix of full chunks (only as far as the compressed chunks for `spec` are cached too, so
  nothing cached needs recompressing) as a KVCache with room to grow.
- `save(prompt, cache, chunks, first_chunk)`: the verifier, once after prefill: full and
  compressed chunks from `first_chunk` on, and the exact tail under a per-request key.
- `load_draft(...)`: the drafter, once per attach: compressed chunks + the exact tail.
Every value goes through the pickle-free codec; every key through `keys`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vericache.compress.base import CompressedChunk, Compressor
from vericache.errors import NotFound
from vericache.model.kvcache import KVCache
from vericache.store.base import ChunkStore
from vericache.store.codec import decode_chunk, decode_full, encode_chunk, encode_full
from vericache.store.keys import chunk_keys, compressed_key, full_key


@dataclass
class TransferStats:
    hits: int = 0  # chunks found in the store
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    store_errors: int = 0  # store calls that failed (unavailable): the request went on without it
    extra: dict = field(default_factory=dict)


class PrefixCache:
    def __init__(self, store: ChunkStore, model_id: str, chunk_size: int, namespace: str = ""):
        self.store, self.model_id, self.chunk_size, self.namespace = store, model_id, chunk_size, namespace

    def keys(self, prompt: list[int]) -> list[str]:
        return chunk_keys(self.model_id, prompt, self.chunk_size, self.namespace)

    def tail_key(self, request_id: str) -> str:
        return f"tail/{self.namespace}/{request_id}"

    def load_full(self, prompt: list[int], spec: str | None, compress_until: int,
                  extra_capacity: int, stats: TransferStats,
                  new_cache: Callable[[int], KVCache] | None = None) -> KVCache | None:
        """The cached prefix, never the prompt's last token (prefill computes at least one),
        in a cache of `new_cache(capacity)` (default: one of its own)."""
        t = time.perf_counter()
        keys = self.keys(prompt[:len(prompt) - 1])
        n = self.store.longest_prefix([full_key(k) for k in keys])
        need = min(n, compress_until // self.chunk_size) if spec is not None else 0
        if need:  # a chunk without its compressed form is recomputed (compressing needs queries)
            have = self.store.longest_prefix([compressed_key(k, spec) for k in keys[:need]])
            if have < need:  # full chunks past `need` lie in the exact tail: no compressed form
                n = have
        if n == 0:
            stats.seconds += time.perf_counter() - t
            return None
        ks, vs = [], []
        for key in keys[:n]:
            data = self.store.get(full_key(key))
            if data is None:  # evicted since longest_prefix: stop at the gap
                break
            span = decode_full(data, borrow=True)  # copied once, into the cache below
            stats.hits += 1
            stats.bytes_read += len(data)
            ks.append(span.k)
            vs.append(span.v)
        stats.seconds += time.perf_counter() - t
        if not ks:
            return None
        if new_cache is None:  # one of its own; the chunks are copied into it once, in place
            k0 = ks[0]
            cache = KVCache(k0.shape[0], k0.shape[1], k0.shape[3], len(prompt) + extra_capacity,
                            k0.dtype, k0.device)
        else:
            cache = new_cache(len(prompt) + extra_capacity)
        for k, v in zip(ks, vs):
            cache.append(k, v)
        return cache

    def save(self, prompt: list[int], cache: KVCache, chunks: list[CompressedChunk], first_chunk: int,
             tail_start: int, request_id: str | None, stats: TransferStats) -> None:
        t = time.perf_counter()
        keys = self.keys(prompt)
        for i in range(first_chunk, len(keys)):
            data = encode_full(*cache.view(i * self.chunk_size, (i + 1) * self.chunk_size),
                               start=i * self.chunk_size)
            self.store.put(full_key(keys[i]), data)
            stats.bytes_written += len(data)
        for c in chunks:
            i = c.start // self.chunk_size
            if i >= first_chunk:
                data = encode_chunk(c)
                self.store.put(compressed_key(keys[i], c.compressor), data)
                stats.bytes_written += len(data)
        stats.seconds += time.perf_counter() - t
        if request_id is not None:
            self.save_tail(request_id, cache, tail_start, len(prompt), stats)

    def save_tail(self, request_id: str, cache: KVCache, tail_start: int, end: int,
                  stats: TransferStats) -> None:
        """The exact KV of prompt tokens [tail_start, end), for one drafter attach."""
        t = time.perf_counter()
        data = encode_full(*cache.view(tail_start, end), start=tail_start)
        self.store.put(self.tail_key(request_id), data)
        stats.bytes_written += len(data)
        stats.seconds += time.perf_counter() - t

    def load_kept_positions(self, prompt: list[int], compressor: Compressor, n_chunks: int,
                            stats: TransferStats) -> list[torch.Tensor]:
        """Positions each of the first `n_chunks` stored compressed chunks keeps ([L, Hkv, m]
        each): the drafter's base set there, for a selection policy on the verifier."""
        t = time.perf_counter()
        keys = self.keys(prompt)[:n_chunks]
        out = [compressor.kept_positions(decode_chunk(self._read(compressed_key(k, compressor.spec), stats)))
               for k in keys]
        stats.seconds += time.perf_counter() - t
        return out

    def load_draft(self, prompt: list[int], compressor: Compressor, tail_start: int, request_id: str,
                   stats: TransferStats, positions: bool = False,
                   dtype: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The drafter's initial KV (in `dtype`, its cache's: `Compressor.draft_kv`):
        decompressed chunks before `tail_start`, then the tail; with `positions`, the slots'
        positions too (`Compressor.draft_positions`), else None."""
        t = time.perf_counter()
        keys = self.keys(prompt)[: tail_start // self.chunk_size]
        chunks = [decode_chunk(self._read(compressed_key(k, compressor.spec), stats)) for k in keys]
        tail = decode_full(self._read(self.tail_key(request_id), stats))
        self.store.delete(self.tail_key(request_id))  # a tail serves one attach
        stats.seconds += time.perf_counter() - t
        k, v = compressor.draft_kv(chunks, tail.k, tail.v, dtype)
        pos = None
        if positions:
            pos = compressor.draft_positions(chunks, tail_start, tail.k.shape[2], k.shape[0], k.shape[1])
        return k, v, pos

    def _read(self, key: str, stats: TransferStats) -> bytes:
        data = self.store.get(key)
        if data is None:
            raise NotFound(f"chunk {key} is not in the store (evicted or never written)")
        stats.bytes_read += len(data)
        stats.hits += 1
        return data
