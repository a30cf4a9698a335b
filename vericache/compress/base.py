"""The compressor interface: how a lossy KV cache for drafting is made from the full KV.

Methods, when they are called and how often:
- `compress(span)`: once per complete chunk of a prompt's full KV (C tokens, default 256),
  right after prefill computed it. Pure: no side effects, the result depends only on the span
  (and on the span's observation queries), never on later tokens. That makes every
  compressor *prefix-causal*: a compressed chunk is stored under the chunk's prefix key and
  reused by any prompt that shares the prefix.
- `decompress(chunk)`: once per chunk when a drafter cache is built (attach). Returns the kept
  tokens' keys and values, dense, in the model dtype; keys are already rotated by their
  original positions, so dropped tokens leave no gap to fix.
- `exact_tail(prompt_len)`: once per request: how many of the prompt's last tokens the drafter
  keeps exact (a recent window). Chunks that end before the tail are compressed; the rest is
  copied exact. Default: none beyond the last, partial chunk.
- `observation_window`: how many of a chunk's last queries `compress` needs (SnapKV); the
  prefill captures them. Default 0.
- `drops_tokens`: whether chunks keep a subset of their tokens (tensor "pos" holds which).
  Only then can a selection policy (`vericache.select`) move the drafter's set.
- `requantize(k, v)`: tokens a selection policy moves into the drafter's set pass through it,
  so they are stored as lossy as the compressor stores the rest. Default: unchanged.
- `salient_budget(region)`: for a compressor that keeps every token at a low precision (KIVI),
  how many of the region's tokens per layer and KV head a selection policy may hold at its
  move's precision instead (8 bits by default), the best-scored ones. Default 0: none (a
  token-dropping compressor's policy moves tokens in and out instead).

A new compressor subclasses `Compressor`, implements `compress` and `decompress`, and is
registered by name in `vericache/compress/registry.py`; scheduling and verification do not
change.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vericache.spec_string import Named


@dataclass
class KVSpan:
    """The exact KV of tokens [start, start + n) of one sequence."""

    k: torch.Tensor  # [layers, Hkv, n, D], post-RoPE
    v: torch.Tensor  # [layers, Hkv, n, D]
    start: int
    obs_q: torch.Tensor | None = None  # [layers, Hq, w, D] post-RoPE queries of the last w tokens

    @property
    def length(self) -> int:
        return self.k.shape[2]


@dataclass
class CompressedChunk:
    """A compressed span: named tensors plus the spec of the compressor that made them."""

    compressor: str  # the compressor's spec, e.g. "snapkv:ratio=4,window=16"
    start: int
    length: int  # tokens of the span it stands for
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Compressor(Named, ABC):
    """Makes the drafter's lossy KV from the full KV. See the module docstring. Equal specs
    (`Named.spec`) make equal compressed chunks."""

    observation_window: int = 0
    drops_tokens: ClassVar[bool] = False

    @abstractmethod
    def compress(self, span: KVSpan) -> CompressedChunk:
        """Compress one chunk of exact KV."""

    @abstractmethod
    def decompress(self, chunk: CompressedChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept tokens' (k, v), each [layers, Hkv, m, D] in the model dtype."""

    def exact_tail(self, prompt_len: int) -> int:
        return 0

    def kept_in_chunk(self, start: int, length: int) -> int:
        """How many tokens `compress` keeps of the chunk [start, start + length) (the drafter
        holds them decompressed, in its K/V dtype, `Runner.draft_dtype`): with the exact
        tail, what its memory budget is charged (`vericache.engine.prefill.drafter_tokens`)."""
        return length

    def requantize(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entering tokens' (k, v) [layers, Hkv, r, D] as the drafter would hold them."""
        return k, v

    def salient_budget(self, region: int) -> int:
        """Region tokens per layer and KV head a policy may hold more precisely (module doc)."""
        return 0

    def draft_kv(self, chunks: list[CompressedChunk], tail_k: torch.Tensor,
                 tail_v: torch.Tensor, dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's initial KV: the chunks decompressed in order, then the exact tail
        ([layers, Hkv, n, D] each, in host memory as the chunks are: a device tail is copied;
        the drafter moves the whole onto its own device). `dtype`: the drafter's cache dtype,
        which each part is rounded to as it is written (once, as the drafter would round the
        whole); None: the parts' own. An 8k prompt's parts in float32 are about 46 MB a
        tensor: in bfloat16, half as much fresh memory is faulted in per attach."""
        parts = [self.decompress(c) for c in chunks] + [(tail_k.cpu(), tail_v.cpu())]
        if dtype is None:  # the parts' own, promoted as torch.cat would
            dtype = functools.reduce(torch.promote_types, [pk.dtype for pk, _ in parts])
        L, H, _, D = tail_k.shape
        k = torch.empty((L, H, sum(pk.shape[2] for pk, _ in parts), D), dtype=dtype)
        v = torch.empty_like(k)
        a = 0
        for pk, pv in parts:
            k[:, :, a:a + pk.shape[2]], v[:, :, a:a + pk.shape[2]] = pk, pv
            a += pk.shape[2]
        return k, v

    def draft_positions(self, chunks: list[CompressedChunk], tail_start: int, tail_len: int,
                        layers: int, heads: int) -> torch.Tensor:
        """Absolute positions of the drafter's initial slots, in `draft_kv`'s order: [layers,
        Hkv, n] int64 (the drafter's sliding-window layers need them)."""
        parts = [self.kept_positions(c) if self.drops_tokens
                 else torch.arange(c.start, c.start + c.length).expand(layers, heads, -1)
                 for c in chunks]
        parts.append(torch.arange(tail_start, tail_start + tail_len).expand(layers, heads, -1))
        return torch.cat(parts, dim=2)

    def kept_positions(self, chunk: CompressedChunk) -> torch.Tensor:
        """Absolute positions of the kept tokens: [layers, Hkv, m], in the order decompress
        returns them (the drafter's slot order)."""
        pos = chunk.tensors.get("pos")
        if pos is not None:
            return pos.long() + chunk.start
        k, _ = self.decompress(chunk)
        L, H, m, _ = k.shape
        return (torch.arange(m) + chunk.start).expand(L, H, m)
