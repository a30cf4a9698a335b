"""A model's weights in the blocks they were quantized in, where that is lossless.

A GGUF model's products arrive quantized (the default SmolLM2's layers Q4_1, its tied
embedding and LM head Q8_0); the loader widens them to float32, so every block of 32 weights
along a row is d * q + m for one scale d and offset m (float16 values) and small integers q.
`blocks_of` finds that form again from the float32 matrix and keeps it only if it gives
every weight back bit for bit. A pass then multiplies x by the model's own weights
(`linear.c`'s `vc_linear_qw`, with `vc_linear_f32`'s bits) reading 5 bits a weight (4-bit q,
float32 d and m per 32) or 9 (8-bit q, float32 d) instead of 32 (`Runner._blocks`: every
product of at most BLOCK_ROWS rows, the drafter's, the verifier's and plain decoding's).
Matrices without the form (a float32, float16 or bfloat16 checkpoint's) keep float32, and the
drafter a bfloat16 copy (`Runner._draft_copy`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

QB = 32  # weights a block (linear.c's QB)


class _QW(ctypes.Structure):
    """`linear.c`'s `struct vc_qw`."""

    _fields_ = [("q", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("bits", ctypes.c_int64)]


@dataclass
class QWeight:
    """A [n, k] matrix as blocks of QB along k: q (bits 4: uint8 [n, k / 2], two a byte, byte
    c of a block holding elements c and c + QB / 2 in its low and high nibbles; bits 8: int8
    [n, k]), d and m float32 [n, k / QB] (m None: 0). `struct` is the C view of it."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    bits: int
    shape: tuple[int, int]
    struct: _QW = field(init=False, repr=False)

    def __post_init__(self):
        self.struct = _QW(self.q.data_ptr(), self.d.data_ptr(),
                          None if self.m is None else self.m.data_ptr(), self.bits)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.struct)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.q, self.d, self.m) if t is not None)

    def widen(self) -> torch.Tensor:
        """The float32 matrix (d * q + m), as the kernel forms each weight."""
        n, k = self.shape
        qi = _unpack(self.q, self.bits, n, k).float()
        w = self.d.unsqueeze(-1) * qi
        if self.m is not None:
            w = w + self.m.unsqueeze(-1)
        return w.reshape(n, k)


def _unpack(q: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    """q's integers as [n, k / QB, QB]."""
    if bits == 8:
        return q.view(n, k // QB, QB)
    b = q.view(n, k // QB, QB // 2)
    return torch.cat([b & 15, b >> 4], dim=-1)


def _exact(w: torch.Tensor, d: torch.Tensor, q: torch.Tensor, m: torch.Tensor | None) -> bool:
    """Whether d * q (+ m) gives w back bit for bit, with d * q exact in float32 (d a float16
    value, |q| < 2^13), as `vc_linear_qw` computes it."""
    if not torch.equal(d, d.half().float()):
        return False
    r = d.unsqueeze(-1) * q.float()
    if m is not None:
        r = r + m.unsqueeze(-1)
    return torch.equal(r.view(torch.int32), w.view(torch.int32))


def blocks_of(w: torch.Tensor) -> QWeight | None:
    """w (float32 [n, k]) as 4-bit affine blocks (Q4_1's form: q 0..15, the block's least
    weight its offset) or 8-bit symmetric ones (Q8_0's: q -127..127, no offset), whichever
    gives every weight back exactly, 4-bit first; None if neither does (or k is not a
    multiple of QB). In one pass of the native kernel (`linear.c`'s `vc_blocks_of`), with
    torch's result, torch's without it: the default model's 121 matrices in 0.26-0.32 s
    against `blocks_of_torch`'s 0.65-0.96 s, and its `load_model` in 3.3-3.6 s against
    4.7-4.9 s before, one thread of a 2-vCPU Zen 5 (`benchmarks/load_time.py`)."""
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % QB or w.numel() == 0:
        return None
    from vericache.model import kernels

    lib = kernels.linear()
    if lib is None:
        return blocks_of_torch(w)
    n, k = w.shape
    w = w.contiguous()
    for bits in (4, 8):
        found = lib.blocks_of(w, bits)
        if found is not None:
            return QWeight(*found, bits, (n, k))
    return None


def blocks_of_torch(w: torch.Tensor) -> QWeight | None:
    """`blocks_of` in torch's operations (without the native kernel; the definition the
    kernel is tested against)."""
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % QB or w.numel() == 0:
        return None
    n, k = w.shape
    wb = w.contiguous().view(n, k // QB, QB)
    lo, hi = wb.amin(-1), wb.amax(-1)
    # Q4_1: the least weight has q 0, the greatest q 15 (llama.cpp's quantizer)
    d = ((hi - lo) / 15).half().float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round((wb - lo.unsqueeze(-1)) / safe.unsqueeze(-1))
    if bool(((q >= 0) & (q <= 15)).all()) and _exact(wb, d, q, lo):
        q8 = q.to(torch.uint8)
        packed = (q8[..., : QB // 2] | (q8[..., QB // 2:] << 4)).reshape(n, k // 2).contiguous()
        return QWeight(packed, d.contiguous(), lo.contiguous(), 4, (n, k))
    # Q8_0: the largest magnitude has |q| 127
    d = (wb.abs().amax(-1) / 127).half().float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(wb / safe.unsqueeze(-1))
    if bool(((q >= -128) & (q <= 127)).all()) and _exact(wb, d, q, None):
        return QWeight(q.to(torch.int8).reshape(n, k).contiguous(), d.contiguous(), None, 8,
                       (n, k))
    return None
