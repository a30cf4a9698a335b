"""The scheduler: pure bookkeeping over the lanes (no tensors, no I/O, no clocks).

Requests move PREFILL → (DRAFT ⇄ VERIFY)* → DONE. Lanes run jobs: the drafter lane runs
draft jobs; the verifier lane runs verify jobs, and prefill jobs in lockstep; staggered, an
admission lane runs prefill jobs, and the drafter lane too, before its draft jobs. The engine
asks `schedule()` for jobs whenever a lane may be free, runs them (each lane on its own
thread), and reports each job's end with `done(job, finished)`.

Per-request states: WAITING (queued, not admitted), PREFILL (prefill job running),
READY_DRAFT, DRAFTING, READY_VERIFY, VERIFYING, DONE.

Modes:
- lockstep: one group; every ready request drafts together, then every request verifies
  together (in several verify jobs when the verifier's memory budget splits it), then all
  draft again; one lane works at a time.
- staggered: requests are split into `groups` groups at admission (the smallest group takes
  the newcomer); each lane takes a whole group, so while group A verifies, group B drafts.
  Admission is work-conserving: a prefill job holds one request, and the admission lane or the
  drafter lane takes it. The drafter lane prefills first (a request that fits is admitted
  before any draft job, as vLLM's scheduler puts prefills first), then drafts, then drafts
  ahead: a draft job costs k steps whatever its batch (each step reads the weights), so
  drafting for the few requests admitted so far while the rest wait multiplied the drafting
  (21 draft jobs against lockstep's 4 for 16 requests, 42 s against 12; docs/performance.md,
  seventeenth session). Except when the verifier would idle: when the verifier lane is free
  and no request is verifying or ready to, the drafter lane drafts for the requests ready to
  draft before it takes another prefill, so the verifier (and an offloaded full KV's link)
  starts with the first admitted requests instead of after the last (twenty-first session: the
  16 x 8k scenario's link had sat idle for the first 24 s of a 52 s run, through the 16
  admissions and the first draft job). A request whose full KV is offloaded (`load_bytes` > 0)
  is admitted on the admission lane only: its admission ends by storing its full KV over the
  tier's link, one store at a time, so a second admission on the drafter lane waited for the
  first's store with the drafter's work behind it (twenty-ninth session, 16 x 8k at 4 Gbit/s:
  the drafter lane's 5 prefills took 6.9 s, and the run 34.4 s against 30.5 s with them on the
  admission lane alone). The verifier lane only verifies: with an offloaded full KV it is
  mostly waiting on its link, and a prefill it ran held every verification (and the link)
  behind its compute, while the admission lane's prefill computes during those waits
  (nineteenth session, 16 x 8k: staggered went from 1.20x to 1.28x lockstep's throughput;
  docs/performance.md).
  With `draft_ahead`, a drafter lane that has no group to draft drafts ahead for requests
  whose drafts are waiting for or in verification (an "ahead" job: it changes no state; the
  engine keeps or drops those tokens when the verification ends), once per round each.
  Plain requests (their last draft job drafted nothing: the cost model chose plain decoding
  steps, or the request decodes in full mode) belong to no group: a draft or verify job
  takes them with whichever group it takes, and a verify job of plain requests only waits
  while other plain requests are a trivial draft job away. Without that, a batch that
  decodes plainly would run as two half batches, each pass reading the weights for half
  the tokens, slower than lockstep.

Memory: a request costs `draft_bytes` on the drafter and `resident_bytes` on the verifier
while admitted, and `load_bytes` on the verifier while it is being verified (the working
copy of an offloaded full KV; 0 for a resident one). An offloaded request also holds
`load_bytes` from its prefill job until its first verify job ends, and that job loads
nothing: its prefilled full KV stays in the verifier's memory for its first verification
(`Verifier.prefill`) while its host copy is stored, instead of being stored and loaded back
(thirtieth session: 16 x 8k at 4 Gbit/s loaded the full KV 30 times over the link, which
carried loads for 22.7 of the run's 28.4 s). Admission keeps room for one working copy (the
largest `load_bytes` admitted, or a running verify job's copies if they take more) beside
what the admitted requests hold, so a verify job can always load one: without it, prefilled
KV admitted ahead of a round's verifications filled the budget, and the job's first load
(always taken, for progress) went past it. Budgets: the drafter's, the verifier's,
and a total over both sides (one machine's memory holding both). Requests are admitted in
arrival order while every budget holds (the first always, so a too-small budget still makes
progress), and a verify job takes the group's ready requests in order while their load fits
what the verifier's and the total budget leave after the admitted requests' holdings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WAITING, PREFILL, READY_DRAFT, DRAFTING, READY_VERIFY, VERIFYING, DONE = (
    "waiting", "prefill", "ready_draft", "drafting", "ready_verify", "verifying", "done")
SCHEDULES = ("lockstep", "staggered")
DRAFT_LANE, VERIFY_LANE, ADMIT_LANE = "draft", "verify", "admit"
LANES = (DRAFT_LANE, VERIFY_LANE, ADMIT_LANE)


@dataclass(frozen=True)
class Job:
    """Work for one lane: kind is "prefill", "draft" or "verify"; rids in admission order."""

    kind: str  # "prefill", "draft", "ahead" or "verify"
    rids: tuple[str, ...]
    on: str = ""  # the lane where it is not the kind's own (a prefill on the drafter's lane)

    @property
    def lane(self) -> str:
        if self.on:
            return self.on
        return DRAFT_LANE if self.kind in ("draft", "ahead") else VERIFY_LANE


@dataclass
class _Req:
    rid: str
    draft_bytes: int
    resident_bytes: int
    load_bytes: int
    state: str = WAITING
    group: int = -1
    ahead: bool = False  # drafted ahead in this round already
    plain: bool = False  # its last draft job drafted nothing (staggered: in every group)
    # offloaded: its prefilled full KV is still in the verifier's memory (from its prefill job
    # until its first verify job ends): held as load_bytes, and that job loads nothing
    first: bool = False

    def verifier_bytes(self) -> int:
        """What it holds on the verifier now (a working copy counts while it is verified)."""
        copy = self.state == VERIFYING or self.first
        return self.resident_bytes + (self.load_bytes if copy else 0)

    def held_bytes(self) -> int:
        """What it holds on the verifier between verify jobs."""
        return self.resident_bytes + (self.load_bytes if self.first else 0)

    def admitted_bytes(self) -> int:
        """What it holds on the verifier once admitted: `held_bytes` with its prefilled KV
        (an offloaded one is `first` from its prefill job on)."""
        return self.resident_bytes + self.load_bytes

    def job_load(self) -> int:
        """The working copy its next verify job loads (none on its prefilled KV)."""
        return 0 if self.first else self.load_bytes


@dataclass
class Scheduler:
    """Two lanes over many requests; see the module docstring for the contract."""

    schedule_mode: str = "lockstep"
    groups: int = 2
    draft_budget: int | None = None  # bytes; None: unbounded
    verify_budget: int | None = None
    max_active: int | None = None
    draft_ahead: bool = False
    total_budget: int | None = None  # bytes over both sides
    _reqs: dict[str, _Req] = field(default_factory=dict)
    _busy: dict[str, Job | None] = field(default_factory=lambda: dict.fromkeys(LANES))
    _next_group: int = 0  # round-robin start for lanes choosing a group

    def __post_init__(self):
        if self.schedule_mode not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule_mode!r}; valid: {', '.join(SCHEDULES)}")
        if self.schedule_mode == "lockstep":
            self.groups = 1
        if self.groups < 1:
            raise ValueError("groups must be >= 1")

    # ---- requests -------------------------------------------------------------------
    def add(self, rid: str, draft_bytes: int = 0, resident_bytes: int = 0, load_bytes: int = 0) -> None:
        """Queue a request (WAITING)."""
        if rid in self._reqs:
            raise ValueError(f"request {rid!r} is already scheduled")
        self._reqs[rid] = _Req(rid, draft_bytes, resident_bytes, load_bytes)

    def remove(self, rid: str) -> None:
        """Drop a request that is in no running job (cancelled or failed): DONE."""
        r = self._reqs[rid]
        if r.state in (PREFILL, DRAFTING, VERIFYING):
            raise ValueError(f"request {rid!r} is in a running {r.state} job")
        r.state = DONE

    def in_use(self) -> tuple[int, int]:
        """(drafter bytes, verifier bytes) the admitted requests hold now (a verifier working
        copy counts while its verification runs)."""
        active = self._admitted()
        return (sum(r.draft_bytes for r in active), sum(r.verifier_bytes() for r in active))

    def forget(self, rid: str) -> None:
        """Drop a DONE request's record (a serving engine's scheduler lives for many requests)."""
        if self._reqs[rid].state != DONE:
            raise ValueError(f"request {rid!r} is not done")
        del self._reqs[rid]

    def state(self, rid: str) -> str:
        return self._reqs[rid].state

    def group(self, rid: str) -> int:
        return self._reqs[rid].group

    @property
    def finished(self) -> bool:
        """Every request is DONE and no job runs."""
        return all(r.state == DONE for r in self._reqs.values()) and not any(self._busy.values())

    def _in(self, *states: str) -> list[_Req]:
        return [r for r in self._reqs.values() if r.state in states]

    def _admitted(self) -> list[_Req]:
        return self._in(PREFILL, READY_DRAFT, DRAFTING, READY_VERIFY, VERIFYING)

    # ---- choosing jobs ------------------------------------------------------------------
    def schedule(self) -> list[Job]:
        """Jobs for the free lanes (marks them busy and their requests' states)."""
        jobs = []
        if self.schedule_mode == "staggered" and self._busy[ADMIT_LANE] is None:
            job = self._prefill_job(ADMIT_LANE)
            if job is not None:
                jobs.append(self._start(job))
        if self._busy[VERIFY_LANE] is None:
            if self.schedule_mode == "staggered":  # admission has lanes of its own
                job = self._verify_job()
            else:
                job = self._prefill_job() or self._verify_job()
            if job is not None:
                jobs.append(self._start(job))
        if self._busy[DRAFT_LANE] is None:
            job = self._draft_job()
            if job is not None:
                jobs.append(self._start(job))
        return jobs

    def _start(self, job: Job) -> Job:
        self._busy[job.lane] = job
        if job.kind == "ahead":
            for rid in job.rids:
                self._reqs[rid].ahead = True
            return job
        new = {"prefill": PREFILL, "draft": DRAFTING, "verify": VERIFYING}[job.kind]
        for rid in job.rids:
            if job.kind == "prefill":  # admitted: its group holds it from its first cache on
                self._reqs[rid].group = self._smallest_group()
                self._reqs[rid].first = self._reqs[rid].load_bytes > 0
            self._reqs[rid].state = new
        return job

    def _prefill_job(self, lane: str = "") -> Job | None:
        if self.schedule_mode == "lockstep" and self._in(DRAFTING):
            return None
        active = self._admitted()
        d = sum(r.draft_bytes for r in active)
        v = sum(r.held_bytes() for r in active)
        n = len(active)
        # room kept for a working copy: a running verify job's copies, or the largest one
        copy = max((r.load_bytes for r in active), default=0)
        running = sum(r.job_load() for r in active if r.state == VERIFYING)
        take = []
        for r in self._in(WAITING):
            if lane == DRAFT_LANE and r.load_bytes:  # offloaded: the admission lane's alone
                break
            held = r.admitted_bytes()
            copy = max(copy, r.load_bytes)
            room = max(copy, running)
            fits = (_fits(d + r.draft_bytes, self.draft_budget)
                    and _fits(v + held + room, self.verify_budget)
                    and _fits(d + r.draft_bytes + v + held + room, self.total_budget)
                    and (self.max_active is None or n < self.max_active))
            if not fits and (n or take):
                break
            take.append(r.rid)
            d, v, n = d + r.draft_bytes, v + held, n + 1
            if self.schedule_mode == "staggered":  # one a job: the other lane takes the next
                break
        return Job("prefill", tuple(take), lane) if take else None

    def _groups_in_order(self) -> list[int]:
        return [(self._next_group + i) % self.groups for i in range(self.groups)]

    def _verify_job(self) -> Job | None:
        if self.schedule_mode == "lockstep" and self._in(DRAFTING):
            return None
        waiting = self._in(READY_VERIFY)
        for g in self._groups_in_order():
            if not any(r.group == g for r in waiting):
                continue
            ready = [r for r in waiting if r.group == g or r.plain]
            if self._plain_to_wait_for(ready):
                return None
            held = self._admitted()
            resident = sum(r.held_bytes() for r in held)
            rooms = [b - used for b, used in ((self.verify_budget, resident),
                                              (self.total_budget, resident + sum(r.draft_bytes for r in held)))
                     if b is not None]
            room = min(rooms) if rooms else None
            # those that load nothing (on their prefilled KV) first, then in admission order
            take, used = set(), 0
            for r in sorted(ready, key=lambda r: r.job_load() > 0):
                if take and not _fits(used + r.job_load(), room):
                    break
                take.add(r.rid)
                used += r.job_load()
            return Job("verify", tuple(r.rid for r in ready if r.rid in take))
        return None

    def _draft_job(self) -> Job | None:
        if self.schedule_mode == "lockstep" and self._in(VERIFYING, READY_VERIFY, PREFILL):
            return None
        waiting = self._in(READY_DRAFT)
        # admission first, unless the verifier would idle (see the module docstring)
        if self.schedule_mode == "staggered" and not (waiting and self._verifier_starved()):
            job = self._prefill_job(DRAFT_LANE)
            if job is not None:
                return job
        for g in self._groups_in_order():
            if any(r.group == g for r in waiting):
                self._next_group = (g + 1) % self.groups
                return Job("draft", tuple(r.rid for r in waiting if r.group == g or r.plain))
        if self.schedule_mode != "staggered" or not self.draft_ahead:
            return None
        # nothing to draft or admit: draft ahead
        ahead = [r.rid for r in self._in(VERIFYING, READY_VERIFY) if not r.ahead]
        return Job("ahead", tuple(ahead)) if ahead else None

    def _verifier_starved(self) -> bool:
        """The verifier lane is free and no request is verifying or ready to: its next work
        waits on a draft job."""
        return self._busy[VERIFY_LANE] is None and not self._in(READY_VERIFY, VERIFYING)

    def _plain_to_wait_for(self, ready: list[_Req]) -> bool:
        """Staggered: `ready` are all plain, and other plain requests will be ready to verify
        after a draft job that drafts nothing (the drafter lane is free to take them, or
        runs such a job): verifying now would split a plain batch in two."""
        if self.schedule_mode != "staggered" or not all(r.plain for r in ready):
            return False
        coming = [r for r in self._in(READY_DRAFT, DRAFTING) if r.plain]
        running = self._busy[DRAFT_LANE]
        return bool(coming) and (running is None or running.kind == "draft" and all(
            self._reqs[rid].plain for rid in running.rids))

    # ---- results ------------------------------------------------------------------------
    def done(self, job: Job, finished: frozenset[str] | set[str] = frozenset(),
             plain: frozenset[str] | set[str] = frozenset()) -> None:
        """A job ended; requests in `finished` are DONE (they may end after prefill or verify).
        A draft job's `plain` requests drafted nothing (see the module docstring)."""
        if self._busy[job.lane] != job:
            raise ValueError(f"{job} is not running")
        self._busy[job.lane] = None
        if job.kind == "ahead":
            return
        for rid in job.rids:
            r = self._reqs[rid]
            if rid in finished:
                r.state = DONE
            elif job.kind == "prefill":
                r.state = READY_DRAFT
            elif job.kind == "draft":
                r.state, r.plain = READY_VERIFY, rid in plain
            else:
                r.state, r.ahead, r.first = READY_DRAFT, False, False

    def _smallest_group(self) -> int:
        sizes = [0] * self.groups
        for r in self._admitted():
            if r.group >= 0:
                sizes[r.group] += 1
        return min(range(self.groups), key=lambda g: sizes[g])


def _fits(used: int, budget: int | None) -> bool:
    return budget is None or used <= budget
