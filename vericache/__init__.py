"""VeriCache: lossless compressed-KV speculative decoding.

The lossy (compressed) KV cache only drafts; the full KV verifies every token,
so greedy output is token-for-token the output of plain full-KV greedy decoding.
"""

import os

__version__ = "0.1.0"

# PyTorch's CPU allocator asks the kernel for transparent huge pages (madvise) for every
# buffer of 2 MB or more when THP_MEM_ALLOC_ENABLE is 1; it reads the variable once, at its
# first allocation, so it is set here, before any. A full 8k SmolLM2 cache is 368 MB of fresh
# memory that a request's admission fills, and so is each offloaded verification's working
# copy: faulted in 4 KB pages, filling one took 74-170 ms on a 2-vCPU EPYC, in 2 MB pages
# 26-33 ms (/tmp probe). The 16 x 8k long-context bench ran 6-28% faster, by variant (means
# of two runs each; docs/performance.md, twenty-sixth session). Set it to 0 to keep the
# allocator's default.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
