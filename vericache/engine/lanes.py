"""Run requests over two lanes, drafter and verifier, each on its own thread.

The scheduler (`vericache.engine.scheduler`, pure bookkeeping) says which job each lane runs
next; this module runs the jobs on the backends (in-process or gRPC clients: the same
interface as `vericache.engine.rounds`) and reports each job's end back to it. In lockstep
mode one lane works at a time (the same rounds as `run_round`); in staggered mode one group
verifies (full-KV load + forward) while another drafts. torch releases the GIL inside its
kernels and the offloaded tier's loads are copies and sleeps, so the lanes really overlap.

Outcomes of a verification are committed to the drafter on the drafter's lane, before the
request's next draft, so a drafter session is only ever touched by one thread; with
`draft_ahead` the drafter lane, when it has nothing else to do, drafts past the drafts being
verified (`Drafter.draft_ahead`), and the commit keeps or drops those tokens.

`run_requests` runs a closed set of requests to the end (benchmarks); requests join when the
scheduler admits them (memory budgets) and leave when they finish (continuous batching).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from vericache.engine.drafter import DraftOut
from vericache.engine.generation import Generation
from vericache.engine.rounds import commit_outcomes, draft_phase, start, verify_phase
from vericache.spec.costmodel import CostModel
from vericache.engine.scheduler import DRAFT_LANE, VERIFY_LANE, Job, Scheduler

# (draft_bytes, resident_bytes, load_bytes) of a request, for the scheduler's budgets
CostFn = Callable[[Generation], tuple[int, int, int]]


@dataclass
class LaneTrace:
    """When things happened (time.perf_counter seconds)."""

    start: float = 0.0
    end: float = 0.0
    busy: dict[str, list[tuple[float, float]]] = field(
        default_factory=lambda: {DRAFT_LANE: [], VERIFY_LANE: []})
    first_token: dict[str, float] = field(default_factory=dict)  # rid -> time of its first token
    finish: dict[str, float] = field(default_factory=dict)
    max_active: int = 0  # most requests admitted at once
    ahead_drafted: int = 0  # tokens drafted ahead (draft_ahead)


class LaneRunner:
    """Runs jobs the scheduler hands out; see `run_requests`."""

    def __init__(self, backends, scheduler: Scheduler, cost: CostFn | None = None,
                 costs: CostModel | None = None):
        """`cost`: each request's memory for the budgets; `costs`: the round cost model that
        chooses k (a new one when None)."""
        self.backends, self.sched = backends, scheduler
        self.cost = cost or (lambda g: (0, 0, 0))
        self.costs = costs or CostModel()
        self.trace = LaneTrace()
        self._gens: dict[str, Generation] = {}
        self._drafts: dict[str, DraftOut] = {}
        self._outcomes: dict[str, tuple[int, int | None]] = {}  # verified, not yet committed
        self._drafted: dict[str, int] = {}  # drafts in each request's latest round

    def _emit(self, g: Generation, toks: list[int], now: float) -> None:
        if toks and g.rid not in self.trace.first_token:
            self.trace.first_token[g.rid] = now
        if g.finished:
            self.trace.finish[g.rid] = now

    def _execute(self, job: Job) -> set[str]:
        """Run one job on its lane's thread; returns the requests that finished."""
        t0 = time.perf_counter()
        gens = [self._gens[rid] for rid in job.rids]
        if job.kind == "prefill":
            for g in gens:
                self._emit(g, start(self.backends, g), time.perf_counter())
        elif job.kind == "draft":
            commit_outcomes(self.backends, gens, self._outcomes)
            out = draft_phase(self.backends, gens, self.costs)
            self._drafted.update({rid: len(d.tokens) for rid, d in out.items()})
            self._drafts.update(out)
        elif job.kind == "ahead":
            batch = [(g, g.k_ahead(self._drafted.get(g.rid, 0))) for g in gens
                     if g.params.mode == "vericache" and not g.finished]
            if batch:
                self.trace.ahead_drafted += self.backends.draft_ahead(batch)
        else:
            drafts = {g.rid: self._drafts.pop(g.rid) for g in gens if g.rid in self._drafts}
            out = verify_phase(self.backends, gens, drafts, self._outcomes, self.costs)
            now = time.perf_counter()
            for g in gens:
                self._emit(g, out[g.rid], now)
        finished = {g.rid for g in gens if g.finished} if job.kind != "ahead" else set()
        for rid in finished:
            self._outcomes.pop(rid, None)
            self.backends.release(self._gens[rid])
        self.trace.busy[job.lane].append((t0, time.perf_counter()))
        return finished

    def run(self, gens: list[Generation]) -> LaneTrace:
        """Run every request to its end; raises the first job error (releasing everyone)."""
        for g in gens:
            self._gens[g.rid] = g
            self.sched.add(g.rid, *self.cost(g))
        pools = {lane: ThreadPoolExecutor(1, thread_name_prefix=f"vericache-{lane}")
                 for lane in (DRAFT_LANE, VERIFY_LANE)}
        running: dict[Future, Job] = {}
        self.trace.start = time.perf_counter()
        try:
            while not self.sched.finished:
                for job in self.sched.schedule():
                    running[pools[job.lane].submit(self._execute, job)] = job
                if not running:
                    raise RuntimeError("the scheduler has requests left but no job to run")
                active = sum(1 for g in gens if self.sched.state(g.rid) not in ("waiting", "done"))
                self.trace.max_active = max(self.trace.max_active, active)
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for f in done:
                    job = running.pop(f)
                    self.sched.done(job, f.result())
        except BaseException:
            wait(running)
            for g in gens:
                self.backends.release(g)
            raise
        finally:
            for p in pools.values():
                p.shutdown(wait=True)
        self.trace.end = time.perf_counter()
        return self.trace


def run_requests(backends, gens: list[Generation], schedule: str = "lockstep", groups: int = 2,
                 draft_budget: int | None = None, verify_budget: int | None = None,
                 cost: CostFn | None = None, max_active: int | None = None,
                 draft_ahead: bool = False, costs: CostModel | None = None) -> LaneTrace:
    """Run `gens` to the end under `schedule` ("lockstep" or "staggered"); budgets in bytes.
    `draft_ahead` (staggered only, backends that offer it) drafts past drafts in verification."""
    draft_ahead = draft_ahead and hasattr(backends, "draft_ahead")
    sched = Scheduler(schedule, groups, draft_budget, verify_budget, max_active, draft_ahead)
    return LaneRunner(backends, sched, cost, costs).run(gens)
