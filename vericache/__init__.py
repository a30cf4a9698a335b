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


def _keep_freed_memory() -> None:
    """Have glibc's malloc keep memory freed in the process for the next allocation, as the
    tcmalloc or jemalloc that vLLM's and Intel's CPU guides preload would: buffers up to
    32 MB (its largest setting) come from its heap instead of each being mapped and faulted
    in afresh, and up to 512 MB freed at the heap's top stays there. An 8k admission's
    drafter KV (23 MB a tensor) took 46-61 ms to assemble in fresh memory and 3 ms in
    memory used before, on a 2-vCPU EPYC (docs/performance.md, thirty-first session).
    VERICACHE_MALLOC_KEEP=0 leaves malloc as it is; elsewhere than glibc nothing changes."""
    if os.environ.get("VERICACHE_MALLOC_KEEP", "1") == "0":
        return
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 512 << 20)


_keep_freed_memory()
