"""Compressors behind one interface (`Compressor`) and one registry."""

from vericache.compress.base import CompressedChunk, Compressor, KVSpan
from vericache.compress.registry import compressor_names, make_compressor, register_compressor

__all__ = ["CompressedChunk", "Compressor", "KVSpan", "compressor_names", "make_compressor",
           "register_compressor"]
