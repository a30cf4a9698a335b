"""The native batch attention (`vericache.model.kernels`): built on this machine, equal to
SDPA with the same masks on ragged batches, windows and padding rows, and used by the
runner's fast path with the same logits as SDPA's."""

import pytest
import torch
import torch.nn.functional as F

from vericache.model import kernels


@pytest.fixture(scope="module")
def attend():
    fn = kernels.attend()
    assert fn is not None, "the kernel must build here (a C compiler is part of the set-up)"
    return fn


def _reference(q, k, v, lo, hi, scale):
    """SDPA over each row's range [lo, hi) as a boolean mask; rows that see nothing: 0."""
    B, H, R, D = q.shape
    keys = torch.arange(k.shape[2])
    seen = (keys[None, None, :] >= lo[:, :, None]) & (keys[None, None, :] < hi[:, :, None])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen[:, None] | ~seen.any(-1)[:, None, :, None],
                                         scale=scale)
    return torch.where(seen.any(-1)[:, None, :, None], out, 0.0)


@pytest.mark.parametrize("batch,rows,window,threads", [
    (5, 3, None, 1), (5, 27, None, 2), (5, 9, 40, 2), (5, 64, 300, 1),
    (1, 3, None, 2), (1, 9, 100, 2), (2, 9, None, 3)])  # few tasks: the keys split by thread
def test_kernel_equals_sdpa(attend, batch, rows, window, threads):
    g = torch.Generator().manual_seed(rows)
    B, H, D, cap = batch, 3, 64, 700
    # a pool's slots: k, v strided views ([L, S, H, cap, D] storage, one layer's slots)
    store = torch.randn(2, 2, B + 2, H, cap, D, generator=g)
    k, v = store[0, 1, 1:B + 1], store[1, 1, 1:B + 1]
    q = torch.randn(B, H, rows, D, generator=g)
    past = torch.tensor([600, 17, 350, 0, 129])[:B]
    lq = 3 if rows % 3 == 0 else 1
    l_idx = torch.arange(rows) % lq
    hi = past[:, None] + l_idx[None, :] + 1
    lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
    if B > 1:
        hi[1, :] = 0  # a padding sequence: its rows see nothing
        lo[1, :] = 0
    out = attend(q, k, v, lo, hi, 0.125, threads)
    ref = _reference(q, k, v, lo, hi, 0.125)
    assert float((out - ref).abs().max()) < 2e-5
    if B > 1:
        assert bool((out[1] == 0).all())


def test_kernel_refuses_what_it_cannot_read(attend):
    q = torch.randn(1, 1, 1, 8)
    k = torch.randn(1, 1, 4, 8)
    lo, hi = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long)
    with pytest.raises(TypeError, match="float32"):
        attend(q.double(), k.double(), k.double(), lo, hi, 1.0)
    with pytest.raises(ValueError, match="unit within a key"):
        attend(q, k.transpose(2, 3), k.transpose(2, 3), lo, hi, 1.0)


def test_loading_it_keeps_subnormals(attend):
    """The library is linked without -ffast-math's start file, which would set flush-to-zero
    for the whole process on load (torch and numpy would then lose subnormals)."""
    import numpy as np

    tiny = np.float32(1e-40)  # a subnormal float32
    assert tiny * np.float32(2) > 0
    assert bool((torch.tensor([1e-40]) * 2 > 0).all())


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv("VERICACHE_KERNELS", "0")
    assert kernels.attend() is None


def test_runner_fast_path_with_and_without_the_kernel(lm, prompts):
    """The real model, a ragged batch of decode and verify rows over pooled caches: the
    kernel's logits are SDPA's to float32 rounding, and its greedy tokens are the same."""
    from vericache.model.runner import SeqBatchItem

    r = lm.runner
    assert isinstance(r.attend_kernel, kernels.Attend)
    ids = [prompts["code"][:900], prompts["long"][:1500], prompts["json"][:300]]
    news = [1, 9, 5]

    def run():
        caches = []
        for p, n in zip(ids, news):
            c = r.new_cache(len(p) + 8)
            r.step(p[:-n], 0, c, logits="none")
            caches.append(c)
        items = [SeqBatchItem(torch.tensor(p[-n:]), torch.arange(len(p) - n, len(p)), c, "all")
                 for p, n, c in zip(ids, news, caches)]
        return r.forward(items)

    with_kernel = run()
    kernel, r.attend_kernel = r.attend_kernel, None
    try:
        without = run()
    finally:
        r.attend_kernel = kernel
    for a, b in zip(with_kernel, without):
        assert float((a - b).abs().max()) < 1e-3 * float(b.abs().max())
        assert torch.equal(a.argmax(-1), b.argmax(-1))
