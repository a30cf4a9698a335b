"""Speculation: the accept rules (pure functions), the per-request draft length and the
engine's cost model that chooses it."""

from vericache.spec.accept import greedy_accept, speculative_accept
from vericache.spec.costmodel import CostModel
from vericache.spec.draftlen import DraftLength

__all__ = ["CostModel", "DraftLength", "greedy_accept", "speculative_accept"]
