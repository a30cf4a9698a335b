"""Compressors on the real model's KV: budget, shapes, positions, prefix-causality, bytes."""

import math

import pytest
import torch

from vericache.compress import KVSpan, compressor_names, make_compressor
from vericache.engine.prefill import build_draft_cache, compress_prompt, prefill, tail_start
from vericache.errors import InvalidArgument, UnknownName

C = 256


@pytest.fixture(scope="module")
def prefilled(lm, prompts):
    ids = prompts["long"][:1300]  # five chunks and a tail
    return ids, prefill(lm.runner, ids, 8, C, window=16)


def test_registry_lists_every_compressor_and_rejects_unknown():
    assert set(compressor_names()) >= {"identity", "streamingllm", "snapkv", "kivi", "snapkv-kivi"}
    with pytest.raises(UnknownName) as e:
        make_compressor("nope")
    assert "snapkv" in str(e.value) and "identity" in str(e.value)


def test_spec_string_carries_parameters():
    c = make_compressor("kivi:bits=4")
    assert c.bits == 4 and "bits=4" in c.spec
    assert make_compressor("snapkv", ratio=8).ratio == 8
    with pytest.raises(InvalidArgument):
        make_compressor("kivi:bits=3")
    with pytest.raises(InvalidArgument):
        make_compressor("snapkv", ratio=0.5)


@pytest.mark.parametrize("spec,ratio", [("snapkv", 4), ("snapkv", 8), ("streamingllm", 8),
                                        ("identity", None)])
def test_dropping_budget_shapes_positions(prefilled, lm, spec, ratio):
    ids, pre = prefilled
    comp = make_compressor(spec, ratio)
    chunks = compress_prompt(comp, pre, len(ids), C)
    r = lm.runner
    assert len(chunks) * C == tail_start(comp, len(ids), C)
    for i, ch in enumerate(chunks):
        k, v = comp.decompress(ch)
        assert k.shape[:2] == (r.num_layers, r.num_kv_heads) and k.shape[3] == r.head_dim
        assert k.shape == v.shape and k.dtype == torch.float32
        pos = comp.kept_positions(ch)
        assert pos.shape == k.shape[:3]
        assert ((pos >= i * C) & (pos < (i + 1) * C)).all()  # positions stay the original ones
        if spec == "snapkv":
            assert k.shape[2] == math.ceil(C / ratio)
            assert (pos.diff(dim=-1) > 0).all()  # sorted, no duplicates
            # the kept keys are exactly the full keys at those positions (keys already rotated)
            full_k, _ = pre.cache.view(i * C, (i + 1) * C)
            idx = (pos - i * C).unsqueeze(-1).expand(*pos.shape, r.head_dim)
            assert torch.equal(torch.gather(full_k, 2, idx), k)
        if spec == "identity":
            assert k.shape[2] == C
    if spec == "streamingllm":
        kept = sum(comp.decompress(c)[0].shape[2] for c in chunks) + len(ids) - len(chunks) * C
        assert kept <= math.ceil(len(ids) / ratio) + C  # sinks + window (+ chunk rounding)


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_error_and_bytes(prefilled, lm, bits):
    ids, pre = prefilled
    comp = make_compressor(f"kivi:bits={bits}")
    k, v = pre.cache.view(0, C)
    ch = comp.compress(KVSpan(k, v, 0))
    k2, v2 = comp.decompress(ch)
    assert k2.shape == k.shape and v2.shape == v.shape
    # per-group min/max quantization: error at most half a step of the group's range
    rel_k = ((k2 - k).abs().amax() / (k.amax() - k.amin())).item()
    assert rel_k <= 0.5 / (2 ** bits - 1) + 1e-3
    full_bytes = k.numel() * 4 * 2
    ratio = full_bytes / ch.nbytes()
    assert ratio > (32 / bits) * 0.6, ratio  # codes dominate; fp16 scales cost the rest
    assert ratio < 32 / bits


def test_snapkv_kivi_combines_both(prefilled):
    ids, pre = prefilled
    comp = make_compressor("snapkv-kivi", ratio=4)
    chunks = compress_prompt(comp, pre, len(ids), C)
    k, v = comp.decompress(chunks[0])
    assert k.shape[2] == C // 4
    snap = make_compressor("snapkv", ratio=4)
    assert chunks[0].nbytes() < snap.compress(KVSpan(*pre.cache.view(0, C), 0, pre.obs_q[0])).nbytes() / 4


@pytest.fixture(scope="module")
def two_prompts(lm, prompts):
    """Prefills of two prompts that share the first 512 tokens and differ after, one pair per
    observation window (compressors with the same window share it)."""
    base = prompts["long"][:512]
    a, b = base + prompts["code"], base + prompts["json"] + prompts["code"]
    memo: dict[int, tuple] = {}

    def get(window: int):
        if window not in memo:
            memo[window] = prefill(lm.runner, a, 0, C, window), prefill(lm.runner, b, 0, C, window)
        return memo[window]

    return get


@pytest.mark.parametrize("spec", ["identity", "streamingllm", "snapkv", "kivi", "snapkv-kivi"])
def test_prefix_causal(two_prompts, spec):
    """A chunk compresses the same whatever follows it: compress it from two prompts that
    share the first 512 tokens and differ after."""
    comp = make_compressor(spec)
    pa, pb = two_prompts(comp.observation_window)
    for i in range(2):
        ca = comp.compress(KVSpan(*pa.cache.view(i * C, (i + 1) * C), i * C, pa.obs_q.get(i)))
        cb = comp.compress(KVSpan(*pb.cache.view(i * C, (i + 1) * C), i * C, pb.obs_q.get(i)))
        assert ca.tensors.keys() == cb.tensors.keys()
        for name in ca.tensors:
            assert torch.equal(ca.tensors[name], cb.tensors[name]), (spec, i, name)


def test_draft_cache_is_chunks_then_exact_tail(prefilled, lm):
    ids, pre = prefilled
    comp = make_compressor("snapkv", ratio=4)
    chunks = compress_prompt(comp, pre, len(ids), C)
    d = build_draft_cache(comp, chunks, pre.cache, len(ids), C, 10)
    kept = sum(comp.decompress(c)[0].shape[2] for c in chunks)
    tail = len(ids) - len(chunks) * C
    assert d.length == kept + tail and tail >= comp.recent
    assert torch.equal(d.k[:, :, kept:d.length], pre.cache.k[:, :, len(ids) - tail:len(ids)])
    assert d.capacity >= d.length + 10


@pytest.mark.parametrize("spec", compressor_names())
def test_the_drafter_budget_charges_what_the_drafter_holds(prefilled, lm, spec):
    """`drafter_tokens` (what the drafter's KV budget is charged) is the length of the draft
    cache that prefill builds: kept tokens of every compressed chunk plus the exact tail."""
    from vericache.engine.prefill import drafter_tokens

    ids, pre = prefilled
    comp = make_compressor(spec)
    for n in (len(ids), 700, 300):
        chunks = compress_prompt(comp, pre, n, C)
        d = build_draft_cache(comp, chunks, pre.cache, n, C, 0)
        assert drafter_tokens(comp, n, C) == d.length, (spec, n)
