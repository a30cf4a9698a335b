"""Selection: which prompt tokens the drafter's lossy cache holds, and how that set moves.

Words (used across `vericache.select`, the verifier and the drafter):
- region: the prompt tokens before the drafter's exact tail, [0, tail_start). A token-dropping
  compressor keeps a subset of them per layer and KV head; the tail, the sinks and the tokens
  generated while decoding are never moved.
- base set: what the prefix-causal compressed chunks keep (the store holds it; a remote drafter
  receives it first). Slot i of the drafter's cache holds the i-th kept token of the chunks
  taken in order, so the verifier, which made (or read) the chunks, knows the drafter's layout.
- kept set: what the drafter holds now, per layer and KV head: `positions[l, h, slot]`. Its
  size per row (the budget, m) never changes: a move swaps tokens, slot for slot.
- salient set: over a compressor that keeps every token (KIVI), the region tokens the drafter
  holds at a move's precision over their quantized values (`Compressor.salient_budget`, m per
  row). It starts empty (`positions` -1: a free entry of the record) and only grows: a move
  (`upgrade_towards`) writes a token over its own slot (the drafter's slot i holds position i
  there), so none has to go back to its quantized values.
- delta: one move of the kept set: per row, the slots to overwrite and the positions (with
  their exact K/V, re-quantized as the compressor stores them) that enter. The verifier
  computes it (it holds the full KV); the drafter only writes it (`Drafter.apply_delta`).
- policy: when and towards what the kept set moves (`static`, `question`, `verify`).

Methods of a policy, when they are called and how often:
- `after_prefill(state, votes, queries, cache)`: once per request, after prefill (or the
  load of a cached prefix), on the verifier, with the attention votes of the prompt's last
  `window` queries over its tokens (the prefill passes give them). May return a delta.
- `after_verify(state, votes, accepted, drafted, cache)`: once per verify round of the
  request, with the round's attention votes over the full KV when `needs_votes`. May return
  a delta.
Policies are pure over the tensors they are given: no I/O, no clocks.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from vericache.spec_string import Named

SINKS = 4  # the first tokens always stay (attention sinks)


_HALF_EVEN = 12582912.0  # 1.5 * 2**23: x + it - it rounds |x| < 2**22 half to even


def _scaled_8bit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`to_8bit`'s q (float32, integer values) and e (float32)."""
    xf = x.float()
    amax = xf.abs().amax(-1).clamp(min=2.0 ** -100)
    e = torch.ceil(torch.log2(amax / 127.0))
    q = xf * torch.exp2(-e)[..., None]
    # |q| <= 127: rounded half to even, as torch.round does (which took 60-80 ms a call in
    # an 8k question move on a 2-vCPU machine, about 30% of the move)
    return q.add_(_HALF_EVEN).sub_(_HALF_EVEN).clamp_(-127, 127), e


def to_8bit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] as int8 values q and a power-of-two scale per row, 2**e (e: int8 [...]):
    x ~ q * 2**e with |q| <= 127. The scale being a power of two, a row that is already such
    a product goes through this again unchanged (the codec re-encodes a delta's values)."""
    q, e = _scaled_8bit(x)
    return q.to(torch.int8), e.to(torch.int8)


def from_8bit(q: torch.Tensor, e: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of `to_8bit`'s (q, e)."""
    return (q.float() * torch.exp2(e.float())[..., None]).to(dtype)


def as_8bit(x: torch.Tensor) -> torch.Tensor:
    """`from_8bit(*to_8bit(x), x.dtype)`'s values, without the int8 tensors between."""
    q, e = _scaled_8bit(x)
    return q.mul_(torch.exp2(e)[..., None]).to(x.dtype)


@dataclass
class SelectionDelta:
    """One move of a drafter's kept set. Entries with slot -1 are padding (rows move by
    different counts); their k/v are copies of a real entry of the row, never written.
    bits 8: the entering K/V cross links as int8 with a power-of-two scale per entry
    (`to_8bit`), and k, v hold those values (what the drafter writes, in every path)."""

    slots: torch.Tensor  # [L, Hkv, r] int64: drafter cache slots to overwrite (-1: none)
    positions: torch.Tensor  # [L, Hkv, r] int64: sequence positions that enter
    k: torch.Tensor  # [L, Hkv, r, D] post-RoPE
    v: torch.Tensor  # [L, Hkv, r, D]
    bits: int = 32  # 32: k, v move in their own dtype; 8: as int8 and a scale per entry

    @property
    def moved(self) -> int:
        """Tokens that enter, summed over layers and KV heads."""
        return int((self.slots >= 0).sum())

    def nbytes(self) -> int:
        """Bytes the compact form moves: the entering tokens' K/V (and their scales at 8
        bits) plus row, slot and position (int32 each) per entry."""
        d = self.k.shape[-1]
        kv = 2 * d + 2 if self.bits == 8 else 2 * d * self.k.element_size()
        return self.moved * (kv + 12)

    def compact(self) -> dict[str, torch.Tensor]:
        """Only the real entries: row (l * Hkv + h), slot, position [m] int32; k, v [m, D]
        (int8, with exponents ke, ve [m] int8, at 8 bits)."""
        valid = self.slots >= 0
        L, H, _ = self.slots.shape
        li, hi, _ = valid.nonzero(as_tuple=True)
        out = {"row": (li * H + hi).to(torch.int32), "slot": self.slots[valid].to(torch.int32),
               "pos": self.positions[valid].to(torch.int32), "k": self.k[valid], "v": self.v[valid],
               "shape": torch.tensor([L, H], dtype=torch.int32)}
        if self.bits == 8:
            (out["k"], out["ke"]), (out["v"], out["ve"]) = to_8bit(out["k"]), to_8bit(out["v"])
        return out

    @classmethod
    def from_compact(cls, t: dict[str, torch.Tensor]) -> "SelectionDelta":
        """The inverse of `compact` (rows sorted as `compact` writes them)."""
        L, H = (int(x) for x in t["shape"])
        row = t["row"].long()
        if row.numel() and (int(row.min()) < 0 or int(row.max()) >= L * H
                            or bool((row[1:] < row[:-1]).any())):
            raise ValueError("selection delta rows out of range or unsorted")
        bits = 8 if "ke" in t else 32
        tk, tv = ((from_8bit(t["k"], t["ke"]), from_8bit(t["v"], t["ve"])) if bits == 8
                  else (t["k"], t["v"]))
        counts = torch.bincount(row, minlength=L * H)
        r = int(counts.max()) if row.numel() else 0
        j = torch.arange(row.numel()) - (torch.cumsum(counts, 0) - counts)[row]
        d = tk.shape[-1]
        slots = torch.full((L * H, r), -1, dtype=torch.long)
        pos = torch.zeros((L * H, r), dtype=torch.long)
        k = tk.new_zeros(L * H, r, d)
        v = tv.new_zeros(L * H, r, d)
        slots[row, j], pos[row, j] = t["slot"].long(), t["pos"].long()
        k[row, j], v[row, j] = tk, tv
        return cls(slots.view(L, H, r), pos.view(L, H, r), k.view(L, H, r, d), v.view(L, H, r, d),
                   bits)


@dataclass
class SelectionState:
    """The verifier's record of one request's drafter set (see the module words)."""

    positions: torch.Tensor  # [L, Hkv, m] int64: the position each region slot holds
    # (a salient set: the salient positions, -1 for entries not used yet)
    region_end: int  # tail_start: candidates are positions [0, region_end)
    score: torch.Tensor | None = None  # [L, Hkv, region_end] float32: the policy's running score
    rounds: int = 0  # verify rounds since the last move
    moves: int = 0  # deltas made
    moved_tokens: int = 0  # entries moved, over layers and KV heads
    salient: bool = False  # a salient set (module words), not a kept set

    @classmethod
    def empty_salient(cls, layers: int, heads: int, budget: int, region_end: int) -> "SelectionState":
        return cls(torch.full((layers, heads, budget), -1, dtype=torch.long), region_end,
                   salient=True)

    @property
    def budget(self) -> int:
        return self.positions.shape[-1]

    @property
    def full(self) -> bool:
        """A salient set whose every entry is used: no move can change it."""
        return self.salient and bool((self.positions >= 0).all())

    def held_mask(self) -> torch.Tensor:
        """[L, Hkv, region_end] bool: True where the drafter holds the position (a salient
        set: holds it precisely)."""
        L, H, _ = self.positions.shape
        mask = torch.zeros(L, H, self.region_end + 1, dtype=torch.bool)
        # a free entry (-1) marks the extra last column, dropped
        mask.scatter_(2, torch.where(self.positions < 0, self.region_end, self.positions), True)
        return mask[..., :self.region_end]


def pooled(score: torch.Tensor, pool: int, avg: bool = False) -> torch.Tensor:
    """Max (or, with `avg`, mean) over `pool` neighbours along the last dim (SnapKV's
    clustering): [L, H, n]."""
    if pool <= 1:
        return score
    L, H, n = score.shape
    flat = score.reshape(L * H, 1, n)
    if avg:
        out = F.avg_pool1d(flat, pool, stride=1, padding=pool // 2, count_include_pad=False)
    else:
        out = F.max_pool1d(flat, pool, stride=1, padding=pool // 2)
    return out[..., :n].reshape(L, H, n)


def _ranked(score: torch.Tensor, pool: int) -> torch.Tensor:
    """The score a move ranks positions by: pooled, sinks first (a new tensor)."""
    s = pooled(score, pool).clone()
    s[..., :SINKS] = float("inf")
    return s


def target_mask(score: torch.Tensor, budget: int, pool: int) -> torch.Tensor:
    """[L, H, n] bool: the top `budget` positions of the pooled score per row, sinks always in."""
    s = _ranked(score, pool)
    idx = s.topk(min(budget, s.shape[-1]), dim=-1).indices
    mask = torch.zeros_like(s, dtype=torch.bool)
    return mask.scatter_(2, idx, True)


def _take(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """t[l, h, pos[l, h, i]] for t [L, H, N, D] (a cache's view: unit stride within a token)
    and pos [L, H, r] (< N): [L, H, r, D] on the host. The tokens are rows of D of t's storage
    (row l s0 + h s1 + p, strides in tokens), taken by one index_select, not by a gather
    whose index, expanded over D, is r D int64s a row to build and read (1500 tokens a row
    of an 8k cache's view, SmolLM2's shape, 2 threads of an AVX-512 EPYC: 33 ms, this 14)."""
    L, H, r = pos.shape
    D = t.shape[3]
    s0, s1, s2, s3 = t.stride()
    if s3 != 1 or s0 % s2 or s1 % s2:
        return torch.gather(t, 2, pos.unsqueeze(-1).expand(L, H, r, D).to(t.device)).cpu()
    a, b = s0 // s2, s1 // s2
    rows = t.as_strided(((L - 1) * a + (H - 1) * b + t.shape[2], D), (s2, 1))
    idx = (torch.arange(L)[:, None, None] * a + torch.arange(H)[None, :, None] * b + pos)
    return rows.index_select(0, idx.reshape(-1).to(t.device)).view(L, H, r, D).cpu()


def _entering(e_pos: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor, n: int,
              bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V of positions e_pos [L, H, r] (< n) from the full KV, on the host, as a move
    carries them (`to_8bit` values at bits 8)."""
    take = _take_8bit if bits == 8 else _take
    return take(k_full[:, :, :n], e_pos), take(v_full[:, :, :n], e_pos)


def _take_8bit(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """`as_8bit(_take(t, pos))`'s values in bfloat16, which holds them exactly (an integer
    of at most 8 bits times a power of two), taken a layer at a time. A question move's
    entering K/V is about 35 MB a tensor in float32 at 8k (SmolLM2): taken and scaled whole,
    each step's result was fresh memory the kernel had to fault in, and an 8k admission's
    move took 36-172 ms on a 2-vCPU EPYC by how much of it the allocator found at hand; a
    layer's buffers are reused from one layer to the next, and only the half-size result
    is new."""
    L, H, r = pos.shape
    out = torch.empty((L, H, r, t.shape[3]), dtype=torch.bfloat16)
    for li in range(L):
        out[li] = as_8bit(_take(t[li:li + 1], pos[li:li + 1]))[0]
    return out


def move_towards(state: SelectionState, score: torch.Tensor, pool: int, limit: int | None,
                 k_full: torch.Tensor, v_full: torch.Tensor, bits: int = 32) -> SelectionDelta | None:
    """The delta that moves `state`'s kept set towards the top of `score` ([L, H, region_end])
    at the same budget, at most `limit` tokens per row (None: all the way), the best-scored
    entering first and the worst-scored leaving first. k_full, v_full: [L, H, >= region_end, D],
    the full KV to take entering tokens from; bits 8: they enter as `to_8bit` values.
    Updates `state.positions`; None when nothing moves."""
    L, H, n = score.shape
    held = state.held_mask()
    want = target_mask(score, state.budget, pool)
    s = pooled(score, pool)
    enter = want & ~held
    leave = held & ~want  # per row as many as enter: both sets have `budget` members
    count = int(enter.sum(-1).max())
    if count == 0:
        return None
    r = count if limit is None else min(count, limit)
    ninf = torch.tensor(float("-inf"))
    e_val, e_pos = torch.where(enter, s, ninf).topk(r, dim=-1)  # best entering first
    l_val, l_pos = torch.where(leave, -s, ninf).topk(r, dim=-1)  # worst leaving first
    valid = torch.isfinite(e_val) & torch.isfinite(l_val)  # [L, H, r]
    # slot of each leaving position: invert positions -> slot over the region
    slot_of = torch.full((L, H, n), -1, dtype=torch.long)
    slot_of.scatter_(2, state.positions, torch.arange(state.budget).expand(L, H, -1).contiguous())
    slots = slot_of.gather(2, l_pos)
    # padding entries copy the row's first entry (never written; keeps re-quantization groups sane)
    first = e_pos[..., :1].expand_as(e_pos)
    e_pos = torch.where(valid, e_pos, first)
    slots = torch.where(valid, slots, torch.full_like(slots, -1))
    k, v = _entering(e_pos, k_full, v_full, n, bits)
    # the verifier's record follows the drafter
    rows = valid.nonzero(as_tuple=True)
    state.positions[rows[0], rows[1], slots[valid]] = e_pos[valid]
    state.moves += 1
    state.moved_tokens += int(valid.sum())
    return SelectionDelta(slots, e_pos, k, v, bits)


def upgrade_towards(state: SelectionState, score: torch.Tensor, pool: int, limit: int | None,
                    k_full: torch.Tensor, v_full: torch.Tensor, bits: int = 32,
                    fill: int | None = None) -> SelectionDelta | None:
    """`move_towards` for a salient set (module words): the best-scored positions of `score`
    ([L, H, region_end], pooled over `pool`; sinks first) not yet salient enter over their own
    slots, at most `limit` per row (None: no bound) and until `fill` entries of the record per
    row are used (None: the budget). Nothing leaves. Updates `state.positions`; None when
    nothing moves."""
    n = score.shape[-1]
    used = (state.positions >= 0).sum(-1)  # [L, H]
    room = (min(fill, state.budget) if fill is not None else state.budget) - used
    r = int(room.max())
    if limit is not None:
        r = min(r, limit)
    if r <= 0:
        return None
    s = _ranked(score, pool)
    s[state.held_mask()] = float("-inf")
    e_val, e_pos = s.topk(min(r, n), dim=-1)  # best first
    r = e_pos.shape[-1]
    valid = (e_val > float("-inf")) & (torch.arange(r) < room[..., None])
    if not bool(valid.any()):
        return None
    # the record's free entries, first ones first
    free = torch.sort((state.positions >= 0).to(torch.int8), dim=-1, stable=True).indices[..., :r]
    rows = valid.nonzero(as_tuple=True)
    state.positions[rows[0], rows[1], free[valid]] = e_pos[valid]
    e_pos = torch.where(valid, e_pos, e_pos[..., :1].expand_as(e_pos))
    k, v = _entering(e_pos, k_full, v_full, n, bits)
    state.moves += 1
    state.moved_tokens += int(valid.sum())
    return SelectionDelta(torch.where(valid, e_pos, torch.full_like(e_pos, -1)), e_pos, k, v, bits)


def move(state: SelectionState, score: torch.Tensor, pool: int, limit: int | None,
         k_full: torch.Tensor, v_full: torch.Tensor, bits: int = 32,
         fill: int | None = None) -> SelectionDelta | None:
    """A policy's move of either kind of set: `upgrade_towards` for a salient set (`fill`
    bounds it), else `move_towards`."""
    if state.salient:
        return upgrade_towards(state, score, pool, limit, k_full, v_full, bits, fill)
    return move_towards(state, score, pool, limit, k_full, v_full, bits)


BITS = (32, 8)  # how a delta's entering K/V move: the model's dtype, or 8 bits (`to_8bit`)


class SelectionPolicy(Named, ABC):
    """How a request's drafter set moves. See the module docstring."""

    moves: ClassVar[bool] = True  # False: the base set stays (no record, no queries, no votes)
    needs_votes: ClassVar[bool] = False  # whether verify passes must return attention votes
    window: int = 0  # prompt queries after_prefill needs (the last `window` tokens)

    def after_prefill(self, state: SelectionState, votes: torch.Tensor, queries: int,
                      k_full: torch.Tensor, v_full: torch.Tensor) -> SelectionDelta | None:
        """votes: [L, Hkv, >= region_end] attention mass of the prompt's last `queries`
        (`window`, fewer in a shorter prompt) rows per KV group (`Prefilled.window_votes`);
        k_full, v_full: [L, Hkv, n, D]."""
        return None

    def after_verify(self, state: SelectionState, votes: torch.Tensor | None, queries: int,
                     accepted: int, drafted: int, k_full: torch.Tensor,
                     v_full: torch.Tensor) -> SelectionDelta | None:
        """votes: [L, Hkv, >= region_end] attention mass of the pass's `queries` rows per KV
        group (None unless `needs_votes`)."""
        return None
