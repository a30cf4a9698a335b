"""The reference compressor: keeps every token exact (drafts then equal the target's)."""

from __future__ import annotations

from vericache.compress.base import CompressedChunk, Compressor, KVSpan


class Identity(Compressor):
    name = "identity"

    def __init__(self):
        super().__init__()

    def compress(self, span: KVSpan) -> CompressedChunk:
        return CompressedChunk(self.spec, span.start, span.length,
                               {"k": span.k.contiguous(), "v": span.v.contiguous()})

    def decompress(self, chunk: CompressedChunk):
        return chunk.tensors["k"], chunk.tensors["v"]
