"""Speculation: the accept rules (pure functions) and the draft-length controller."""

from vericache.spec.accept import greedy_accept, speculative_accept
from vericache.spec.draftlen import DraftLength

__all__ = ["DraftLength", "greedy_accept", "speculative_accept"]
