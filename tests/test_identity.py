"""The headline: VeriCache's greedy output is token-for-token full-KV greedy decoding."""

import pytest
import torch

from conftest import chat_ids
from vericache.engine.generation import Generation, GenParams
from vericache.engine.lanes import run_requests
from vericache.engine.local import generate
from vericache.engine.rounds import LocalBackends

N = 32
SPECS = ["identity", "streamingllm", "snapkv", "kivi", "kivi:bits=4", "snapkv-kivi"]
# Drafting must work, not only the identity of the output. At a fixed k the identity drafter's
# drafts are all accepted (exact, below); the others keep a floor: (acceptance rate, {k: tokens
# per round}) about half the lowest value measured over the three prompts (fp32 CPU, the
# compressors' default ratios): streamingllm 0.74 (tau 4.7 at k=4, 11.75 at k=16), snapkv 1.0
# (4.7, 15.67), kivi 0.55 (4.27, 9.4), kivi:bits=4 1.0 (4.7, 15.67), snapkv-kivi 1.0 (4.7,
# 15.67). A drafter whose drafts stop being accepted fails.
MIN_DRAFTING = {
    "streamingllm": (0.35, {4: 2.3, 16: 5.5}),
    "snapkv": (0.5, {4: 2.3, 16: 7.5}),
    "kivi": (0.25, {4: 2.1, 16: 4.5}),
    "kivi:bits=4": (0.5, {4: 2.3, 16: 7.5}),
    "snapkv-kivi": (0.5, {4: 2.3, 16: 7.5}),
}


@pytest.fixture(scope="module")
def store():
    """One prefix cache for the grid: the second k of a compressor reuses the first one's
    prefill (full and compressed chunks), as a server's later requests do."""
    from vericache.store.memory import MemoryStore

    s = MemoryStore()
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(lm, prompts):
    return {name: generate(lm, ids, GenParams(mode="full", max_tokens=N, ignore_eos=True))
            for name, ids in prompts.items()}


def test_prompts_are_real(prompts, reference):
    assert len(prompts["long"]) >= 2000
    for ref in reference.values():
        assert len(ref.token_ids) == N


def test_full_equals_transformers_generate(lm, prompts, reference):
    from transformers import AutoModelForCausalLM

    from vericache.model.loader import hf_folder_for, resolve_model_path

    folder, _ = hf_folder_for(resolve_model_path(None))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    for name in ("code", "json", "long"):  # the long one: ~2.1k tokens of code
        ids = prompts[name]
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(ids):].tolist() == reference[name].token_ids, name


# every compressor once, k = 4 and 16 both present, the identity drafter at both (its rounds
# are exact: k + 1 tokens)
GRID = [("identity", 4), ("identity", 16), ("streamingllm", 16), ("snapkv", 4), ("kivi", 16),
        ("kivi:bits=4", 4), ("snapkv-kivi", 16)]
assert {spec for spec, _ in GRID} == set(SPECS)


@pytest.mark.slow
@pytest.mark.parametrize("spec,k", GRID)
def test_vericache_identical_to_full(lm, prompts, reference, store, spec, k):
    """The output is full-KV greedy decoding's, and drafting works. k is fixed (adaptive off:
    every round drafts k, fewer only where fewer tokens are left), so tokens per round are the
    drafter's own: the identity drafter's k drafts are all accepted, k + 1 tokens a round;
    the others stay above their floors (MIN_DRAFTING). The three prompts run as one batch in
    the serving engine's executor (`run_requests`, lockstep), against references decoded
    one at a time."""
    full_rounds, rest = divmod(N - 1, k + 1)  # the prefill chose the first token
    params = GenParams(mode="vericache", compressor=spec, draft_len=k, adaptive=False,
                       max_tokens=N, ignore_eos=True)
    gens = {name: Generation(lm, ids, params, request_id=name) for name, ids in prompts.items()}
    run_requests(LocalBackends(lm, store), list(gens.values()), "lockstep")
    for name, g in gens.items():
        assert g.output_ids == reference[name].token_ids, (spec, k, name)
        assert g.text.text == reference[name].text
        u, s = g.usage(), g.stats
        assert u["completion_tokens"] == N and u["rounds"] >= 1
        assert 1 <= u["tokens_per_round"] <= k + 1
        assert s.verify_tokens <= s.drafted + u["rounds"]
        print(f"\n{spec} k={k} {name}: tau {s.tokens_per_round:.3f}, "
              f"acceptance {s.acceptance_rate:.3f} ({s.accepted}/{s.drafted}), {s.rounds} rounds")
        if spec == "identity":
            # k + 1 a round; the last round drafts only what is left (rest - 1 drafts)
            assert s.round_emitted == [k + 1] * full_rounds + ([rest] if rest else []), name
            assert s.accepted == s.drafted == N - 1 - s.rounds
            assert s.tokens_per_round == (N - 1) / (full_rounds + (rest > 0))
        else:
            min_rate, min_tau = MIN_DRAFTING[spec]
            assert s.acceptance_rate >= min_rate, (spec, k, name, s.acceptance_rate)
            assert s.tokens_per_round >= min_tau[k], (spec, k, name, s.tokens_per_round)


def test_lossy_mode_runs_on_compressed_cache_only(lm, prompts, reference):
    res = generate(lm, prompts["long"][:1100], GenParams(mode="lossy", compressor="streamingllm",
                                                         ratio=8, max_tokens=N, ignore_eos=True))
    assert len(res.token_ids) == N
    assert res.stats.draft_kv_bytes < res.stats.full_kv_bytes / 3


@pytest.mark.parametrize("mode", ["full", "vericache"])
def test_eos_inside_the_draft_ends_like_full(lm, prompts, mode):
    """A short answer ends with EOS; with the identity drafter the EOS is drafted and verified
    inside a draft. Both end at the same token with finish_reason 'stop'."""
    ids = chat_ids(lm, "Say hello.")
    ref = generate(lm, ids, GenParams(mode="full", max_tokens=200))
    assert ref.finish_reason == "stop" and len(ref.token_ids) < 200
    res = generate(lm, ids, GenParams(mode=mode, compressor="identity", draft_len=16, max_tokens=200))
    assert res.token_ids == ref.token_ids and res.finish_reason == "stop"
    assert lm.eos_token_ids[0] not in res.token_ids


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 17])
def test_max_tokens_inside_the_draft(lm, prompts, max_tokens):
    ids = prompts["code"]
    ref = generate(lm, ids, GenParams(mode="full", max_tokens=max_tokens))
    res = generate(lm, ids, GenParams(mode="vericache", compressor="identity", draft_len=16,
                                      max_tokens=max_tokens))
    assert res.token_ids == ref.token_ids and len(res.token_ids) == max_tokens
    assert res.finish_reason == ref.finish_reason == "length"


def test_stop_string_inside_the_draft(lm, prompts):
    ids = prompts["code"]
    ref = generate(lm, ids, GenParams(mode="full", max_tokens=64, stop=["return"]))
    res = generate(lm, ids, GenParams(mode="vericache", compressor="snapkv", draft_len=16,
                                      max_tokens=64, stop=["return"]))
    assert ref.finish_reason == "stop" and "return" not in ref.text
    assert (res.token_ids, res.text, res.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)


def test_k_equals_one(lm, prompts, reference):
    res = generate(lm, prompts["code"], GenParams(mode="vericache", compressor="streamingllm",
                                                  draft_len=1, max_tokens=N, ignore_eos=True))
    assert res.token_ids == reference["code"].token_ids
    assert res.usage["tokens_per_round"] <= 2


def test_sampling_is_seeded(lm, prompts):
    p = dict(mode="vericache", compressor="snapkv", max_tokens=24, temperature=0.8, seed=7)
    a = generate(lm, prompts["code"], GenParams(**p))
    b = generate(lm, prompts["code"], GenParams(**p))
    assert a.token_ids == b.token_ids
    c = generate(lm, prompts["code"], GenParams(**{**p, "seed": 8}))
    assert c.token_ids != a.token_ids
