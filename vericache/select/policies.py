"""The selection policies: static, question, verify (see `vericache.select.base` for the words)."""

from __future__ import annotations

import torch

from vericache.errors import InvalidArgument
from vericache.select.base import BITS, SelectionPolicy, SelectionState, move, pooled


class Static(SelectionPolicy):
    """The base set stays: what each chunk's compressor kept, blind to the question."""

    name = "static"
    moves = False


class Question(SelectionPolicy):
    """Classic SnapKV over the whole prompt, once: the prompt's last `window` queries score
    every region token (per layer and KV head, summed over the group's query heads, pooled
    over `pool` neighbours by their mean, or with avg=0 their max) and the kept set moves,
    at once, to the top of that score: all the way, or by at most `first` tokens per layer
    and KV head (the best-scored entering first), which bounds the move's bytes where it
    crosses a slow link. `bits`: how a move's entering K/V go, 8 (the default: 8-bit
    values, `vericache.select.base.to_8bit`, a quarter of float32's bytes on a link; the
    drafter is lossy already, and its drafts are verified) or 32 (the full KV's own values).
    8 is the default by measurement: it changed no τ of the snapkv probes
    (docs/performance.md, sixteenth session) and moves a quarter of the bytes.
    Mean pooling over 5 is the default (SnapKV's reference code pools so): at 16 x 8k it
    raised τ from 15.03 to 16.0 over max pooling over 7 (docs/performance.md, eighteenth
    session)."""

    name = "question"

    def __init__(self, window: int = 32, pool: int = 5, first: int = 0, bits: int = 8,
                 avg: int = 1, **params):
        self.window, self.pool, self.first, self.bits = int(window), int(pool), int(first), int(bits)
        self.avg = int(avg)
        if (self.window < 1 or self.pool < 1 or self.first < 0 or self.bits not in BITS
                or self.avg not in (0, 1)):
            raise InvalidArgument("selection window and pool must be >= 1, first >= 0 (0: no "
                                  "bound), bits 32 or 8, avg 0 or 1", "selection")
        # a default shows not in the spec (so `question` reads as it did before first, bits, avg)
        if self.first:
            params["first"] = self.first
        if self.bits != 8:
            params["bits"] = self.bits
        if not self.avg:
            params["avg"] = self.avg
        super().__init__(window=self.window, pool=self.pool, **params)

    def after_prefill(self, state, votes, queries, k_full, v_full):
        # the score: attention mass per window query (each query's row sums to 1)
        score = votes[:, :, :state.region_end].float().cpu() / queries
        state.score = score
        return move(state, self.pooled(score), 1, self.first or None, k_full, v_full, self.bits,
                    self.prefill_fill(state))

    def prefill_fill(self, state: SelectionState) -> int | None:
        """A salient set's entries the move after prefill may fill (None: all of them)."""
        return None

    def pooled(self, score: torch.Tensor) -> torch.Tensor:
        """The score a move ranks by: pooled over `pool` neighbours, by max (or mean: avg=1)."""
        return pooled(score, self.pool, bool(self.avg))


class Verify(Question):
    """Question-aware at prefill, then verifier-guided (the idea of Vegas and SparseSpec over
    any lossy cache): each verify pass's attention over the full KV is folded into a decayed
    score per position; every `every` rounds, or after a round that accepted under half its
    drafts, the kept set moves towards the score's top by at most `tokens` per layer and KV
    head (`first` and `bits` as for `question`). A salient set (KIVI: it only grows) fills
    half its budget after prefill and the rest from these moves; once it is full the verifier
    asks for no more votes (`SelectionState.full`)."""

    name = "verify"
    needs_votes = True

    def __init__(self, window: int = 32, pool: int = 5, every: int = 4, tokens: int = 32,
                 decay: float = 0.8, first: int = 0, bits: int = 8, avg: int = 1):
        self.every, self.tokens, self.decay = int(every), int(tokens), float(decay)
        if self.every < 1 or self.tokens < 1 or not 0.0 <= self.decay < 1.0:
            raise InvalidArgument("verify selection needs every >= 1, tokens >= 1, 0 <= decay < 1",
                                  "selection")
        super().__init__(window, pool, first, bits, avg, every=self.every, tokens=self.tokens,
                         decay=self.decay)

    def after_verify(self, state, votes, queries, accepted, drafted, k_full, v_full):
        if votes is None or state.score is None or queries < 1:
            return None
        fresh = votes[:, :, :state.region_end].float().cpu() / queries
        state.score.mul_(self.decay).add_(fresh, alpha=1.0 - self.decay)
        state.rounds += 1
        if state.rounds < self.every and not (drafted and 2 * accepted < drafted):
            return None
        state.rounds = 0
        return move(state, self.pooled(state.score), 1, self.tokens, k_full, v_full, self.bits)

    def prefill_fill(self, state: SelectionState) -> int | None:
        return state.budget // 2 if state.salient else None
