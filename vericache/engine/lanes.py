"""The engine's executor: requests over the lanes (drafter, verifier and, staggered, admission),
each on its own thread.

This is the one executor: `vericache serve`, the gateway (`BatchEngine` is its admission and
event shell) and `vericache bench --scenario` (`run_requests`) all run their requests here.

The scheduler (`vericache.engine.scheduler`, pure bookkeeping) says which job each lane runs
next; this module runs the jobs on the backends (`vericache.engine.backends.Backends`:
in-process or gRPC) and reports each job's end back to it. In lockstep mode one lane works at
a time (the same rounds as `run_round`); in staggered mode one group verifies (full-KV load +
forward) while another drafts, and new requests are prefilled beside both. torch releases
the GIL inside its kernels and the offloaded tier's loads are copies and sleeps, so the
lanes really overlap.

Outcomes of a verification are committed to the drafter on the drafter's lane, before the
request's next draft, so a drafter session is only ever touched by one thread; with
`draft_ahead` the drafter lane, when it has nothing else to do, drafts past the drafts being
verified (`Drafter.draft_ahead`), and the commit keeps or drops those tokens.

One thread (the caller of `serve` or `run`) owns the scheduler: it takes new requests and
cancellations from an inbox, hands jobs to the lanes and reads their ends. Requests join
when the scheduler admits them (memory budgets, `max_active`) and leave when they finish,
fail or are cancelled (continuous batching). A failed job fails only its own requests (a
prefill failure only its request); `run` (a closed set, benchmarks) raises instead.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from vericache.engine.backends import Backends
from vericache.engine.drafter import DraftOut
from vericache.engine.generation import Generation
from vericache.engine.rounds import commit_outcomes, draft_phase, start, verify_phase
from vericache.engine.scheduler import (DONE, DRAFTING, LANES, PREFILL, VERIFYING, WAITING,
                                        Job, Scheduler)
from vericache.errors import Unavailable, VeriCacheError
from vericache.memory import IdleTrim
from vericache.spec.costmodel import CostModel

log = logging.getLogger(__name__)

# (draft_bytes, resident_bytes, load_bytes) of a request, for the scheduler's budgets
CostFn = Callable[[Generation], tuple[int, int, int]]
# tokens a request emitted (called on the verifier lane's thread, in order per request)
TokensFn = Callable[[Generation, list[int]], None]
# a request left the executor: None when it finished, else why it failed ("cancelled", ...)
EndFn = Callable[[Generation, "str | None"], None]


@dataclass
class LaneTrace:
    """What the lanes did. Times are time.perf_counter seconds; the per-job intervals and the
    per-request times are kept only when `detailed` (a closed run), the totals always."""

    detailed: bool = True
    start: float = 0.0
    end: float = 0.0
    busy: dict[str, list[tuple[float, float]]] = field(
        default_factory=lambda: {lane: [] for lane in LANES})
    busy_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LANES, 0.0))
    # (lane, job kind) -> [seconds, jobs]: where each lane's time went
    jobs: dict[tuple[str, str], list] = field(default_factory=dict)
    first_token: dict[str, float] = field(default_factory=dict)  # rid -> time of its first token
    finish: dict[str, float] = field(default_factory=dict)
    max_active: int = 0  # most requests admitted at once
    ahead_drafted: int = 0  # tokens drafted ahead (draft_ahead)
    overlapped: int = 0  # verify jobs during which the drafter lane drafted
    peak_kv: tuple[int, int] = (0, 0)  # most (drafter, verifier) KV bytes charged at once
    peak_kv_total: int = 0  # most KV bytes charged at once over both sides


@dataclass
class _JobResult:
    finished: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # rid -> reason
    plain: set[str] = field(default_factory=set)  # a draft job's requests that drafted nothing


def failure_reason(e: BaseException) -> str:
    """What a request's client is told when its job failed."""
    if isinstance(e, VeriCacheError):
        return f"{type(e).__name__}: {e}"
    return f"internal error: {type(e).__name__}: {e}"


class LaneRunner:
    """Runs the scheduler's jobs on two lane threads; see the module docstring.

    `cost`: each request's memory for the budgets; `costs`: the round cost model that
    chooses k (a new one when None); `on_tokens`, `on_end`: a serving shell's hooks."""

    def __init__(self, backends: Backends, scheduler: Scheduler, cost: CostFn | None = None,
                 costs: CostModel | None = None, on_tokens: TokensFn | None = None,
                 on_end: EndFn | None = None, detailed: bool = True):
        self.backends, self.sched = backends, scheduler
        self.cost = cost or (lambda g: (0, 0, 0))
        self.costs = costs or CostModel()
        self.on_tokens, self.on_end = on_tokens, on_end
        self.trace = LaneTrace(detailed)
        self._gens: dict[str, Generation] = {}
        self._drafts: dict[str, DraftOut] = {}
        self._outcomes: dict[str, tuple[int, int | None]] = {}  # verified, not yet committed
        self._drafted: dict[str, int] = {}  # drafts in each request's latest round
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", g) | ("cancel", rid)
        self._cancelled: set[str] = set()
        self._wake = threading.Event()
        self._running: dict[Future, Job] = {}
        self._overlapped: dict[Job, bool] = {}  # running verify job -> a draft job overlapped it
        self._ending: dict[str, str | None] = {}  # ends waiting for an ahead job on the rid
        # rid -> why: its ahead job found the drafter unavailable (or past its deadline); its
        # next draft job fails it at once instead of waiting out a second deadline
        self._doomed: dict[str, str] = {}
        self.waiting = 0  # requests not admitted yet (read from any thread)
        self.admitted = 0
        self.kv_in_use = (0, 0)  # (drafter, verifier) bytes charged to the budgets
        self.idle = IdleTrim()  # serving: freed memory back to the system once idle

    # ---- from any thread ----------------------------------------------------------------
    def submit(self, g: Generation) -> None:
        """Queue a request; its tokens and end arrive through the hooks."""
        self.waiting += 1
        self._inbox.put(("add", g))
        self._wake.set()

    def cancel(self, rid: str) -> None:
        """End a request at its next job boundary (its end reason is "cancelled")."""
        self._inbox.put(("cancel", rid))
        self._wake.set()

    # ---- the owner thread ---------------------------------------------------------------
    def run(self, gens: list[Generation]) -> LaneTrace:
        """Run a closed set of requests to their end; raises the first job error (releasing
        everyone)."""
        for g in gens:
            self.submit(g)
        self._loop(lambda: self._idle() and self.sched.finished, strict=True)
        return self.trace

    def serve(self, stop: threading.Event) -> None:
        """Take requests until `stop` is set; then end the ones left ("engine closed")."""
        self._loop(stop.is_set, strict=False)

    def _idle(self) -> bool:
        return not self._running and self._inbox.empty()

    def _loop(self, should_stop: Callable[[], bool], strict: bool) -> None:
        # the lanes compute with this thread's intra-op thread count (a new thread would
        # start from OpenMP's default, ignoring e.g. `vericache bench --threads`)
        self._threads = threads = torch.get_num_threads()  # the lanes' jobs share them
        pools = {lane: ThreadPoolExecutor(1, thread_name_prefix=f"vericache-{lane}",
                                          initializer=torch.set_num_threads, initargs=(threads,))
                 for lane in LANES}
        self.trace.start = time.perf_counter()
        try:
            while True:
                self._drain()
                if should_stop():
                    break
                for job in self.sched.schedule():
                    self._launch(pools[job.lane], job)
                self._count()
                if strict and not self._running and self._inbox.empty():
                    raise RuntimeError("the scheduler has requests left but no job to run")
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                for f in [f for f in self._running if f.done()]:
                    self._settle(f, self._running.pop(f), strict)
                if self._gens or self._running:
                    self.idle.busy()
                elif not strict:
                    self.idle.poll()
        except BaseException:
            wait(self._running)
            for rid in list(self._gens):
                self.backends.release(self._gens.pop(rid))
            raise
        finally:
            for p in pools.values():
                p.shutdown(wait=True)
            self.trace.end = time.perf_counter()
        self._running.clear()  # stopped: jobs still running were waited for, not settled
        self._ending.clear()
        for rid in list(self._gens):
            self._end(rid, "engine closed")

    def _drain(self) -> None:
        while True:
            try:
                what, x = self._inbox.get_nowait()
            except queue.Empty:
                break
            if what == "add":
                self._gens[x.rid] = x
                self.sched.add(x.rid, *self.cost(x))
            else:
                self._cancelled.add(x)
        for rid in list(self._cancelled):
            if rid not in self._gens:
                self._cancelled.discard(rid)
            elif self.sched.state(rid) not in (PREFILL, DRAFTING, VERIFYING):
                self.sched.remove(rid)
                self._end(rid, "cancelled")

    def _count(self) -> None:
        states = [self.sched.state(rid) for rid in self._gens]
        self.waiting = sum(s == WAITING for s in states) + self._inbox.qsize()
        self.admitted = sum(s not in (WAITING, DONE) for s in states)
        self.trace.max_active = max(self.trace.max_active, self.admitted)
        self.kv_in_use = self.sched.in_use()
        self.trace.peak_kv = tuple(map(max, self.trace.peak_kv, self.kv_in_use))
        self.trace.peak_kv_total = max(self.trace.peak_kv_total, sum(self.kv_in_use))

    def _launch(self, pool: ThreadPoolExecutor, job: Job) -> None:
        if job.kind == "prefill":
            for rid in job.rids:
                self._gens[rid].group = self.sched.group(rid)
        if job.kind == "verify":
            self._overlapped[job] = any(j.kind == "draft" for j in self._running.values())
        elif job.kind == "draft":
            for j in self._overlapped:
                self._overlapped[j] = True
        # the jobs running at once share the threads (see `_execute`)
        f = pool.submit(self._execute, job, max(1, self._threads // (len(self._running) + 1)))
        self._running[f] = job
        f.add_done_callback(lambda _: self._wake.set())

    def _settle(self, f: Future, job: Job, strict: bool) -> None:
        """A job ended: tell the scheduler, end its finished or failed requests."""
        if job.kind == "verify" and self._overlapped.pop(job, False):
            self.trace.overlapped += 1
        e = f.exception()
        if e is not None and strict:
            raise e
        if job.kind == "ahead":  # it changes no state; ends it held back go ahead now
            if e is not None:
                log.warning("drafting ahead failed (the next draft job reports it): %s", e)
                if isinstance(e, Unavailable):
                    self._doomed.update({rid: failure_reason(e) for rid in job.rids})
            self.sched.done(job)
            for rid, why in [(r, w) for r, w in self._ending.items() if r in job.rids]:
                del self._ending[rid]
                self._end(rid, why)
            return
        res = _JobResult(failed={rid: failure_reason(e) for rid in job.rids}) if e else f.result()
        if e is not None and not isinstance(e, VeriCacheError):
            log.error("%s job failed unexpectedly", job.kind, exc_info=e)
        self.sched.done(job, res.finished | set(res.failed), res.plain)
        for rid in job.rids:
            if rid in res.failed or rid in res.finished:
                self._end(rid, res.failed.get(rid))

    def _end(self, rid: str, why: str | None) -> None:
        """Release a request that is in no running job (or later, after an ahead job)."""
        if any(j.kind == "ahead" and rid in j.rids for j in self._running.values()):
            self._ending[rid] = why
            return
        g = self._gens.pop(rid)
        if self.sched.state(rid) != DONE:
            self.sched.remove(rid)
        self.sched.forget(rid)
        self._cancelled.discard(rid)
        for d in (self._drafts, self._outcomes, self._drafted, self._doomed):
            d.pop(rid, None)
        self.backends.release(g)
        self._count()
        if self.on_end is not None:
            self.on_end(g, why)

    def _emit(self, g: Generation, toks: list[int]) -> None:
        if self.trace.detailed:
            now = time.perf_counter()
            if toks and g.rid not in self.trace.first_token:
                self.trace.first_token[g.rid] = now
            if g.finished:
                self.trace.finish[g.rid] = now
        if self.on_tokens is not None:
            self.on_tokens(g, toks)

    def _execute(self, job: Job, threads: int) -> _JobResult:
        """Run one job on its lane's thread, computing on `threads` intra-op threads: the
        lanes' threads share the caller's, split between the jobs running when this one
        starts. Each lane on all of them oversubscribed the cores (on 2 vCPUs, three lanes'
        OpenMP teams of two: a static split waits for its descheduled half), and the
        staggered schedule's lanes compute at once (embedded; a lane whose backends are
        gRPC services only waits on them)."""
        # torch applies its process-wide count to a thread at the thread's first query or
        # parallel op, which would undo a count set before it: query first
        torch.get_num_threads()
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        gens = [self._gens[rid] for rid in job.rids]
        res = _JobResult()
        if job.kind == "prefill":
            for g in gens:
                try:
                    self._emit(g, start(self.backends, g))
                except Exception as e:  # noqa: BLE001 -- this request fails, the others go on
                    if not isinstance(e, VeriCacheError):
                        log.error("%s: prefill failed unexpectedly", g.rid, exc_info=e)
                    res.failed[g.rid] = (str(e) if isinstance(e, VeriCacheError)
                                         else f"internal error: {type(e).__name__}")
        elif job.kind == "draft":
            for g in gens:
                if g.rid in self._doomed:
                    res.failed[g.rid] = self._doomed.pop(g.rid)
            gens = [g for g in gens if g.rid not in res.failed]
            commit_outcomes(self.backends, gens, self._outcomes, self.costs,
                            {rid for rid, n in self._drafted.items() if n})
            out = draft_phase(self.backends, gens, self.costs) if gens else {}
            self._drafted.update({rid: len(d.tokens) for rid, d in out.items()})
            self._drafts.update(out)
            res.plain = {g.rid for g in gens if g.rid not in out or not out[g.rid].tokens}
        elif job.kind == "ahead":
            batch = [(g, g.k_ahead(self._drafted.get(g.rid, 0))) for g in gens
                     if g.params.mode == "vericache" and not g.finished]
            if batch:
                self.trace.ahead_drafted += self.backends.draft_ahead(batch)
        else:
            drafts = {g.rid: self._drafts.pop(g.rid) for g in gens if g.rid in self._drafts}
            out = verify_phase(self.backends, gens, drafts, self._outcomes, self.costs)
            for g in gens:
                self._emit(g, out[g.rid])
        if job.kind != "ahead":
            res.finished = {g.rid for g in gens if g.finished and g.rid not in res.failed}
        t1 = time.perf_counter()
        self.trace.busy_s[job.lane] += t1 - t0
        spent = self.trace.jobs.setdefault((job.lane, job.kind), [0.0, 0])
        spent[0] += t1 - t0
        spent[1] += 1
        if self.trace.detailed:
            self.trace.busy[job.lane].append((t0, t1))
        return res


def run_requests(backends: Backends, gens: list[Generation], schedule: str = "lockstep",
                 groups: int = 2, draft_budget: int | None = None, verify_budget: int | None = None,
                 cost: CostFn | None = None, max_active: int | None = None,
                 draft_ahead: bool = False, costs: CostModel | None = None,
                 total_budget: int | None = None) -> LaneTrace:
    """Run `gens` to the end under `schedule` ("lockstep" or "staggered"); budgets in bytes
    (`total_budget`: drafter and verifier together). `draft_ahead` (staggered only) drafts
    past drafts in verification."""
    sched = Scheduler(schedule, groups, draft_budget, verify_budget, max_active, draft_ahead,
                      total_budget)
    return LaneRunner(backends, sched, cost, costs).run(gens)
