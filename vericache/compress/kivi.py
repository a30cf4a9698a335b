"""KIVI quantization (Liu et al., 2024): keys per channel, values per token, packed codes.

Keys are quantized in groups of `group` consecutive tokens per channel; values in groups of
`group` channels per token; each group stores an fp16 scale and minimum, codes are packed
`8 // bits` to a byte. The last `residual` tokens of a prompt stay exact (the exact tail),
as do the drafter's own new tokens.

Salient tokens: KIVI keeps every token, so a selection policy (`vericache.select`) has
nothing to move in or out; it moves precision instead. Up to one region token in `salient`
per layer and KV head, the best-scored by the policy, is written over its 2-bit (or 4-bit)
values at the move's precision (8 bits by default), as mixed-precision caches keep salient
tokens finer (ZipCache, MiKV). `salient=0` turns that off.
"""

from __future__ import annotations


import torch

from vericache.compress.base import CompressedChunk, Compressor, KVSpan
from vericache.compress.dropping import SnapKV, gather_tokens
from vericache.errors import InvalidArgument


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., n] (n a multiple of 8 // bits) -> packed uint8 [..., n * bits / 8]."""
    per = 8 // bits
    c = codes.view(*codes.shape[:-1], -1, per)
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8)
    for i in range(per):
        out |= c[..., i] << (i * bits)
    return out


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (i * bits)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).view(*packed.shape[:-1], -1)[..., :n]


def quantize_groups(x: torch.Tensor, bits: int, dim: int) -> dict[str, torch.Tensor]:
    """Asymmetric min/max quantization of x over groups laid along `dim` (a group axis)."""
    x = x.float()
    mn = x.amin(dim=dim, keepdim=True)
    mx = x.amax(dim=dim, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((mx - mn) / levels).clamp(min=1e-8).half()
    mn = mn.half()
    codes = ((x - mn.float()) / scale.float()).round().clamp(0, levels).to(torch.uint8)
    return {"codes": codes, "scale": scale, "min": mn}


class KIVI(Compressor):
    name = "kivi"

    def __init__(self, bits: int = 2, group: int = 32, residual: int = 64, salient: int = 8):
        if int(bits) not in (2, 4):
            raise InvalidArgument(f"kivi bits must be 2 or 4 (got {bits})", param="bits")
        if int(salient) < 0:
            raise InvalidArgument(f"kivi salient must be >= 0 (got {salient})", param="salient")
        self.bits, self.group, self.residual = int(bits), int(group), int(residual)
        self.salient = int(salient)
        # the chunks do not depend on `salient`: a default shows not in the spec (the store's
        # keys), so chunks stored before it existed are found
        extra = {} if self.salient == 8 else {"salient": self.salient}
        super().__init__(bits=self.bits, group=self.group, residual=self.residual, **extra)

    def exact_tail(self, prompt_len: int) -> int:
        return self.residual

    def salient_budget(self, region: int) -> int:
        return region // self.salient if self.salient else 0

    def quantize(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """k, v: [L, H, n, D] -> packed tensors. Tokens are padded to a multiple of `group`."""
        L, H, n, D = k.shape
        g = self.group
        if D % g or D % (8 // self.bits):
            raise InvalidArgument(f"head dim {D} is not a multiple of the group {g}", param="group")
        pad = (-n) % g
        if pad:  # repeat the last token so the padded rows do not widen any group's range
            k = torch.cat([k, k[:, :, -1:].expand(L, H, pad, D)], dim=2)
        nk = n + pad
        kq = quantize_groups(k.reshape(L, H, nk // g, g, D), self.bits, dim=3)  # per channel
        vq = quantize_groups(v.reshape(L, H, n, D // g, g), self.bits, dim=4)  # per token
        return {
            "k_codes": _pack(kq["codes"].transpose(-1, -2).contiguous(), self.bits),  # [L,H,n/g,D,g*b/8]
            "k_scale": kq["scale"], "k_min": kq["min"],
            "v_codes": _pack(vq["codes"], self.bits), "v_scale": vq["scale"], "v_min": vq["min"],
            "n": torch.tensor([n], dtype=torch.int32),
        }

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(t["n"][0])
        g = self.group
        kc = _unpack(t["k_codes"], self.bits, g).transpose(-1, -2)  # [L, H, n/g, g, D]
        k = kc.float() * t["k_scale"].float() + t["k_min"].float()
        L, H, ng, _, D = k.shape
        k = k.reshape(L, H, ng * g, D)[:, :, :n]
        vc = _unpack(t["v_codes"], self.bits, g)  # [L, H, n, D/g, g]
        v = (vc.float() * t["v_scale"].float() + t["v_min"].float()).reshape(L, H, n, D)
        return k.to(dtype).contiguous(), v.to(dtype).contiguous()

    def compress(self, span: KVSpan) -> CompressedChunk:
        t = self.quantize(span.k, span.v)
        t["dtype_probe"] = torch.empty(0, dtype=span.k.dtype)
        return CompressedChunk(self.spec, span.start, span.length, t)

    def decompress(self, chunk: CompressedChunk):
        return self.dequantize(chunk.tensors, chunk.tensors["dtype_probe"].dtype)


class SnapKVKIVI(Compressor):
    """SnapKV token dropping, then KIVI quantization of the kept tokens."""

    name = "snapkv-kivi"
    drops_tokens = True

    def __init__(self, ratio: float = 4.0, bits: int = 4, window: int = 16, group: int = 32,
                 residual: int = 64):
        self.snap = SnapKV(ratio=ratio, window=window)
        self.kivi = KIVI(bits=bits, group=group, residual=residual)
        self.observation_window = self.snap.observation_window
        super().__init__(ratio=self.snap.ratio, bits=self.kivi.bits, window=self.snap.window,
                         group=self.kivi.group, residual=self.kivi.residual)

    def exact_tail(self, prompt_len: int) -> int:
        return self.kivi.residual

    def kept_in_chunk(self, start: int, length: int) -> int:
        return self.snap.kept_in_chunk(start, length)

    def compress(self, span: KVSpan) -> CompressedChunk:
        idx = self.snap.select(span)
        t = self.kivi.quantize(gather_tokens(span.k, idx), gather_tokens(span.v, idx))
        t["pos"] = idx.to(torch.int32)
        t["dtype_probe"] = torch.empty(0, dtype=span.k.dtype)
        return CompressedChunk(self.spec, span.start, span.length, t)

    def decompress(self, chunk: CompressedChunk):
        return self.kivi.dequantize(chunk.tensors, chunk.tensors["dtype_probe"].dtype)

    def requantize(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # in float32 whatever k's dtype (an 8-bit move's is bfloat16): the drafter rounds the
        # dequantized values once, to its own
        return self.kivi.dequantize(self.kivi.quantize(k, v), torch.float32)
