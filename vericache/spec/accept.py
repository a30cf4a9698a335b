"""The accept rule of one round, as pure functions.

Words, defined once:
- draft: the k tokens d_1..d_k the drafter proposed greedily (or sampled) over its lossy KV,
  continuing the verified sequence whose last token is x_0.
- target: the verifier's choice at each of the k + 1 positions after x_0, from ONE forward
  pass of [x_0, d_1, ..., d_k] over the full KV: t_i follows d_1..d_{i-1}.
- accepted prefix: d_1..d_a, the longest prefix with d_i == t_i (greedy), or accepted by the
  speculative-sampling test (sampling).
- bonus: the verifier's own token after the accepted prefix: t_{a+1} (greedy), or a sample
  from the residual distribution at the first rejection, or from p_{k+1} if all were accepted.
- round: one draft + one verify; it emits a + 1 tokens (tau = a + 1), always at least one.

Greedy acceptance makes the output exactly plain full-KV greedy decoding: every emitted token
is the full-KV argmax given the verified tokens before it.
"""

from __future__ import annotations

import torch


def greedy_accept(draft: list[int], target: list[int]) -> tuple[int, int]:
    """Return (a, bonus): a = length of the accepted prefix, bonus = target[a].

    `target` holds k + 1 tokens for k = len(draft) drafts.
    """
    if len(target) != len(draft) + 1:
        raise ValueError(f"need {len(draft) + 1} target tokens, got {len(target)}")
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return a, target[a]


def speculative_accept(draft: list[int], q: torch.Tensor, p: torch.Tensor,
                       generator: torch.Generator) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al.; Chen et al.): lossless in distribution.

    q: [k, V] the drafter's distributions the drafts were sampled from; p: [k + 1, V] the
    verifier's. Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
    rejection sample the bonus from normalise(max(0, p_i - q_i)); if every draft is accepted
    sample the bonus from p_{k+1}. Returns (a, bonus).
    """
    k = len(draft)
    if q.shape[0] != k or p.shape[0] != k + 1:
        raise ValueError(f"q must have {k} rows and p {k + 1}; got {q.shape[0]} and {p.shape[0]}")
    for i, tok in enumerate(draft):
        pi, qi = float(p[i, tok]), float(q[i, tok])
        u = float(torch.rand((), generator=generator))
        if qi > 0 and u < min(1.0, pi / qi):
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]
        return i, int(torch.multinomial(dist, 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))
