"""Every selection policy, registered by name in this one file; classes are imported lazily."""

from __future__ import annotations

import importlib

from vericache.errors import InvalidArgument, UnknownName
from vericache.select.base import SelectionPolicy
from vericache.spec_string import parse_spec

_REGISTRY: dict[str, tuple[str, str]] = {}


def register_selection(name: str, module: str, cls: str) -> None:
    if name in _REGISTRY:
        raise ValueError(f"selection policy {name!r} is already registered")
    _REGISTRY[name] = (module, cls)


def selection_names() -> list[str]:
    return sorted(_REGISTRY)


def make_selection(spec: str, **params) -> SelectionPolicy:
    """Build a policy by name; `spec` may carry parameters: "verify:every=8,tokens=64"."""
    name, params = parse_spec(spec, params)
    try:
        module, cls = _REGISTRY[name]
    except KeyError:
        raise UnknownName(f"unknown selection {name!r}; valid: {', '.join(selection_names())}",
                          param="selection") from None
    try:
        return getattr(importlib.import_module(module), cls)(**params)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"bad parameters for selection {name!r}: {e}", param="selection") from e


register_selection("static", "vericache.select.policies", "Static")
register_selection("question", "vericache.select.policies", "Question")
register_selection("verify", "vericache.select.policies", "Verify")
