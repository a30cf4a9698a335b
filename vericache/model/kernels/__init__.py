"""Native CPU kernels, compiled on first use with the machine's C compiler.

`attend()`: the batch attention of the runner's fast path (`attend.c`): every sequence and
KV head of a pass in one call, each row over its own key range, each key block read once
for every row that sees it, split across the caller's OpenMP threads (ctypes drops the GIL
for the call). On a
2-vCPU EPYC at 16 sequences of 2k tokens (SmolLM2's 3 KV heads, 3 query heads each, one
decode row), a layer took 6.4 ms on one thread and 3.1-5.4 ms on two, against 9.2 and 6.9
ms for torch's SDPA with the batch's mask (/tmp probe; `benchmarks/attention.py --sdpa-too`
measures both against this machine's read bandwidth).

`linear()`: the fast path's products of at most `runner.LINEAR_ROWS` rows (`linear.c`):
each block of weight rows read once for every row, the output features split between the
caller's OpenMP threads. At batch 1 the pass reads the weights; MKL's GEMV read them at
16 GB/s on one thread of this EPYC and no faster on two, the kernel at 42 GB/s on two. Over
bfloat16 weights (a drafter's copy, `Runner.draft_weights`) it reads half the bytes, and
with AVX512-BF16 dots them with x split into two bfloat16 parts (`Linear.bf16_dot`); over
weights kept in the blocks they were quantized in (`vericache.model.qweights`, a GGUF
model's) it reads 5 or 9 bits a weight and gives the float32 product's bits.

The same library runs a fast pass's decoder layers in one call (`Linear.layers`, filled in
by `Runner._fused`): norms, products, RoPE, the K/V writes, the attention (`attend.c`'s
function, by its address) and the gated MLP (`silu_mul`, a branch-free exp that
vectorises), one function after another as the runner's layer loop calls them, so either
gives the same bits; at batch 1 the loop's Python and torch work between the calls was
about a tenth of a 1k-token decode step.

Each library is built once per source, flags and CPU (`-march=native`) into the models'
cache folder (`$VERICACHE_CACHE_DIR`, default `~/.cache/vericache`), under kernels/,
atomically, so that concurrent processes agree. Without a compiler, or with
`VERICACHE_KERNELS=0`, `attend()` and `linear()` are None and the runner uses SDPA and
F.linear; the reason is logged once. The attention is compiled with -ffast-math (vector
expf; linked without it, see LIBRARIES): results differ from SDPA's in the last bits, as
any two attention kernels do. The products differ from MKL's in the last bits too (another
summation order). Both place a row's sums by the row alone, so the fast pass they serve is
batch-invariant, and `exact=bitwise` items run in it (`Runner._fast_is_invariant`); the
invariant pass, for the passes they do not serve whole, uses neither (its RMSNorm and RoPE,
row by row either way, are `linear.c`'s too).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# name -> (source, compile flags, link flags). attend.c is compiled with -ffast-math (vector
# expf) and linked without it: gcc links a library built with it to crtfastmath.o, which on
# load sets flush-to-zero for the whole process (subnormals became 0 in torch and numpy
# alike; hypothesis refused to run). linear.c is compiled without it (its sums keep the order
# written). Both use OpenMP: the libgomp.so.1 they link is the one torch has loaded.
LIBRARIES = {
    "attend": (HERE / "attend.c", ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"],
               ["-fopenmp", "-lmvec", "-lm"]),
    "linear": (HERE / "linear.c", ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp",
                                    "-fPIC"],
               ["-fopenmp", "-lm"]),
}

_lock = threading.Lock()
_loaded: dict[str, object] = {}


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build(name: str) -> Path:
    from vericache.model.loader import cache_root  # (the loader imports the runner, this)

    source, flags, libs = LIBRARIES[name]
    cache = cache_root()
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256("\0".join([source.read_text(), cc, *flags, "-shared", *libs,
                                     _cpu()]).encode())
    out = cache / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, so = Path(tmp) / f"{name}.o", Path(tmp) / out.name
        for cmd in ([cc, *flags, "-c", "-o", str(obj), str(source)],
                    [cc, "-shared", "-o", str(so), str(obj), *libs]):
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(so, out)  # atomic: a concurrent build writes the same bytes
    return out


class Attend:
    """`attend(q, k, v, lo, hi, scale, threads)` -> out: q [B, H, R, D] float32 (any
    layout; made contiguous); k, v [B, H, N, D] views with unit stride within a key (a pool's
    slots), both float32 or both bfloat16 (a drafter's cache: widened, or its keys dotted
    with the query rounded to bfloat16 where `bf16_dot`; summed in float32); lo, hi [B, R] int64: row r of sequence b attends over keys
    [lo, hi) (none: zeros). `threads` OpenMP threads split the B * H tasks, or each task's
    keys when the tasks are few (batch 1). `votes` also gives each key's attention mass
    summed over the rows (the selection policies' votes), with the same outputs."""

    def __init__(self, lib: ctypes.CDLL):
        p, i = ctypes.c_void_p, ctypes.c_int64
        self._fns = {dtype: getattr(lib, name) for dtype, name in
                     ((torch.float32, "vc_attend_f32"), (torch.bfloat16, "vc_attend_bf16"))}
        self._votes = {dtype: getattr(lib, name) for dtype, name in
                       ((torch.float32, "vc_attend_votes_f32"),
                        (torch.bfloat16, "vc_attend_votes_bf16"))}
        for fn in self._fns.values():
            fn.argtypes = [p, p, p, i, i, i, p, p, p, i, i, i, i, ctypes.c_float, i]
            fn.restype = ctypes.c_int
        for fn in self._votes.values():
            fn.argtypes = [p, p, p, i, i, i, p, p, p, p, i, i, i, i, i, i, i, ctypes.c_float, i]
            fn.restype = ctypes.c_int
        # ALiBi's (float32 K/V; votes optional): each score plus its bias, `alibi` below
        self._alibi = lib.vc_attend_alibi_f32
        self._alibi.argtypes = [p, p, p, i, i, i, p, p, p, p, i, i, i, i, i, i, i,
                                ctypes.c_float, i, p, i]
        self._alibi.restype = ctypes.c_int
        # per K/V dtype, for `Linear.layers`
        self.address = {dtype: ctypes.cast(fn, ctypes.c_void_p).value
                        for dtype, fn in self._fns.items()}
        # whether bfloat16 keys (head sizes a multiple of 32) meet the query rounded to
        # bfloat16 in AVX512-BF16 dot products (else both are read as float32)
        self.bf16_dot = bool(lib.vc_attend_bf16_dot())

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor,
                 hi: torch.Tensor, scale: float, threads: int = 1,
                 alibi: "tuple[torch.Tensor, int] | None" = None) -> torch.Tensor:
        """`alibi` (slope, kind): ALiBi's bias on each score, for float32 K/V in dense caches
        (a key's slot is its position, a row's hi - 1): slope [H, R] float32, each task head's
        rows' slopes; kind 0, 1, 2 MPT's, BLOOM's and Falcon's arithmetic (`Runner._alibi`)."""
        q, lo, hi = self._check(q, k, v, lo, hi)
        B, H, R, D = q.shape
        out = torch.empty_like(q)
        if alibi is not None:
            failed = self._alibi_call(q, k, v, lo, hi, out, None, 0, (1, 0), scale, threads,
                                      alibi)
        else:
            failed = self._fns[k.dtype](q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0),
                                        k.stride(1), k.stride(2), lo.data_ptr(), hi.data_ptr(),
                                        out.data_ptr(), B, H, R, D, float(scale), threads)
        if failed:
            raise MemoryError("attend: out of memory for its buffers")
        return out

    def _alibi_call(self, q, k, v, lo, hi, out, votes, vs, rows, scale, threads, alibi) -> int:
        slope, kind = alibi
        B, H, R, D = q.shape
        if (k.dtype != torch.float32 or slope.dtype != torch.float32
                or tuple(slope.shape) != (H, R) or not slope.is_contiguous()):
            raise ValueError("attend: ALiBi needs float32 K/V and slopes [H, R], contiguous")
        return self._alibi(q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
                           k.stride(2), lo.data_ptr(), hi.data_ptr(),
                           None if out is None else out.data_ptr(),
                           None if votes is None else votes.data_ptr(), vs, rows[0], rows[1],
                           B, H, R, D, float(scale), threads, slope.data_ptr(), int(kind))

    def votes(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, lo: torch.Tensor,
              hi: torch.Tensor, scale: float, threads: int, votes: torch.Tensor,
              rows: tuple[int, int] = (1, 0),
              alibi: "tuple[torch.Tensor, int] | None" = None) -> torch.Tensor | None:
        """The call's outputs (None where `v` is None: no value products), and each key's
        attention mass summed over each task's rows written into `votes` ([B, H, n] float32,
        unit stride along n, n at least every row's hi; keys no row sees get 0). The outputs
        are the bits `__call__` gives. `rows` (l, first): only the rows r with r % l >= first
        vote (a task's R rows as query heads of l rows each; the default counts every row)."""
        vv = k if v is None else v  # (a votes-only call reads no values)
        q, lo, hi = self._check(q, k, vv, lo, hi)
        B, H, R, D = q.shape
        n = votes.shape[-1]
        if (votes.dtype != torch.float32 or tuple(votes.shape) != (B, H, n)
                or votes.stride(2) != 1 or votes.stride(0) != H * votes.stride(1)
                or int(hi.max()) > n):
            raise ValueError("attend: votes must be [B, H, n] float32, n past every row's keys")
        if rows[0] < 1 or rows[1] < 0:
            raise ValueError("attend: votes' rows (l, first) need l >= 1 and first >= 0")
        out = None if v is None else torch.empty_like(q)
        if alibi is not None:
            if self._alibi_call(q, k, vv, lo, hi, out, votes, votes.stride(1), rows, scale,
                                threads, alibi):
                raise MemoryError("attend: out of memory for its buffers")
            return out
        if self._votes[k.dtype](q.data_ptr(), k.data_ptr(), vv.data_ptr(),
                                k.stride(0), k.stride(1), k.stride(2), lo.data_ptr(),
                                hi.data_ptr(), None if out is None else out.data_ptr(),
                                votes.data_ptr(), votes.stride(1), rows[0], rows[1], B, H, R,
                                D, float(scale), threads):
            raise MemoryError("attend: out of memory for its buffers")
        return out

    def _check(self, q, k, v, lo, hi):
        if q.dtype != torch.float32 or k.dtype not in self._fns or v.dtype != k.dtype:
            raise TypeError("attend: float32 queries, float32 or bfloat16 keys and values")
        if k.stride() != v.stride() or k.stride(3) != 1 or q.device.type != "cpu":
            raise ValueError("attend: k and v must share strides, unit within a key, on CPU")
        return q.contiguous(), lo.contiguous(), hi.contiguous()


_P, _I = ctypes.c_void_p, ctypes.c_int64


class Pass(ctypes.Structure):
    """`linear.c`'s `struct vc_pass`: a fast pass's decoder layers for `Linear.layers`
    (`Runner._fused` fills it; pointer fields hold ctypes arrays, one entry per layer)."""

    _fields_ = ([(n, _I) for n in ("T", "H", "hq", "hkv", "D", "I", "R", "layers", "B", "lq",
                                   "threads")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("h", _P)]
                + [(n, _P) for n in ("ln_in", "w_qkv", "b_qkv", "w_o", "ln_mlp", "w_gu", "w_down",
                                     "qk_norm", "cos", "sin", "ck", "cv")]
                + [(n, _I) for n in ("sb", "sh", "sn")]
                + [(n, _P) for n in ("wslot", "wpos", "pad", "lo", "hi", "attend")]
                + [("kv_bf16", _I), ("w_type", _I)])

# `Pass.w_type`: what the products' weight pointers point to (W_BLOCKS_X2: blocks, each
# product's input in two int8 parts, `vc_linear_qw_q8x2`: a drafter's layers)
W_FLOAT32, W_BFLOAT16, W_BLOCKS, W_BLOCKS_X2 = 0, 1, 2, 3


def pointers(tensors) -> ctypes.Array:
    """A C array of the tensors' data pointers (None: NULL), for `Pass`'s per-layer fields."""
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr()
                                                for t in tensors])


class Linear:
    """`linear(x, w, b, threads)` -> x w^T + b, for skinny x (`linear.c`): x [m, k], w [n, k],
    b [n] or None, float32 and contiguous on CPU; the output features split between `threads`
    OpenMP threads. Each output's sum runs in an order fixed by k alone: a row's result is
    the same bits whatever other rows share the call and however many threads run it.
    `rms` and `rope`: the same passes' RMSNorm and rotary embedding, row by row (each a
    handful of torch ops, about 15 and 10 us a call, against 2-3 here)."""

    def __init__(self, lib: ctypes.CDLL):
        p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        def product(name: str, restype=ctypes.c_int):  # (x, w, b, y, m, n, k, threads or top)
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = [p, p, p, p, i, i, i, i], restype
            return fn

        self._fn = product("vc_linear_f32", None)
        self._fn_bf16w = product("vc_linear_bf16w")
        self._fn_qw = product("vc_linear_qw")
        self._fn_qw_q8x = product("vc_linear_qw_q8x")
        self._fn_qw_q8x2 = product("vc_linear_qw_q8x2")
        self._fn_qw_refine = product("vc_linear_qw_refine")
        # whether block products with x rounded to int8 run as integer dot products
        # (AVX512-VNNI or AVX2; else `int8_x` takes the exact block product)
        self.q8x = bool(lib.vc_q8x())
        # whether those are VNNI's (AVX512-VNNI): `int8_x=2` (x in two int8 parts) pays there
        self.q8x_vnni = bool(lib.vc_q8x_vnni())
        # whether bfloat16 weights meet x, split into two bfloat16 parts, in AVX512-BF16 dot
        # products (else x stays float32 and the weights are widened)
        self.bf16_dot = bool(lib.vc_bf16_dot())
        self._rms = lib.vc_rms_f32
        self._rms.argtypes = [p, p, p, i, i, f]
        self._rms.restype = None
        self._rope = lib.vc_rope_f32
        self._rope.argtypes = [p, i, i, i, i, p, p, i]
        self._rope.restype = None
        self._rms_heads = lib.vc_rms_heads_f32
        self._rms_heads.argtypes = [p, p, i, i, i, i, ctypes.c_float]
        self._rms_heads.restype = None
        self._silu_mul = lib.vc_silu_mul_f32
        self._silu_mul.argtypes = [p, p, i, i]
        self._silu_mul.restype = None
        self._layers = lib.vc_layers_f32
        self._layers.argtypes = [ctypes.POINTER(Pass)]
        self._layers.restype = ctypes.c_int
        self._blocks_of = lib.vc_blocks_of
        self._blocks_of.argtypes = [p, i, i, i, p, p, p]
        self._blocks_of.restype = ctypes.c_int

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gu[:, :I]) * gu[:, I:] for a contiguous float32 gu [T, 2I] (the gated MLP),
        each element by itself: the function `layers` applies, so both give the same bits."""
        if gu.dtype != torch.float32 or not gu.is_contiguous() or gu.shape[-1] % 2:
            raise ValueError("silu_mul: contiguous float32 [T, 2I] only")
        t, i2 = gu.shape
        a = gu.new_empty(t, i2 // 2)
        self._silu_mul(gu.data_ptr(), a.data_ptr(), t, i2 // 2)
        return a

    def layers(self, p: "Pass") -> None:
        """Run a pass's decoder layers (`vc_layers_f32`) on p.h in place."""
        if self._layers(ctypes.byref(p)):
            raise MemoryError("layers: out of memory for its buffers")

    def blocks_of(self, w: torch.Tensor, bits: int):
        """`vc_blocks_of`: (q, d, m) of w (contiguous float32 [n, k], k % 32 == 0) in blocks
        of `bits` (4: q uint8 [n, k / 2] packed, m float32 [n, k / 32]; 8: q int8 [n, k], m
        None), d float32 [n, k / 32]; None where some block is not of that form."""
        n, k = w.shape
        if w.dtype != torch.float32 or not w.is_contiguous() or k % 32 or bits not in (4, 8):
            raise ValueError("blocks_of: contiguous float32 [n, k], k a multiple of 32; bits 4 or 8")
        q = torch.empty(n, k * bits // 8, dtype=torch.uint8 if bits == 4 else torch.int8)
        d = torch.empty(n, k // 32)
        m = torch.empty(n, k // 32) if bits == 4 else None
        ok = self._blocks_of(w.data_ptr(), n, k, bits, q.data_ptr(), d.data_ptr(),
                             None if m is None else m.data_ptr())
        return (q, d, m) if ok else None

    def rms(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of a contiguous float32 x, scaled by w [x.shape[-1]]."""
        if x.dtype != torch.float32 or w.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError("rms: contiguous float32 only")
        n = x.shape[-1]
        if w.shape != (n,) or not w.is_contiguous():
            raise ValueError(f"rms: w must be [{n}] and contiguous")
        y = torch.empty_like(x)
        self._rms(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
        return y

    def rms_heads(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each head of x [T, heads, D] in place (float32, unit stride within a
        head, heads D apart, tokens at any stride), head h scaled by w[h] (w [heads, D])."""
        T, heads, D = x.shape
        if (x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != D
                or w.dtype != torch.float32 or w.shape != (heads, D) or not w.is_contiguous()):
            raise ValueError("rms_heads: x [T, heads, D] float32 with unit and D strides; "
                             "w [heads, D] contiguous float32")
        self._rms_heads(x.data_ptr(), w.data_ptr(), T, heads, D, x.stride(0), eps)
        return x

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE in place on x [T, heads, W] (float32, unit stride within a head,
        heads at least W apart, a wider head's tail among them; tokens at any stride); cos, sin
        [T, R] contiguous, R <= W even."""
        T, heads, W = x.shape
        R = cos.shape[-1]
        if (x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) < W
                or cos.dtype != torch.float32 or cos.shape != (T, R) or sin.shape != (T, R)
                or not (cos.is_contiguous() and sin.is_contiguous()) or R > W or R % 2):
            raise ValueError("rope: x [T, heads, W] float32 with unit stride, heads at least W "
                             "apart; cos, sin [T, R] contiguous float32, R <= W even")
        self._rope(x.data_ptr(), T, heads, x.stride(1), x.stride(0), cos.data_ptr(),
                   sin.data_ptr(), R)
        return x

    def draft_head(self, x: torch.Tensor, w, b: torch.Tensor | None = None,
                   threads: int = 1, top: int = 16) -> torch.Tensor:
        """A drafter's LM head over the model's weight blocks (`QWeight`): x w^T + b with x
        rounded to int8 a block of 32 (`vc_linear_qw_q8x`, VNNI's or AVX2's integer dot products:
        an 8-bit head read at two to three times the exact product's rate), then each row's `top`
        largest logits computed again from x itself (`vc_linear_qw_refine`), so that a greedy
        draft takes the exact head's argmax unless that token fell out of the rounded head's
        `top` (rounding alone, every logit from it, cost about one token of τ at 16 x 8k; the
        drafts are verified either way). Without AVX512-VNNI or AVX2 (`q8x` False): the exact
        product."""
        y = self(x, w, b, threads, int8_x=1)
        if self.q8x:
            x = x.contiguous()
            m, k = x.shape
            if self._fn_qw_refine(x.data_ptr(), w.address, None if b is None else b.data_ptr(),
                                  y.data_ptr(), m, y.shape[1], k, top):
                raise ValueError("draft_head: block weights (k a multiple of 32, 4 or 8 bits) "
                                 "and 1 <= top <= 64")
        return y

    def __call__(self, x: torch.Tensor, w, b: torch.Tensor | None = None,
                 threads: int = 1, int8_x: int = 0) -> torch.Tensor:
        """x w^T + b; w float32, bfloat16 (a drafter's copy, `Runner.draft_weights`:
        `vc_linear_bf16w`, where x is split into two bfloat16 parts if `bf16_dot`), or a
        `vericache.model.qweights.QWeight` (the model's own quantized blocks: `vc_linear_qw`,
        the bits float32 w gives; `int8_x` 1, `vc_linear_qw_q8x`: x rounded to int8 a block
        of 32, a drafter's head: `draft_head`; `int8_x` 2, `vc_linear_qw_q8x2`: x in two int8
        parts, a drafter's layers where `q8x_vnni`)."""
        from vericache.model.qweights import QWeight

        blocks = isinstance(w, QWeight)
        if (x.dtype != torch.float32 or x.device.type != "cpu"
                or not blocks and w.dtype not in (torch.float32, torch.bfloat16)):
            raise TypeError("linear: float32 x and float32, bfloat16 or block weights, on CPU only")
        if not blocks and not w.is_contiguous() or (b is not None and not b.is_contiguous()):
            raise ValueError("linear: w and b must be contiguous")
        x = x.contiguous()
        (m, k), (n, kw) = x.shape, tuple(w.shape)
        if kw != k:
            raise ValueError(f"linear: x has {k} columns, w {kw}")
        y = x.new_empty(m, n)
        args = (x.data_ptr(), w.address if blocks else w.data_ptr(),
                None if b is None else b.data_ptr(), y.data_ptr(), m, n, k, threads)
        if blocks:
            rc = {0: self._fn_qw, 1: self._fn_qw_q8x, 2: self._fn_qw_q8x2}[int(int8_x)](*args)
            if rc == -1:
                raise MemoryError("linear: out of memory for x in int8")
            if rc:
                raise ValueError("linear: block weights need k a multiple of 32 and 4 or 8 bits")
        elif w.dtype == torch.float32:
            self._fn(*args)
        elif self._fn_bf16w(*args):
            raise MemoryError("linear: out of memory for x in bfloat16")
        return y


def _load(name: str, kind: type):
    """The compiled library `name` wrapped in `kind`, or None (no compiler, a failed build, or
    VERICACHE_KERNELS=0); built once a process."""
    if os.environ.get("VERICACHE_KERNELS", "1") == "0":
        return None
    with _lock:
        if name not in _loaded:
            try:
                _loaded[name] = kind(ctypes.CDLL(str(_build(name))))
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", "") or e
                log.warning("native %s kernel unavailable (%s); using torch's", name, detail)
                _loaded[name] = None
        return _loaded[name]


def attend() -> Attend | None:
    """The compiled attention kernel, or None (the runner then uses SDPA)."""
    return _load("attend", Attend)


def linear() -> Linear | None:
    """The compiled skinny-product kernel, or None (the runner then uses F.linear)."""
    return _load("linear", Linear)
