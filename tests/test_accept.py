"""The accept rule: named cases, and speculative sampling's distribution."""

import pytest
import torch

from vericache.spec import DraftLength, greedy_accept, speculative_accept
from vericache.spec.costmodel import PROBE_EVERY

CASES = {
    # name: (draft, target, accepted, bonus)
    "perfect_match": ([5, 6, 7], [5, 6, 7, 8], 3, 8),
    "mismatch_first_token": ([5, 6, 7], [9, 6, 7, 8], 0, 9),
    "mismatch_mid_draft": ([5, 6, 7, 1], [5, 6, 2, 1, 4], 2, 2),
    "mismatch_last_draft": ([5, 6, 7], [5, 6, 3, 8], 2, 3),
    "k_equals_1_accept": ([5], [5, 9], 1, 9),
    "k_equals_1_reject": ([5], [4, 9], 0, 4),
    "empty_draft": ([], [3], 0, 3),
    "match_after_mismatch_ignored": ([1, 2, 3], [1, 0, 3, 4], 1, 0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_accept_cases(name):
    draft, target, a, bonus = CASES[name]
    assert greedy_accept(draft, target) == (a, bonus)


def test_greedy_accept_needs_k_plus_one_targets():
    with pytest.raises(ValueError):
        greedy_accept([1, 2], [1, 2])


def test_draft_length_follows_the_plan_only_when_adaptive():
    d = DraftLength(k_max=16)
    assert d.k == 16 and not d.probe
    d.choose(0)
    assert d.k == 0
    d.choose(99)
    assert d.k == 16  # never above k_max
    for _ in range(40):
        d.update(0, 0)
    assert d.probe  # plain steps for a while: its profile is stale
    d.update(4, 1)
    assert not d.probe and d.profile.reached[:3] == [1, 1, 0] and d.profile.accepted[:2] == [1, 0]
    e, gaps, streak = DraftLength(k_max=16), [], 0
    for _ in range(3000):  # probes that the plan follows with plain steps come ever less often
        if e.probe:
            gaps.append(streak)
            e.update(2, 0)
            streak = 0
        else:
            e.update(0, 0)
            streak += 1
    assert gaps[:5] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY, 16 * PROBE_EVERY]
    assert set(gaps[5:]) == {16 * PROBE_EVERY}
    e.update(2, 2)  # drafting again (not a probe): probes start over at PROBE_EVERY
    e.update(2, 2)
    assert e.probe_every == PROBE_EVERY
    fixed = DraftLength(k_max=8, adaptive=False)
    fixed.choose(2)
    assert fixed.k == 8


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("seed", [0, 1])
def test_speculative_sampling_matches_target_distribution(seed):
    """First emitted token of a round: distributed exactly as p_1, whatever the draft q."""
    g = torch.Generator().manual_seed(seed)
    V, k, N = 6, 3, 20000
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, dim=-1)
    counts = torch.zeros(V)
    for _ in range(N):
        draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        a, bonus = speculative_accept(draft, q, p, g)
        first = draft[0] if a >= 1 else bonus
        counts[first] += 1
    # chi-square with V-1 = 5 degrees of freedom: 20.5 is the 0.999 quantile
    assert _chi2(counts, p[0]) < 20.5


def test_speculative_sampling_second_token_conditional():
    """Given the first token was a draft d_1, the second is distributed as p_2."""
    g = torch.Generator().manual_seed(3)
    V, N = 5, 30000
    p = torch.softmax(torch.randn(3, V, generator=g), dim=-1)
    q = torch.softmax(torch.randn(2, V, generator=g), dim=-1)
    counts = torch.zeros(V)
    for _ in range(N):
        draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        a, bonus = speculative_accept(draft, q, p, g)
        if a >= 1:
            counts[draft[1] if a >= 2 else bonus] += 1
    assert _chi2(counts, p[1]) < 18.5  # 4 dof, 0.999


def test_identical_draft_is_always_accepted():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 7, generator=g), dim=-1)
    for _ in range(200):
        draft = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(3)]
        a, _ = speculative_accept(draft, p[:3], p, g)
        assert a == 3
