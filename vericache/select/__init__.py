"""Which prompt tokens the drafter holds, and how the verifier moves them (`base` has the words)."""

from vericache.select.base import SelectionDelta, SelectionPolicy, SelectionState
from vericache.select.registry import make_selection, register_selection, selection_names

__all__ = ["SelectionDelta", "SelectionPolicy", "SelectionState", "make_selection",
           "register_selection", "selection_names"]
