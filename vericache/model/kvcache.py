"""A preallocated per-sequence KV cache, written in place.

Layout: `k`, `v`: [num_layers, num_kv_heads, capacity, head_dim]; slots [0, length) are live.
Keys are stored after RoPE, so a cache may hold any subset of a sequence's tokens (token
dropping keeps the original positions baked into the keys). Appending writes the next slots;
rollback is `crop(n)`; nothing copies the whole cache per step (growth doubles capacity).

`pos` (optional, [num_layers, num_kv_heads, capacity] int64): the absolute position of each
slot's token, for sliding-window attention over a cache that holds a subset of the tokens (the
drafter's). None: slot i holds position i (a dense cache from position 0, the verifier's).
The runner writes the positions of the tokens it appends to a cache that has them.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 positions: bool = False):
        shape = (num_layers, num_kv_heads, max(1, capacity), head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.pos = torch.empty(shape[:3], dtype=torch.long, device=device) if positions else None
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more tokens (grows by doubling; copies only then)."""
        need = self.length + extra
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], cap, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        if self.pos is not None:
            pos = self.pos.new_empty(self.pos.shape[0], self.pos.shape[1], cap)
            pos[:, :, : self.length] = self.pos[:, :, : self.length]
            self.pos = pos

    def crop(self, length: int) -> None:
        """Keep the first `length` tokens (rollback after a rejected draft)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop({length}) outside [0, {self.length}]")
        self.length = length

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None = None) -> None:
        """Append tokens for every layer. k, v: [num_layers, num_kv_heads, n, head_dim]; pos
        (a cache with positions): [num_layers, num_kv_heads, n] or [n]."""
        n = k.shape[2]
        self.reserve(n)
        self.k[:, :, self.length : self.length + n] = k
        self.v[:, :, self.length : self.length + n] = v
        if self.pos is not None:
            if pos is None:
                raise ValueError("this cache records positions: append needs them")
            self.pos[:, :, self.length : self.length + n] = pos.to(self.pos.device)
        self.length += n

    def view(self, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The live keys and values of tokens [start, end): [L, Hkv, n, D] each (views)."""
        end = self.length if end is None else end
        return self.k[:, :, start:end], self.v[:, :, start:end]

    def nbytes(self) -> int:
        """Bytes of the live part (keys and values)."""
        per_token = 2 * self.k.shape[0] * self.k.shape[1] * self.k.shape[3] * self.k.element_size()
        return per_token * self.length

    @classmethod
    def from_tensors(cls, k: torch.Tensor, v: torch.Tensor, extra_capacity: int = 0,
                     pos: torch.Tensor | None = None) -> "KVCache":
        """A cache holding k, v ([L, Hkv, n, D]) with room for `extra_capacity` more tokens;
        with `pos` ([L, Hkv, n] or [n]), one that records positions."""
        c = cls(k.shape[0], k.shape[1], k.shape[3], k.shape[2] + extra_capacity, k.dtype, k.device,
                positions=pos is not None)
        c.append(k, v, pos)
        return c
