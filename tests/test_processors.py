"""Logits processing (`vericache.spec.processors`): named cases against hand-computed values
and transformers' own processor, the speculative accept rule's distribution under each
processor (chi-square), and greedy decoding with penalties and logit_bias on the real model:
vericache mode equals full mode, full mode equals transformers' generate."""

import math

import pytest
import torch

from vericache.engine.generation import GenParams
from vericache.engine.local import generate
from vericache.errors import InvalidArgument
from vericache.spec import speculative_accept
from vericache.spec.processors import Processing, TokenHistory, choose, penalize, process, target

NEG = -math.inf

# name: (processing, raw logits [V], prompt, generated, processed logits [V])
PENALTY_CASES = {
    "repetition_divides_positive_multiplies_negative": (
        Processing(repetition_penalty=2.0), [2.0, -2.0, 1.0, 3.0], [0], [1], [1.0, -4.0, 1.0, 3.0]),
    "frequency_counts_generated_only": (
        Processing(frequency_penalty=0.5), [1.0, 1.0, 1.0, 1.0], [3], [1, 1, 2], [1.0, 0.0, 0.5, 1.0]),
    "presence_once_per_generated_token": (
        Processing(presence_penalty=0.7), [1.0, 1.0, 1.0, 1.0], [3], [1, 1, 2], [1.0, 0.3, 0.3, 1.0]),
    "logit_bias_adds_by_id": (
        Processing(logit_bias={0: -100.0, 2: 5.0}), [1.0, 2.0, 3.0, 4.0], [], [], [-99.0, 2.0, 8.0, 4.0]),
    "bias_then_repetition": (  # vLLM: logit_bias first, then the penalties
        Processing(logit_bias={1: 4.0}, repetition_penalty=2.0), [1.0, -2.0, 0.0, 0.0], [], [1],
        [1.0, 1.0, 0.0, 0.0]),
    "neutral_changes_nothing": (Processing(), [1.0, -2.0, 0.5, 0.0], [0], [1], [1.0, -2.0, 0.5, 0.0]),
}


@pytest.mark.parametrize("name", sorted(PENALTY_CASES))
def test_penalty_cases(name):
    p, logits, prompt, generated, want = PENALTY_CASES[name]
    h = TokenHistory(prompt, 4, p)
    h.extend(generated)
    got = process(torch.tensor([logits]), p, h)[0]
    assert torch.allclose(got, torch.tensor(want)), got


def test_row_context_holds_the_drafts_before_it():
    """Row i of a verify pass counts d_1..d_i: the drafter's step i sees the same context."""
    p = Processing(presence_penalty=1.0, frequency_penalty=0.5)
    h = TokenHistory([], 4, p)
    h.extend([2])
    rows = process(torch.zeros(3, 4), p, h, [1, 1])
    assert rows.tolist() == [[0, 0, -1.5, 0], [0, -1.5, -1.5, 0], [0, -2.0, -1.5, 0]]
    g = torch.Generator()
    for i, drafts in enumerate(([], [1], [1, 1])):  # greedy steps: the argmax avoids penalised ids
        logits = torch.tensor([0.0, 1.9, 1.0, 0.5])
        tok, _ = choose(logits, p, h, drafts, g)
        assert tok == [1, 3, 3][i]  # 1.9 - 1.5 < 0.5 once d_1 = 1 is in the context
        assert torch.equal(penalize(logits[None], p, h.row_counts(drafts)[-1:], h.prompt_mask),
                           process(logits.expand(i + 1, 4), p, h, drafts)[-1:])


def test_repetition_penalty_equals_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=g) * 3
    prompt, generated = [3, 7, 7, 11], [11, 20, 42]
    p = Processing(repetition_penalty=1.3)
    h = TokenHistory(prompt, 50, p)
    h.extend(generated)
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + generated]), logits.clone())
    assert torch.allclose(process(logits, p, h), want)


# name: (processing, probabilities of the raw logits at temperature 1, kept tokens)
FILTER_CASES = {
    "top_k_2": (Processing(1.0, top_k=2), [0.5, 0.3, 0.15, 0.05], [0, 1]),
    "top_k_ties_kept": (Processing(1.0, top_k=1), [0.4, 0.4, 0.2], [0, 1]),
    "top_p_needs_the_second": (Processing(1.0, top_p=0.6), [0.5, 0.3, 0.2], [0, 1]),
    "top_p_reached_by_the_first": (Processing(1.0, top_p=0.5), [0.5, 0.3, 0.2], [0]),
    "top_p_tiny_keeps_the_best": (Processing(1.0, top_p=1e-6), [0.2, 0.5, 0.3], [1]),
    "min_p_half_of_the_best": (Processing(1.0, min_p=0.5), [0.5, 0.3, 0.2], [0, 1]),
    "min_p_1_keeps_the_best": (Processing(1.0, min_p=1.0), [0.2, 0.5, 0.3], [1]),
}


@pytest.mark.parametrize("name", sorted(FILTER_CASES))
def test_filter_cases(name):
    p, probs, kept = FILTER_CASES[name]
    probs = torch.tensor([probs])
    got = target(probs.log(), p)[0]
    want = torch.zeros_like(probs[0])
    want[kept] = probs[0, kept] / probs[0, kept].sum()
    assert torch.allclose(got, want, atol=1e-6), got


@pytest.mark.parametrize("kw,param", [
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.1}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),  # (found by the HTTP fuzz: nan)
    ({"repetition_penalty": 1e4}, "repetition_penalty"),
    ({"logit_bias": {5: 101.0}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
])
def test_out_of_range_names_the_parameter(kw, param):
    with pytest.raises(InvalidArgument) as e:
        Processing(**kw)
    assert e.value.param == param
    with pytest.raises(InvalidArgument) as e:  # GenParams checks the same way
        GenParams(**kw)
    assert e.value.param == param


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of `counts` against `probs` (cells of probability 0 must stay
    empty): the probability of a statistic at least this large."""
    assert counts[probs == 0].sum() == 0, "a token the target excludes was emitted"
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))


PROCESSORS = {
    "top_k": Processing(1.0, top_k=4),
    "top_p": Processing(0.9, top_p=0.8),
    "min_p": Processing(1.2, min_p=0.15),
    "presence_penalty": Processing(1.0, presence_penalty=1.5),
    "frequency_penalty": Processing(1.0, frequency_penalty=1.2),
    "repetition_penalty": Processing(1.0, repetition_penalty=1.8),
    "logit_bias": Processing(1.0, logit_bias={0: 2.0, 5: -100.0}),
    "all_together": Processing(0.8, top_k=6, top_p=0.95, min_p=0.02, presence_penalty=0.5,
                               frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={1: 1.0}),
}


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_speculative_sampling_gives_the_processed_target(name):
    """A round of k = 2 with processed drafts (q) and processed verifier rows (p), each row
    with its own context (the raw logits depend on the position only): the first emitted token is distributed as the processed target of
    position 1 (context: the generated tokens), and the second, given d_1 = t was accepted,
    as the processed target of position 2 with t in its context."""
    proc = PROCESSORS[name]
    g = torch.Generator().manual_seed(11)
    V, N = 8, 20000
    raw_q = torch.randn(2, V, generator=g) * 1.5  # the drafter's raw logits, position by position
    raw_p = torch.randn(3, V, generator=g) * 1.5  # the verifier's
    prompt, generated = [1, 2, 2], [2, 3, 3, 4]
    hist = TokenHistory(prompt, V, proc)
    hist.extend(generated)
    # every context of this two-draft round, computed once: the drafter's q_1 and q_2(d_1)
    # (from the drafter's own step function), the verifier's processed rows p(d_1, d_2)
    q1 = choose(raw_q[0], proc, hist, [], g)[1]
    q2 = torch.stack([choose(raw_q[1], proc, hist, [t], g)[1] for t in range(V)])
    p = [[target(process(raw_p, proc, hist, [a, b]), proc) for b in range(V)] for a in range(V)]
    d1 = torch.multinomial(q1, N, replacement=True, generator=g).tolist()
    d2 = [int(torch.multinomial(q2[a], 1, generator=g)) for a in d1]
    first, second = torch.zeros(V), torch.zeros(V, V)
    for a1, a2 in zip(d1, d2):
        a, bonus = speculative_accept([a1, a2], torch.stack([q1, q2[a1]]), p[a1][a2], g)
        first[a1 if a >= 1 else bonus] += 1
        if a >= 1:
            second[a1, a2 if a >= 2 else bonus] += 1
    want1 = target(process(raw_p[:1], proc, hist), proc)[0]
    p1 = _p_value(first, want1)
    t = int(second.sum(dim=1).argmax())  # the most frequent accepted d_1
    want2 = target(process(raw_p[:2], proc, hist, [t]), proc)[1]
    p2 = _p_value(second[t], want2)
    print(f"{name}: p-value first token {p1:.3f}, second token given d_1={t} "
          f"({int(second[t].sum())} rounds) {p2:.3f}")
    assert p1 > 1e-3 and p2 > 1e-3


# ---- the real model: greedy with penalties and logit_bias --------------------------------
N_TOKENS = 32
PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3,
                 logit_bias={"13": -3.0, "198": 1.5})  # ids as JSON sends them: "." and "\n"


@pytest.fixture(scope="module")
def penalised_full(lm, prompts):
    return {name: generate(lm, prompts[name], GenParams(mode="full", max_tokens=N_TOKENS,
                                                        ignore_eos=True, logprobs=2, **PENALTIES))
            for name in ("code", "json")}


@pytest.mark.parametrize("spec,k", [("snapkv", 4), ("streamingllm", 8), ("kivi", 16)])
def test_greedy_with_penalties_vericache_equals_full(lm, prompts, penalised_full, spec, k):
    plain = generate(lm, prompts["code"], GenParams(mode="full", max_tokens=N_TOKENS, ignore_eos=True))
    assert plain.token_ids != penalised_full["code"].token_ids  # the penalties change the output
    for name, ref in penalised_full.items():
        res = generate(lm, prompts[name], GenParams(
            mode="vericache", compressor=spec, draft_len=k, adaptive=False, max_tokens=N_TOKENS,
            ignore_eos=True, logprobs=2, **PENALTIES))
        assert res.token_ids == ref.token_ids, name
        assert res.usage["tokens_per_round"] > 1  # drafts were accepted under the penalties
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(res.logprobs, ref.logprobs))
        print(f"{spec} k={k} {name}: logprob max diff {diff:.2e}")
        assert diff < 1e-3


def test_full_with_repetition_penalty_equals_transformers(lm, prompts):
    from transformers import AutoModelForCausalLM

    from vericache.model.loader import hf_folder_for, resolve_model_path

    folder, _ = hf_folder_for(resolve_model_path(None))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ids = prompts["code"]
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=N_TOKENS, do_sample=False, repetition_penalty=1.3,
                      eos_token_id=None, pad_token_id=0)
    res = generate(lm, ids, GenParams(mode="full", max_tokens=N_TOKENS, ignore_eos=True,
                                      repetition_penalty=1.3))
    plain = generate(lm, ids, GenParams(mode="full", max_tokens=N_TOKENS, ignore_eos=True))
    assert out[0, len(ids):].tolist() == res.token_ids != plain.token_ids


def test_a_tiny_temperature_samples_the_argmax_not_nan():
    """A temperature below fp32's reach (OpenAI accepts any >= 0) samples at MIN_TEMPERATURE:
    a one-hot on the argmax, never a nan from 0 / 0 (found by the HTTP fuzz test)."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    probs = target(logits, Processing(temperature=9.8e-150))
    assert not probs.isnan().any() and probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
