"""Where the verifier keeps a request's full KV between rounds: resident, or offloaded.

- resident: the full KV stays in the verifier's memory (`KVCache`), as before.
- offloaded: the full KV lives in a slower tier (here a host-memory copy) behind a link with
  a bandwidth (`Link`: a real copy of the bytes, paced per direction, so a run can stand for a
  1 Gbit/s network or a 25 GB/s PCIe bus; full duplex, as both are). Prefill's KV is offloaded
  by a storer thread while the verifier's lane goes on (`offload`; readers of the host copy
  wait for it to land; a CPU runner's cache is already host memory, so it is adopted and the
  link only carries its bytes' time). Each verification opens a working copy
  (`StreamedKV`) that a loader thread fills layer by layer while the forward pass computes:
  the runner reads layer l's keys through a gate that waits only until layer l has landed,
  so loading layer l+1 overlaps computing layer l. After the pass the accepted tokens' new
  KV is written back over the link and the working copy is dropped; its memory goes back to
  the tier for the next working copy (`_copy_buffers`), as a server's KV pool does.

Every byte moved and every second the compute waited on the link is counted (`TierStats`),
with the wait intervals kept so a benchmark can say how much of the transfer time another
lane's work hid.

A load that fails (a copy raises: the link or the device went away) does not leave the pass
reading unfilled memory: the error is kept with the load, every layer's gate is opened, and
the forward pass raises it (`Unavailable`) at the first layer it reads after the failure, so
the pass's requests fail and emit nothing. A load that never runs (the tier was closed under
it) opens the gates with an error too: nothing waits forever.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from vericache.errors import Unavailable
from vericache.model.kvcache import KVCache

TIERS = ("resident", "offloaded")
COPY_ROUND = 256  # a new working copy's room, in tokens, is rounded up to this (`_copy_buffers`)


def _kv_bytes(keys) -> int:
    """Bytes of the caches whose key buffers are `keys` (each value buffer the same size)."""
    return sum(2 * k.numel() * k.element_size() for k in keys)


@dataclass
class TierStats:
    """Link traffic and timing of an offloaded tier (all threads together)."""

    bytes_loaded: int = 0  # tier -> working copy, for verification
    bytes_stored: int = 0  # working copy / prefill -> tier
    loads: int = 0  # verify passes that loaded KV
    transfer_s: float = 0.0  # seconds the loader spent moving layers (copy + link pacing)
    stall_s: float = 0.0  # seconds the forward pass waited for a layer
    stalls: list[tuple[float, float]] = field(default_factory=list)  # (start, end), perf_counter

    @property
    def bytes_moved(self) -> int:
        return self.bytes_loaded + self.bytes_stored


class Link:
    """A full-duplex link of `gbps` gigabits per second each way (None: as fast as memory
    copies go), as PCIe and Ethernet are: loads (tier -> working copy) and stores (prefill and
    write-back -> tier) each have the whole rate and do not queue behind each other.

    A transfer of n bytes holds its direction for n / rate seconds, after the transfers before
    it on that direction; the copy itself runs inside that time (a DMA engine would move the
    bytes while the link carries them), so a copy takes max(its memory time, its link time),
    not their sum."""

    DIRECTIONS = ("load", "store")

    def __init__(self, gbps: float | None = None):
        self.gbps = gbps
        self.rate = gbps * 1e9 / 8 if gbps else None  # bytes per second, each way
        self._free = dict.fromkeys(self.DIRECTIONS, 0.0)  # when each direction is next free
        self._lock = threading.Lock()
        self._streams: dict[str, torch.cuda.Stream] = {}  # a CUDA side stream per direction

    def copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str = "load") -> int:
        """Copy src into dst over the link's `direction` (done when this returns); returns the
        bytes moved. A copy to or from a GPU runs on its direction's side stream, so it
        overlaps the compute stream and the other direction. dst and src the same memory (an
        adopted cache): the link carries the bytes' time and nothing is copied."""
        n = src.numel() * src.element_size()
        done = 0.0
        if self.rate is not None:
            with self._lock:
                start = max(time.perf_counter(), self._free[direction])
                done = self._free[direction] = start + n / self.rate
        if _same_memory(dst, src):
            pass  # the tier adopted a CPU cache (`OffloadedTier.offload`): only the link's time
        elif dst.is_cuda or src.is_cuda:
            stream = self._streams.get(direction)
            if stream is None:
                stream = self._streams[direction] = torch.cuda.Stream(
                    device=dst.device if dst.is_cuda else src.device)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
        else:
            dst.copy_(src)
        wait = done - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return n


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.device == b.device and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


class _Load:
    """One verify pass's load: an event per layer (set when it landed, or when the load
    ended without it) and the error that ended the load early, if one did."""

    def __init__(self, layers: int):
        self.ready = [threading.Event() for _ in range(layers)]
        self.error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        """Keep the first error, then open every gate (error first: a gate that opens sees it)."""
        if self.error is None:
            self.error = error
        for ev in self.ready:
            ev.set()

    def check(self) -> None:
        if self.error is not None:
            raise self.error


class _Gate:
    """Stands in for `KVCache.k` / `.v` in the runner: indexing layer l waits for it to land
    (and raises the load's error when it ended without it)."""

    def __init__(self, buf: torch.Tensor, load: _Load, stats: TierStats, lock: threading.RLock):
        self.buf, self.load, self.stats, self.lock = buf, load, stats, lock

    def __getitem__(self, li):
        ev = self.load.ready[li]
        if not ev.is_set():
            t0 = time.perf_counter()
            ev.wait()
            t1 = time.perf_counter()
            with self.lock:
                self.stats.stall_s += t1 - t0
                self.stats.stalls.append((t0, t1))
        self.load.check()
        return self.buf[li]


class StreamedKV:
    """A working copy of an offloaded request's full KV for one forward pass: the runner sees
    a cache (`k`, `v`, `length`, `reserve`); its layers arrive while it computes."""

    def __init__(self, host: KVCache, extra: int, load: _Load, stats: TierStats,
                 lock: threading.RLock, buffers: tuple[torch.Tensor, torch.Tensor]):
        """`buffers`: k and v memory of at least `host.length + extra` tokens
        (`OffloadedTier._copy_buffers`); the copy sees their first tokens."""
        self.host = host
        n = host.length + extra
        self.k_buf, self.v_buf = (b[:, :, :n] for b in buffers)
        self.load = load
        self.k = _Gate(self.k_buf, load, stats, lock)
        self.v = _Gate(self.v_buf, load, stats, lock)
        self.length = host.length

    def view(self, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens [start, end) as `KVCache.view` (after the pass: every
        layer has landed; raises the load's error if one did not)."""
        self.load.check()
        end = self.length if end is None else end
        return self.k_buf[:, :, start:end], self.v_buf[:, :, start:end]

    @property
    def capacity(self) -> int:
        """Tokens the working copy has room for."""
        return self.k_buf.shape[2]

    def reserve(self, extra: int) -> None:
        if self.length + extra > self.capacity:
            raise ValueError(f"working copy holds {self.capacity} tokens; "
                             f"{self.length + extra} needed")

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"crop({length}) outside [0, {self.length}]")
        self.length = length


class OffloadedTier:
    """Full KV in host memory behind a `Link`; loaded layer by layer for each verification."""

    def __init__(self, link: Link | None = None, device: torch.device | str = "cpu"):
        """Working copies live on `device` (the runner's); the tier is host memory (pinned
        when the device is a GPU)."""
        self.link = link or Link()
        self.device = torch.device(device)
        self.stats = TierStats()
        # reentrant: a working copy freed by the cycle collector while this thread holds it
        # gives its memory back under it (`_keep_copy`)
        self._lock = threading.RLock()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="vericache-kv-loader")
        self._storer = ThreadPoolExecutor(1, thread_name_prefix="vericache-kv-storer")
        self._inflight = threading.Semaphore(1)  # offloads queued or copying (see `offload`)
        # host copy -> its offload (an entry leaves with its host copy)
        self._landing: weakref.WeakKeyDictionary[KVCache, Future] = weakref.WeakKeyDictionary()
        self._free: list[KVCache] = []  # released host copies, for later requests (`host_cache`)
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # dropped working copies' k, v

    def host_cache(self, capacity: int, num_layers: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> KVCache:
        """An empty host-memory cache with room for `capacity` tokens: the released one
        (`recycle`, `preallocate`) of that shape with the least room that fits, else a new
        one (pinned when the working copies live on a GPU).

        The tier's host memory is kept as LMCache's local CPU buffer and vLLM's CPU swap space
        are: memory that held one request's full KV holds a later one's, instead of going back
        to the OS and being faulted in again. Writing fresh pages is what a prefill's new cache
        cost here: on a 2-vCPU VM, beside the loader's copies, about 115k page faults and
        0.95 s of system time per 8k admission (docs/performance.md, twenty-first session)."""
        with self._lock:
            fits = [c for c in self._free if c.capacity >= capacity and c.k.dtype == dtype
                    and (c.k.shape[0], c.k.shape[1], c.k.shape[3]) == (num_layers, num_kv_heads, head_dim)]
            if fits:
                c = min(fits, key=lambda c: c.capacity)
                self._free.remove(c)
                return c
            if self._free:  # the new cache replaces a kept one that does not fit (see `recycle`)
                self._free.remove(min(self._free, key=lambda c: c.capacity))
        return self._new_host(capacity, num_layers, num_kv_heads, head_dim, dtype)

    def _new_host(self, capacity: int, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> KVCache:
        c = KVCache(num_layers, num_kv_heads, head_dim, capacity, dtype, "cpu")
        c.in_place = True  # a pass reading it (a CPU runner's first verification) copies nothing
        if self.device.type == "cuda":
            c.k, c.v = c.k.pin_memory(), c.v.pin_memory()
        return c

    def recycle(self, host: KVCache) -> None:
        """Keep a released request's host copy for a later request (`host_cache`) once its
        offload has landed; one that failed is dropped. It does not wait: a copy still in
        flight is kept when it lands (the verifier releases under its service's model lock).
        The caller must hold no other use of it: the verifier calls this when it frees the
        request's session. A new cache replaces a kept one (`host_cache`), so the tier never
        holds more host caches, in use and kept, than it had in use at once."""
        with self._lock:
            fut = self._landing.pop(host, None)
        if fut is None:
            self._keep(host)
        else:
            fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None
                                  else self._keep(host))

    def _keep(self, host: KVCache) -> None:
        with self._lock:
            host.length = 0
            self._free.append(host)

    def preallocate(self, count: int, capacity: int, num_layers: int, num_kv_heads: int,
                    head_dim: int, dtype: torch.dtype) -> None:
        """Allocate and touch `count` new host caches of `capacity` tokens for `host_cache` to
        hand out: the tier's host memory in place before requests come, as a server that has
        run a while holds it (`vericache bench --scenario long-context` does this before its
        offloaded variants' timed runs)."""
        made = [self._new_host(capacity, num_layers, num_kv_heads, head_dim, dtype)
                for _ in range(count)]
        for c in made:
            c.k.zero_()
            c.v.zero_()
            self.recycle(c)

    def counters(self) -> tuple[float, float]:
        """(seconds verify passes waited for layers, seconds the loader moved them) so far:
        what the cost model prices a pass's load by (`Backends.tier_counters`)."""
        with self._lock:
            return self.stats.stall_s, self.stats.transfer_s

    @property
    def host_bytes_free(self) -> int:
        """Bytes of the host caches kept for later requests."""
        with self._lock:
            return _kv_bytes(c.k for c in self._free)

    def offload(self, cache: KVCache) -> KVCache:
        """Move a prefilled full KV into the tier: returns its host copy at once, while a
        storer thread copies it over the link's store direction (the caller's lane goes on,
        as a GPU's copy engine would let it). A copied `cache` is kept until the copy has
        landed, and one offload at a time is in flight (a second waits here for the first to
        land), so at most one prefilled full KV is held beyond the budgets' count. Every
        reader of the host copy waits for it (`landed`), and a copy that failed fails them
        with `Unavailable`.
        A cache already in host memory (a CPU runner's) is adopted as the host copy: the link
        still carries its bytes (the storer holds the store direction for their time), but
        nothing is copied, as a GPU's copy engine would spend no CPU time on it (on this 2-core
        VM the copy into fresh memory cost the storer about 0.9 s of CPU per 8k request)."""
        if cache.k.device.type == "cpu" and self.device.type == "cpu":
            host = cache
        else:
            host = self.host_cache(cache.capacity, cache.num_layers, cache.k.shape[1],
                                   cache.k.shape[3], cache.k.dtype)
            host.length = cache.length
        self._inflight.acquire()
        try:  # the prefilled tokens (a first verification may add tokens to `cache` meanwhile)
            fut = self._storer.submit(self._store, host, cache, cache.length)
        except RuntimeError as e:  # the storer was shut down
            self._inflight.release()
            raise Unavailable(f"KV tier is closed: {e}") from e
        with self._lock:
            self._landing[host] = fut
        return host

    def _store(self, host: KVCache, cache: KVCache, m: int) -> None:
        try:
            n = 0
            for li in range(cache.num_layers):
                n += self.link.copy(host.k[li, :, :m], cache.k[li, :, :m], "store")
                n += self.link.copy(host.v[li, :, :m], cache.v[li, :, :m], "store")
            with self._lock:
                self.stats.bytes_stored += n
        finally:
            self._inflight.release()

    def landed(self, host: KVCache) -> None:
        """Wait until `host`'s offload (if one is in flight) has landed; raises `Unavailable`
        if it failed."""
        with self._lock:
            fut = self._landing.get(host)
        if fut is None:
            return
        try:
            fut.result()
        except Unavailable:
            raise
        except BaseException as e:  # noqa: BLE001 -- every reader of the host copy sees it
            raise Unavailable(f"KV tier: offloading the full KV failed: {type(e).__name__}: {e}") from e

    def open(self, hosts: list[KVCache], extras: list[int]) -> list[StreamedKV]:
        """Working copies with room for `extras` new tokens; a loader thread fills them layer
        by layer (layer l of every request, then layer l+1). A failed load makes the pass
        that reads them raise `Unavailable` (see the module docstring)."""
        load = _Load(hosts[0].num_layers)
        streams = []
        for h, e in zip(hosts, extras):
            bufs = self._copy_buffers(h, h.length + e)
            s = StreamedKV(h, e, load, self.stats, self._lock, bufs)
            weakref.finalize(s, self._keep_copy, bufs)  # its memory, for the next copy
            streams.append(s)
        try:
            fut = self._loader.submit(self._load, streams, load)
        except RuntimeError as e:  # the loader was shut down
            raise Unavailable(f"KV tier is closed: {e}") from e

        def cancelled(f) -> None:  # a load cancelled before it ran opens the gates too
            if f.cancelled():
                load.fail(Unavailable("KV tier load was cancelled (the tier was closed)"))

        fut.add_done_callback(cancelled)
        return streams

    def _copy_buffers(self, host: KVCache, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v memory for a working copy of `host`'s shape with room for `tokens`: a dropped
        copy's (the smallest that fits), else new, of `tokens` rounded up to COPY_ROUND.

        A working copy's memory is reused, as vLLM's and SGLang's KV pools are, instead of
        allocated per verification: on a CPU runner, fresh memory is faulted in while the
        loader writes it, and the kernel's zeroing of those pages takes the cores from the
        lanes (docs/performance.md, twenty-eighth session). A new copy replaces a kept one
        that does not fit, so the tier never holds more copies, open and kept, than were
        open at once."""
        L, H, _, D = host.k.shape
        with self._lock:  # (by index: `==` on tensors compares their values)
            rooms = [k.shape[2] for k, _ in self._copies]
            fits = [i for i, (k, _) in enumerate(self._copies) if rooms[i] >= tokens
                    and k.dtype == host.k.dtype and (k.shape[0], k.shape[1], k.shape[3]) == (L, H, D)]
            if fits:
                return self._copies.pop(min(fits, key=rooms.__getitem__))
            if self._copies:
                self._copies.pop(rooms.index(min(rooms)))
        cap = -(-tokens // COPY_ROUND) * COPY_ROUND
        k = torch.empty((L, H, cap, D), dtype=host.k.dtype, device=self.device)
        return k, torch.empty_like(k)

    def _keep_copy(self, bufs: tuple[torch.Tensor, torch.Tensor]) -> None:
        """A dropped working copy's memory, for `_copy_buffers`. (Loads run one at a time on
        the loader thread: a load that outlived its failed pass ends before the next load
        into this memory begins.)"""
        with self._lock:
            self._copies.append(bufs)

    @property
    def copy_bytes_kept(self) -> int:
        """Bytes of dropped working copies kept for later ones."""
        with self._lock:
            return _kv_bytes(k for k, _ in self._copies)

    def _load_layer(self, s: StreamedKV, li: int) -> int:
        """Copy layer `li` of one request's KV over the link; returns the bytes moved."""
        m = s.host.length
        return (self.link.copy(s.k_buf[li, :, :m], s.host.k[li, :, :m])
                + self.link.copy(s.v_buf[li, :, :m], s.host.v[li, :, :m]))

    def _load(self, streams: list[StreamedKV], load: _Load) -> None:
        t0 = time.perf_counter()
        n = 0
        li = 0
        counted = False

        def count() -> None:  # before the last gate opens: the pass sees its load counted
            nonlocal counted
            counted = True
            with self._lock:
                self.stats.bytes_loaded += n
                self.stats.loads += 1
                self.stats.transfer_s += time.perf_counter() - t0
        try:
            for s in streams:  # a host copy still being offloaded lands first
                self.landed(s.host)
            for li, ev in enumerate(load.ready):
                for s in streams:
                    n += self._load_layer(s, li)
                if li == len(load.ready) - 1:
                    count()
                ev.set()
        except BaseException as e:  # noqa: BLE001 -- handed to the pass that waits on it
            err = Unavailable(f"KV tier: loading layer {li} failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            load.fail(err)  # every gate opens; the pass raises err, never reads unfilled layers
        finally:
            if not counted:
                count()

    def write_back(self, s: StreamedKV) -> None:
        """Store the pass's kept new tokens [host.length, s.length) into the tier."""
        self._store_new(s.host, s.k_buf, s.v_buf, s.host.length, s.length)

    def store_new(self, host: KVCache, cache: KVCache, start: int) -> None:
        """Store the new tokens [start, cache.length) of `cache`, the request's prefilled full
        KV still in the compute's memory (`Verifier.prefill`: its first verification runs on
        it, loading nothing), into its host copy `host`. A CPU runner's cache is its own host
        copy (`offload` adopted it): the link then carries the bytes' time only."""
        self._store_new(host, cache.k, cache.v, start, cache.length)

    def _store_new(self, h: KVCache, k: torch.Tensor, v: torch.Tensor, a: int, b: int) -> None:
        h.reserve(b - h.length)  # (nothing to reserve where h is the cache itself)
        n = 0
        if b > a:
            n += self.link.copy(h.k[:, :, a:b], k[:, :, a:b], "store")
            n += self.link.copy(h.v[:, :, a:b], v[:, :, a:b], "store")
        h.length = b
        with self._lock:
            self.stats.bytes_stored += n

    def close(self) -> None:
        self._storer.shutdown(wait=True)
        self._loader.shutdown(wait=True)


def make_tier(name: str, link_gbps: float | None = None,
              device: torch.device | str = "cpu") -> OffloadedTier | None:
    """None for `resident`; an `OffloadedTier` behind a link of `link_gbps` for `offloaded`,
    with working copies on `device`."""
    if name not in TIERS:
        raise ValueError(f"unknown KV tier {name!r}; valid: {', '.join(TIERS)}")
    if link_gbps is not None and link_gbps <= 0:
        raise ValueError(f"link bandwidth must be > 0 Gbit/s (got {link_gbps})")
    return OffloadedTier(Link(link_gbps), device) if name == "offloaded" else None
