"""The native kernels (`vericache.model.kernels`), built on this machine:
- the batch attention equals SDPA with the same masks on ragged batches, windows and padding
  rows;
- the skinny product equals a float64 product, and a row's bits do not depend on the rows
  beside it or on the threads, over float32 weights and a drafter's bfloat16 copy;
- the runner's fast path gives the same logits with them as with torch's own;
- torch's large buffers get huge pages once vericache is imported."""

import contextlib
import os
from pathlib import Path

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


@pytest.mark.parametrize("batch,rows,window,threads,D", [
    (5, 3, None, 1, 64), (5, 27, None, 2, 64), (5, 9, 40, 2, 64), (5, 64, 300, 1, 64),
    (1, 3, None, 2, 64), (1, 9, 100, 2, 64), (2, 9, None, 3, 64),  # few tasks: keys in parts
    (3, 6, None, 2, 128), (2, 3, 50, 1, 40)])  # head sizes in vectors (64, 128) and in scalars
def test_kernel_equals_sdpa(attend, batch, rows, window, threads, D):
    g = torch.Generator().manual_seed(rows)
    B, H, cap = batch, 3, 700
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
    out = attend(q, k, v, lo, hi, D ** -0.5, threads)
    ref = _reference(q, k, v, lo, hi, D ** -0.5)
    assert float((out - ref).abs().max()) < 2e-5
    if B > 1:
        assert bool((out[1] == 0).all())


@pytest.mark.parametrize("D", [64, 128])
def test_kernel_rows_are_invariant(attend, D):
    """A row whose keys start at 0 gets the same bits on 1 to 3 threads, alone or beside
    other sequences, as one row of a verify pass, as its own decode step (its GQA group's rows)
    or as a call of its one row: its key parts, blocks and vectors are placed by its own range,
    and the rows that share a tile of scores (`qk_tile`) each get the sums a row alone gets."""
    g = torch.Generator().manual_seed(3)
    B, H, G, cap = 4, 3, 3, 3000
    k, v = torch.randn(B, H, cap, D, generator=g), torch.randn(B, H, cap, D, generator=g)
    L = 5  # verify rows a sequence, GQA's query heads folded in: rows (g, l)
    q = torch.randn(B, H, G * L, D, generator=g)
    past = torch.tensor([2900, 17, 1030, 511])
    hi = (past[:, None] + torch.arange(L)[None, :] + 1).repeat(1, G)  # [B, G L]
    lo = torch.zeros_like(hi)
    full = attend(q, k, v, lo, hi, 0.125, 2)
    for threads in (1, 3):
        assert torch.equal(attend(q, k, v, lo, hi, 0.125, threads), full)
    for b in range(B):
        alone = attend(q[b: b + 1], k[b: b + 1], v[b: b + 1], lo[b: b + 1], hi[b: b + 1], 0.125, 2)
        assert torch.equal(alone, full[b: b + 1])
        for j in range(L):  # row j of the pass = the decode step with its keys
            rows = torch.arange(G) * L + j
            step = attend(q[b: b + 1, :, rows], k[b: b + 1], v[b: b + 1], lo[b: b + 1, rows],
                          hi[b: b + 1, rows], 0.125, 1)
            assert torch.equal(step, full[b: b + 1, :, rows])
            for r in rows.tolist():  # one row: a tile of its own
                one = attend(q[b: b + 1, :, r: r + 1], k[b: b + 1], v[b: b + 1],
                             lo[b: b + 1, r: r + 1], hi[b: b + 1, r: r + 1], 0.125, 1)
                assert torch.equal(one, full[b: b + 1, :, r: r + 1])


@pytest.mark.parametrize("D,window,threads", [(64, None, 2), (128, 50, 1), (40, None, 3)])
def test_kernel_reads_bfloat16_as_its_float32_widening(attend, D, window, threads):
    """A drafter's bfloat16 cache: the kernel's output is its output over the same keys and
    values widened to float32 (the sums are float32 in both) to float32 rounding, on strided
    pool slots, with windows and padding rows, and its bits do not depend on the threads.
    Where the CPU dots bfloat16 pairs (`bf16_dot`: AVX512-BF16, a head size a multiple of
    32), the query it scores by is its own rounded to bfloat16.
    Not bit for bit with the float32 build: the two are separate instantiations, and under
    -ffast-math the compiler may order or fuse their sums differently (it did on one of this
    project's machines); nothing needs more, since a draft is only a proposal."""
    g = torch.Generator().manual_seed(D)
    B, H, cap, rows = 4, 3, 900, 9
    store = torch.randn(2, B + 1, H, cap, D, generator=g).to(torch.bfloat16)
    k, v = store[0, 1:], store[1, 1:]
    q = torch.randn(B, H, rows, D, generator=g)
    hi = torch.tensor([880, 3, 515, 0])[:, None] + torch.arange(rows)[None, :] % 3 + 1
    hi[3] = 0  # a padding sequence
    lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
    out = attend(q, k, v, lo, hi, D ** -0.5, threads)
    qs = q.bfloat16().float() if attend.bf16_dot and D % 32 == 0 else q
    widened = attend(qs, k.float(), v.float(), lo, hi, D ** -0.5, threads)
    assert torch.allclose(out, widened, rtol=1e-5, atol=1e-6)
    assert bool((out[3] == 0).all())
    for other in {1, 2, 3} - {threads}:
        assert torch.equal(attend(q, k, v, lo, hi, D ** -0.5, other), out)
    assert float((out - _reference(qs, k.float(), v.float(), lo, hi, D ** -0.5)).abs().max()) < 2e-5
    with pytest.raises(TypeError, match="bfloat16"):
        attend(q, k, v.float(), lo, hi, 1.0)


@pytest.mark.parametrize("D,dtype,threads", [(64, torch.float32, 2), (128, torch.float32, 1),
                                             (40, torch.float32, 3), (64, torch.bfloat16, 2)])
def test_kernel_votes_are_the_softmax_rows_summed(attend, D, dtype, threads):
    """`Attend.votes`: each key's attention mass summed over a task's rows (a float64
    softmax's, to float32 rounding; 0 for keys no row sees, past them up to n), over ragged
    ranges, a row with no keys and several parts of keys; the outputs are the bits of the call
    without votes, a votes-only call (no values) gives the same votes, and `rows` sums the
    rows it names only."""
    g = torch.Generator().manual_seed(D + threads)
    B, H, R, N, n = 3, 2, 7, 1300, 1310
    q = torch.randn(B, H, R, D, generator=g)
    k, v = (torch.randn(B, H, N, D, generator=g).to(dtype) for _ in range(2))
    hi = torch.randint(1, N + 1, (B, R), generator=g)
    lo = (hi - torch.randint(1, 900, (B, R), generator=g)).clamp(min=0)
    lo[0, 0] = hi[0, 0]  # a row that sees nothing
    votes = torch.full((B, H, n), 7.0)
    out = attend.votes(q, k, v, lo, hi, D ** -0.5, threads, votes)
    assert torch.equal(out, attend(q, k, v, lo, hi, D ** -0.5, threads))
    qs = q.bfloat16().float() if dtype == torch.bfloat16 and attend.bf16_dot and D % 32 == 0 else q
    s = torch.einsum("bhrd,bhnd->bhrn", qs.double(), k.double()) * D ** -0.5
    keys = torch.arange(n)
    seen = (keys[None, None, :] >= lo[:, :, None]) & (keys[None, None, :] < hi[:, :, None])
    s = F.pad(s, (0, n - N)).masked_fill(~seen[:, None], float("-inf"))
    want = torch.softmax(s, -1).nan_to_num(0.0).sum(2)
    assert float((votes.double() - want).abs().max()) < 1e-5
    assert bool((votes[:, :, N:] == 0).all()) and float(votes[0].sum()) == pytest.approx((R - 1) * H)
    alone = torch.full((B, H, n), 7.0)
    assert attend.votes(q, k, None, lo, hi, D ** -0.5, threads, alone) is None
    assert torch.equal(alone, votes)
    some = torch.full((B, H, n), 7.0)  # rows r with r % 4 >= 1 vote: 1, 2, 3, 5, 6
    assert torch.equal(attend.votes(q, k, v, lo, hi, D ** -0.5, threads, some, (4, 1)), out)
    part = torch.softmax(s, -1).nan_to_num(0.0)[:, :, [1, 2, 3, 5, 6]].sum(2)
    assert float((some.double() - part).abs().max()) < 1e-5
    with pytest.raises(ValueError, match="votes"):
        attend.votes(q, k, v, lo, hi, D ** -0.5, threads, torch.empty(B, H, int(hi.max()) - 1))
    with pytest.raises(ValueError, match="rows"):
        attend.votes(q, k, v, lo, hi, D ** -0.5, threads, some, (0, 0))


def test_attention_dots_bfloat16_where_the_cpu_has_avx512_bf16(attend):
    """The library is built for this CPU (-march=native): bfloat16 keys are dotted as pairs
    exactly where /proc/cpuinfo lists AVX512-BF16."""
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("flags")).split()
    assert attend.bf16_dot == ("avx512_bf16" in flags)


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
    assert kernels.linear() is None


@pytest.fixture(scope="module")
def linear():
    fn = kernels.linear()
    assert fn is not None, "the kernel must build here (a C compiler is part of the set-up)"
    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(960, 576), (49, 1536), (1539, 577), (3, 40)])
def test_linear_equals_a_float64_product(linear, n, k, dtype):
    """Feature blocks and a feature tail (n % 4), vectors and a column tail (k % 16, k % 32),
    with and without bias, 1 to 33 rows (row blocks of 4 and their remainders); over float32
    weights and a drafter's bfloat16 copy (`vc_linear_bf16w`: x split into two bfloat16
    parts where the CPU dots bfloat16 pairs, `bf16_dot`, 16 of its bits, within the bound)."""
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g)
    for m in (1, 2, 3, 4, 7, 33):
        x = torch.randn(m, k, generator=g)
        for bias in (None, b):
            out = linear(x, w, bias, 2)
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert out.shape == (m, n)
            assert float((out.double() - ref).abs().max()) < 1e-5 * k ** 0.5 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_are_invariant(linear, dtype):
    """A row's result is the same bits alone, among 1 to 37 others, and on 1 to 3 threads:
    each output's sum runs in an order fixed by k (over float32 weights and bfloat16 ones)."""
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(1031, 577, generator=g).to(dtype), torch.randn(1031, generator=g)
    x = torch.randn(38, 577, generator=g)
    alone = torch.cat([linear(x[i: i + 1], w, b, 1) for i in range(38)])
    for m, threads in ((38, 1), (38, 2), (5, 3), (17, 2)):
        assert torch.equal(linear(x[:m], w, b, threads), alone[:m]), (m, threads)
    assert torch.equal(linear(x[20:31], w, b, 2), alone[20:31])


def _quantized(n, k, bits, seed):
    """A float32 [n, k] matrix as a GGUF dequantizer writes one: float16 d (and m for Q4_1)
    per 32 weights, d * q + m in float32 (q 0..15 with the block's least 0 and greatest 15;
    Q8_0: -127..127 with the largest magnitude 127)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-4).half().float()
    if bits == 4:
        q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15
        m = (torch.randn(n, k // 32, 1, generator=g) * 0.1).half().float()
        return (d * q + m).reshape(n, k)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127
    return (d * q).reshape(n, k)


@pytest.mark.parametrize("bits", [4, 8])
def test_blocks_of_gives_quantized_weights_back_exactly(bits):
    """Weights that were quantized (Q4_1's affine 4-bit blocks, Q8_0's symmetric 8-bit ones)
    are found in that form, which gives every float32 weight back bit for bit in 5 or 9 bits;
    weights that were not (a float32 checkpoint's), or rows not in whole blocks, are not."""
    from vericache.model.qweights import blocks_of

    w = _quantized(70, 576, bits, seed=bits)
    qw = blocks_of(w)
    assert qw.bits == bits and qw.shape == (70, 576)
    assert torch.equal(qw.widen().view(torch.int32), w.view(torch.int32))
    assert qw.nbytes == 70 * 576 * bits // 8 + 70 * 18 * 4 * (2 if bits == 4 else 1)
    assert blocks_of(torch.randn(70, 576)) is None
    assert blocks_of(w[:, :560]) is None  # 560 = 17.5 blocks
    nudged = w.clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(1.0))
    assert blocks_of(nudged) is None  # one weight one ulp off: not exact, so not kept


def _edited(w: torch.Tensor, row: int, cols: slice, value: float) -> torch.Tensor:
    w = w.clone()
    w[row, cols] = value
    return w


@pytest.mark.parametrize("bits", [4, 8])
def test_native_blocks_of_is_torchs(linear, bits):
    """`vc_blocks_of` (what a model load runs) finds the form `blocks_of_torch` finds, the
    same q, d and m, or none where it finds none: quantized blocks, a block of zeros, of
    negative zeros, of one value, of subnormal-scale values, of values too wide for a
    float16 scale, a NaN or an infinity among them, one weight an ulp off."""
    from vericache.model.qweights import blocks_of, blocks_of_torch

    w = _quantized(70, 576, bits, seed=40 + bits)
    nudged = w.clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(1.0))
    wide = w.clone()
    wide[4, :32] = torch.randn(32, generator=torch.Generator().manual_seed(2)) * 1e5
    cases = {"quantized": w, "nudged": nudged, "wide": wide,
             "zeros": _edited(w, 1, slice(0, 32), 0.0),
             "negative zeros": _edited(w, 1, slice(0, 32), -0.0),
             "one value": _edited(w, 1, slice(32, 64), 0.5),
             "tiny": _edited(w, 4, slice(0, 32), 1e-30),
             "NaN": _edited(w, 2, slice(7, 8), float("nan")),
             "NaN first": _edited(w, 2, slice(0, 1), float("nan")),
             "inf": _edited(w, 2, slice(7, 8), float("inf")),
             "random": torch.randn(70, 576), "integers": torch.randint(0, 16, (64, 64)).float()}
    found = {}
    for name, m in cases.items():
        a, b = blocks_of(m), blocks_of_torch(m)
        found[name] = None if a is None else a.bits
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.bits == b.bits and torch.equal(a.q, b.q) and torch.equal(a.d, b.d), name
            assert (a.m is None) == (b.m is None) and (a.m is None or torch.equal(a.m, b.m)), name
    # (the cases cover both outcomes: the form found, and refused)
    assert found["quantized"] == found["zeros"] == bits
    assert found["nudged"] is found["NaN"] is found["inf"] is found["random"] is None


@pytest.mark.parametrize("bits", [4, 8])
def test_linear_over_blocks_equals_a_float64_product_and_rows_are_invariant(linear, bits):
    """`vc_linear_qw`: x times the blocks' weights, with and without bias, 1 to 33 rows and a
    feature tail (n % 4): the bits `vc_linear_f32` gives over the float32 matrix, within
    float32 rounding of the float64 product; a row's result is the same bits alone, among
    others, and on 1 to 3 threads."""
    from vericache.model.qweights import blocks_of

    n, k = 1031, 576
    w = _quantized(n, k, bits, seed=10 + bits)
    qw, g = blocks_of(w), torch.Generator().manual_seed(3)
    b = torch.randn(n, generator=g)
    x = torch.randn(33, k, generator=g)
    for m in (1, 2, 3, 4, 7, 33):
        for bias in (None, b):
            out = linear(x[:m], qw, bias, 2)
            assert torch.equal(out, linear(x[:m], w, bias, 2))
            ref = F.linear(x[:m].double(), w.double(), None if bias is None else bias.double())
            assert float((out.double() - ref).abs().max()) < 1e-5 * k ** 0.5
    alone = torch.cat([linear(x[i: i + 1], qw, b, 1) for i in range(33)])
    for m, threads in ((33, 1), (33, 2), (5, 3), (17, 2)):
        assert torch.equal(linear(x[:m], qw, b, threads), alone[:m]), (m, threads)
    with pytest.raises(ValueError, match="columns"):
        linear(torch.randn(2, 544), qw)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_drafters_head_over_blocks_keeps_the_exact_argmax(linear, bits):
    """`Linear.draft_head`: x rounded to int8 a block of 32 for integer dot products
    (`vc_linear_qw_q8x`), then each row's `top` largest logits computed again from x: those
    entries are the exact product's (up to float32 summation order), the argmax
    is the exact one, and the rest stay within the rounding's reach of it (a 4-bit block's q
    centred on 8; 1 to 7 rows, bias or not, 1 or 2 threads). Without AVX512-VNNI or AVX2
    (`q8x` False) the head is the exact product itself. The refinement refuses a top outside
    1..64."""
    from vericache.model.qweights import blocks_of

    n, k = 1031, 576
    w = _quantized(n, k, bits, seed=20 + bits)
    qw, g = blocks_of(w), torch.Generator().manual_seed(5)
    b = torch.randn(n, generator=g)
    x = torch.randn(7, k, generator=g)
    for m, bias, threads in ((1, None, 1), (4, b, 2), (7, None, 2)):
        exact = linear(x[:m], qw, bias, threads)
        rounded = linear(x[:m], qw, bias, threads, int8_x=1)
        head = linear.draft_head(x[:m], qw, bias, threads, top=16)
        if not linear.q8x:
            assert torch.equal(rounded, exact) and torch.equal(head, exact)
            continue
        err = float((rounded - exact).norm() / exact.norm())
        assert 0 < err < 0.015, err  # rounded, and not far: 0.6% here, 2.7% uncentred
        top = rounded.topk(16, dim=-1).indices
        # the exact product's, up to float32 summation order (AVX2's 8 lanes: a few ulps;
        # x's rounding moved these entries by about 0.1 here)
        assert torch.allclose(head.gather(1, top), exact.gather(1, top), rtol=1e-6, atol=1e-5)
        rest = torch.ones_like(head, dtype=torch.bool).scatter_(1, top, False)
        assert torch.equal(head[rest], rounded[rest])
        assert torch.equal(head.argmax(-1), exact.argmax(-1))
    if linear.q8x:
        for top in (0, 65):
            with pytest.raises(ValueError, match="top"):
                linear.draft_head(x[:1], qw, None, 1, top=top)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_drafters_layers_over_blocks_take_x_in_two_int8_parts(linear, bits):
    """`vc_linear_qw_q8x2` (`int8_x=2`): x in two int8 parts a block of 32, the second the
    first's rounding error in 256ths, for integer dot products. With k of 3, 4 and 18 blocks
    (AVX512-VNNI takes 4-bit blocks four at a time, the rest one at a time), 1 to 5 rows, a
    feature tail and bias or not, it stays within 1e-4 of the exact product, at least 50 times
    closer than x in one int8 part. Each row's result is the same bits alone, among others,
    and on 1 or 2 threads. Without AVX512-VNNI or AVX2 (`q8x` False) it is the exact
    product."""
    from vericache.model.qweights import blocks_of

    n, g = 1031, torch.Generator().manual_seed(7)
    b = torch.randn(n, generator=g)
    for k in (96, 128, 576):
        qw = blocks_of(_quantized(n, k, bits, seed=30 + bits + k))
        x = torch.randn(5, k, generator=g) * torch.rand(5, k, generator=g) * 3
        for m, bias, threads in ((1, None, 1), (2, b, 2), (3, None, 2), (5, b, 1)):
            exact = linear(x[:m], qw, bias, threads)
            two = linear(x[:m], qw, bias, threads, int8_x=2)
            if not linear.q8x:
                assert torch.equal(two, exact)
                continue
            one = linear(x[:m], qw, bias, threads, int8_x=1)
            err2 = float((two - exact).norm() / exact.norm())
            err1 = float((one - exact).norm() / exact.norm())
            assert 0 < err2 < 1e-4 and err1 > 50 * err2, (k, m, err1, err2)
        alone = torch.cat([linear(x[i: i + 1], qw, b, 1, int8_x=2) for i in range(5)])
        for threads in (1, 2):
            assert torch.equal(linear(x, qw, b, threads, int8_x=2), alone), (k, threads)


def test_linear_dots_bfloat16_where_the_cpu_has_avx512_bf16(linear):
    """The library is built for this CPU (-march=native): AVX512-BF16's dot products exactly
    where /proc/cpuinfo lists them."""
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("flags")).split()
    assert linear.bf16_dot == ("avx512_bf16" in flags)


@pytest.mark.parametrize("n", [576, 64, 77])
def test_rms_equals_torch(linear, n):
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(9, 4, n, generator=g), torch.randn(n, generator=g)
    out = linear.rms(x, w, 1e-5)
    assert float((out - F.rms_norm(x, (n,), w, 1e-5)).abs().max()) < 1e-5
    assert torch.equal(linear.rms(x[3:4], w, 1e-5), out[3:4])  # a row alone: the same bits


@pytest.mark.parametrize("rot", [64, 32])  # full and partial rotary
def test_rope_equals_the_runners_torch_form(linear, rot):
    """In place on a pass's q/k rows, a view of its fused qkv product (tokens strided)."""
    from vericache.model.runner import Runner

    g = torch.Generator().manual_seed(rot)
    qkv = torch.randn(6, 15 * 64 + 3 * 64, generator=g)
    qk = qkv[:, : 15 * 64].view(6, 15, 64)
    cos, sin = torch.randn(6, rot, generator=g), torch.randn(6, rot, generator=g)
    ref = Runner._rope(qk.clone(), cos[:, None], sin[:, None])
    v = qkv[:, 15 * 64:].clone()
    out = linear.rope(qk, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()  # in place
    assert float((out - ref).abs().max()) < 1e-5
    assert torch.equal(qkv[:, 15 * 64:], v)  # v untouched
    with pytest.raises(ValueError, match="rope"):
        linear.rope(qk.transpose(0, 1), cos, sin)


def test_linear_refuses_what_it_cannot_read(linear):
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(TypeError, match="float32"):
        linear(x.double(), w.double())
    with pytest.raises(TypeError, match="bfloat16 or block weights"):
        linear(x, w.half())
    with pytest.raises(ValueError, match="contiguous"):
        linear(x, torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="columns"):
        linear(x, torch.randn(4, 9))


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

    _same_with_and_without(r, "attend_kernel", run)


@pytest.mark.parametrize("vote_from", [0, 5])
def test_a_passs_votes_keep_its_bits_and_are_the_explicit_paths(lm, prompts, vote_from):
    """An item that asks for votes (the `verify` policy's verify pass; with `vote_from`, a
    prefill's question window) gets them from the kernel's votes: its logits and K/V are the
    bits of the same pass without votes (so a voting verify pass is the decode steps' bits,
    as any other), and its votes are those of the explicit-score path (torch's softmax, taken
    without the kernel) to float32 rounding, a row's mass 1 each (9 rows, or the last 4, 3
    query heads a KV head). Without the kernel too, the votes leave the pass's bits as they
    are (its rows come from a call of its own, its votes after)."""
    from vericache.model.runner import SeqBatchItem

    r = lm.runner
    p = prompts["code"][:900]
    n = len(p)

    def run(votes: bool):
        c = r.new_cache(n + 8)
        r.step(p[:-9], 0, c, logits="none")
        it = SeqBatchItem(torch.tensor(p[-9:]), torch.arange(n - 9, n), c, "all", votes=votes,
                          vote_from=vote_from)
        return r.forward([it])[0], it.attn_votes, c

    def same(a, b):
        assert torch.equal(a[0], b[0])
        assert torch.equal(a[2].k[:, :, :n], b[2].k[:, :, :n])
        assert torch.equal(a[2].v[:, :, :n], b[2].v[:, :, :n])

    plain, voted = run(False), run(True)
    same(plain, voted)
    saved = r.attend_kernel
    r.attend_kernel = None
    try:
        plain_t, explicit = run(False), run(True)
    finally:
        r.attend_kernel = saved
    same(plain_t, explicit)
    votes, explicit = voted[1], explicit[1]
    assert votes.shape == explicit.shape == (r.num_layers, r.num_kv_heads, n)
    assert float((votes - explicit).abs().max()) < 1e-5
    assert torch.allclose(votes.sum(-1), torch.full_like(votes[..., 0], (9.0 - vote_from) * r.group))


def _with_and_without(r, attr: str, run) -> tuple:
    """run() with the runner's `attr` (a kernel, or `_fused_w`: the fused layer stack) and
    with None in its place (torch's function, the layer loop): (with, without)."""
    with_it = run()
    saved = getattr(r, attr)
    setattr(r, attr, None)
    try:
        return with_it, run()
    finally:
        setattr(r, attr, saved)


def _same_with_and_without(r, kernel: str, run) -> None:
    """run() with the runner's `kernel` and with torch's in its place: each logits tensor
    equal to float32 rounding, with the same greedy tokens."""
    with_kernel, without = _with_and_without(r, kernel, run)
    for a, b in zip(with_kernel, without):
        assert float((a - b).abs().max()) < 1e-3 * float(b.abs().max())
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_runner_products_with_and_without_the_kernel(lm, prompts):
    """The real model's 200-token prefill chunk, a 17-row verify pass and a decode step with
    the native product and with F.linear: logits equal to float32 rounding, and the same
    greedy tokens."""
    from vericache.model.runner import LINEAR_ROWS

    r = lm.runner
    assert isinstance(r.linear_kernel, kernels.Linear)
    ids = prompts["long"][:1200]
    assert LINEAR_ROWS >= 200

    def run():
        c = r.new_cache(len(ids) + 8)
        pre = r.step(ids[:200], 0, c, logits="all")[0]
        r.step(ids[200:-18], 200, c, logits="none")
        verify = r.step(ids[-18:-1], len(ids) - 18, c, logits="all")[0]
        decode = r.step(ids[-1:], len(ids) - 1, c)[0]
        return pre, verify, decode

    _same_with_and_without(r, "linear_kernel", run)


def test_silu_mul_equals_torch(linear):
    """The gated MLP's silu(g) * u, with its branch-free exp: within a few float32 ulp of the
    float64 value over the whole range, where g < -88.7 (exp(-g) past float32) within 1e-35,
    and each element by itself (a row alone gives the same bits)."""
    g = torch.Generator().manual_seed(3)
    gate = torch.cat([torch.randn(7, 300, generator=g) * s for s in (0.01, 1.0, 8.0, 40.0)])
    gate[0, :8] = torch.tensor([0.0, -0.0, 88.0, -88.0, 200.0, -200.0, -88.7, -88.71])
    up = torch.randn_like(gate)
    out = linear.silu_mul(torch.cat([gate, up], 1))
    ref = F.silu(gate.double()) * up.double()
    ulp = torch.finfo(torch.float32).eps * ref.abs()
    assert bool(((out.double() - ref).abs() <= 4 * ulp + 1e-35).all())
    assert bool(((out.double() - ref).abs() <= 4 * ulp)[gate > -86].all())
    assert torch.equal(linear.silu_mul(torch.cat([gate, up], 1)[5:6]), out[5:6])
    with pytest.raises(ValueError, match="silu_mul"):
        linear.silu_mul(torch.randn(2, 7))


def test_rms_heads_is_rms_per_head(linear):
    """Per-head RMSNorm in place on a view of a qkv product (tokens strided, v untouched):
    each head the row RMSNorm (`rms`) of that head with its own weights, bit for bit."""
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(5, 7 * 64 + 2 * 64, generator=g)
    w = torch.randn(7, 64, generator=g)
    qk = qkv[:, : 7 * 64].view(5, 7, 64)
    want = torch.stack([linear.rms(qk[:, h].contiguous(), w[h].contiguous(), 1e-6)
                        for h in range(7)], 1)
    v, orig = qkv[:, 7 * 64:].clone(), qk.clone()
    out = linear.rms_heads(qk, w, 1e-6)
    assert out.data_ptr() == qkv.data_ptr() and torch.equal(out, want)
    assert torch.equal(qkv[:, 7 * 64:], v)
    ref = F.rms_norm(orig.double(), (64,), None, 1e-6) * w.double()
    assert float((out.double() - ref).abs().max()) < 1e-5
    with pytest.raises(ValueError, match="rms_heads"):
        linear.rms_heads(qk, w[:6], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layers_are_the_loop_bit_for_bit(lm, prompts, monkeypatch, dtype):
    """The real model's decode step, a 17-row verify pass, a batch of decode rows over pooled
    caches and a ragged batch (a decode row beside a 4-row verify pass, padded): one native
    call for all layers (`Runner._fused`) gives the layer loop's logits and K/V, bit for
    bit; over caches of the model's float32 and of a drafter's bfloat16 (the fused call
    rounds what it writes as torch's conversion does)."""
    from vericache.model.runner import SeqBatchItem

    r = lm.runner
    assert r._fused_w["w_qkv"][0] == r.layers[0].w_qkv.data_ptr()  # the layers fused, by pointer
    calls = []
    fused = r._fused
    monkeypatch.setattr(r, "_fused", lambda *a: (calls.append(a[1].shape[0]), fused(*a)))
    ids = [prompts["code"][:700], prompts["long"][:1100], prompts["json"][:300]]

    def run():
        caches = []
        for p in ids:
            c = r.new_cache(len(p) + 20, dtype=dtype)
            r.step(p[:-18], 0, c, logits="none")
            caches.append(c)
        verify = r.step(ids[0][-18:-1], len(ids[0]) - 18, caches[0], logits="all")[0]
        decode = r.step(ids[0][-1:], len(ids[0]) - 1, caches[0])[0]
        batch = r.forward([SeqBatchItem(torch.tensor([p[-18]]), torch.tensor([len(p) - 18]), c,
                                        "last") for p, c in zip(ids[1:], caches[1:])])
        ragged = r.forward([SeqBatchItem(torch.tensor(p[-17: -17 + n]),
                                         torch.arange(len(p) - 17, len(p) - 17 + n), c, "all")
                            for p, c, n in zip(ids[1:], caches[1:], (1, 4))])
        kv = [c.view() for c in caches]
        return [verify, decode, *batch, *ragged], kv

    (out_f, kv_f), (out_l, kv_l) = _with_and_without(r, "_fused_w", run)
    # each fast pass fused (prefill tails too); none in the loop's run
    assert calls[-4:] == [17, 1, 2, 5]
    for a, b in zip(out_f, out_l):
        assert torch.equal(a, b)
    for (kf, vf), (kl, vl) in zip(kv_f, kv_l):
        assert torch.equal(kf, kl) and torch.equal(vf, vl)


def test_fused_layers_with_qkv_bias(tmp_path):
    """A tiny Qwen2 (a qkv bias), a sliding-window Mistral (a window per layer's range) and
    Qwen3 (per-head q/k norms): fused passes are the loop's bit for bit; Gemma 3 (norms
    after attention and MLP, GeGLU) keeps the loop."""
    from test_architectures import build
    from vericache.model.loader import load_model

    for name, fusable in (("qwen2", True), ("mistral-sliding", True), ("qwen3", True),
                          ("gemma3_text", False)):
        folder = tmp_path / name
        build(name, folder)
        r = load_model(str(folder), dtype="float32").runner
        assert (r._fused_w is not None) == fusable, name
        ids = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(1)).tolist()

        def run():
            c = r.new_cache(64)
            r.step(ids[:40], 0, c, logits="none")
            out = [r.step(ids[40:49], 40, c, logits="all")[0]]
            out += [r.step(ids[i: i + 1], i, c)[0] for i in range(49, 60)]
            return out, c.view()

        (out_f, kv_f), (out_l, kv_l) = _with_and_without(r, "_fused_w", run)
        assert all(torch.equal(a, b) for a, b in zip(out_f, out_l)), name
        assert all(torch.equal(a, b) for a, b in zip(kv_f, kv_l)), name


def test_the_drafters_kv_dtype_rule(monkeypatch):
    """bfloat16 for a float32 model on CPU with the kernel (which reads it), the model's dtype
    elsewhere;
    VERICACHE_DRAFT_KV_DTYPE overrides it, and an unknown value is refused, naming the
    choices."""
    from vericache.errors import InvalidArgument
    from vericache.model.kvcache import draft_kv_dtype

    monkeypatch.delenv("VERICACHE_DRAFT_KV_DTYPE", raising=False)
    assert draft_kv_dtype("cpu", torch.float32) == torch.bfloat16
    assert draft_kv_dtype("cpu", torch.float32, kernel=False) == torch.float32  # SDPA's
    assert draft_kv_dtype("cuda", torch.float32) == torch.float32
    assert draft_kv_dtype("cuda", torch.float16) == torch.float16
    monkeypatch.setenv("VERICACHE_DRAFT_KV_DTYPE", "model")
    assert draft_kv_dtype("cpu", torch.float32) == torch.float32
    monkeypatch.setenv("VERICACHE_DRAFT_KV_DTYPE", "bfloat16")
    assert draft_kv_dtype("cuda", torch.float16) == torch.bfloat16
    monkeypatch.setenv("VERICACHE_DRAFT_KV_DTYPE", "fp8")
    with pytest.raises(InvalidArgument, match="auto, model, bfloat16"):
        draft_kv_dtype("cpu", torch.float32)


def test_the_drafters_weights_rule(monkeypatch):
    """A float32 model whose drafter holds bfloat16 K/V, with the native product: a weight
    copy (blocks or bfloat16, `Runner._draft_copy`); no copy otherwise, or with
    VERICACHE_DRAFT_WEIGHTS=model; an unknown value is refused, naming the choices."""
    from vericache.errors import InvalidArgument
    from vericache.model.kvcache import draft_weights_dtype

    monkeypatch.delenv("VERICACHE_DRAFT_WEIGHTS", raising=False)
    assert draft_weights_dtype(torch.float32, torch.bfloat16) == torch.bfloat16
    assert draft_weights_dtype(torch.float32, torch.bfloat16, kernel=False) is None
    assert draft_weights_dtype(torch.float32, torch.float32) is None
    assert draft_weights_dtype(torch.bfloat16, torch.bfloat16) is None
    monkeypatch.setenv("VERICACHE_DRAFT_WEIGHTS", "bfloat16")
    assert draft_weights_dtype(torch.float32, torch.bfloat16) == torch.bfloat16
    monkeypatch.setenv("VERICACHE_DRAFT_WEIGHTS", "model")
    assert draft_weights_dtype(torch.float32, torch.bfloat16) is None
    monkeypatch.setenv("VERICACHE_DRAFT_WEIGHTS", "int8")
    with pytest.raises(InvalidArgument, match="auto, bfloat16, model"):
        draft_weights_dtype(torch.float32, torch.bfloat16)


@contextlib.contextmanager
def _draft_copy_restored(r):
    """The runner's drafter weight copy, and what was chosen with it, as they were after a
    test that remakes the copy (`Runner._draft_copy` reads its environment choices then)."""
    saved = r._draft_w, r._draft_fused_w, r._draft_head_int8, r._draft_layers_x2, r.draft_weights
    try:
        yield
    finally:
        (r._draft_w, r._draft_fused_w, r._draft_head_int8, r._draft_layers_x2,
         r.draft_weights) = saved


def _choose_for_drafts(r, monkeypatch, var: str, choice: str) -> None:
    """`var` set to `choice`, and the drafter's copy dropped so that the next draft pass
    remakes it under that choice (inside `_draft_copy_restored`)."""
    monkeypatch.setenv(var, choice)
    r._draft_w = r._draft_fused_w = None


def _last_logits(r, ids, last: int, dtype):
    """The logits of ids' `last` tokens, after a pass over the others, in a cache of `dtype`
    (the drafter's: a draft pass)."""
    c = r.new_cache(len(ids) + 8, dtype=dtype)
    r.step(ids[:-last], 0, c, logits="none")
    return r.step(ids[-last:], len(ids) - last, c, logits="all")[0]


@pytest.mark.parametrize("var", ["VERICACHE_DRAFT_HEAD", "VERICACHE_DRAFT_LAYERS"])
def test_the_drafters_int8_rules(monkeypatch, var):
    """VERICACHE_DRAFT_HEAD and VERICACHE_DRAFT_LAYERS: `auto` by default, or `exact`; an
    unknown value is refused, naming the choices."""
    from vericache.errors import InvalidArgument
    from vericache.model.kvcache import draft_head_choice, draft_layers_choice

    choice = {"VERICACHE_DRAFT_HEAD": draft_head_choice,
              "VERICACHE_DRAFT_LAYERS": draft_layers_choice}[var]
    monkeypatch.delenv(var, raising=False)
    assert choice() == "auto"
    monkeypatch.setenv(var, "exact")
    assert choice() == "exact"
    monkeypatch.setenv(var, "int8")
    with pytest.raises(InvalidArgument, match="auto, exact"):
        choice()


def test_a_draft_passs_head_keeps_the_exact_heads_tokens(lm, prompts, monkeypatch):
    """The default model's LM head is Q8_0 blocks: a draft pass over them takes
    `draft_head` where the CPU has AVX512-VNNI or AVX2 (`VERICACHE_DRAFT_HEAD=auto`), the exact
    block product with `exact`. On 40 rows of the code prompt, both give every row the same
    greedy token, and auto's largest logit is the exact head's; its other logits differ
    (rounded x) where the CPU has either."""
    r = lm.runner
    ids = prompts["code"][:600]
    out = {}
    with _draft_copy_restored(r):
        for choice in ("exact", "auto"):
            _choose_for_drafts(r, monkeypatch, "VERICACHE_DRAFT_HEAD", choice)
            out[choice] = _last_logits(r, ids, 40, r.draft_dtype)
            assert r._draft_head_int8 == (choice == "auto" and r.linear_kernel.q8x)
    exact, fast = out["exact"], out["auto"]
    assert torch.equal(fast.argmax(-1), exact.argmax(-1))
    assert torch.allclose(fast.max(-1).values, exact.max(-1).values, rtol=0, atol=1e-4)
    assert torch.equal(fast, exact) != r.linear_kernel.q8x


def test_a_draft_passs_layers_take_x_in_two_int8_parts(lm, prompts, monkeypatch):
    """The default model's layers are Q4_1 blocks: a draft pass's layer products over them take
    x in two int8 parts (`vc_linear_qw_q8x2`) where the CPU has AVX512-VNNI
    (`VERICACHE_DRAFT_LAYERS=auto`), the exact block product with `exact`, in the fused
    pass and in the loop's products alike. On 40 rows of the code prompt both give every row
    the same greedy token, and the logits move by less than twice what the drafter's
    bfloat16 caches move them from the verifier's pass; they differ where the CPU has VNNI
    (the form was taken), and a verifier's pass (float32 caches) is the same bits either
    way."""
    r = lm.runner
    ids = prompts["code"][:600]
    out, full = {}, {}
    with _draft_copy_restored(r):
        for choice in ("exact", "auto"):
            _choose_for_drafts(r, monkeypatch, "VERICACHE_DRAFT_LAYERS", choice)
            out[choice] = _last_logits(r, ids, 40, r.draft_dtype)
            assert r._draft_layers_x2 == (choice == "auto" and r.linear_kernel.q8x_vnni)
            fused, loop = _with_and_without(r, "_fused_w",
                                            lambda: _last_logits(r, ids, 3, r.draft_dtype))
            assert torch.equal(fused, loop), choice
            full[choice] = _last_logits(r, ids, 40, torch.float32)
    exact, fast = out["exact"], out["auto"]
    assert torch.equal(fast.argmax(-1), exact.argmax(-1))
    # the drift it adds is of the size the drafter's bfloat16 caches already give (mean
    # |logit change| 0.058 and 0.052 here, on a Zen 4): rounding anywhere moves the later
    # layers' bfloat16 roundings
    drift = float((fast - exact).abs().mean())
    assert drift < 2 * float((full["exact"] - exact).abs().mean()), drift
    assert torch.equal(fast, exact) != r.linear_kernel.q8x_vnni
    assert torch.equal(full["exact"], full["auto"])


def test_draft_passes_take_the_models_own_blocks_or_a_bfloat16_copy(lm, prompts, monkeypatch):
    """A pass over a drafter's bfloat16 caches multiplies by the drafter's weight copy, made
    at the first such pass. The default model came as GGUF Q4_1 layers and a Q8_0 LM head,
    so by default the copy is those blocks, the ones every pass shares (exact: every weight
    given back bit for bit, in 111 MB where bfloat16 takes 269 MB; no bytes of the drafter's
    own); with VERICACHE_DRAFT_WEIGHTS=bfloat16, a bfloat16
    copy (half the float32 bytes). Either pass's logits stay near the float32 weights' with
    the same greedy token (not to float32 rounding even over the blocks: the drafter's
    attention rounds its queries to bfloat16 where the CPU dots bfloat16, and a sum's order
    moves those roundings). A pass over the
    model's float32 caches (the verifier's) never touches the copy: the same bits with the
    copy as without it."""
    from vericache.model.qweights import QWeight

    r = lm.runner
    assert r.draft_weights == torch.bfloat16
    mats = [getattr(lyr, n) for lyr in r.layers for n in ("w_qkv", "w_o", "w_gate_up", "w_down")]
    ids = prompts["code"][:600]

    def run(dtype):
        return _last_logits(r, ids, 5, dtype)

    drafted = {}
    with _draft_copy_restored(r):
        for choice in ("auto", "bfloat16"):
            _choose_for_drafts(r, monkeypatch, "VERICACHE_DRAFT_WEIGHTS", choice)
            drafted[choice] = run(r.draft_dtype)
            if choice == "auto":
                assert r.draft_weight_form() == "blocks"
                copies = [r._draft_w[w.data_ptr()] for w in mats + [r.lm_head]]
                assert [c.bits for c in copies] == [4] * len(mats) + [8]
                assert all(torch.equal(c.widen(), w) for c, w in zip(copies[:8], mats[:8]))
                assert torch.equal(copies[-1].widen(), r.lm_head)
                assert r.draft_weight_bytes() == 0  # the runner's own blocks
                assert r.weight_block_bytes() == sum(
                    w.numel() // 2 + w.numel() // 32 * 8 for w in mats) + (
                    r.lm_head.numel() + r.lm_head.numel() // 32 * 4)
            else:
                assert r.draft_weight_form() == "bfloat16"
                assert not any(isinstance(c, QWeight) for c in r._draft_w.values())
                assert r.draft_weight_bytes() == sum(w.numel() for w in mats + [r.lm_head]) * 2
        verified = run(r.dtype)
        r.draft_weights = None  # the model's own weights for every pass
        assert r._drafts([]) is False and r.draft_weight_form() == "model"
        assert torch.equal(run(r.dtype), verified)
        drafted_f32 = run(r.draft_dtype)
    top = float(drafted_f32.abs().max())
    for logits in drafted.values():
        assert torch.equal(logits.argmax(-1), drafted_f32.argmax(-1))
        assert float((logits - drafted_f32).abs().max()) < 0.05 * top


def test_every_pass_reads_the_blocks_with_the_float32_bits(lm, prompts):
    """The default model's products have a lossless block form, which every pass of at most
    BLOCK_ROWS rows reads (`Runner._blocks`): a decode step, a 33-row verify pass and the
    prefill before them give the same logits and K/V, bit for bit, with the blocks as with
    the float32 matrices."""
    from vericache.model.runner import BLOCK_ROWS

    r = lm.runner
    assert len(r._blocks) == 4 * r.num_layers + 1 and r._blocks_fused_w is not None
    assert 33 <= BLOCK_ROWS
    ids = prompts["code"][:700]

    def run():
        c = r.new_cache(len(ids) + 8)
        r.step(ids[:-34], 0, c, logits="none")
        verify = r.step(ids[-34:-1], len(ids) - 34, c, logits="all")[0]
        step = r.step(ids[-1:], len(ids) - 1, c, logits="all")[0]
        return verify, step, c.k[:, :, :len(ids)].clone(), c.v[:, :, :len(ids)].clone()

    with_blocks = run()
    saved = r._blocks, r._blocks_fused_w
    r._blocks, r._blocks_fused_w = {}, None
    try:
        without = run()
    finally:
        r._blocks, r._blocks_fused_w = saved
    for a, b in zip(with_blocks, without):
        assert torch.equal(a, b)


def test_weight_blocks_can_be_turned_off_and_a_bad_value_is_refused(monkeypatch):
    """VERICACHE_WEIGHT_BLOCKS=off: no block form is searched; an unknown value is refused,
    naming the choices."""
    from vericache.errors import InvalidArgument
    from vericache.model.runner import Runner

    r = Runner.__new__(Runner)
    r.layers, r.lm_head, r.head_dense = [], None, None
    monkeypatch.setenv("VERICACHE_WEIGHT_BLOCKS", "off")
    assert r._find_blocks() == {}
    monkeypatch.setenv("VERICACHE_WEIGHT_BLOCKS", "yes")
    with pytest.raises(InvalidArgument, match="auto, off"):
        r._find_blocks()


_HUGE_PROBE = """
import os, vericache, torch
x = torch.ones(96 << 18)  # 96 MB, filled: its pages are faulted in
rollup = open("/proc/self/smaps_rollup").read()
huge = [int(line.split()[1]) for line in rollup.splitlines() if line.startswith("AnonHugePages")]
print(os.environ["THP_MEM_ALLOC_ENABLE"], huge[0])
"""


def test_importing_vericache_gives_torchs_large_buffers_huge_pages():
    """`import vericache` sets THP_MEM_ALLOC_ENABLE=1 unless the user set it, before torch's
    first allocation: with the kernel's transparent huge pages on request (`madvise`, the
    common default) a 96 MB tensor then lies in 2 MB pages, and with the user's 0 it does not
    (`always`: both do; `never`: neither)."""
    import subprocess
    import sys

    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    mode = mode[mode.index("[") + 1: mode.index("]")]
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    runs = {}
    for setting in (None, "0"):
        e = env if setting is None else {**env, "THP_MEM_ALLOC_ENABLE": setting}
        out = subprocess.run([sys.executable, "-c", _HUGE_PROBE], env=e, capture_output=True,
                             text=True, check=True).stdout.split()
        runs[setting] = (out[0], int(out[1]))
    assert runs[None][0] == "1" and runs["0"][0] == "0"  # the default, and the user's choice kept
    if mode == "never":
        assert runs[None][1] == 0
    else:
        assert runs[None][1] >= 64 << 10  # kB: most of the 96 MB in huge pages
    if mode == "madvise":
        assert runs["0"][1] < 8 << 10
