"""Protobuf <-> core conversions for the drafter and verifier services, in one place."""

from __future__ import annotations

import numpy as np
import torch

from vericache.errors import InvalidArgument

MAX_PROMPT_TOKENS = 1 << 20


def token_list(ids, vocab_size: int, param: str = "token_ids", allow_empty: bool = False) -> list[int]:
    out = list(ids)
    if not out and not allow_empty:
        raise InvalidArgument(f"{param} is empty", param)
    if len(out) > MAX_PROMPT_TOKENS:
        raise InvalidArgument(f"{param} has {len(out)} tokens, more than {MAX_PROMPT_TOKENS}", param)
    if out and (min(out) < 0 or max(out) >= vocab_size):
        raise InvalidArgument(f"{param} holds a token id outside [0, {vocab_size})", param)
    return out


def probs_to_bytes(q: torch.Tensor | None) -> bytes:
    """[k, V] float32 -> raw bytes (empty for greedy)."""
    return b"" if q is None else q.float().contiguous().numpy().tobytes()


def probs_from_bytes(data: bytes, k: int, vocab_size: int) -> torch.Tensor | None:
    if not data:
        return None
    if len(data) != 4 * k * vocab_size:
        raise InvalidArgument(f"draft_probs holds {len(data)} bytes, expected {4 * k * vocab_size}",
                              "draft_probs")
    return torch.from_numpy(np.frombuffer(data, dtype=np.float32).reshape(k, vocab_size).copy())
