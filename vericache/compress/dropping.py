"""Token-dropping compressors: StreamingLLM (sinks + recent window) and SnapKV.

Both keep a subset of tokens per layer and KV head, at their original positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vericache.compress.base import CompressedChunk, Compressor, KVSpan
from vericache.errors import InvalidArgument


def _check_ratio(ratio: float) -> float:
    ratio = float(ratio)
    if not ratio >= 1.0:
        raise InvalidArgument(f"ratio must be >= 1 (got {ratio})", param="ratio")
    return ratio


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x: [L, H, n, D], idx: [L, H, m] -> [L, H, m, D]."""
    return torch.gather(x, 2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


class StreamingLLM(Compressor):
    """Attention sinks plus a recent window (Xiao et al., 2023).

    A chunk keeps only the sink tokens it holds (positions < sinks); the recent window is the
    exact tail, sized so the whole cache is about prompt_len / ratio tokens.
    """

    name = "streamingllm"
    drops_tokens = True

    def __init__(self, ratio: float = 8.0, sinks: int = 4):
        self.ratio, self.sinks = _check_ratio(ratio), int(sinks)
        super().__init__(ratio=self.ratio, sinks=self.sinks)

    def compress(self, span: KVSpan) -> CompressedChunk:
        keep = max(0, min(span.length, self.sinks - span.start))
        L, H = span.k.shape[:2]
        pos = torch.arange(keep, dtype=torch.int32).expand(L, H, keep).contiguous()
        return CompressedChunk(self.spec, span.start, span.length, {
            "k": span.k[:, :, :keep].contiguous(), "v": span.v[:, :, :keep].contiguous(), "pos": pos})

    def decompress(self, chunk: CompressedChunk):
        return chunk.tensors["k"], chunk.tensors["v"]

    def exact_tail(self, prompt_len: int) -> int:
        return max(0, math.ceil(prompt_len / self.ratio) - self.sinks)

    def kept_in_chunk(self, start: int, length: int) -> int:
        return max(0, min(length, self.sinks - start))


class SnapKV(Compressor):
    """Observation-window scoring (Li et al., 2024), per chunk and per KV head.

    The chunk's last `window` queries score its keys (softmax over the chunk, causal), summed
    over the window and over the query heads of each KV group, max-pooled over `pool`
    neighbours; the top ceil(n / ratio) tokens per layer and KV head are kept. The prompt's
    last `recent` tokens (the question, the chat template's turn markers) stay exact.
    """

    name = "snapkv"
    drops_tokens = True

    def __init__(self, ratio: float = 4.0, window: int = 16, pool: int = 7, recent: int = 64):
        self.ratio, self.window, self.pool = _check_ratio(ratio), int(window), int(pool)
        self.recent = int(recent)
        self.observation_window = self.window
        super().__init__(ratio=self.ratio, window=self.window, pool=self.pool, recent=self.recent)

    def exact_tail(self, prompt_len: int) -> int:
        return self.recent

    def kept_in_chunk(self, start: int, length: int) -> int:
        return min(length, max(1, math.ceil(length / self.ratio)))

    def select(self, span: KVSpan) -> torch.Tensor:
        """Indices (within the span) of the kept tokens: [layers, Hkv, m], sorted."""
        L, hkv, n, d = span.k.shape
        m = max(1, math.ceil(n / self.ratio))
        if m >= n:
            return torch.arange(n).expand(L, hkv, n).contiguous()
        if span.obs_q is None:
            raise InvalidArgument("snapkv needs the chunk's observation queries")
        q = span.obs_q.float()  # [L, Hq, w, D]
        w = q.shape[2]
        g = q.shape[1] // hkv
        q = q.reshape(L, hkv, g * w, d)  # obs_q may be a slice of wider captured rows
        scores = torch.matmul(q, span.k.float().transpose(-1, -2)) * d ** -0.5  # [L, Hkv, G w, n]
        qpos = torch.arange(n - w, n).repeat(g)  # the window's positions within the span
        scores.masked_fill_(torch.arange(n)[None, :] > qpos[:, None], float("-inf"))
        votes = torch.softmax(scores, dim=-1).sum(dim=2)  # [L, Hkv, n]
        if self.pool > 1:
            votes = F.max_pool1d(votes.view(L * hkv, 1, n), self.pool, stride=1,
                                 padding=self.pool // 2).view(L, hkv, n)
        idx = votes.topk(m, dim=-1).indices
        return idx.sort(dim=-1).values

    def compress(self, span: KVSpan) -> CompressedChunk:
        idx = self.select(span)
        return CompressedChunk(self.spec, span.start, span.length, {
            "k": gather_tokens(span.k, idx), "v": gather_tokens(span.v, idx),
            "pos": idx.to(torch.int32)})

    def decompress(self, chunk: CompressedChunk):
        return chunk.tensors["k"], chunk.tensors["v"]
