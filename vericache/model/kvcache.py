"""A preallocated per-sequence KV cache, written in place.

Layout: `k`, `v`: [num_layers, num_kv_heads, capacity, head_dim]; slots [0, length) are live.
Keys are stored after RoPE, so a cache may hold any subset of a sequence's tokens (token
dropping keeps the original positions baked into the keys). Appending writes the next slots;
rollback is `crop(n)`; nothing copies the whole cache per step (growth doubles capacity).

`pos` (optional, [num_layers, num_kv_heads, capacity] int64): the absolute position of each
slot's token, for sliding-window attention over a cache that holds a subset of the tokens (the
drafter's). None: slot i holds position i (a dense cache from position 0, the verifier's).
The runner writes the positions of the tokens it appends to a cache that has them.

`KVPool`: the caches of a batch side by side in one tensor per K and V, so that the runner's
attention reads every sequence of a pass in one call per layer. A member cache's `k`, `v` (and
`pos`) are views of its slot: the API above is unchanged. A cache is made in a pool's slot
(`KVPool.claim`, through `Runner.new_cache(arena=)`: the engine's caches of one side, or of
one scheduler group, share a pool from their first token, and a batch of them copies
nothing), or on its own and then copied into a pool at the first pass it shares
(`KVPool.hold`): a batch that stays the same is copied once; a cache that outgrows its slot
leaves the pool (`reserve`) and the next pass re-pools. A batch that loses members keeps its
pool (their slots become free), and a cache that joins takes the lowest free slot (its tokens
copied, nothing else), while the pass fills at least half the span of slots it reads (any
part of it where the call reads only its rows' keys, the native kernel's): re-pooling
allocates and copies every member (1.9 GB for 8 requests of 5k tokens in this model), and
with continuous batching, where requests end one by one, it did so at every end (passes of
1.9-4.5 s against 0.2 s on a 2-core CPU, behind the services); a new pool on CPU has slots to
spare (the next power of two), so a batch that grows one request at a time re-pools log2(n)
times, not n.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch

from vericache.errors import InvalidArgument
from vericache.memory import page_size

DRAFT_KV_DTYPES = ("auto", "model", "bfloat16")
DRAFT_WEIGHTS = ("auto", "bfloat16", "model")
DRAFT_HEADS = ("auto", "exact")
DRAFT_LAYERS = ("auto", "exact")


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable `name`, one of `choices` (the first by default); an unknown
    value is refused, naming them."""
    choice = os.environ.get(name, choices[0])
    if choice not in choices:
        raise InvalidArgument(f"{name} must be one of {', '.join(choices)} (got {choice!r})", name)
    return choice


def draft_kv_dtype(device: torch.device | str, dtype: torch.dtype,
                   kernel: bool = True) -> torch.dtype:
    """The dtype of a drafter's K/V for a model of `dtype` on `device`: the model's, except a
    float32 model on CPU with the native attention (`kernel`), whose drafter holds bfloat16
    (half the bytes; the kernel widens them as it reads, or with AVX512-BF16 dots the keys
    as bfloat16 pairs with the query rounded to bfloat16, and every sum stays float32; the
    drafter is lossy already and its drafts are verified; the snapkv τ probes of
    docs/performance.md, seventeenth session, moved by +0.2 or not at all). Without the
    kernel, SDPA would widen a copy of every layer's K/V per step, so the model's dtype stays.
    `VERICACHE_DRAFT_KV_DTYPE`: `auto` (that rule), `model` (the model's dtype always),
    `bfloat16`. The drafter service reports the bytes a token in its Health, which the
    gateway admits by."""
    choice = env_choice("VERICACHE_DRAFT_KV_DTYPE", DRAFT_KV_DTYPES)
    if choice == "bfloat16" or (choice == "auto" and kernel and dtype == torch.float32
                                and torch.device(device).type == "cpu"):
        return torch.bfloat16
    return dtype


def draft_weights_choice() -> str:
    """`VERICACHE_DRAFT_WEIGHTS`: `auto` (the blocks where the runner has them, else a
    bfloat16 copy), `bfloat16` (the bfloat16 copy even where blocks would serve) or `model`
    (no copy: the model's own float32 weights); an unknown value is refused."""
    return env_choice("VERICACHE_DRAFT_WEIGHTS", DRAFT_WEIGHTS)


def draft_head_choice() -> str:
    """`VERICACHE_DRAFT_HEAD`: `auto` (a draft pass's LM head over the model's quantized weight
    blocks rounds its input to int8 a block of 32, as llama.cpp's Q8 activations, for integer
    dot products, then computes each row's 16 largest logits again exactly:
    `kernels.Linear.draft_head`, where the CPU has AVX512-VNNI or AVX2) or `exact` (the exact block
    product, as every other pass takes); an unknown value is refused. Drafts are verified in
    float32 either way: outputs do not change, τ may."""
    return env_choice("VERICACHE_DRAFT_HEAD", DRAFT_HEADS)


def draft_layers_choice() -> str:
    """`VERICACHE_DRAFT_LAYERS`: `auto` (a draft pass's layer products over the model's 4-bit or
    8-bit weight blocks take their input in two int8 parts a block of 32, the second the
    first's rounding error in 256ths, for integer dot products: `linear.c`'s
    `vc_linear_qw_q8x2`, where the CPU has AVX512-VNNI) or `exact` (the exact block product, as
    every other pass takes); an unknown value is refused. Drafts are verified in float32
    either way: outputs do not change, τ may."""
    return env_choice("VERICACHE_DRAFT_LAYERS", DRAFT_LAYERS)


def draft_weights_dtype(dtype: torch.dtype, draft_dtype: torch.dtype,
                        kernel: bool = True) -> torch.dtype | None:
    """The dtype of the weight copy a drafter's passes multiply by, or None (the model's own
    weights). A float32 model whose drafter holds bfloat16 K/V (`draft_kv_dtype`), with the
    native product (`kernel`): a copy (`Runner._draft_copy`): the blocks the model's weights
    were quantized in where they give them back exactly (`vericache.model.qweights`, a GGUF
    model's, which the runner holds for every pass: `vc_linear_qw` reads 5 or 9 bits a
    weight, and the drafts see the model's own weights), else bfloat16 (`vc_linear_bf16w`:
    half the bytes to read; with AVX512-BF16, bfloat16 dot products, x split into two
    bfloat16 parts so that only the weights are rounded). The bfloat16 copy costs half the
    model's float32 weights (270 MB for SmolLM2-135M) in the process that drafts; the blocks
    (111 MB) are the runner's anyway. Rounded drafts are verified in float32, so outputs do
    not change. The value returned is the copy's marker dtype, bfloat16, either way; the
    choice is `draft_weights_choice`'s."""
    choice = draft_weights_choice()
    if (choice != "model" and kernel and dtype == torch.float32
            and draft_dtype == torch.bfloat16):
        return torch.bfloat16
    return None


# a slot is handed out by `KVPool.claim` (a lane making a cache) and by `KVPool.hold` (a
# pass adopting a cache that joins): one at a time, or two threads could take one slot
_slots_lock = threading.Lock()


class KVCache:
    # read where it lies, never copied into a pool (an offloaded tier's host copy, whose memory
    # the tier hands to later requests: `OffloadedTier.host_cache`)
    in_place = False

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 positions: bool = False):
        shape = (num_layers, num_kv_heads, max(1, capacity), head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.pos = torch.empty(shape[:3], dtype=torch.long, device=device) if positions else None
        self.length = 0
        self.pool: KVPool | None = None  # the pool whose slot `slot` holds k, v (and pos)
        self.slot = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more tokens (grows by doubling; copies only then, and a
        pooled cache then leaves its pool)."""
        need = self.length + extra
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        self.pool = None
        with torch.inference_mode(False):  # a normal tensor, whoever grows it
            self._grow(cap)

    def _grow(self, cap: int) -> None:
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


class KVPool:
    """Caches in slots of one tensor each: `k`, `v`: [num_layers, S, num_kv_heads, capacity,
    head_dim]; `pos` (caches that record positions): [num_layers, S, num_kv_heads, capacity].
    Slot s is member cache c with c.slot == s and c.pool is this pool; its live tokens are
    [0, c.length) of the slot, as in a cache of its own. Layer l of slots [lo, top) is
    `k[l, lo:top]`: [top - lo, Hkv, capacity, D], the batch of keys one attention call reads
    (a view).

    Storage is allocated empty and made finite lazily (`ready`): one call reads every slot of
    its span up to the longest sequence's end, masked past each one's own, and 0 x NaN from
    uninitialised memory is NaN (a batch with a 700-token sequence once gave NaN logits). A
    slot's region that no call reads is never touched, so on CPU, where memory is committed on
    first touch, free slots and unused capacity cost address space, not memory: the pool is
    in small pages, and `advise` puts a slot whose cache will fill at least half of it in
    huge pages (`vericache.memory.page_size`)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 slots: int, dtype: torch.dtype, device: torch.device | str,
                 positions: bool = False):
        # the runner pools inside its inference mode: the pool must stay a normal tensor, one
        # the engine may write in place later (a drafter's refresh)
        with torch.inference_mode(False):
            shape = (num_layers, slots, num_kv_heads, capacity, head_dim)
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
            self.pos = torch.empty(shape[:4], dtype=torch.long, device=device) if positions else None
        for t in (self.k, self.v, self.pos):  # small pages until a slot is advised
            if t is not None:
                page_size(t, huge=False)
        self.size = slots
        self._owners: list[weakref.ref | None] = [None] * slots  # each slot's member
        self._finite = [0] * slots  # slot s holds finite K/V (and positions) in [0, _finite[s])

    @classmethod
    def of(cls, caches: list[KVCache], slots: int = 0) -> "KVPool":
        """A new pool of max(len(caches), `slots`) slots, with the largest capacity among
        `caches`, holding them in slots 0.. (their live tokens copied; a cache's old storage is
        freed when nothing else holds it)."""
        c0 = caches[0]
        pool = cls(c0.num_layers, c0.k.shape[1], c0.k.shape[3], max(c.capacity for c in caches),
                   max(len(caches), slots), c0.k.dtype, c0.k.device, c0.pos is not None)
        for s, c in enumerate(caches):
            pool._adopt(c, s)
        return pool

    def _held(self, s: int) -> bool:
        """Whether slot `s` still belongs to a live member (one released, or grown out of
        the pool, frees it)."""
        c = None if self._owners[s] is None else self._owners[s]()
        return c is not None and c.pool is self and c.slot == s

    def free_slots(self) -> list[int]:
        """The slots no live member holds, lowest first."""
        return [s for s in range(self.size) if not self._held(s)]

    def _bind(self, c: KVCache, s: int) -> None:
        c.k, c.v = self.k[:, s], self.v[:, s]
        c.pos = None if self.pos is None else self.pos[:, s]
        c.pool, c.slot = self, s
        self._owners[s] = weakref.ref(c)

    def _adopt(self, c: KVCache, s: int) -> None:
        """Move `c` into free slot `s` (advised for its capacity): its live tokens are copied,
        nothing else."""
        self.advise(s, c.capacity)
        n = c.length
        with torch.inference_mode(False):
            self.k[:, s, :, :n] = c.k[:, :, :n]
            self.v[:, s, :, :n] = c.v[:, :, :n]
            if self.pos is not None:
                self.pos[:, s, :, :n] = c.pos[:, :, :n]
        self._bind(c, s)
        self._finite[s] = max(self._finite[s], n)

    def advise(self, s: int, tokens: int) -> None:
        """Slot `s` will hold up to `tokens` tokens: huge pages for its rows where that is at
        least half the capacity (reads about 10% faster), else small pages (a short cache
        commits its tokens' pages, not the slot's 2 MB rows). Before the slot's first write;
        a slot committed earlier keeps its pages."""
        huge = 2 * tokens >= self.capacity
        for t in (self.k, self.v, self.pos):
            if t is not None:
                for layer in range(t.shape[0]):
                    page_size(t[layer, s], huge)

    def claim(self, tokens: int | None = None) -> KVCache | None:
        """A new empty cache in the lowest free slot (its capacity: the pool's), or None when
        every slot is held. Nothing is copied: what the cache's owner writes lands in the pool.
        `tokens`: how many it will hold at most, for its pages (`advise`)."""
        with _slots_lock:
            free = self.free_slots()
            if not free:
                return None
            c = KVCache.__new__(KVCache)
            c.length = 0
            self._bind(c, free[0])
        if tokens is not None:
            self.advise(c.slot, tokens)
        return c

    def ready(self, lo: int, top: int, hi: int) -> None:
        """Make slots [lo, top) finite up to token `hi` (what one call over them reads):
        each slot's region past what it already holds finite (a member's live tokens, a former
        member's, or earlier zeros) is zeroed, once."""
        for s in range(lo, top):
            c = self._owners[s]() if self._held(s) else None
            done = max(self._finite[s], 0 if c is None else c.length)
            if done < hi:
                with torch.inference_mode(False):
                    self.k[:, s, :, done:hi] = 0
                    self.v[:, s, :, done:hi] = 0
                    if self.pos is not None:
                        self.pos[:, s, :, done:hi] = 0
            self._finite[s] = max(done, hi)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @staticmethod
    def poolable(caches: list) -> bool:
        """Caches one pool can hold: plain KVCaches (not `in_place`) of one dtype, device and
        shape, all with positions or all without."""
        c0 = caches[0]
        return all(type(c) is KVCache and not c.in_place and c.k.dtype == c0.k.dtype and c.k.device == c0.k.device
                   and c.k.shape[1] == c0.k.shape[1] and c.k.shape[3] == c0.k.shape[3]
                   and (c.pos is None) == (c0.pos is None) for c in caches)

    @classmethod
    def hold(cls, caches: list[KVCache], sparse: bool = False) -> tuple["KVPool", int, int]:
        """(pool, lo, top): a pool holding every cache of `caches` in slots [lo, top), which
        they fill at least half of (the other slots of that span are free, or members not in
        this pass: padding rows of the call). The pool most of them share when the rest fit its
        free slots (the lowest) and its capacity; else a new one (`of`), with slots to spare on
        CPU (the next power of two: a batch growing one request at a time re-pools log2(n)
        times, not n; unused slots cost no memory there, see the class docstring).
        `sparse`: the call reads only its rows' own keys (the native kernel: a padding row
        reads nothing and no slot is made finite), so the span may be of any size: caches of
        one pool stay where they are, and a pass over any of them copies nothing (the engine
        keeps one pool a side for it: `vericache.engine.rounds.arena`)."""
        pools = [c.pool for c in caches if c.pool is not None]
        pool = max(pools, key=lambda p: sum(q is p for q in pools), default=None)
        if pool is not None:
            joining = [c for c in caches if c.pool is not pool]
            with _slots_lock:
                free = pool.free_slots()
                if len(joining) <= len(free) and all(c.capacity <= pool.capacity for c in joining):
                    slots = [c.slot for c in caches if c.pool is pool] + free[:len(joining)]
                    lo, top = min(slots), max(slots) + 1
                    if sparse or 2 * len(caches) >= top - lo:
                        for c, s in zip(joining, free):
                            pool._adopt(c, s)
                        return pool, lo, top
        spare = 1 << (len(caches) - 1).bit_length() if caches[0].k.device.type == "cpu" else 0
        return cls.of(caches, spare), 0, len(caches)
