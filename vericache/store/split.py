"""`SplitStore(chunks, scratch)`: prefix chunks in a durable store, per-request values in a
scratch store beside it. The kvstore service runs one (`--scratch-mb`).

The store holds two kinds of value (`vericache.store.keys`):
- prefix chunks, named by their content, kept for any later request that shares the prefix:
  they belong in Redis or LMCache, shared and bounded by the operator's policy;
- per-request values (a request's exact tail, a round's exact-KV refresh, the selection's
  moves): written by one service, read once by the other within the round, then deleted or
  overwritten. Nothing reuses them, so a trip through Redis only costs time (measured on the
  2-core CI machine: ~700 MB/s from the kvstore's memory against ~200-250 MB/s with Redis
  behind it). They go to `scratch`, the kvstore's own memory with a TTL and a capacity, so a
  reader that never comes leaks nothing for long.
Keys route by `is_chunk_key`; `stats` is the chunks' store's, with the scratch's as
`scratch_*` extras.
"""

from __future__ import annotations

from collections.abc import Sequence

from vericache.store.base import ChunkStore, Value
from vericache.store.keys import is_chunk_key


class SplitStore(ChunkStore):
    def __init__(self, chunks: ChunkStore, scratch: ChunkStore):
        self.chunks, self.scratch = chunks, scratch

    def _for(self, key: str) -> ChunkStore:
        return self.chunks if is_chunk_key(key) else self.scratch

    def put(self, key: str, value: Value) -> None:
        self._for(key).put(key, value)

    def get(self, key: str) -> bytes | None:
        return self._for(key).get(key)

    def contains(self, key: str) -> bool:
        return self._for(key).contains(key)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        chunk = [is_chunk_key(k) for k in keys]
        found = {True: iter(self.chunks.contains_many([k for k, c in zip(keys, chunk) if c])),
                 False: iter(self.scratch.contains_many([k for k, c in zip(keys, chunk) if not c]))}
        return [next(found[c]) for c in chunk]

    def longest_prefix(self, keys: Sequence[str]) -> int:
        if all(is_chunk_key(k) for k in keys):  # the common case: one call to the chunks' store
            return self.chunks.longest_prefix(keys)
        present = self.contains_many(keys)
        return present.index(False) if False in present else len(present)

    def delete(self, key: str) -> bool:
        return self._for(key).delete(key)

    def stats(self) -> dict[str, int | float | str]:
        s = self.scratch.stats()
        return {**self.chunks.stats(),
                **{f"scratch_{k}": v for k, v in s.items() if isinstance(v, (int, float))}}

    def close(self) -> None:
        self.scratch.close()
        self.chunks.close()
