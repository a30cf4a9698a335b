"""The offloaded full-KV tier: outputs identical to resident decoding, every byte counted."""

import pytest

from vericache.engine.generation import GenParams
from vericache.engine.kvtier import make_tier
from vericache.engine.local import generate
from vericache.engine.rounds import LocalBackends

N = 24


@pytest.fixture(scope="module")
def ids(prompts):
    return prompts["long"][:700]


@pytest.fixture(scope="module")
def reference(lm, ids):
    return generate(lm, ids, GenParams(mode="full", max_tokens=N, ignore_eos=True))


@pytest.mark.parametrize("mode", ["full", "vericache"])
def test_offloaded_identical_to_resident(lm, ids, reference, mode):
    tier = make_tier("offloaded", link_gbps=200.0)
    try:
        res = generate(lm, ids, GenParams(mode=mode, max_tokens=N, ignore_eos=True, draft_len=6),
                       LocalBackends(lm, tier=tier))
    finally:
        tier.close()
    assert res.token_ids == reference.token_ids
    st, per_tok = tier.stats, lm.runner.kv_bytes_per_token()
    rounds = res.stats.rounds
    assert st.loads == rounds
    # every verify pass loaded the whole KV so far: at least the prompt's
    assert st.bytes_loaded >= rounds * len(ids) * per_tok
    # prefill stored the prompt; each round wrote back its kept tokens (emitted, but the last)
    assert st.bytes_stored == (len(ids) + N - 1) * per_tok
    assert 0 <= st.stall_s <= st.transfer_s + 1.0


def test_make_tier_rejects_bad_names_and_rates():
    assert make_tier("resident") is None
    with pytest.raises(ValueError, match="resident, offloaded"):
        make_tier("disk")
    with pytest.raises(ValueError):
        make_tier("offloaded", 0)
