"""The drafter side: per-request lossy caches, batched greedy (or sampled) drafting.

Methods and when they are called:
- `attach(rid, k, v, ...)`: once per request, after prefill: the lossy KV (compressed chunks +
  exact tail) becomes the request's cache; `pending` holds the verified tokens not fed yet.
- `draft(batch)`: once per round for every drafting request together: k steps, one forward
  pass per step over all requests still drafting. A request stops early at EOS.
- `commit(rid, accepted, bonus, exact)`: once per round after verification: crop to the
  accepted tokens (and overwrite their KV with the exact KV when `exact` is given), queue
  the unfed verified tokens.
- `release(rid)`: once, when the request ends or fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vericache.compress.base import Compressor
from vericache.errors import InvalidArgument, NotFound
from vericache.model.kvcache import KVCache
from vericache.model.runner import Runner, SeqBatchItem
from vericache.store.base import ChunkStore
from vericache.store.prefix import PrefixCache, TransferStats


def tempered_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) over the last dim, finite for any temperature > 0: the
    max is subtracted first, so a tiny temperature gives a one-hot, not inf - inf = nan."""
    x = logits.float()
    return torch.softmax((x - x.max(dim=-1, keepdim=True).values) / temperature, dim=-1)


def choose(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """Greedy argmax, or a sample at the temperature (and the distribution it came from)."""
    if temperature == 0:
        return int(torch.argmax(logits)), None
    probs = tempered_softmax(logits, temperature)
    return int(torch.multinomial(probs, 1, generator=gen)), probs


@dataclass
class DraftSession:
    cache: KVCache
    pending: list[int]  # verified tokens not fed to the cache yet (the last is x_0)
    seq_len: int  # verified tokens of the sequence, pending included
    temperature: float = 0.0
    gen: torch.Generator = field(default_factory=torch.Generator)
    drafts: list[int] = field(default_factory=list)
    q: list[torch.Tensor | None] = field(default_factory=list)
    len_before: int = 0  # cache length at the round's start


@dataclass
class DraftOut:
    tokens: list[int]
    q: torch.Tensor | None  # [k, V] when sampling


class Drafter:
    def __init__(self, runner: Runner, eos_token_ids: tuple[int, ...], store: ChunkStore | None = None,
                 model_id: str = ""):
        """With a store, `attach_from_store` loads compressed chunks and the exact tail."""
        self.runner, self.eos = runner, eos_token_ids
        self.store, self.model_id = store, model_id
        self.sessions: dict[str, DraftSession] = {}

    def _get(self, rid: str) -> DraftSession:
        try:
            return self.sessions[rid]
        except KeyError:
            raise NotFound(f"no drafter session {rid!r}") from None

    def attach(self, rid: str, k: torch.Tensor, v: torch.Tensor, pending: list[int], seq_len: int,
               extra_capacity: int, temperature: float = 0.0, seed: int = 0) -> None:
        dev, dt = self.runner.device, self.runner.dtype  # an offloaded full KV sits on the host
        cache = KVCache.from_tensors(k.to(dev, dt), v.to(dev, dt), extra_capacity)
        self.sessions[rid] = DraftSession(cache, list(pending), seq_len, temperature,
                                          torch.Generator().manual_seed(seed))

    def attach_from_store(self, rid: str, prompt: list[int], compressor: Compressor, chunk_size: int,
                          tail_start: int, first_token: int, extra_capacity: int,
                          temperature: float = 0.0, seed: int = 0, namespace: str = "") -> TransferStats:
        if self.store is None:
            raise InvalidArgument("this drafter has no store to attach from", "kvstore")
        stats = TransferStats()
        pc = PrefixCache(self.store, self.model_id, chunk_size, namespace)
        k, v = pc.load_draft(prompt, compressor, tail_start, rid, stats)
        self.attach(rid, k, v, [first_token], len(prompt) + 1, extra_capacity, temperature, seed)
        return stats

    def _next_item(self, s: DraftSession, k: int) -> SeqBatchItem | None:
        d = s.drafts
        if len(d) >= k or (d and d[-1] in self.eos):
            return None
        if not d:
            toks, pos0 = s.pending, s.seq_len - len(s.pending)
        else:
            toks, pos0 = [d[-1]], s.seq_len + len(d) - 1
        return SeqBatchItem(torch.tensor(toks), torch.arange(pos0, pos0 + len(toks)), s.cache)

    def draft(self, batch: list[tuple[str, int]]) -> list[DraftOut]:
        """Draft up to k tokens for each (rid, k), all requests stepping together."""
        sess = [self._get(rid) for rid, _ in batch]
        ks = [k for _, k in batch]
        for s in sess:
            s.drafts, s.q, s.len_before = [], [], s.cache.length
        live = list(range(len(sess)))
        while live:
            items = [(i, self._next_item(sess[i], ks[i])) for i in live]
            live = [i for i, it in items if it is not None]
            if not live:
                break
            logits = self.runner.forward([it for _, it in items if it is not None])
            for i, lg in zip(live, logits):
                tok, q = choose(lg[-1], sess[i].temperature, sess[i].gen)
                sess[i].drafts.append(tok)
                sess[i].q.append(q)
        return [DraftOut(list(s.drafts), torch.stack(s.q) if s.q and s.q[0] is not None else None)
                for s in sess]

    def commit(self, rid: str, accepted: int, bonus: int | None, exact: KVCache | None = None) -> None:
        """The verifier accepted `accepted` drafts and chose `bonus` (None: lossy, no verifier)."""
        s = self._get(rid)
        k = len(s.drafts)
        new = s.drafts[:accepted] + ([] if bonus is None else [bonus])
        if k:
            keep = min(accepted, k - 1)
            n = len(s.pending) + keep
            s.cache.crop(s.len_before + n)
            if exact is not None:  # the verify pass computed these tokens' exact KV
                p0 = s.seq_len - len(s.pending)
                s.cache.k[:, :, s.len_before:s.len_before + n] = exact.k[:, :, p0:p0 + n]
                s.cache.v[:, :, s.len_before:s.len_before + n] = exact.v[:, :, p0:p0 + n]
            s.pending = s.drafts[keep:accepted] + ([] if bonus is None else [bonus])
        else:
            s.pending = s.pending + new
        s.seq_len += len(new)
        s.drafts, s.q = [], []

    def release(self, rid: str) -> None:
        self.sessions.pop(rid, None)
