"""Log probabilities of emitted tokens, as a pure function of full-KV logits.

They are the raw model distribution's (vLLM's default `logprobs_mode=raw_logprobs`):
log_softmax of the raw logits, before logit_bias, penalties, temperature and filters
(`vericache.spec.processors`), so they do not depend on how a token was chosen. They come
only from full-KV logits: the prefill for the first token, the verify pass's row i for the
i-th token a round emits (row a for the bonus), never the drafter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MAX_TOP_LOGPROBS = 20  # alternatives per token at most (OpenAI's top_logprobs limit)


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob), most likely first


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """logits [R, V] (row i: the position of tokens[i]), R >= len(tokens); `top_n` most likely
    alternatives per token (0: none)."""
    n = len(tokens)
    lp = torch.log_softmax(logits[:n].float(), dim=-1)  # [n, V]
    ids = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    if top_n:
        vals, ids = torch.topk(lp, min(top_n, lp.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in range(n)]
    return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)]
