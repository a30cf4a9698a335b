"""Exactness by construction: with `exact="bitwise"` a verify pass equals decode steps bit for
bit (logits and the K/V written), at batch 1 (fp32, bf16, fp16) and 16 (fp32, bf16); and
VeriCache's output in that mode is full decoding's in that mode. In float32 on CPU the fast
mode is batch-invariant too, through the native kernels (their rows' sums are placed by the
row alone), and bitwise passes the kernels serve run in it; with torch's products and SDPA
it is not, unless this CPU's GEMM is (AMX's bfloat16 one was). Elsewhere the fast mode's distance is
measured, not asserted (benchmarks/exactness.py reports it)."""

from __future__ import annotations

import pytest

from conftest import chat_ids, long_code_prompt
from vericache.bench.exactness import measure
from vericache.engine.generation import GenParams
from vericache.engine.local import generate
from vericache.errors import InvalidArgument

pytestmark = pytest.mark.slow  # bf16 on CPU: minutes; scheduled first


def _products_row_invariant(r) -> bool:
    """Whether torch's product with the runner's first qkv weight gives each of 32 rows the
    bits it gets alone (a CPU's GEMM may: AMX's bfloat16 one did)."""
    import torch
    import torch.nn.functional as F

    w = r.layers[0].w_qkv
    x = torch.randn(32, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    return torch.equal(F.linear(x, w), torch.cat([F.linear(x[i: i + 1], w) for i in range(32)]))


@pytest.fixture(scope="module")
def lm_bf16():
    from vericache.model.loader import load_model

    return load_model(None, dtype="bfloat16", device="cpu")


@pytest.fixture(scope="module")
def lm_fp16():
    from vericache.model.loader import load_model

    return load_model(None, dtype="float16", device="cpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_bitwise_verify_pass_equals_decode_steps(lm, lm_bf16, lm_fp16, dtype):
    """Batch 1: two verify passes of 8 rows each equal to their decode steps, bit for bit,
    logits and K/V. Only the bitwise mode is run: the fast mode's distance is
    `test_bitwise_is_batch_invariant`'s to assert and benchmarks/exactness.py's to report."""
    model = {"float32": lm, "bfloat16": lm_bf16, "float16": lm_fp16}[dtype]
    prompt = long_code_prompt(model, 400)
    bit = measure(model.runner, [prompt], rows=16, ks=(7,), modes=("bitwise",))["bitwise", 7, 1]
    print(dtype, "bitwise:", bit.as_dict())
    assert bit.rows == 16
    assert bit.max_abs_logit == 0 and bit.logit_rows_differing == 0
    assert bit.kv_rows_differing == 0 and bit.argmax_flips == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bitwise_is_batch_invariant(lm, lm_bf16, dtype):
    """16 sequences in one verify pass (rows of every count: 2 and 4 a sequence, 32 and 64 a
    pass, in float32; 8 sequences, 4 rows a sequence, 32 a pass, in bf16, whose torch products
    take minutes on CPUs without AVX512-BF16), each equal to its own decode steps at batch 1.
    The fast pass is too in float32 on CPU, where the native kernels serve it; with torch's
    products and SDPA (bf16, or the kernels off) it is not, unless torch's products are
    themselves row-invariant on this CPU (its bfloat16 products on AMX were)."""
    model = lm if dtype == "float32" else lm_bf16
    n = 16 if dtype == "float32" else 8
    prompts = [chat_ids(model, f"Write the number {i} in words, then in Roman numerals.")
               for i in range(n)]
    r = model.runner
    native = r.linear_kernel is not None and r.attend_kernel is not None
    assert native == (dtype == "float32")
    ks = (1, 3) if native else (3,)
    d = measure(r, prompts, rows=4, ks=ks, batches=(n,))
    for k in ks:
        bit, fast = d["bitwise", k, n], d["fast", k, n]
        assert bit.rows == 4 * n
        assert bit.max_abs_logit == 0 and bit.logit_rows_differing == 0
        assert bit.kv_rows_differing == 0
        if native:
            assert fast.max_abs_logit == 0 and fast.kv_rows_differing == 0
        elif not _products_row_invariant(r):
            assert fast.logit_rows_differing > 0  # what the invariant pass removes
    if native:  # the same runner on torch's products and SDPA
        kernels = r.linear_kernel, r.attend_kernel
        r.linear_kernel = r.attend_kernel = None
        try:
            d = measure(r, prompts, rows=4, ks=(3,), batches=(16,))
        finally:
            r.linear_kernel, r.attend_kernel = kernels
        assert d["fast", 3, 16].logit_rows_differing > 0


@pytest.fixture(scope="module")
def bf16_full_bitwise(lm_bf16):
    """A 400-token code prompt and full decoding's 20 tokens over it in bf16, bitwise."""
    prompt = long_code_prompt(lm_bf16, 400)
    return prompt, generate(lm_bf16, prompt, GenParams(mode="full", max_tokens=20,
                                                       ignore_eos=True, exact="bitwise"))


@pytest.mark.parametrize("selection", ["question", "verify:every=1"])
def test_vericache_bitwise_equals_full_bitwise_in_bf16(lm_bf16, bf16_full_bitwise, selection):
    """In bf16, where fast passes differ from steps in low bits, the bitwise mode's output is
    full decoding's token for token, and drafting ran (tokens per round > 1). With `verify`
    the verify passes also return attention votes (computed beside the invariant rows)."""
    prompt, ref = bf16_full_bitwise
    out = generate(lm_bf16, prompt, GenParams(mode="vericache", max_tokens=20, ignore_eos=True,
                                              exact="bitwise", draft_len=8, adaptive=False,
                                              selection=selection))
    assert out.token_ids == ref.token_ids
    assert out.stats.rounds < 20 / 1.5  # drafts were accepted: > 1.5 tokens a round
    if selection != "question":
        assert out.stats.select_moves > 1  # the votes moved the drafter's set


def test_exact_takes_fast_or_bitwise():
    GenParams(exact="bitwise")
    with pytest.raises(InvalidArgument, match="exact"):
        GenParams(exact="exactly")


def test_bitwise_runs_in_the_fast_pass_where_the_kernels_make_it_invariant(lm, monkeypatch):
    """float32 on CPU: a bitwise verify pass (asking for votes or not) and the decode steps
    over the same tokens run in the fast pass (the native kernels place every row's sums by
    the row alone), and agree bit for bit, logits and K/V; a bitwise pass the kernels do not serve whole (a chunk of more
    than KERNEL_ROWS rows) still takes the invariant pass."""
    import torch

    from vericache.model.runner import KERNEL_ROWS, SeqBatchItem

    r = lm.runner
    calls, invariant = [], r._invariant_pass
    monkeypatch.setattr(r, "_invariant_pass",
                        lambda items: (calls.append(len(items)), invariant(items))[1])
    prompt = long_code_prompt(lm, 400)
    n = len(prompt)

    def cache():
        c = r.new_cache(n + 8)
        r.step(prompt[:-8], 0, c, logits="none")
        return c

    def item(lo, hi, c, votes=False):
        return SeqBatchItem(torch.tensor(prompt[lo:hi]), torch.arange(lo, hi), c, "all",
                            bitwise=True, votes=votes)

    one, each, voting = cache(), cache(), cache()
    verify = r.forward([item(n - 8, n, one)])[0]
    steps = torch.cat([r.forward([item(i, i + 1, each)])[0] for i in range(n - 8, n)])
    # a `verify` policy's pass: votes asked, the same bits, in the fast pass too
    voted = item(n - 8, n, voting, votes=True)
    assert torch.equal(r.forward([voted])[0], steps)
    assert calls == []
    assert torch.equal(verify, steps)
    assert all(torch.equal(a, b) for a, b in zip(one.view(), each.view()))
    assert torch.allclose(voted.attn_votes.sum(-1), torch.full((r.num_layers, r.num_kv_heads),
                                                               8.0 * r.group))
    r.forward([item(0, KERNEL_ROWS + 1, r.new_cache(KERNEL_ROWS + 8))])
    assert calls == [1]


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_bitwise_through_the_offloaded_tier(lm, kernels):
    """Bitwise passes read the offloaded tier's working copies (layers that land while they
    compute) as they read a resident cache: VeriCache over the tier, bitwise, is resident
    full decoding, bitwise, token for token, and every verify pass but the first (on the
    prefilled KV) loaded the KV; in the fast pass (native kernels) and in the invariant pass
    (torch's products and SDPA)."""
    from vericache.engine.kvtier import make_tier
    from vericache.engine.rounds import LocalBackends

    r = lm.runner
    saved = r.linear_kernel, r.attend_kernel
    if kernels == "torch":
        r.linear_kernel = r.attend_kernel = None
    try:
        prompt = long_code_prompt(lm, 600)
        ref = generate(lm, prompt, GenParams(mode="full", max_tokens=16, ignore_eos=True,
                                             exact="bitwise"))
        tier = make_tier("offloaded", link_gbps=200.0)
        try:
            out = generate(lm, prompt, GenParams(mode="vericache", max_tokens=16,
                                                 ignore_eos=True, exact="bitwise", draft_len=6,
                                                 adaptive=False),
                           LocalBackends(lm, tier=tier))
        finally:
            tier.close()
    finally:
        r.linear_kernel, r.attend_kernel = saved
    assert out.token_ids == ref.token_ids
    assert tier.stats.loads == out.stats.rounds - 1 > 0
