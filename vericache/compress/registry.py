"""Every compressor, registered by name in this one file; classes are imported lazily."""

from __future__ import annotations

import importlib

from vericache.compress.base import Compressor
from vericache.errors import InvalidArgument, UnknownName
from vericache.spec_string import parse_spec

_REGISTRY: dict[str, tuple[str, str]] = {}


def register_compressor(name: str, module: str, cls: str) -> None:
    if name in _REGISTRY:
        raise ValueError(f"compressor {name!r} is already registered")
    _REGISTRY[name] = (module, cls)


def compressor_names() -> list[str]:
    return sorted(_REGISTRY)


def compressor_class(name: str) -> type[Compressor]:
    try:
        module, cls = _REGISTRY[name]
    except KeyError:
        raise UnknownName(f"unknown compressor {name!r}; valid: {', '.join(compressor_names())}",
                          param="compressor") from None
    return getattr(importlib.import_module(module), cls)


def make_compressor(name: str, ratio: float | None = None, **params) -> Compressor:
    """Build a compressor by name. `ratio` applies to the dropping ones; `name` may carry
    parameters as in a spec: "kivi:bits=4" or "snapkv:ratio=8,window=32"."""
    name, params = parse_spec(name, params)
    cls = compressor_class(name)
    if ratio is not None and "ratio" in cls.__init__.__code__.co_varnames:
        params["ratio"] = ratio
    try:
        return cls(**params)
    except TypeError as e:
        raise InvalidArgument(f"bad parameters for compressor {name!r}: {e}", param="compressor") from e


register_compressor("identity", "vericache.compress.identity", "Identity")
register_compressor("streamingllm", "vericache.compress.dropping", "StreamingLLM")
register_compressor("snapkv", "vericache.compress.dropping", "SnapKV")
register_compressor("kivi", "vericache.compress.kivi", "KIVI")
register_compressor("snapkv-kivi", "vericache.compress.kivi", "SnapKVKIVI")
