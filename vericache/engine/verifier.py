"""The verifier side: per-request full KV, prefill, and batched verification.

Methods and when they are called:
- `prefill(rid, prompt_ids, ...)`: once per request: computes the full KV (after a cached
  prefix when one is given), compresses the chunks before the exact tail, and returns the
  first token (from full-KV logits) with the compressed chunks.
- `verify(batch)`: once per round for every verifying request together: ONE forward pass of
  [x_0, d_1..d_k] per request over its full KV; accepts by `vericache.spec.accept`; crops the
  cache to the accepted tokens. Returns (accepted, bonus) per request.
- `release(rid)`: once, when the request ends or fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vericache.compress.base import CompressedChunk, Compressor
from vericache.engine.drafter import choose
from vericache.engine.prefill import compress_prompt, prefill
from vericache.errors import NotFound
from vericache.model.kvcache import KVCache
from vericache.model.runner import Runner, SeqBatchItem
from vericache.spec.accept import greedy_accept, speculative_accept


@dataclass
class VerifySession:
    cache: KVCache  # every verified token but the last
    pending: list[int]  # [x_0]
    temperature: float = 0.0
    gen: torch.Generator = field(default_factory=torch.Generator)


@dataclass
class PrefillOut:
    first_token: int
    chunks: list[CompressedChunk]  # compressed chunks before the exact tail


class Verifier:
    def __init__(self, runner: Runner):
        self.runner = runner
        self.sessions: dict[str, VerifySession] = {}

    def _get(self, rid: str) -> VerifySession:
        try:
            return self.sessions[rid]
        except KeyError:
            raise NotFound(f"no verifier session {rid!r}") from None

    def prefill(self, rid: str, prompt_ids: list[int], extra_capacity: int, chunk_size: int,
                compressor: Compressor | None = None, temperature: float = 0.0, seed: int = 0,
                cached: KVCache | None = None) -> PrefillOut:
        window = compressor.observation_window if compressor else 0
        pre = prefill(self.runner, prompt_ids, extra_capacity, chunk_size, window, cache=cached)
        gen = torch.Generator().manual_seed(seed)
        first, _ = choose(pre.logits, temperature, gen)
        chunks = compress_prompt(compressor, pre, len(prompt_ids), chunk_size) if compressor else []
        self.sessions[rid] = VerifySession(pre.cache, [first], temperature, gen)
        return PrefillOut(first, chunks)

    def cache(self, rid: str) -> KVCache:
        return self._get(rid).cache

    def verify(self, batch: list[tuple[str, list[int], torch.Tensor | None]]) -> list[tuple[int, int]]:
        """For each (rid, drafts, q): one pass over the full KV, accept, crop."""
        sess = [self._get(rid) for rid, _, _ in batch]
        items = []
        for s, (_, drafts, _) in zip(sess, batch):
            toks = s.pending + list(drafts)
            pos0 = s.cache.length
            items.append(SeqBatchItem(torch.tensor(toks), torch.arange(pos0, pos0 + len(toks)),
                                      s.cache, logits="all"))
        logits = self.runner.forward(items)
        out = []
        for s, (_, drafts, q), lg in zip(sess, batch, logits):
            k = len(drafts)
            if s.temperature == 0:
                a, bonus = greedy_accept(list(drafts), lg.argmax(dim=-1).tolist())
            else:
                p = torch.softmax(lg.float() / s.temperature, dim=-1)
                a, bonus = speculative_accept(list(drafts), q if k else p[:0], p, s.gen)
            s.cache.crop(s.cache.length - k + a)
            s.pending = [bonus]
            out.append((a, bonus))
        return out

    def release(self, rid: str) -> None:
        self.sessions.pop(rid, None)
