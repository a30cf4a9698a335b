"""Chunk keys: a chained hash, so a key names a whole prefix (as in vLLM and LMCache).

A chunk is C consecutive tokens (default 256). The key of chunk i is

    sha256(VERSION, model id, namespace, key of chunk i-1, token ids of chunk i)

with the empty string as the parent of chunk 0. Two prompts share the key of chunk i exactly
when they share the model, the namespace (tenant) and every token up to the end of chunk i.
Only complete chunks get a key; a partial tail is never stored.

The *kind* of a stored value is part of the stored key: the full KV of a prefix's last chunk
lives under `full_key(k)`, a compressed form under `compressed_key(k, spec)` (the compressor
spec is hashed so keys stay short). `model_id` should name the model and its KV dtype
(e.g. "smollm2-135m-instruct@float32"), since full chunks of two dtypes differ.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence

from vericache.errors import InvalidArgument

DEFAULT_CHUNK_SIZE = 256
_VERSION = b"vericache-chunk-v1"


def chunk_key(model_id: str, parent: str, token_ids: Sequence[int], namespace: str = "") -> str:
    """The key of one chunk, given its parent's key ("" for the first chunk)."""
    h = hashlib.sha256()
    for part in (_VERSION, model_id.encode(), namespace.encode(), parent.encode()):
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.hexdigest()


def chunk_keys(model_id: str, token_ids: Sequence[int], chunk_size: int = DEFAULT_CHUNK_SIZE,
               namespace: str = "") -> list[str]:
    """Keys of the complete chunks of `token_ids`, in order; a partial tail gets none."""
    if chunk_size <= 0:
        raise InvalidArgument(f"chunk_size must be positive, got {chunk_size}", param="chunk_size")
    keys: list[str] = []
    parent = ""
    for start in range(0, len(token_ids) - chunk_size + 1, chunk_size):
        parent = chunk_key(model_id, parent, token_ids[start:start + chunk_size], namespace)
        keys.append(parent)
    return keys


def full_key(prefix_key: str) -> str:
    """Where the exact (full) KV of the prefix's last chunk is stored."""
    return f"{prefix_key}/full"


def compressed_key(prefix_key: str, compressor_spec: str) -> str:
    """Where the compressed form of the prefix's last chunk, made by `compressor_spec`, lives."""
    spec_hash = hashlib.sha256(compressor_spec.encode()).hexdigest()[:16]
    return f"{prefix_key}/c/{spec_hash}"


def stored_key(prefix_key: str, compressor_spec: str | None = None) -> str:
    """`full_key` when `compressor_spec` is None, else `compressed_key`."""
    if compressor_spec is None:
        return full_key(prefix_key)
    return compressed_key(prefix_key, compressor_spec)


_CHUNK_KEY = re.compile(r"[0-9a-f]{64}/(full|c/[0-9a-f]{16})")


def is_chunk_key(key: str) -> bool:
    """Whether `key` names a stored prefix chunk (`full_key` or `compressed_key`): its value
    is fixed by its name, unlike the per-request keys below, which are rewritten or deleted."""
    return _CHUNK_KEY.fullmatch(key) is not None


def refresh_key(request_id: str) -> str:
    """Where the verifier leaves a round's exact KV for the drafter (services only)."""
    return f"refresh/{request_id}"


def select_key(request_id: str) -> str:
    """Where the verifier leaves moves of the drafter's kept set for the drafter (services)."""
    return f"select/{request_id}"
