"""Plug-ins named by a spec string, "NAME" or "NAME:key=value,...": compressors and selection
policies are built from one and report one (`Named.spec`), so equal specs mean equal objects."""

from __future__ import annotations

from typing import ClassVar


def parse_spec(text: str, params: dict | None = None) -> tuple[str, dict]:
    """("NAME", {key: value}) of "NAME:key=value,..."; numbers with a "." are floats, other
    values ints; keys already in `params` win."""
    name, _, rest = text.partition(":")
    out = dict(params or {})
    for kv in filter(None, rest.split(",")):
        key, _, val = kv.partition("=")
        out.setdefault(key.strip(), float(val) if "." in val else int(val))
    return name, out


class Named:
    """A plug-in with a registry name and the parameters it was built with."""

    name: ClassVar[str]

    def __init__(self, **params):
        self.params = params

    @property
    def spec(self) -> str:
        """Name plus parameters, sorted: equal specs make equal objects."""
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec}>"
