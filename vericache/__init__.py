"""VeriCache: lossless compressed-KV speculative decoding.

The lossy (compressed) KV cache only drafts; the full KV verifies every token,
so greedy output is token-for-token the output of plain full-KV greedy decoding.
"""

__version__ = "0.1.0"
