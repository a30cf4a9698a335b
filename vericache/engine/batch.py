"""The serving engine: admission and event streaming around the one executor.

`BatchEngine` validates and queues requests, hands them to `vericache.engine.lanes.LaneRunner`
(the executor `vericache bench --scenario` measures too) running on a background thread, and
turns what the runner reports into each request's events. Requests join and leave between
jobs (continuous batching), up to `max_batch` at once and within the memory budgets; the
backends are in-process (`LocalBackends`, the embedded mode) or gRPC clients of the drafter
and verifier services (`RemoteBackends`): the same code path. Callers submit from any thread
and read events from a thread-safe queue, or asynchronously with `astream`.

Schedules (`schedule=`, see `vericache.engine.scheduler`):
- lockstep: every admitted request drafts, then every one verifies.
- staggered: requests form two groups; while one verifies, the other drafts, and the drafter
  lane, when it has nothing else to do, drafts ahead past the drafts in verification.
  Drafting and verification use different resources (the compressed KV and compute on the
  drafter; the full KV's link and compute on the verifier), and with the services they are
  different processes, so the two overlap.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from vericache.engine.api import Engine
from vericache.engine.backends import Backends
from vericache.engine.budget import check_fits
from vericache.engine.generation import Generation, GenParams
from vericache.engine.lanes import CostFn, LaneRunner
from vericache.engine.local import GenEvent
from vericache.engine.rounds import LocalBackends
from vericache.engine.scheduler import SCHEDULES, Scheduler
from vericache.errors import ResourceExhausted
from vericache.model.loader import LoadedModel
from vericache.spec.costmodel import CostModel

log = logging.getLogger(__name__)


@dataclass
class EngineEvent(GenEvent):
    usage: dict | None = None  # on the last event
    error: str | None = None  # set when the request failed; no more events follow
    logprobs: list | None = None  # TokenLogprob per token in token_ids, when the request asked
    kinds: list[str] | None = None  # how each of token_ids came (`Generation.emitted_kinds`)


class RequestStream:
    """Events of one request, in order; the last has finish_reason or error set. Read them
    with plain iteration (any thread) or `astream()` (an asyncio loop; no thread per request)."""

    def __init__(self, gen: Generation, request_id: str, on_cancel=None):
        self.gen, self.request_id = gen, request_id
        self.cancelled = False
        self._on_cancel = on_cancel
        self.counted = False  # its figures are in the engine's counters
        self._cond = threading.Condition()
        self._events: list[EngineEvent] = []
        self._aqueue: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def cancel(self) -> None:
        """Stop the request at its next job boundary (its last event says "cancelled")."""
        if not self.cancelled and self._on_cancel is not None:
            self._on_cancel(self.request_id)
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


class BatchEngine(Engine):
    """See the module docstring. `cost` gives each request's (draft, resident, load) KV bytes
    for the budgets `draft_budget` and `verify_budget` (bytes; None: unbounded)."""

    def __init__(self, lm: LoadedModel, max_batch: int = 16, max_waiting: int = 64,
                 backends: Backends | None = None, schedule: str = "lockstep",
                 draft_ahead: bool = True, cost: CostFn | None = None,
                 draft_budget: int | None = None, verify_budget: int | None = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
        self.schedule = schedule
        self.lm = lm
        self.backends = backends or LocalBackends(lm)
        self.model_name, self.tokenizer, self.max_context = lm.name, lm.tokenizer, lm.max_context
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.runner = LaneRunner(
            self.backends,
            Scheduler(schedule, 2, draft_budget, verify_budget, max_batch,
                      draft_ahead and schedule == "staggered"),
            cost, CostModel(), on_tokens=self._emit, on_end=self._finish, detailed=False)
        self._cost = cost
        self.costs = self.runner.costs  # learns this engine's round costs; chooses each round's k
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ids = 0
        # request ids name sessions on shared drafter and verifier services: unique per engine
        self._id_prefix = uuid.uuid4().hex[:12]
        self.counters = {"requests": 0, "finished": 0, "errors": 0, "cancelled": 0, "tokens": 0, "rounds": 0,
                         "draft_s": 0.0, "verify_s": 0.0, "prefill_s": 0.0, "store_s": 0.0,
                         "store_hits": 0, "store_bytes_read": 0, "store_bytes_written": 0,
                         "cached_tokens": 0, "select_s": 0.0,
                         "select_moved_tokens": 0, "select_delta_bytes": 0}
        self.tau_hist: dict[int, int] = {}
        self.k_hist: dict[int, int] = {}  # vericache rounds by drafts verified (0: plain steps)
        self._thread = threading.Thread(target=self._serve, name="vericache-engine", daemon=True)
        self._thread.start()

    def calibrate(self, params: GenParams) -> dict:
        """Fill the cost model from timed rounds of synthetic requests with `params` (the
        server's defaults) through this engine's backends (`vericache.engine.calibrate`).
        Call before serving: the rounds run on the calling thread."""
        from vericache.engine.calibrate import calibrate

        return calibrate(self.backends, self.lm, self.costs, params)

    # ---- API ---------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: GenParams) -> RequestStream:
        """Validate and queue a request (raises InvalidArgument / ContextTooLong / ResourceExhausted)."""
        with self._lock:
            self._ids += 1
            rid = f"req-{self._id_prefix}-{self._ids}"
        gen = Generation(self.lm, prompt_ids, params, request_id=rid)
        if self._cost is not None:
            check_fits(self._cost(gen), self.runner.sched.draft_budget, self.runner.sched.verify_budget)
        if self.runner.waiting >= self.max_waiting:
            raise ResourceExhausted(f"{self.max_waiting} requests are already waiting")
        rs = RequestStream(gen, rid, self.runner.cancel)
        with self._lock:
            self.counters["requests"] += 1
            self._streams[rid] = rs
        self.runner.submit(gen)
        return rs

    @property
    def queue_depth(self) -> int:
        return max(0, self.runner.waiting)

    @property
    def active(self) -> int:
        return self.runner.admitted

    def metrics(self) -> dict:
        tr = self.runner.trace
        with self._lock:
            counters = dict(self.counters)
        counters.update(overlapped_rounds=tr.overlapped, ahead_drafted=tr.ahead_drafted,
                        **{f"{lane}_busy_s": s for lane, s in tr.busy_s.items()})
        sched = self.runner.sched
        draft, verify = self.runner.kv_in_use
        kv = {"drafter": {"in_use": draft, "budget": sched.draft_budget},
              "verifier": {"in_use": verify, "budget": sched.verify_budget}}
        return {"counters": counters, "tau_hist": dict(self.tau_hist), "kv_bytes": kv,
                "k_hist": dict(self.k_hist), "costs": self.costs.snapshot()}

    def health(self) -> dict[str, bool]:
        return self.backends.health()

    def set_budgets(self, cost: CostFn | None, draft_budget: int | None,
                    verify_budget: int | None) -> None:
        """Adopt a request cost and KV budgets learned after start-up (the gateway reads them
        from the services' Health once they answer); requests admitted from now on see them."""
        self._cost = self.runner.cost = cost or (lambda g: (0, 0, 0))
        sched = self.runner.sched
        sched.draft_budget, sched.verify_budget = draft_budget, verify_budget

    def sessions(self) -> dict[str, int]:
        return self.backends.sessions()

    def close(self) -> None:
        self._stop.set()
        self.runner.cancel("")  # wakes the runner
        self._thread.join(timeout=30)

    # ---- the runner's hooks ----------------------------------------------------------
    def _serve(self) -> None:
        try:
            self.runner.serve(self._stop)
        except Exception:  # noqa: BLE001 -- a bug in the executor must not leave clients waiting
            log.exception("the engine's executor stopped")
            with self._lock:
                left = list(self._streams.values())
            for rs in left:
                rs.put(EngineEvent([], "", None, rs.gen.usage(), "internal error: the engine stopped"))

    def _count(self, rs: RequestStream) -> None:
        """Add a request's figures to the counters, once (before its client gets its last
        event, so /metrics read after an answer includes it)."""
        if rs.counted:
            return
        rs.counted = True
        g = rs.gen
        with self._lock:
            self.counters["finished"] += 1
            self.counters["rounds"] += g.stats.rounds
            for key in ("draft_s", "verify_s", "prefill_s", "store_s", "store_hits",
                        "store_bytes_read", "store_bytes_written", "cached_tokens", "select_s",
                        "select_moved_tokens", "select_delta_bytes"):
                self.counters[key] += getattr(g.stats, key)
            if g.selection is not None:
                key = f"selection:{g.selection.name}"
                self.counters[key] = self.counters.get(key, 0) + 1
            for n in g.stats.round_emitted:
                self.tau_hist[n] = self.tau_hist.get(n, 0) + 1
            if g.params.mode == "vericache":
                for k, n in g.stats.k_hist.items():
                    self.k_hist[k] = self.k_hist.get(k, 0) + n

    def _emit(self, g: Generation, toks: list[int]) -> None:
        rs = self._streams[g.rid]
        with self._lock:
            self.counters["tokens"] += len(toks)
        done = g.finished
        if done:
            self._count(rs)
        lps = None if g.logprobs is None else g.logprobs[len(g.logprobs) - len(toks):]
        rs.put(EngineEvent(toks, g.text.delta(done), g.stop.finish_reason,
                           g.usage() if done else None, logprobs=lps,
                           kinds=g.emitted_kinds[:len(toks)]))

    def _finish(self, g: Generation, error: str | None) -> None:
        with self._lock:
            rs = self._streams.pop(g.rid)
        if error is None:
            return
        if error not in ("cancelled", "engine closed"):
            log.warning("%s failed: %s", g.rid, error)
        self._count(rs)
        with self._lock:
            self.counters["cancelled" if error == "cancelled" else "errors"] += 1
        rs.put(EngineEvent([], "", None, g.usage(), error))
