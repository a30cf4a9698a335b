"""The selection policies: static, question, verify (see `vericache.select.base` for the words)."""

from __future__ import annotations

import torch

from vericache.errors import InvalidArgument
from vericache.select.base import SelectionPolicy, SelectionState, move_towards, window_votes


class Static(SelectionPolicy):
    """The base set stays: what each chunk's compressor kept, blind to the question."""

    name = "static"
    moves = False


class Question(SelectionPolicy):
    """Classic SnapKV over the whole prompt, once: the prompt's last `window` queries score
    every region token (per layer and KV head, summed over the group's query heads, max-pooled
    over `pool` neighbours) and the kept set moves, all at once, to the top of that score."""

    name = "question"

    def __init__(self, window: int = 32, pool: int = 7, **params):
        self.window, self.pool = int(window), int(pool)
        if self.window < 1 or self.pool < 1:
            raise InvalidArgument("selection window and pool must be >= 1", "selection")
        super().__init__(window=self.window, pool=self.pool, **params)

    def question_score(self, state: SelectionState, window_q: list[torch.Tensor],
                       window_pos: torch.Tensor, k_full: torch.Tensor) -> torch.Tensor:
        """[L, Hkv, region_end]: attention mass per window query (rows sum to 1 each)."""
        n = int(window_pos.max()) + 1
        rows = []
        for layer, q in enumerate(window_q):
            votes = window_votes(q, k_full[layer, :, :n].cpu(), window_pos)
            rows.append(votes[:, :state.region_end] / q.shape[1])
        return torch.stack(rows)

    def after_prefill(self, state, window_q, window_pos, k_full, v_full):
        score = self.question_score(state, window_q, window_pos, k_full)
        state.score = score
        return move_towards(state, score, self.pool, None, k_full, v_full)


class Verify(Question):
    """Question-aware at prefill, then verifier-guided (the idea of Vegas and SparseSpec over
    any lossy cache): each verify pass's attention over the full KV is folded into a decayed
    score per position; every `every` rounds, or after a round that accepted under half its
    drafts, the kept set moves towards the score's top by at most `tokens` per layer and KV
    head."""

    name = "verify"
    needs_votes = True

    def __init__(self, window: int = 32, pool: int = 7, every: int = 4, tokens: int = 32,
                 decay: float = 0.8):
        self.every, self.tokens, self.decay = int(every), int(tokens), float(decay)
        if self.every < 1 or self.tokens < 1 or not 0.0 <= self.decay < 1.0:
            raise InvalidArgument("verify selection needs every >= 1, tokens >= 1, 0 <= decay < 1",
                                  "selection")
        super().__init__(window, pool, every=self.every, tokens=self.tokens, decay=self.decay)

    def after_verify(self, state, votes, queries, accepted, drafted, k_full, v_full):
        if votes is None or state.score is None or queries < 1:
            return None
        fresh = votes[:, :, :state.region_end].float().cpu() / queries
        state.score.mul_(self.decay).add_(fresh, alpha=1.0 - self.decay)
        state.rounds += 1
        if state.rounds < self.every and not (drafted and 2 * accepted < drafted):
            return None
        state.rounds = 0
        return move_towards(state, state.score, self.pool, self.tokens, k_full, v_full)
