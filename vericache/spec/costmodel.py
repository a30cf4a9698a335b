"""Cost-aware draft length: the k per round that maximises expected tokens per second.

Words (draft, accepted, bonus and round as in `vericache.spec.accept`):
- acceptance profile of a request: p_j = P(draft j is accepted | drafts 1..j-1 were), for
  j = 1..k_max, counted from the request's own rounds and shrunk towards the pooled profile.
- pooled profile: the same p_j counted over every request's rounds so far, each position
  shrunk towards the one before it (so positions no round has reached yet take the rate of
  the last one reached, and before any round, PRIOR_RATE). It is per position because
  acceptance is not one rate: a round that has reached draft 15 is usually in a stretch the
  drafter copies well, so late positions are accepted more often than early ones, and one
  pooled rate (0.972 after a warm-up on a document, whose drafts were accepted whole at
  k = 32) priced long drafts too low: the plan drafted 10, then 19.
  A request's own rounds scale the pooled rejection rates by how its rejections compare with
  what the pooled profile expected at the positions it reached.
- expected tokens of a round with k drafts: E(k) = 1 + sum_{i=1..k} prod_{j<=i} p_j (the
  bonus token always comes).
- round time of a group: T(k) = k * t_draft_step + t_verify(pass) + n * t_commit, n the
  requests drafting; with k = 0 the round is a plain full-KV decode step (no draft step, a
  verify pass of one token per request, nothing to commit). t_commit is what handing one
  drafting request's outcome to its drafter costs (a Commit RPC per request behind the
  services: left out, a round of 8 drafting requests was priced 5-10% cheap there).
- goodput: the group's expected tokens over its round time, sum_i E_i(k_i) / T. The group
  drafts a common K (a draft step runs while any request drafts) when its goodput beats
  plain steps' by DRAFT_MARGIN; a request whose own expected gain does not pay for its verify
  tokens drops to k = 0 that round.

The times come from the engine's own rounds (`CostModel.observe_*`): a draft step is linear
in the sequences drafting and their total context; a verify pass in its tokens, its total
context (KV read) and tokens × context (attention). Where the full KV is loaded from an
offloaded tier for each pass, the load runs beside the compute (layer l loads while layer
l-1 computes), so a pass takes the longer of the two, not their sum: the fit then learns
the pass's compute alone (its time less the time it waited for layers), the tier's seconds
per context token loaded are a running estimate of their own, and a pass is priced at
max(compute, load). Summed into one line, the load made every drafted token look as dear
as a loaded one: at 8 x 4k over a 4 Gbit/s tier the plan drafted 10-19 tokens where 30
were accepted. Both
also carry a step for a pass of more than one row: a one-row pass is a matrix-vector product,
and on a CPU the first few extra rows cost far more than their share (measured here: 2-16
rows read the weights at 4-18 GB/s against ~40 for one), so a straight line through 1, 3 and
9 rows would price a short draft's verify pass too cheaply. Each is a least-squares fit over
running estimates per shape bucket (`LinearFit`), so it follows the machine and the load
without forgetting the shapes it has not seen lately. A serving engine fills them at start-up
(`vericache.engine.calibrate`: timed rounds through its own backends); until both fits have
seen enough distinct shapes (no calibration, or one that failed) the plan explores a fixed
cycle of k values.
This module is bookkeeping: no tensors, no clocks (callers pass seconds in).
"""

from __future__ import annotations

import bisect
import logging
import threading
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

PRIOR_RATE = 0.6  # acceptance rate assumed before any round has been seen
SHRINK = 4.0  # pseudo-rounds pulling a position's rate towards its prior
REJECT_SHRINK = 1.0  # pseudo-rejections in a request's scaling of the pooled rejection rates
# k of the first rounds while the fits learn (capped by k_max): short drafts, since a draft
# step's time is fitted per step; varied, since a verify pass's is fitted per token
EXPLORE = (1, 0, 2, 4, 0, 8, 1, 3)
OPTIMISTIC_RATE = 0.9  # a stale request probes only if drafting would pay at this rate
FIRST_OBS = 3  # a shape bucket's first times enter as their median (LinearFit)
OUTLIER = 2.0  # ... and later ones at most this multiple of its estimate
MIN_FIT = 6  # observations before a fit is trusted (the verify fit: of >= 3 token counts)
PROBE_EVERY = 32  # a request on plain steps drafts once this often, to refresh its profile
PROBE_K = 2  # ... this many tokens
# drafting must be predicted this much faster than plain steps before a group drafts: a
# prediction is a few percent off (k_table.py: predicted 1.04x, measured 0.93x at 4 x 4k), and
# a wrong draft costs where a missed one only forgoes a small gain
DRAFT_MARGIN = 1.05
# ... and this much before a request's drafter starts: its first drafting round prepares
# and loads the drafter's KV (over a slow link in remote prefix: 47 MB a 4k request, with
# 55 MB of selection moves and tails over the near one, and the selection's compute), a cost
# no round's price carries; a marginal gain never pays it back (remote-prefix on this CPU: one
# round of k = 1 per request started every drafter, 0.78x full near, against 0.92x in a run
# where none drafted)
START_MARGIN = 1.2
# ... and where the time it saves over the group's next tokens (each request's remaining
# tokens, at most START_HORIZON of them) pays for the drafters' start, priced per context
# token from the extra time of draft phases that started drafters (over the services, the
# first drafting round of 8 requests of 0.3k-4k tokens took 2.8-3.1 s beyond its steps, more
# than drafting 1.2x faster than plain steps at 35 tok/s saves over 64-token answers)
START_HORIZON = 256
# ... and by this much where the group's plain step is priced by the line alone (its shape
# not seen yet, and no offloaded load setting its price): a start is paid once, and the
# line reaches shapes far from the ones it was fitted on. Remote prefix on a 2-vCPU Zen 4,
# calibrated at 1-2k tokens: a plain step of one 8k request was priced 0.080 s against the
# 0.036 s it took, of four 0.33 s against 0.07-0.09; in one of that session's runs the
# verify policy's plan started drafters in its first rounds and ran 16.24 tok/s, against
# 27.79 for the question policy's plain steps in the same run (docs/performance.md,
# thirty-ninth session)
START_MARGIN_UNSEEN = 2.0


def nonnegative_lstsq(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |Aθ - b| over θ >= 0 (each cost grows with its feature), by trying every set of
    free coefficients (fine for the few features here), with a light ridge for directions
    the rows do not span yet."""
    d = A.shape[1]
    G, h = A.T @ A, A.T @ b
    G = G + 1e-9 * max(float(np.trace(G)), 1.0) * np.eye(d)
    best, best_r = np.zeros(d), float(b @ b)
    for mask in range(1, 1 << d):
        free = [i for i in range(d) if mask >> i & 1]
        t = np.linalg.solve(G[np.ix_(free, free)], h[free])
        if (t < 0).any():
            continue
        theta = np.zeros(d)
        theta[free] = t
        r = float(np.sum((A @ theta - b) ** 2))
        if r < best_r:
            best, best_r = theta, r
    return best


class LinearFit:
    """y ≈ θ·x, fitted by least squares over shape buckets.

    A bucket holds the observations of one shape (the caller's key): the running means of
    their x and y, a plain mean over its first observations, then an exponential one that
    gives the newest `recency` of the weight, so the bucket follows the machine and its load.
    θ is refitted over the buckets, each weighted by its observations (at most CAP_WEIGHT),
    with every coefficient kept >= 0 (no feature makes a pass cheaper). A shape not seen for a while
    keeps its last estimate. (Recursive least squares with forgetting did not: hundreds of
    rounds of nearly one shape, the context growing, wound its covariance up and let noise
    move the prediction for every other shape; a simulated 9-row pass was predicted at 0.08
    of its time after 600 plain steps, and a server drafted where it did not pay.) At most
    `max_buckets`, the least recently seen dropped first.

    A prediction for a shape whose bucket has been seen starts from that bucket's own mean
    (plus θ times the difference of x from the bucket's mean x), weighted by how often it was
    seen, n / (n + SEEN_PRIOR); the line alone prices the shapes not seen. Pass times are not
    linear in their rows over the range the plan asks about (a CPU pass of 4 rows costs about
    what 8 do; hundreds of rows cost per row): a line through them priced a 16-row plain step
    at 1.5 times its measured time, and the plan compared k against that, not the step.

    A bucket's first FIRST_OBS times enter as their median (the smaller of the first two), not
    their mean: the first pass of a new shape is often slow (memory touched for the first
    time, a new batch's caches), and averaged in it priced the group's plain step above its
    cost while the drafting round's unseen shape was priced from the line, so every new group
    drafted once (and started its drafters) where drafting did not pay (serve_mixed: the first
    batch of 8 requests, each one round of k = 2 and its drafter's load, 0.90x full mode).
    Later times enter at most OUTLIER times the bucket's estimate: one slow pass (a batch's
    caches pooled for the first time: 4.5 s where its steps take 0.25) moved a seen plain
    step's price to 1.2 s, and the group drafted and started its drafters (the services,
    0.84x full mode); a machine that really slows down still moves it, by OUTLIER a time.
    """

    SEEN_PRIOR = 0.5

    CAP_WEIGHT = 8

    def __init__(self, dims: int, recency: float = 0.1, max_buckets: int = 64):
        self.dims, self.recency, self.max_buckets = dims, recency, max_buckets
        self.theta = np.zeros(dims)
        self.n = 0
        self.shapes: set = set()
        self.floor = float("inf")  # a tenth of the smallest y seen: predictions stay above it
        self._buckets: dict = {}  # bucket -> [observations, mean x, mean y]; oldest first
        self._firsts: dict = {}  # the rest of a bucket's key -> its buckets' first keys, sorted

    def observe(self, x: np.ndarray, y: float, shape=None, bucket=None) -> None:
        """One observation; `shape` counts towards `ready`, `bucket` (default: `shape`) is
        the bucket it joins."""
        key = shape if bucket is None else bucket
        b = self._buckets.pop(key, None)
        if b is None:
            b = [0, np.zeros(self.dims), 0.0, []]
            if len(self._buckets) >= self.max_buckets:
                old = next(iter(self._buckets))
                del self._buckets[old]
                f, rest = _split(old)
                self._firsts[rest].remove(f)
            f, rest = _split(key)
            bisect.insort(self._firsts.setdefault(rest, []), f)
        b[0] += 1
        a = max(1.0 / b[0], self.recency)
        b[1] = b[1] + a * (np.asarray(x, dtype=float) - b[1])
        if b[0] <= FIRST_OBS:  # the smaller of two, then the median of FIRST_OBS (see the class)
            b[3].append(y)
            b[2] = sorted(b[3])[(len(b[3]) - 1) // 2]
        else:
            b[2] += a * (min(y, OUTLIER * b[2]) - b[2])
        self._buckets[key] = b  # now the most recently seen
        self.n += 1
        self.floor = min(self.floor, 0.1 * y)
        if shape is not None and len(self.shapes) < 64:
            self.shapes.add(shape)
        self._refit()

    def _refit(self) -> None:
        X = np.stack([b[1] for b in self._buckets.values()])
        y = np.array([b[2] for b in self._buckets.values()])
        w = np.minimum([b[0] for b in self._buckets.values()], self.CAP_WEIGHT).astype(float)
        self.theta = nonnegative_lstsq(X * np.sqrt(w)[:, None], y * np.sqrt(w))

    def seen(self, bucket) -> int:
        """How many observations `bucket` holds (0: its shape is priced by the line)."""
        b = self._buckets.get(bucket)
        return 0 if b is None else b[0]

    def ready(self, shapes: int = 1) -> bool:
        """Whether the fit has seen MIN_FIT observations of at least `shapes` shapes."""
        return self.n >= MIN_FIT and len(self.shapes) >= shapes

    def predict(self, x: np.ndarray, bucket=None) -> float:
        """θ·x, pulled towards the bucket's own estimate where `bucket` has been seen, and
        otherwise towards what its seen neighbours give (`_anchor`): the line alone prices
        an unseen shape off the level of the seen ones next to it, and the plan compares the
        two (a plain step of 4 x 4k seen, its k = 1 round not: the line priced the round so
        cheaply against the step that the requests drafted once, and started their
        drafters, where drafting did not pay)."""
        x = np.asarray(x, dtype=float)
        y = float(x @ self.theta)
        b = self._buckets.get(bucket) if bucket is not None else None
        if b is not None:
            w = b[0] / (b[0] + self.SEEN_PRIOR)
            y = w * (b[2] + float((x - b[1]) @ self.theta)) + (1.0 - w) * y
        elif bucket is not None:
            anchored = self._anchor(bucket, x)
            if anchored is not None:
                w = anchored[1]
                y = w * anchored[0] + (1.0 - w) * y
        return max(y, self.floor if self.n else 0.0, 1e-6)

    def _anchor(self, bucket, x: np.ndarray) -> tuple[float, float] | None:
        """An unseen bucket's estimate from the seen buckets sharing the rest of its key (the
        context bucket) and nearest it in the first (rows or sequences): between two, their
        times interpolated in that key; beyond them, the nearest one's time; each plus θ times
        the difference of x from theirs. With its weight: the neighbours' n / (n + SEEN_PRIOR),
        beyond the seen ones also times how near (the smaller key over the larger)."""
        first, rest = _split(bucket)
        firsts = self._firsts.get(rest, [])
        i = bisect.bisect_left(firsts, first)  # firsts[i] > first: `bucket` itself is not seen
        below = next(((f, self._buckets[_join(f, rest)]) for f in firsts[i - 1:i] if f > 0), None)
        above = next(((f, self._buckets[_join(f, rest)]) for f in firsts[i:i + 1] if f > 0), None)
        if first <= 0 or (below is None and above is None):
            return None
        if below is not None and above is not None:
            (fb, bb), (fa, ba) = below, above
            wa = (first - fb) / (fa - fb)
            level = (1 - wa) * bb[2] + wa * ba[2]
            mean_x = (1 - wa) * bb[1] + wa * ba[1]
            n = min(bb[0], ba[0])
            return level + float((x - mean_x) @ self.theta), n / (n + self.SEEN_PRIOR)
        f, b = below or above
        near = min(f, first) / max(f, first)
        return b[2] + float((x - b[1]) @ self.theta), near * b[0] / (b[0] + self.SEEN_PRIOR)


class RunningMean:
    """A mean of the first 1 / `recency` values, then an exponential one that gives the
    newest `recency` of the weight (0 before any)."""

    def __init__(self, recency: float):
        self.recency, self.n, self.value = recency, 0, 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.value += max(1.0 / self.n, self.recency) * (x - self.value)


def _split(key) -> tuple:
    """A bucket's key as (first, rest): rows or sequences, and the context bucket (if any)."""
    return (key[0], key[1:]) if isinstance(key, tuple) else (key, ())


def _join(first, rest: tuple):
    return (first, *rest) if rest else first


def _verify_x(tokens: int, ctx_sum: float, work: float) -> np.ndarray:
    return np.array([1.0, tokens, float(tokens > 1), ctx_sum / 1e4, work / 1e5])


def _draft_x(batch: int, ctx_sum: float) -> np.ndarray:
    return np.array([1.0, batch, float(batch > 1), ctx_sum / 1e4])


def _held_x(ctx: float) -> np.ndarray:
    return np.array([1.0, ctx / 1e4])


def _verify_bucket(tokens: int, ctx_sum: float) -> tuple:
    return tokens, round(ctx_sum, -3)


def _draft_bucket(batch: int, ctx_sum: float) -> tuple:
    return batch, round(ctx_sum, -3)


def _tally(reached: list[int], accepted_at: list[int], n: int, accepted: int) -> None:
    """Count a round that reached its first `n` draft positions and accepted `accepted`."""
    for j in range(n):
        reached[j] += 1
        accepted_at[j] += j < accepted


@dataclass
class AcceptanceProfile:
    """One request's p_j (see the module words); `k_max` positions."""

    k_max: int
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.reached = [0] * self.k_max
        self.accepted = [0] * self.k_max

    def update(self, drafted: int, accepted: int) -> None:
        """A round drafted `drafted` tokens; the first `accepted` were accepted."""
        _tally(self.reached, self.accepted, min(drafted, accepted + 1, self.k_max), accepted)

    def rates(self, prior: float | list[float]) -> list[float]:
        """p_j for j < k_max: the request's counts shrunk towards `prior` (one rate, or the
        pooled profile's rate per position), whose rejection rates are first scaled by this
        request's rejections over those the prior expected where it reached."""
        q = [prior] * self.k_max if isinstance(prior, (int, float)) else list(prior[:self.k_max])
        seen = sum(r - a for r, a in zip(self.reached, self.accepted))
        expected = sum(r * (1.0 - p) for r, p in zip(self.reached, q))
        scale = (seen + REJECT_SHRINK) / (expected + REJECT_SHRINK)
        return [(a + SHRINK * (1.0 - min((1.0 - p) * scale, 0.99))) / (r + SHRINK)
                for r, a, p in zip(self.reached, self.accepted, q)]

    def expected_tokens(self, prior: float | list[float]) -> list[float]:
        """[E(0), E(1), ..., E(k_max)]."""
        out, alive = [1.0], 1.0
        for p in self.rates(prior):
            alive *= p
            out.append(out[-1] + alive)
        return out


class PooledProfile:
    """The pooled profile of the module words: per-position counts over every request's
    rounds, as long as the longest draft seen."""

    def __init__(self):
        self.reached: list[int] = []
        self.accepted: list[int] = []

    def update(self, drafted: int, accepted: int) -> None:
        n = min(drafted, accepted + 1)
        if n > len(self.reached):
            self.reached += [0] * (n - len(self.reached))
            self.accepted += [0] * (n - len(self.accepted))
        _tally(self.reached, self.accepted, n, accepted)

    def rates(self, n: int) -> list[float]:
        """p_j for j < n, each shrunk towards p_{j-1} (p_{-1} = PRIOR_RATE)."""
        out, p = [], PRIOR_RATE
        for j in range(n):
            r, a = (self.reached[j], self.accepted[j]) if j < len(self.reached) else (0, 0)
            p = (a + SHRINK * p) / (r + SHRINK)
            out.append(p)
        return out

    @property
    def rate(self) -> float:
        """The overall rate (accepted over reached), shrunk towards PRIOR_RATE; for reports."""
        return (sum(self.accepted) + SHRINK * PRIOR_RATE) / (sum(self.reached) + SHRINK)


@dataclass
class Plan:
    """One group's round: the k of each request and the goodput the model expects."""

    ks: list[int]
    predicted_tps: float | None  # None while exploring


class CostModel:
    """The engine's running cost estimates and the per-round choice of k (see the module
    docstring). Thread-safe: the staggered lanes observe from two threads."""

    def __init__(self, recency: float = 0.1):
        """`recency`: the weight of a shape's newest time in its running estimate."""
        self.recency = recency
        self.verify = LinearFit(5, recency)  # a verify pass's compute (its whole time when resident)
        self.draft = LinearFit(4, recency)
        self.load_s_per_token: float | None = None  # offloaded tier: seconds per context token loaded
        # a plain step on a held copy, per request (`observe_held`): no load beside it
        self.held = LinearFit(2, recency)
        self.commit = RunningMean(recency)  # seconds to commit a drafting request's outcome
        self.start = RunningMean(recency)  # seconds to start a drafter, per context token
        self._lock = threading.Lock()
        self._explore = 0
        self._forget_traffic()
        self.calibration: dict | None = None  # what the start-up calibration did, if it ran

    def _forget_traffic(self) -> None:
        """What the model learned from requests, as opposed to times: none yet."""
        self.pooled = PooledProfile()  # every request's rounds: each request's prior
        self._forget_counters()

    def _forget_counters(self) -> None:
        self.predicted_tps = 0.0  # running means, for /metrics
        self.measured_tps = 0.0
        self.rounds = 0
        self.k_hist: dict[int, int] = {}  # request-rounds at each k (0: plain decode steps)

    # ---- observations ----------------------------------------------------------------
    def observe_draft(self, steps: int, batch: int, ctx_sum: float, seconds: float) -> None:
        """A draft phase: `steps` forward passes over `batch` sequences of `ctx_sum` tokens."""
        if steps < 1 or batch < 1:
            return
        with self._lock:
            self.draft.observe(_draft_x(batch, ctx_sum), seconds / steps, _draft_bucket(batch, ctx_sum))
            log.debug("draft phase: %d steps, %d sequences, context %d: %.4f s a step", steps,
                      batch, ctx_sum, seconds / steps)

    def observe_verify(self, tokens: int, ctx_sum: float, work: float, seconds: float,
                       stall_s: float = 0.0, load_s: float = 0.0) -> None:
        """A verify pass of `tokens` new tokens over caches of `ctx_sum` tokens in all;
        `work` = sum over requests of new tokens × context. Where the pass loaded its KV from
        an offloaded tier: `load_s`, the loader's seconds, and `stall_s`, the seconds the
        pass waited for layers (see the module docstring)."""
        with self._lock:
            if load_s > 0 and ctx_sum > 0:
                per = load_s / ctx_sum
                self.load_s_per_token = (per if self.load_s_per_token is None else
                                         self.load_s_per_token + self.recency * (per - self.load_s_per_token))
                seconds = max(seconds - stall_s, 0.05 * seconds)
            self.verify.observe(_verify_x(tokens, ctx_sum, work), seconds, tokens,
                                _verify_bucket(tokens, ctx_sum))
            log.debug("verify pass: %d tokens, context %d: %.4f s", tokens, ctx_sum, seconds)

    def observe_held(self, batch: int, ctx_sum: float, seconds: float) -> None:
        """Plain steps of `batch` requests on the working copies their verification held
        (`vericache.engine.verifier.Finish`) took `seconds`. Kept apart from the verify fit:
        a loaded pass computes beside its load (on a CPU the loader's copies take the same
        cores and memory: a one-row 8k pass's compute was priced at 0.12-0.16 s there, a held
        step takes about 0.06), and what finishing pays is the held step's own price."""
        if batch >= 1:
            with self._lock:
                ctx = ctx_sum / batch
                self.held.observe(_held_x(ctx), seconds / batch, 1, round(ctx, -3))

    def observe_commit(self, requests: int, seconds: float) -> None:
        """The outcomes of a round in which `requests` requests drafted were committed to
        their drafters in `seconds`."""
        if requests >= 1:
            with self._lock:
                self.commit.add(seconds / requests)

    def observe_start(self, ctx_sum: int, seconds: float) -> None:
        """A draft phase that started drafters of `ctx_sum` context tokens in all took
        `seconds` more than its steps' predicted time (`draft_step_s`)."""
        if ctx_sum >= 1:
            with self._lock:
                self.start.add(max(seconds, 0.0) / ctx_sum)

    def draft_step_s(self, batch: int, ctx_sum: float) -> float:
        """A draft step's predicted seconds (0 before any was seen)."""
        with self._lock:
            if not self.draft.n:
                return 0.0
            return self.draft.predict(_draft_x(batch, ctx_sum), _draft_bucket(batch, ctx_sum))

    def verify_s(self, tokens: int, ctx_sum: float, work: float) -> float:
        """A verify pass's predicted seconds (call with the lock held)."""
        t = self.verify.predict(_verify_x(tokens, ctx_sum, work), _verify_bucket(tokens, ctx_sum))
        if self.load_s_per_token is not None:
            t = max(t, self.load_s_per_token * ctx_sum)
        return t

    def finish_within(self, context: int) -> int:
        """Where every verify pass loads the full KV (an offloaded tier): how many plain steps
        on a pass's loaded copy of a `context`-token request cost less than loading it again
        for another round (`vericache.engine.verifier.Finish`): the load's predicted seconds
        over a held step's (`observe_held`; until MIN_FIT were seen, a one-token pass's
        compute, the dearer price). 0 while no load has been seen (a resident full KV) or the
        verify fit has not seen MIN_FIT passes."""
        with self._lock:
            if self.load_s_per_token is None or not self.verify.ready():
                return 0
            if self.held.ready():
                step = self.held.predict(_held_x(context), round(context, -3))
            else:
                step = self.verify.predict(_verify_x(1, context, context), _verify_bucket(1, context))
            return int(self.load_s_per_token * context / max(step, 1e-6))

    def observe_round(self, emitted: int, seconds: float, profiles: list[tuple[int, int]]) -> None:
        """A group's round emitted `emitted` tokens in `seconds`; (drafted, accepted) per request."""
        with self._lock:
            if seconds > 0:
                tps = emitted / seconds
                self.measured_tps = tps if self.rounds == 0 else 0.9 * self.measured_tps + 0.1 * tps
            self.rounds += 1
            log.debug("round: %d tokens in %.4f s, (drafted, accepted) %s", emitted, seconds, profiles)
            for d, a in profiles:
                self.pooled.update(d, a)

    def calibrated(self, info: dict) -> None:
        """The start-up calibration (`vericache.engine.calibrate`) is done: keep the times it
        fed, forget its synthetic requests' acceptance, rounds and k histogram."""
        with self._lock:
            self._forget_traffic()
            self.calibration = dict(info, fitted=self._fitted())

    def warmed(self) -> None:
        """Earlier traffic (a benchmark's untimed warm-up requests) is done: keep the times
        and the pooled acceptance it taught, as a server that has been up has them, and reset
        the counters that report on the run (rounds, k histogram, predicted and measured
        tokens/s)."""
        with self._lock:
            self._forget_counters()

    @property
    def prior_rate(self) -> float:
        """The pooled overall acceptance rate (reports; the plan uses the pooled profile)."""
        return self.pooled.rate

    def _fitted(self) -> bool:
        return self.verify.ready(shapes=3) and self.draft.ready()

    # ---- the choice ------------------------------------------------------------------
    def _round_s(self, k: int, caps: list[int], ctxs: list[int], dctx: float) -> tuple[float, list[int]]:
        ks = [min(k, c) for c in caps]
        drafting = [i for i, x in enumerate(ks) if x > 0]
        t = 0.0
        if drafting:
            steps = max(ks)
            t += steps * self.draft.predict(_draft_x(len(drafting), dctx),
                                            _draft_bucket(len(drafting), dctx))
            t += len(drafting) * self.commit.value
        tokens = sum(x + 1 for x in ks)
        work = sum((x + 1) * c for x, c in zip(ks, ctxs))
        return t + self.verify_s(tokens, sum(ctxs), work), ks

    def _goodput(self, ks: list[int], ctxs: list[int], dctx: float,
                 gains: list[list[float]]) -> tuple[float, float]:
        """A round at `ks`: its expected tokens over its time, and the time."""
        t, _ = self._round_s(max(ks), ks, ctxs, dctx)
        return sum(e[x] for e, x in zip(gains, ks)) / t, t

    def plan(self, caps: list[int], ctxs: list[int], profiles: list[AcceptanceProfile],
             probes: list[bool], remaining: list[int] | None = None,
             started: list[bool] | None = None) -> Plan:
        """k for each request of a group. caps: each request's largest k this round (k_max,
        less near max_tokens); ctxs: their contexts (tokens); probes: requests whose profile
        is stale (plain steps for a while): they draft PROBE_K tokens this round if drafting
        would pay at OPTIMISTIC_RATE acceptance; remaining: the tokens each may still emit
        (max_tokens less its output), where known: a request that drafts and could end this
        round (remaining - 1 drafts, all accepted) drafts to its end when the pass that its
        last few tokens would otherwise need, weighted by the chance of ending, pays for the
        extra drafts (the goodput of one round does not see that pass: at 32 tokens, 8 x 4k
        over a 4 Gbit/s tier, the plan drafted 28 where 30 ended most requests, and took 22
        request-rounds where k = 32 fixed took 17); started: whether each request's drafter
        has started (default: all have): one that has not drafts only where the group's
        drafting pays for the start (`_starts_pay`: by START_MARGIN over plain steps, and by
        the time saved over the next tokens against the measured start), and probes only
        where drafting at OPTIMISTIC_RATE would (without probes a long request that starts
        from a low prior would never learn that its drafts are accepted)."""
        with self._lock:
            if not self._fitted():
                k = EXPLORE[self._explore % len(EXPLORE)]
                self._explore += 1
                ks = [min(k, c) for c in caps]
                self._count(ks)
                return Plan(ks, None)
            prior = self.pooled.rates(max((p.k_max for p in profiles), default=0))
            gains = [p.expected_tokens(prior) for p in profiles]
            dctx = float(sum(ctxs))
            best = (-1.0, [0] * len(caps))
            for k in range(0, max(caps, default=0) + 1):
                t, ks = self._round_s(k, caps, ctxs, dctx)
                g = sum(e[x] for e, x in zip(gains, ks)) / t
                if g > best[0]:
                    best = (g, ks)
            tps, ks = best
            drafting_tps = tps
            plain_t, plain_ks = self._round_s(0, caps, ctxs, dctx)
            plain_tps = sum(e[0] for e in gains) / plain_t
            seen = self._priced_by_times(len(caps), dctx)
            if tps < DRAFT_MARGIN * plain_tps:
                tps, ks = plain_tps, plain_ks
            if started is not None:
                starts = sum(c for x, s, c in zip(ks, started, ctxs) if x and not s)
                if starts and not self._starts_pay(tps, plain_tps, starts, remaining, len(caps),
                                                   seen):
                    ks = [x if s else 0 for x, s in zip(ks, started)]
                    tps, _ = self._goodput(ks, ctxs, dctx, gains)
                    if tps < DRAFT_MARGIN * plain_tps:
                        tps, ks = plain_tps, plain_ks
            # a request whose drafts do not pay for their verify tokens takes a plain step
            for i, x in enumerate(ks):
                if x == 0 or probes[i]:
                    continue
                trial = ks[:i] + [0] + ks[i + 1:]
                g, _ = self._goodput(trial, ctxs, dctx, gains)
                if g > tps:
                    ks, tps = trial, g
            if remaining is not None:
                ks, tps = self._draft_to_the_end(ks, caps, ctxs, dctx, gains, remaining)
            # a stale request drafts a little to refresh its profile, unless drafting would
            # not pay even at a high acceptance rate (then it stays on plain steps)
            if any(p and ks[i] == 0 and caps[i] > 0 for i, p in enumerate(probes)):
                hopeful = [1.0]
                for j in range(1, max(caps) + 1):
                    hopeful.append(hopeful[-1] + OPTIMISTIC_RATE ** j)
                for i, p in enumerate(probes):
                    if not (p and ks[i] == 0 and caps[i] > 0):
                        continue
                    trial = ks[:i] + [min(caps[i], max(PROBE_K, max(ks)))] + ks[i + 1:]
                    t, _ = self._round_s(max(trial), trial, ctxs, dctx)
                    g = (sum(e[y] for j, (e, y) in enumerate(zip(gains, trial)) if j != i)
                         + hopeful[trial[i]]) / t
                    if (g > tps if started is None or started[i]
                            else self._starts_pay(g, tps, ctxs[i], remaining, len(caps), seen)):
                        ks = trial
            log.debug("plan: contexts %s -> k %s, %.2f tokens/s predicted (plain steps: %.2f in "
                      "%.4f s; the best common k: %.2f; commit %.4f s a request, start %.2e s a "
                      "token)", ctxs, ks, tps, plain_tps, plain_t, drafting_tps, self.commit.value,
                      self.start.value)
            self.predicted_tps = tps if self.rounds == 0 else 0.9 * self.predicted_tps + 0.1 * tps
            self._count(ks)
            return Plan(ks, tps)

    def _priced_by_times(self, tokens: int, ctx_sum: float) -> bool:
        """Whether a pass of `tokens` rows over `ctx_sum` context tokens is priced from
        measured times: its shape's bucket seen, or its price the offloaded tier's measured
        load (call with the lock held)."""
        bucket = _verify_bucket(tokens, ctx_sum)
        if self.verify.seen(bucket):
            return True
        return (self.load_s_per_token is not None and self.load_s_per_token * ctx_sum
                >= self.verify.predict(_verify_x(tokens, ctx_sum, ctx_sum), bucket))

    def _starts_pay(self, tps: float, plain_tps: float, start_ctx: int,
                    remaining: list[int] | None, n: int, seen: bool = True) -> bool:
        """Whether drafting at goodput `tps` against plain steps' `plain_tps` pays for
        starting drafters of `start_ctx` context tokens: by START_MARGIN (START_MARGIN_UNSEEN
        where the plain step is not `seen`, priced by the line alone), and by the time it
        saves over the group's next tokens (START_HORIZON) against the start's measured
        price."""
        if tps < (START_MARGIN if seen else START_MARGIN_UNSEEN) * plain_tps:
            return False
        tokens = sum(min(r, START_HORIZON) for r in remaining) if remaining else n * START_HORIZON
        return tokens * (1.0 / plain_tps - 1.0 / tps) >= start_ctx * self.start.value

    def _draft_to_the_end(self, ks, caps, ctxs, dctx, gains, remaining):
        """See `plan` (`remaining`): a round's time is credited with the passes it saves, for
        each request that may end in it a one-token pass of that request alone, times the
        chance that every draft is accepted. Tried for every request that could end at once
        (the group's draft steps are shared: one request alone rarely pays for the longer
        draft phase that all of them together do), then for each alone. The goodput returned
        is the round's own, without the credit."""
        def could_end(i, x):
            end = remaining[i] - 1
            return x > 0 and x < end == caps[i]

        def scored(trial):
            g, t = self._goodput(trial, ctxs, dctx, gains)
            saved = sum((gains[i][y] - gains[i][y - 1]) * self.verify_s(1, ctxs[i], ctxs[i])
                        for i, y in enumerate(trial) if y and y == remaining[i] - 1)
            return g * t / max(t - saved, 1e-9), g

        best, (credited, tps) = ks, scored(ks)
        ending = [i for i, x in enumerate(ks) if could_end(i, x)]
        trials = ([[remaining[i] - 1 if i in ending else x for i, x in enumerate(ks)]] if len(ending) > 1 else [])
        trials += [ks[:i] + [remaining[i] - 1] + ks[i + 1:] for i in ending]
        for trial in trials:
            c, g = scored(trial)
            if c > credited:
                best, credited, tps = trial, c, g
        return best, tps

    def _count(self, ks: list[int]) -> None:
        for k in ks:
            self.k_hist[k] = self.k_hist.get(k, 0) + 1

    def snapshot(self) -> dict:
        """Figures for /metrics and reports."""
        with self._lock:
            total = sum(self.k_hist.values())
            return {"predicted_tps": self.predicted_tps, "measured_tps": self.measured_tps,
                    "rounds": self.rounds, "k_hist": dict(self.k_hist),
                    "plain_share": self.k_hist.get(0, 0) / total if total else 0.0,
                    "fitted": self._fitted(), "explore_rounds": self._explore,
                    "calibration": self.calibration,
                    "verify_theta": self.verify.theta.tolist(),
                    "load_s_per_token": self.load_s_per_token,
                    "held_theta": self.held.theta.tolist(),
                    "commit_s": self.commit.value, "start_s_per_token": self.start.value,
                    "draft_theta": self.draft.theta.tolist()}
