"""How far a verify pass is from decode steps: logits and K/V, bit for bit.

Words: the *steps* decode a prompt's continuation one token per pass, as full decoding does
at batch 1 (the reference). A *window* is k+1 consecutive rows of it; the *verify pass* runs
a window in one pass from the cache as it was before the window, as VeriCache's verifier
does with the pending token and k drafts that are all accepted. At batch B the verify pass
holds B sequences' windows at once (each its own prompt and continuation).

A *mode* is how full-KV passes run: "fast" (batched rows) or "bitwise" (items marked
`bitwise`: `Runner._invariant_pass`). Each mode is compared with its own steps (a decode
step of that mode), over the same tokens: the fast steps choose the continuation (greedy),
the bitwise steps follow it.

Per window row (a token position of one sequence) `measure` compares:
- logits: the largest absolute difference, and whether any bit differs;
- the K/V the row wrote, in every layer: whether any bit differs;
- the steps' top-2 margin (how near a tie the reference was), and argmax flips (the verify
  row's argmax differs from the step's: a token VeriCache would have emitted differently).
The steps run once per mode; every k and batch reuses them (a window's cache is the steps'
cache cropped to the window's start).
"""

from __future__ import annotations

import time
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


@dataclass
class Reference:
    """One mode's steps over every prompt: per sequence the tokens fed (row i's input), the
    logits of each row [rows, V], and the cache after them (K/V of every row)."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]
    caches: list[KVCache]
    start: list[int]  # each sequence's first row's cache slot (its prompt length)


def steps(runner: Runner, prompts: list[list[int]], rows: int, bitwise: bool,
          follow: list[list[int]] | None = None) -> Reference:
    """`rows` decode steps of each prompt, one token per pass, batch 1: greedy, or feeding
    `follow`'s tokens (another mode's continuation)."""
    toks, logits, caches, start = [], [], [], []
    for i, p in enumerate(prompts):
        cache, x = prefill_cache(runner, p, rows + 1)
        start.append(cache.length)
        fed, ls = [], []
        for r in range(rows):
            x = follow[i][r] if follow is not None else x
            fed.append(x)
            item = SeqBatchItem(torch.tensor([x]), torch.tensor([cache.length]), cache,
                                bitwise=bitwise)
            lg = runner.forward([item])[0]
            ls.append(lg)
            x = int(lg[-1].argmax())
        toks.append(fed)
        logits.append(torch.cat(ls))
        caches.append(cache)
    return Reference(toks, logits, caches, start)


def verify_distance(runner: Runner, ref: Reference, k: int, batch: int, bitwise: bool) -> Distance:
    """Every window of k+1 rows of `ref` as a verify pass, `batch` sequences a pass (their
    windows side by side), each from the steps' cache cropped to the window's start."""
    out = Distance()
    n, rows = len(ref.tokens), len(ref.tokens[0])
    for b0 in range(0, n, batch):
        seqs = range(b0, min(n, b0 + batch))
        work = {i: clone(ref.caches[i]) for i in seqs}
        for w0 in range(0, rows - k, k + 1):
            items = []
            for i in seqs:
                s0 = work[i].length = ref.start[i] + w0
                items.append(SeqBatchItem(torch.tensor(ref.tokens[i][w0: w0 + k + 1]),
                                          torch.arange(s0, s0 + k + 1), work[i], logits="all",
                                          bitwise=bitwise))
            for i, lv in zip(seqs, runner.forward(items)):
                out.add(_distance(ref.caches[i], work[i], ref.start[i] + w0, k + 1, lv,
                                  ref.logits[i][w0: w0 + k + 1]))
        del work  # before the next group's copies: one group's caches at a time
    return out


def measure(runner: Runner, prompts: list[list[int]], rows: int, ks=(4,), batches=(1,),
            modes: tuple[str, ...] = ("fast", "bitwise"),
            on_cell=None) -> dict[tuple[str, int, int], Distance]:
    """Per (mode, k, batch): the distance of verify passes from that mode's steps over
    `rows` greedy tokens of every prompt (see the module docstring). `on_cell(mode, k, batch,
    distance, seconds)` is called as each cell ends (the steps' time goes to a mode's first)."""
    out, follow = {}, None
    for m in sorted(modes, key=lambda m: m != "fast"):  # the fast steps choose the tokens
        t = time.perf_counter()
        ref = steps(runner, prompts, rows, m == "bitwise", follow)
        follow = ref.tokens
        for k in ks:
            for b in batches:
                out[m, k, b] = d = verify_distance(runner, ref, k, b, m == "bitwise")
                if on_cell is not None:
                    on_cell(m, k, b, d, time.perf_counter() - t)
                t = time.perf_counter()
        del ref
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
