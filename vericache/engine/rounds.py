"""Rounds over drafter and verifier backends (`vericache.engine.backends.Backends`): the
same code in-process (`LocalBackends`, here) and over gRPC (`vericache.engine.remote`).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from vericache.engine.backends import Backends
from vericache.engine.drafter import Drafter, DraftOut
from vericache.engine.generation import Generation
from vericache.engine.verifier import Finish, Verdict, Verifier
from vericache.spec.costmodel import CostModel
from vericache.spec.grammar import Grammars
from vericache.store.codec import decode_deltas, encode_deltas
from vericache.store.keys import select_key


# Slots of a pool (`Runner.new_cache`; on CPU unused slots cost address space only): 16
# caches of up to the model's context; more fill a second pool, and a pass over both copies
# its caches into one (`KVPool.hold`)
ARENA_SLOTS = 16


def arena(runner, side: str, group: int):
    """The pool (`Runner.new_cache(arena=)`) of a request's caches on `side` ("verify" or
    "draft") in scheduler group `group`: one pool a side where the native kernel reads that
    side's passes, else one a group. The kernel reads only a pass's rows' own keys, so a pass
    over any slots of one pool copies nothing (`KVPool.hold`'s sparse spans): a staggered
    group's, and one that takes both groups' requests (plain requests, which belong to no
    group, and draft-ahead jobs). In a pool per group such a pass copied the other group's
    caches into its pool (an 8k verifier cache in 0.84 s, against 0.07 s for the pass;
    docs/performance.md, thirty-ninth session). SDPA reads every slot of a pass's span, so
    where it runs the passes (no native kernel; the drafter of a model whose attention reads
    positions, whose caches record them) a group keeps a pool of its own. (A pass of more
    than the kernel's `KERNEL_ROWS` rows a sequence, a verify pass of k >= 64, is SDPA's too:
    over one pool a side, such a pass of one group is copied into a pool of its own.)"""
    ranged = runner.attend_kernel is not None and not (side == "draft" and runner.positioned)
    return side if ranged else (side, group)


class LocalBackends(Backends):
    """Drafter and verifier in this process. With a store (embedded `vericache serve`: a
    memory:// store) prefixes are cached across requests and the drafter attaches from the
    store, exactly as the services do; without one, chunks pass in memory.

    With a store, a `vericache` request attaches when it first drafts: its prefill leaves the
    drafter's part (exact tail, the selection's first moves) undone (`draft_later`), and its
    rounds until then are plain steps that touch no drafter, so a request the cost model keeps
    on plain steps never builds or moves draft KV. The first round that drafts for it does
    that part and loads its draft KV, fed every token verified meanwhile (as the services do:
    `vericache.engine.remote`). With `async_attach` (remote prefix caching: the drafter's link
    is slow) that load runs in the background: rounds stay plain full-KV decode steps until it
    lands, and drafting starts with the first round after."""

    def __init__(self, lm, store=None, tier=None, drafter_store=None, async_attach: bool = False):
        """`tier`: where the verifier keeps full KV between rounds (None: resident; an
        `vericache.engine.kvtier.OffloadedTier`: offloaded). `drafter_store`: the drafter's
        view of the store when it differs from the verifier's (another link)."""
        self.lm, self.store, self.tier = lm, store, tier
        # each side's caches of a scheduler group sit in one pool (`Runner.new_cache`): a
        # group's passes then copy no cache to batch it
        lm.runner.arena_slots = max(lm.runner.arena_slots, ARENA_SLOTS)
        self.grammars = Grammars.of(lm)  # both sides' (structured output)
        self.verifier = Verifier(lm.runner, store, lm.model_id, tier, grammars=self.grammars)
        self.drafter = Drafter(lm.runner, lm.eos_token_ids, drafter_store or store, lm.model_id,
                               grammars=self.grammars)
        self._drafter_link = drafter_store is not None and store is not None
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="vericache-attach") if async_attach else None
        # rid -> (its load, or None: loaded when it first drafts; the tokens verified since)
        self._attaching: dict[str, tuple[Future | None, list[int]]] = {}
        self._tail_start: dict[str, int] = {}

    def admit(self, g: Generation) -> Verdict:
        p = g.params
        t0 = time.perf_counter()
        via_store = self.store is not None and g.compressor is not None
        later = via_store and p.mode == "vericache"
        out = self.verifier.prefill(g.rid, g.prompt, g.extra_capacity, p.chunk_size, g.compressor,
                                    g.sampling, g.seed, p.namespace, save_tail=via_store,
                                    selection=g.selection, top_logprobs=p.logprobs,
                                    bitwise=p.exact == "bitwise", draft_later=later,
                                    arena=arena(self.lm.runner, "verify", g.group))
        t1 = time.perf_counter()
        g.stats.full_kv_bytes = len(g.prompt) * self.lm.runner.kv_bytes_per_token()
        g.stats.record_transfer(out.cached_tokens, out.transfer)
        if g.compressor is not None:
            if later:
                self._attaching[g.rid] = (None, [out.first_token])
                self._tail_start[g.rid] = out.tail_start
            elif via_store:
                tr = self.drafter.attach_from_store(
                    g.rid, g.prompt, g.compressor, p.chunk_size, out.tail_start, out.first_token,
                    g.extra_capacity, g.sampling, g.seed + 1, p.namespace,
                    arena=arena(self.lm.runner, "draft", g.group))
                g.stats.record_transfer(0, tr)
                g.stats.draft_kv_bytes = tr.bytes_read  # compressed chunks + exact tail, as stored
            else:
                full = self.verifier.cache(g.rid)
                k, v = g.compressor.draft_kv(out.chunks, *full.view(out.tail_start, len(g.prompt)),
                                             self.drafter.runner.draft_dtype)
                tail = len(g.prompt) - out.tail_start
                pos = None
                if self.lm.runner.positioned:
                    pos = g.compressor.draft_positions(out.chunks, out.tail_start, tail,
                                                       k.shape[0], k.shape[1])
                self.drafter.attach(g.rid, k, v, [out.first_token], len(g.prompt) + 1,
                                    g.extra_capacity, g.sampling, g.seed + 1,
                                    region=k.shape[2] - tail, prompt=g.prompt, pos=pos,
                                    arena=arena(self.lm.runner, "draft", g.group))
                g.stats.draft_kv_bytes = (sum(c.nbytes() for c in out.chunks)
                                          + tail * self.lm.runner.kv_bytes_per_token())
            if g.rid not in self._attaching:
                self._apply_deltas(g)
            if p.mode == "lossy":
                self.verifier.release(g.rid)  # the lossy baseline never uses the full KV again
        g.stats.prefill_s, g.stats.compress_s = t1 - t0, time.perf_counter() - t1
        return Verdict(0, out.first_token,
                       None if out.first_logprob is None else [out.first_logprob])

    def _attached(self, g: Generation, drafts: bool = True) -> bool:
        """Whether the drafter holds the request: attaching it if its load has landed, or,
        when it `drafts` this round, if it waits to be attached until it drafts."""
        if g.rid not in self._attaching:
            return True
        f, verified = self._attaching[g.rid]
        if f is None:  # loaded when it first drafts, after the verifier's part
            if not drafts:
                return False
            g.stats.record_transfer(0, self.verifier.prepare_draft(g.rid))
            p = g.params
            load = partial(self.drafter.load_from_store, g.rid, g.prompt, g.compressor,
                           p.chunk_size, self._tail_start[g.rid], p.namespace)
            if self._loader is not None:  # over the slow link, in the background
                self._attaching[g.rid] = (self._loader.submit(load), verified)
                return False
            loaded = load()
        elif f.done():
            loaded = f.result()
        else:
            return False
        del self._attaching[g.rid]
        k, v, pos, tr = loaded
        tail = len(g.prompt) - self._tail_start[g.rid]
        self.drafter.attach(g.rid, k, v, verified, len(g.prompt) + len(verified), g.extra_capacity,
                            g.sampling, g.seed + 1, region=k.shape[2] - tail, prompt=g.prompt,
                            pos=pos, arena=arena(self.lm.runner, "draft", g.group))
        g.stats.record_transfer(0, tr)
        g.stats.draft_kv_bytes = tr.bytes_read
        self._apply_deltas(g)
        return True

    def _apply_deltas(self, g: Generation) -> None:
        """Move the drafter's set as the verifier decided (`vericache.select`). With the
        drafter on its own link to the store (remote prefix), the moves cross it as they do
        between the services: written by the verifier, read by the drafter."""
        deltas = self.verifier.take_deltas(g.rid)
        if deltas and self._drafter_link:
            key = select_key(g.rid)
            self.store.put(key, encode_deltas(deltas))
            deltas = decode_deltas(self.drafter.store.get(key))
            self.drafter.store.delete(key)
        for delta in deltas:
            self.drafter.apply_delta(g.rid, delta)
        rec = self.verifier.selection(g.rid)
        if rec is not None:
            g.stats.record_selection(rec.seconds, rec.state.moves, rec.state.moved_tokens,
                                     rec.delta_bytes)

    def draft(self, batch: list[tuple[Generation, int]]) -> list[DraftOut]:
        ready = [(g, k) for g, k in batch if self._attached(g, drafts=k > 0)]
        got = dict(zip([g.rid for g, _ in ready],
                       self.drafter.draft([(g.rid, k) for g, k in ready]) if ready else []))
        return [got.get(g.rid, DraftOut([], None)) for g, _ in batch]

    def draft_ahead(self, batch: list[tuple[Generation, int]]) -> int:
        return self.drafter.draft_ahead([(g.rid, k) for g, k in batch if g.rid not in self._attaching])

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)

    def health(self) -> dict[str, bool]:
        return {"drafter": True, "verifier": True}

    def sessions(self) -> dict[str, int]:
        return {"drafter": len(self.drafter.sessions), "verifier": len(self.verifier.sessions)}

    def tier_counters(self) -> tuple[float, float]:
        return (0.0, 0.0) if self.tier is None else self.tier.counters()

    def verify(self, batch: list[tuple[Generation, DraftOut]],
               finish: dict[str, Finish] | None = None) -> list[Verdict]:
        return self.verifier.verify([(g.rid, d.tokens, d.q) for g, d in batch],
                                    refresh=[g.rid for g, d in batch if g.refreshes_draft and d.tokens],
                                    finish=finish)

    def commit(self, g: Generation, accepted: int, bonus: int | None) -> None:
        if g.rid in self._attaching:  # no drafter yet: a plain decode step; feed it later
            self._attaching[g.rid][1].append(bonus)
            return
        exact = self.verifier.take_exact(g.rid) if bonus is not None else None
        self.drafter.commit(g.rid, accepted, bonus, exact)
        if bonus is not None:
            self._apply_deltas(g)

    def release(self, g: Generation) -> None:
        pending = self._attaching.pop(g.rid, None)
        self._tail_start.pop(g.rid, None)
        if pending is not None and pending[0] is not None:
            pending[0].cancel()
        self.drafter.release(g.rid)
        self.verifier.release(g.rid)


def start(backends: Backends, g: Generation) -> list[int]:
    """Prefill one request; returns its first emitted tokens."""
    v = backends.admit(g)
    return g.on_first(v.bonus, v.logprobs)


def run_round(backends: Backends, gens: list[Generation], costs: CostModel | None = None) -> dict[str, list[int]]:
    """One round for every request in `gens` (lockstep: all draft, then all verify).
    Returns the tokens each request emitted, by request id."""
    return verify_phase(backends, gens, draft_phase(backends, gens, costs), costs=costs)


def plan_draft_lens(gens: list[Generation], costs: CostModel) -> None:
    """Choose this round's k for every adaptive vericache request of the group (the cost
    model's goodput-maximising plan; see `vericache.spec.costmodel`)."""
    group = [g for g in gens if g.params.mode == "vericache" and g.draftlen.adaptive]
    if not group:
        return
    plan = costs.plan([g.k_cap() for g in group], [g.context for g in group],
                      [g.draftlen.profile for g in group], [g.draftlen.probe for g in group],
                      [g.stop.remaining for g in group], [g.drafter_started for g in group])
    for g, k in zip(group, plan.ks):
        g.draftlen.choose(k)


def draft_phase(backends: Backends, gens: list[Generation], costs: CostModel | None = None) -> dict[str, DraftOut]:
    """The drafter's half of a round: draft for every request that drafts (not `full`); with
    `costs`, each adaptive request's k comes from the cost model, which learns from the time
    the drafting took."""
    if costs is not None:
        plan_draft_lens(gens, costs)
    ks = {g.rid: g.k_for_round() for g in gens}
    # a request's first draft step after plain steps (or its first ever) also feeds the
    # verified tokens its drafter has not seen: a pass of many rows that the draft-step fit
    # must not learn as a step (a k = 1 round after 30 plain steps would be learned as one
    # draft step costing a 31-row pass)
    steady = {g.rid for g in gens if g.stats.draft_steps and g.draftlen.plain_streak <= 1}
    starting = [g for g in gens if ks[g.rid] > 0 and not g.drafter_started]
    for g in gens:
        g.drafter_started |= ks[g.rid] > 0
    drafting = [g for g in gens if g.params.mode != "full"]
    t0 = time.perf_counter()
    drafts = dict(zip([g.rid for g in drafting],
                      backends.draft([(g, ks[g.rid]) for g in drafting]) if drafting else []))
    t1 = time.perf_counter()
    for g in gens:
        g.round_draft_s = t1 - t0 if g in drafting else 0.0
    for g in drafting:
        g.stats.draft_s += t1 - t0
        g.stats.draft_steps += len(drafts[g.rid].tokens)
    stepped = [g for g in drafting if drafts[g.rid].tokens]
    if costs is not None and stepped and all(g.rid in steady for g in stepped):
        costs.observe_draft(max(len(drafts[g.rid].tokens) for g in stepped), len(stepped),
                            sum(g.context for g in stepped), t1 - t0)
    elif costs is not None and starting:
        # the drafters' start (their KV prepared and loaded) is what the phase took beyond
        # its steps; a start in the background (async attach) costs the phase nothing
        steps = max((len(drafts[g.rid].tokens) for g in stepped), default=0)
        step = costs.draft_step_s(len(stepped), sum(g.context for g in stepped)) if steps else 0.0
        costs.observe_start(sum(g.context for g in starting), t1 - t0 - steps * step)
    return drafts


def verify_phase(backends: Backends, gens: list[Generation], drafts: dict[str, DraftOut],
                 outcomes: dict[str, tuple[int, int | None]] | None = None,
                 costs: CostModel | None = None) -> dict[str, list[int]]:
    """The verifier's half: one verify pass for every request that verifies (not `lossy`),
    then commit the outcome to the drafter; with `outcomes` given, the (accepted, bonus) to
    commit are put there instead, for the caller to commit on the drafter's thread (see
    `commit_outcomes`). With `costs`, the pass's time and the round's tokens feed the cost
    model. Returns the tokens each request emitted."""
    out: dict[str, list[int]] = {g.rid: [] for g in gens}
    verifying = [g for g in gens if g.params.mode != "lossy"]
    empty = DraftOut([], None)
    shape = [(len(drafts.get(g.rid, empty).tokens) + 1, g.context) for g in verifying]
    finish = _finish_plan(verifying, costs)
    tier0 = backends.tier_counters()
    t1 = time.perf_counter()
    results = backends.verify([(g, drafts.get(g.rid, empty)) for g in verifying],
                              finish) if verifying else []
    t2 = time.perf_counter()
    tier1 = backends.tier_counters()
    # a request's first pass after its prefill also moves its cache into the batch's pool
    # (`vericache.model.kvcache.KVPool`): not learned as a pass of its shape
    joined = any(g.stats.rounds == 0 for g in verifying)
    if costs is not None and verifying and not joined:
        costs.observe_verify(sum(n for n, _ in shape), sum(c for _, c in shape),
                             sum(n * c for n, c in shape), t2 - t1,
                             stall_s=tier1[0] - tier0[0], load_s=tier1[1] - tier0[1])
    emitted, profile = 0, []
    pending = {} if outcomes is None else outcomes
    for g, v in zip(verifying, results):
        d, a, bonus = drafts.get(g.rid, empty), v.accepted, v.bonus
        if g.params.mode == "vericache":
            pending[g.rid] = (a, bonus)
        out[g.rid] = g.on_round(d.tokens, a, bonus, v.logprobs)
        g.stats.verify_s += t2 - t1
        emitted += a + 1
        profile.append((len(d.tokens), a))
    if costs is not None and verifying:
        draft_s = max((g.round_draft_s for g in verifying), default=0.0)
        costs.observe_round(emitted, draft_s + t2 - t1, profile)
    if outcomes is None:
        commit_outcomes(backends, verifying, pending, costs,
                        {g.rid for g in verifying if drafts.get(g.rid, empty).tokens})
    finish_held(backends, [g for g, v in zip(verifying, results) if v.held], out, costs)
    for g in gens:
        if g.params.mode == "lossy":
            _commit(backends, g, 1, None, outcomes)
            out[g.rid] = g.on_lossy(drafts[g.rid].tokens[0])
    return out


def _finish_plan(gens: list[Generation], costs: CostModel | None) -> dict[str, Finish]:
    """Which requests' verify passes hold their loaded full KV when few tokens are left
    (`vericache.engine.verifier.Finish`): where the full KV is loaded for each pass (the cost
    model has priced a load) and plain steps on the loaded copy cost less than loading it
    again, for every request that uses the full KV (`full` too: the offloaded baseline gets
    the same rule)."""
    if costs is None:
        return {}
    plan = {}
    for g in gens:
        within = costs.finish_within(g.context)
        if within > 0 and g.stop.remaining > 1:
            plan[g.rid] = Finish(g.stop.remaining, within)
    return plan


def finish_held(backends: Backends, held: list[Generation], out: dict[str, list[int]],
                costs: CostModel | None = None) -> None:
    """Plain decode steps on the working copies the verify pass held (`Verdict.held`), until
    each request ends: the tokens it emits extend `out`. A request holds only while tokens are
    left, and its last step leaves none, so each ends here (at max_tokens, or earlier at a
    stop); its drafter, released with it, is never told these tokens."""
    empty = DraftOut([], None)
    while held := [g for g in held if not g.finished]:
        t0 = time.perf_counter()
        results = backends.verify([(g, empty) for g in held], _finish_plan(held, costs))
        if costs is not None:  # one-row passes that loaded nothing: what finishing costs
            costs.observe_held(len(held), sum(g.context for g in held), time.perf_counter() - t0)
        for g, v in zip(held, results):
            out[g.rid] += g.on_held_step(v.bonus, v.logprobs)
        held = [g for g, v in zip(held, results) if v.held]


def _commit(backends, g: Generation, accepted: int, bonus: int | None, outcomes) -> None:
    if outcomes is None:
        backends.commit(g, accepted, bonus)
    else:
        outcomes[g.rid] = (accepted, bonus)


def commit_outcomes(backends, gens: list[Generation], outcomes: dict[str, tuple[int, int | None]],
                    costs: CostModel | None = None, drafted: Collection[str] = ()) -> None:
    """Commit the deferred verification outcomes of `gens` (those that have one); with
    `costs`, the time feeds the cost model's commit price, per request of `drafted` (those
    whose round drafted) committed."""
    t, n = time.perf_counter(), 0
    for g in gens:
        if g.rid in outcomes:
            n += g.rid in drafted
            backends.commit(g, *outcomes.pop(g.rid))
    if costs is not None and n:
        costs.observe_commit(n, time.perf_counter() - t)
