"""The engine: many requests, batched per forward pass, over drafter/verifier backends.

A background thread runs rounds over every active request: admitted requests are prefilled
between rounds; then all drafts of the round step together (one pass per draft step over
every request still drafting), then one verify pass for all of them. Requests join and leave
between rounds (continuous batching). The backends are in-process (`LocalBackends`, the
embedded mode) or gRPC clients of the drafter and verifier services: the same code path.
Callers submit from any thread and read events from a thread-safe queue, or asynchronously
with `astream`.

Schedules (`schedule=`):
- lockstep: each round, every active request drafts, then every one verifies.
- staggered: the active requests form two halves; while one half verifies (on the engine
  thread), the other drafts (on a drafter thread), then they swap. Drafting and verification
  use different resources (the compressed KV and compute on the drafter; the full KV's link
  and compute on the verifier), and with the services they are different processes, so the
  two overlap. Verification outcomes are committed to the drafter on the drafter thread,
  before that request's next draft.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from vericache.engine.api import Engine
from vericache.engine.generation import Generation, GenParams
from vericache.engine.local import GenEvent
from vericache.engine.rounds import (LocalBackends, commit_outcomes, draft_phase, run_round, start,
                                     verify_phase)
from vericache.errors import ResourceExhausted, VeriCacheError
from vericache.model.loader import LoadedModel
from vericache.spec.costmodel import CostModel

log = logging.getLogger(__name__)


@dataclass
class EngineEvent(GenEvent):
    usage: dict | None = None  # on the last event
    error: str | None = None  # set when the request failed; no more events follow


class RequestStream:
    """Events of one request, in order; the last has finish_reason or error set. Read them
    with plain iteration (any thread) or `astream()` (an asyncio loop; no thread per request)."""

    def __init__(self, gen: Generation, request_id: str):
        self.gen, self.request_id = gen, request_id
        self.cancelled = False
        self.counted = False  # its figures are in the engine's counters
        self._cond = threading.Condition()
        self._events: list[EngineEvent] = []
        self._aqueue: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def cancel(self) -> None:
        self.cancelled = True

    def put(self, ev: EngineEvent) -> None:
        with self._cond:
            if self._aqueue is not None:
                self._loop.call_soon_threadsafe(self._aqueue.put_nowait, ev)
            else:
                self._events.append(ev)
                self._cond.notify_all()

    def __iter__(self) -> Iterator[EngineEvent]:
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._events) > i)
                ev = self._events[i]
            i += 1
            yield ev
            if ev.finish_reason or ev.error:
                return

    async def astream(self) -> AsyncIterator[EngineEvent]:
        with self._cond:
            self._loop = asyncio.get_running_loop()
            self._aqueue = asyncio.Queue()
            for ev in self._events:
                self._aqueue.put_nowait(ev)
        while True:
            ev = await self._aqueue.get()
            yield ev
            if ev.finish_reason or ev.error:
                return


SCHEDULES = ("lockstep", "staggered")


class BatchEngine(Engine):
    def __init__(self, lm: LoadedModel, max_batch: int = 16, max_waiting: int = 64, backends=None,
                 schedule: str = "lockstep"):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
        self.schedule = schedule
        self._drafted: dict = {}  # staggered: rid -> DraftOut drafted, not verified yet
        self._outcomes: dict = {}  # staggered: rid -> (accepted, bonus) not committed yet
        self._draft_pool = (ThreadPoolExecutor(1, thread_name_prefix="vericache-draft")
                            if schedule == "staggered" else None)
        self.lm = lm
        self.backends = backends or LocalBackends(lm)
        self.costs = CostModel()  # learns this engine's round costs; chooses each round's k
        self.model_name, self.tokenizer, self.max_context = lm.name, lm.tokenizer, lm.max_context
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self._waiting: queue.Queue[RequestStream] = queue.Queue()
        self._active: list[RequestStream] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._ids = 0
        # request ids name sessions on shared drafter and verifier services: unique per engine
        self._id_prefix = uuid.uuid4().hex[:12]
        self.counters = {"requests": 0, "finished": 0, "errors": 0, "cancelled": 0, "tokens": 0, "rounds": 0,
                         "draft_s": 0.0, "verify_s": 0.0, "prefill_s": 0.0, "round_s": 0.0,
                         "store_hits": 0, "store_bytes_read": 0, "store_bytes_written": 0,
                         "cached_tokens": 0, "overlapped_rounds": 0, "select_s": 0.0,
                         "select_moved_tokens": 0, "select_delta_bytes": 0}
        self.tau_hist: dict[int, int] = {}
        self.k_hist: dict[int, int] = {}  # vericache rounds by drafts verified (0: plain steps)
        self._thread = threading.Thread(target=self._loop, name="vericache-engine", daemon=True)
        self._thread.start()

    # ---- API ---------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: GenParams) -> RequestStream:
        """Validate and queue a request (raises InvalidArgument / ContextTooLong / ResourceExhausted)."""
        with self._lock:
            self._ids += 1
            rid = f"req-{self._id_prefix}-{self._ids}"
        gen = Generation(self.lm, prompt_ids, params, request_id=rid)
        if self._waiting.qsize() >= self.max_waiting:
            raise ResourceExhausted(f"{self.max_waiting} requests are already waiting")
        with self._lock:
            rs = RequestStream(gen, rid)
            self.counters["requests"] += 1
        self._waiting.put(rs)
        self._wake.set()
        return rs

    @property
    def queue_depth(self) -> int:
        return self._waiting.qsize()

    @property
    def active(self) -> int:
        return len(self._active)

    def metrics(self) -> dict:
        return {"counters": dict(self.counters), "tau_hist": dict(self.tau_hist),
                "k_hist": dict(self.k_hist), "costs": self.costs.snapshot()}

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        if self._draft_pool is not None:
            self._draft_pool.shutdown(wait=False)

    # ---- the loop ------------------------------------------------------------------
    def _finish(self, rs: RequestStream, error: str | None = None) -> None:
        g = rs.gen
        usage = g.usage()
        self._drafted.pop(g.rid, None)
        self._outcomes.pop(g.rid, None)
        self.backends.release(g)
        self._count(rs)
        if error:
            self.counters["cancelled" if error == "cancelled" else "errors"] += 1
            rs.put(EngineEvent([], "", None, usage, error))

    def _count(self, rs: RequestStream) -> None:
        """Add a request's figures to the counters, once (before its client gets its last
        event, so /metrics read after an answer includes it)."""
        if rs.counted:
            return
        rs.counted = True
        g = rs.gen
        self.counters["finished"] += 1
        self.counters["rounds"] += g.stats.rounds
        for key in ("draft_s", "verify_s", "store_hits", "store_bytes_read", "store_bytes_written",
                    "cached_tokens", "select_s", "select_moved_tokens", "select_delta_bytes"):
            self.counters[key] += getattr(g.stats, key)
        if g.selection is not None:
            key = f"selection:{g.selection.name}"
            self.counters[key] = self.counters.get(key, 0) + 1
        for n in g.stats.round_emitted:
            self.tau_hist[n] = self.tau_hist.get(n, 0) + 1
        if g.params.mode == "vericache":
            for k, n in g.stats.k_hist.items():
                self.k_hist[k] = self.k_hist.get(k, 0) + n

    def _emit(self, rs: RequestStream, toks: list[int]) -> None:
        g = rs.gen
        self.counters["tokens"] += len(toks)
        done = g.finished
        if done:
            self._count(rs)
        rs.put(EngineEvent(toks, g.text.delta(done), g.stop.finish_reason,
                                  g.usage() if done else None))

    def _admit(self) -> None:
        while len(self._active) < self.max_batch:
            try:
                rs = self._waiting.get_nowait()
            except queue.Empty:
                return
            if rs.cancelled:
                self._finish(rs, "cancelled")
                continue
            try:
                t = time.perf_counter()
                toks = start(self.backends, rs.gen)
                self.counters["prefill_s"] += time.perf_counter() - t
            except Exception as e:  # noqa: BLE001 -- this request fails, the others go on
                if not isinstance(e, VeriCacheError):
                    log.exception("%s: prefill failed unexpectedly", rs.request_id)
                self._finish(rs, str(e) if isinstance(e, VeriCacheError)
                             else f"internal error: {type(e).__name__}")
                continue
            self._emit(rs, toks)
            if rs.gen.finished:
                self._finish(rs)
            else:
                self._active.append(rs)

    def _staggered_round(self, gens: list[Generation]) -> dict[str, list[int]]:
        """Verify the requests that have drafts while the others draft (see the module
        docstring); returns the tokens each verified request emitted."""
        verify = [g for g in gens if g.rid in self._drafted]
        draft = [g for g in gens if g.rid not in self._drafted]
        if not verify and len(draft) > 1:  # start two halves
            draft = draft[:(len(draft) + 1) // 2]

        def drafting():
            commit_outcomes(self.backends, draft, self._outcomes)
            return draft_phase(self.backends, draft, self.costs)

        job = self._draft_pool.submit(drafting) if draft else None
        try:
            drafts = {g.rid: self._drafted.pop(g.rid) for g in verify}
            out = (verify_phase(self.backends, verify, drafts, self._outcomes, self.costs)
                   if verify else {})
        finally:
            new = job.result() if job is not None else {}  # never leave the drafter running
        self._drafted.update(new)
        if verify and draft:
            self.counters["overlapped_rounds"] += 1
        return out

    def _round(self) -> None:
        batch = [rs for rs in self._active if not rs.cancelled]
        t0 = time.perf_counter()
        gens = [rs.gen for rs in batch]
        if not batch:
            out = {}
        elif self.schedule == "staggered":
            out = self._staggered_round(gens)
        else:
            out = run_round(self.backends, gens, self.costs)
        self.counters["round_s"] += time.perf_counter() - t0
        for rs in batch:
            if rs.gen.rid in out:
                self._emit(rs, out[rs.gen.rid])
        still = []
        for rs in self._active:
            if rs.gen.finished or rs.cancelled:
                self._finish(rs, "cancelled" if rs.cancelled and not rs.gen.finished else None)
            else:
                still.append(rs)
        self._active = still

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._admit()
                if not self._active:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._round()
            except Exception as e:  # a lost backend or a bug must not leave clients waiting
                if isinstance(e, VeriCacheError):  # e.g. Unavailable: a service went away
                    log.warning("round failed: %s", e)
                    reason = f"{type(e).__name__}: {e}"
                else:
                    log.exception("engine round failed")
                    reason = f"internal error: {e}"
                for rs in self._active:
                    self._finish(rs, reason)
                self._active = []
