"""How far a verify pass is from decode steps: logits and K/V, bit for bit.

Words: a *window* is k+1 consecutive tokens of full greedy decoding of a prompt. The *steps*
decode it one token per pass, as full decoding does (the reference: the base cache advances
by them). The *verify pass* runs the same window in one pass over a copy of the cache from
before the window, as VeriCache's verifier does with the pending token and k drafts that
are all accepted.
With `batch` > 1, the verify pass holds `batch` sequences at once (each its own prompt and
continuation), and the steps run each sequence alone.

Per window row (a token position of one sequence) `measure` compares:
- logits: the largest absolute difference, and whether any bit differs;
- the K/V the row wrote, in every layer: whether any bit differs;
- the steps' top-2 margin (how near a tie the reference was), and argmax flips (the verify
  row's argmax differs from the step's: a token VeriCache would have emitted differently).
`bitwise=True` marks the verify items `bitwise` (Runner.forward runs their rows one pass
each): every difference must then be zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from vericache.model.kvcache import KVCache
from vericache.model.runner import Runner, SeqBatchItem


@dataclass
class Distance:
    rows: int = 0  # window rows compared
    max_abs_logit: float = 0.0
    logit_rows_differing: int = 0  # rows with any logit bit different
    kv_rows_differing: int = 0  # rows whose written K or V differs in any bit, any layer
    min_top2_margin: float = float("inf")  # the steps' smallest top-1 minus top-2 logit
    argmax_flips: int = 0

    def add(self, other: "Distance") -> None:
        self.rows += other.rows
        self.max_abs_logit = max(self.max_abs_logit, other.max_abs_logit)
        self.logit_rows_differing += other.logit_rows_differing
        self.kv_rows_differing += other.kv_rows_differing
        self.min_top2_margin = min(self.min_top2_margin, other.min_top2_margin)
        self.argmax_flips += other.argmax_flips

    def as_dict(self) -> dict:
        return asdict(self)


def clone(cache: KVCache) -> KVCache:
    c = KVCache(cache.num_layers, cache.k.shape[1], cache.k.shape[3], cache.capacity,
                cache.k.dtype, cache.k.device)
    c.k.copy_(cache.k)
    c.v.copy_(cache.v)
    c.length = cache.length
    return c


def prefill_cache(runner: Runner, ids: list[int], room: int, chunk: int = 256) -> tuple[KVCache, int]:
    """The prompt's full KV, `chunk` tokens per pass, with `room` free slots after it; and the
    greedy first token (the prompt's last logits' argmax)."""
    cache = runner.new_cache(len(ids) + room)
    for s in range(0, len(ids), chunk):
        lg, _ = runner.step(ids[s:s + chunk], s, cache)
    return cache, int(lg[-1].argmax())


def measure(runner: Runner, prompts: list[list[int]], rows: int, k: int,
            modes: tuple[str, ...] = ("fast", "bitwise")) -> dict[str, Distance]:
    """Decode `rows` greedy tokens of every prompt in windows of k+1 by single steps (the
    reference), and run each window also as one verify pass of every sequence at once, per
    mode ("fast": batched rows; "bitwise": items marked bitwise), from copies of the cache
    before the window. Returns the distance per mode (see the module docstring)."""
    out = {m: Distance() for m in modes}
    firsts, bases = [], []
    for p in prompts:
        cache, first = prefill_cache(runner, p, rows + k + 2)
        bases.append(cache)
        firsts.append(first)
    pending = firsts
    for _ in range(max(1, rows // (k + 1))):
        starts = [b.length for b in bases]
        work = {m: [clone(b) for b in bases] for m in modes}
        windows, refs = [], []
        for i, b in enumerate(bases):  # the steps: each token's logits, then the next token
            w, ls, x = [], [], pending[i]
            for _ in range(k + 1):
                w.append(x)
                lg, _ = runner.step([x], b.length, b)
                ls.append(lg)
                x = int(lg[-1].argmax())
            windows.append(w)
            refs.append(torch.cat(ls))
            pending[i] = x
        for m in modes:
            items = [SeqBatchItem(torch.tensor(w), torch.arange(s0, s0 + k + 1), c, logits="all",
                                  bitwise=m == "bitwise")
                     for w, s0, c in zip(windows, starts, work[m])]
            for b, c, s0, lv, ls in zip(bases, work[m], starts, runner.forward(items), refs):
                out[m].add(_distance(b, c, s0, k + 1, lv, ls))
    return out


def _distance(ref: KVCache, got: KVCache, start: int, n: int, lv: torch.Tensor,
              ls: torch.Tensor) -> Distance:
    d = Distance(rows=n)
    d.max_abs_logit = float((lv - ls).abs().max())
    d.logit_rows_differing = int((lv != ls).any(dim=-1).sum())
    kv = torch.zeros(n, dtype=torch.bool)
    for name in ("k", "v"):
        a = getattr(got, name)[:, :, start:start + n]  # [layers, Hkv, n, D]
        r = getattr(ref, name)[:, :, start:start + n]
        kv |= (a != r).any(dim=3).any(dim=1).any(dim=0)
    d.kv_rows_differing = int(kv.sum())
    top2 = ls.float().topk(2, dim=-1).values
    d.min_top2_margin = float((top2[:, 0] - top2[:, 1]).min())
    d.argmax_flips = int((lv.argmax(-1) != ls.argmax(-1)).sum())
    return d
