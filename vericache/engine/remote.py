"""`Backends` over gRPC: the engine's rounds (`vericache.engine.rounds`) run against the
drafter and verifier services exactly as against the in-process ones. Every call has a
deadline (`timeout_s`; Release and Health shorter ones of their own, at most `timeout_s`); a
failed call surfaces as the core's typed error. Only Release and Health are retried (once, on
UNAVAILABLE): Prefill, Attach, Draft, Verify and Commit change a session's state, so one that
may have run is never sent twice (an Attach is tried again only after a Release of the
session it may have made) — the request fails instead, or goes on without its drafter (below),
and its sessions are released.
The drafter is what VeriCache can lose without losing a token: an Attach that finds a chunk
evicted from the store (NOT_FOUND), or a Draft or Commit whose drafter is unreachable or
restarted (UNAVAILABLE, a deadline, or NOT_FOUND for its session), does not fail a `vericache`
request: the verifier decodes it alone from then on, in plain full-KV steps
(`Generation.lose_drafter`), so it still ends with the same tokens. A request not yet attached
when the drafter stops answering waits on plain steps and attaches once it answers again.

A `vericache` request attaches to the drafter when it first drafts, not at admission: until
then its rounds are plain steps that never touch the drafter, and a request the cost model
keeps on plain steps (short contexts, small batches on a CPU) never moves its draft KV (its
compressed chunks and exact tail, read by the drafter through the kvstore) and the verifier
never writes the drafter's part (its Prefill's `draft_later`: the exact tail and the
selection's first moves wait for PrepareDraft, sent right before the Attach). Its plain-step
tokens wait here and go with its first Draft order, as any plain round's do."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from vericache._proto import load
from vericache.engine.backends import Backends
from vericache.engine.drafter import DraftOut
from vericache.engine.generation import Generation
from vericache.engine.verifier import NO_FINISH, Finish, Verdict
from vericache.errors import DeadlineExceeded, NotFound, Unavailable, VeriCacheError
from vericache.grpc_token import with_token
from vericache.spec.logprobs import TokenLogprob
from vericache.spec.processors import Processing
from vericache.store.codec import probs_from_bytes, probs_to_bytes
from vericache.store.grpc_store import RECONNECT_OPTIONS, STATUS_ERRORS

log = logging.getLogger(__name__)
vpb, vpb_grpc = load("verifier")
dpb, dpb_grpc = load("drafter")
# a Verify or Draft message with sampled distributions carries k x vocab float32s
MODEL_MESSAGE_BYTES = 256 << 20
RELEASE_TIMEOUT_S = 10.0
# after a drafter call finds it unreachable, requests waiting to attach take plain steps for
# this long before they try it again (a restart takes seconds; each try costs a connect)
DRAFTER_RETRY_S = 2.0
# A restarted drafter or verifier is found again within 5 s (gRPC's default backoff grows
# to 120 s, and calls fail fast as UNAVAILABLE until the next reconnect attempt).
_OPTIONS = [("grpc.max_send_message_length", MODEL_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MODEL_MESSAGE_BYTES), *RECONNECT_OPTIONS]


def call(fn, request, timeout: float, what: str):
    """`fn(request)` under a deadline; a gRPC failure becomes the core's typed error."""
    try:
        return fn(request, timeout=timeout)
    except grpc.RpcError as e:
        raise STATUS_ERRORS.get(e.code(), VeriCacheError)(f"{what}: {e.code().name}: {e.details()}") from None


def _orders(batch: list[tuple[Generation, int]], plain: dict[str, list[int]] | None = None):
    """Draft orders; with `plain`, each request's unsent plain-step tokens go with its order
    (and leave `plain`)."""
    return dpb.DraftRequest(items=[
        dpb.DraftItem(request_id=g.rid, k=k, plain_tokens=plain.pop(g.rid, []) if plain else [])
        for g, k in batch])


def _sampling(p: Processing):
    """The `Sampling` message of a request's processing (the temperature travels apart)."""
    return vpb.Sampling(top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                        repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias),
                        grammar=p.grammar)


def _logprob(m) -> TokenLogprob:
    return TokenLogprob(m.token, m.logprob, list(zip(m.top_tokens, m.top_logprobs)))


def _record_selection(g: Generation, st) -> None:
    """A service's selection totals (SelectionStats) into the request's stats."""
    g.stats.record_selection(st.seconds, st.moves, st.moved_tokens, st.delta_bytes)


class RemoteBackends(Backends):
    """The drafter and verifier services as the engine's backends. `token`: the services'
    internal token, sent with every call."""

    def __init__(self, drafter: str, verifier: str, vocab_size: int, timeout_s: float = 300.0,
                 token: str | None = None):
        self.vocab, self.timeout = vocab_size, timeout_s
        self._channels = [grpc.insecure_channel(t, options=_OPTIONS) for t in (drafter, verifier)]
        self.drafter = dpb_grpc.DrafterStub(with_token(self._channels[0], token))
        self.verifier = vpb_grpc.VerifierStub(with_token(self._channels[1], token))
        self._moved: dict[str, bool] = {}  # rid -> the last Verify left a selection delta
        # Rounds without drafts (k = 0: plain decode steps) cost the drafter nothing but the
        # bonus to queue, so they make no drafter call: their bonuses wait here and go with
        # the request's next Draft order (`DraftItem.plain_tokens`), and the verifier keeps
        # no exact KV for them (the drafter has nothing of that round to refresh).
        self._plain: dict[str, list[int]] = {}  # rid -> plain-step bonuses not yet sent
        self._drafted: dict[str, bool] = {}  # rid -> this round carried drafts
        self._refresh: dict[str, bool] = {}  # rid -> this round's Verify kept exact KV
        self._releaser = ThreadPoolExecutor(4, thread_name_prefix="release")
        self._unattached: dict[str, object] = {}  # rid -> its AttachRequest, sent when it drafts
        # unattached requests whose PrepareDraft is done -> whether their last Attach passed
        # its deadline (the drafter may then hold a session for it, freed before the next)
        self._prepared: dict[str, bool] = {}
        self._drafter_down_until = 0.0  # monotonic time: no Attach is tried before it
        self._tier_s = [0.0, 0.0]  # the verifier's (stall, load) seconds over our passes

    def admit(self, g: Generation) -> Verdict:
        p = g.params
        spec = g.compressor.spec if g.compressor is not None else ""
        out = call(self.verifier.Prefill, vpb.PrefillRequest(
            request_id=g.rid, token_ids=g.prompt, compressor=spec, chunk_size=p.chunk_size,
            temperature=p.temperature, seed=g.seed, extra_capacity=g.extra_capacity,
            namespace=p.namespace, save_tail=bool(spec),
            selection=g.selection.spec if g.selection is not None else "",
            sampling=_sampling(g.sampling), top_logprobs=p.logprobs, exact=p.exact,
            draft_later=p.mode == "vericache"), self.timeout, "verifier Prefill")
        s = g.stats
        _record_selection(g, out.selection)
        s.prefill_s, s.cached_tokens = out.seconds, out.cached_tokens
        s.store_hits, s.store_bytes_read = out.store_hits, out.bytes_read
        s.store_bytes_written, s.store_s = out.bytes_written, out.store_seconds
        if spec:
            attach = dpb.AttachRequest(
                request_id=g.rid, token_ids=g.prompt, first_token=out.first_token,
                compressor=spec, chunk_size=p.chunk_size, tail_start=out.tail_start,
                temperature=p.temperature, seed=g.seed + 1, extra_capacity=g.extra_capacity,
                namespace=p.namespace, apply_selection=out.selection_deltas > 0,
                sampling=_sampling(g.sampling))
            if p.mode == "vericache":  # its Prefill left the drafter's part for PrepareDraft
                self._unattached[g.rid] = attach  # attached when it first drafts (`_attach`)
            else:  # lossy: the drafter decodes every token, the full KV is not used again
                self._attach(g, attach)
                call(self.verifier.Release, vpb.ReleaseRequest(request_id=g.rid), self.timeout,
                     "verifier Release")
        return Verdict(0, out.first_token,
                       [_logprob(out.first_logprob)] if out.HasField("first_logprob") else None)

    def _attach(self, g: Generation, req) -> bool:
        """Send a request's Attach; False where the store evicted a chunk the drafter needs
        (between the verifier's write and this read): a `vericache` request is then decoded
        by the verifier alone, plain full-KV steps (what `full` mode does), so it still
        completes with the same tokens."""
        try:
            att = call(self.drafter.Attach, req, self.timeout, "drafter Attach")
        except NotFound as e:
            self._lose_drafter(g, e)
            return False
        s = g.stats
        s.store_hits += att.store_hits
        s.store_bytes_read += att.bytes_read
        s.store_s += att.seconds
        s.draft_kv_bytes = att.bytes_read
        return True

    def draft(self, batch: list[tuple[Generation, int]]) -> list[DraftOut]:
        out = {g.rid: DraftOut([], None) for g, _ in batch}
        orders = [(g, k) for g, k in batch if k > 0 and self._attached(g)]
        if orders:
            try:
                res = call(self.drafter.Draft, _orders(orders, self._plain), self.timeout,
                           "drafter Draft")
            except (Unavailable, NotFound) as e:  # the drafter died, or restarted empty
                for g, _ in orders:
                    self._lose_drafter(g, e)
            else:
                for (g, _), r in zip(orders, res.results):
                    out[g.rid] = DraftOut(list(r.tokens), probs_from_bytes(r.probs, len(r.tokens), self.vocab))
        for g, _ in batch:
            self._drafted[g.rid] = bool(out[g.rid].tokens)
        return [out[g.rid] for g, _ in batch]

    def _attached(self, g: Generation) -> bool:
        """Whether the drafter holds the request, attaching it now if it has not yet (the
        verifier first writes what its Prefill left for the drafter: PrepareDraft)."""
        if g.stats.drafter_lost:
            return False
        req = self._unattached.get(g.rid)
        if req is None:
            return True
        if time.monotonic() < self._drafter_down_until:
            return False  # a plain step; tried again once the drafter may answer
        if g.rid not in self._prepared:
            try:
                prep = call(self.verifier.PrepareDraft, vpb.PrepareDraftRequest(request_id=g.rid),
                            self.timeout, "verifier PrepareDraft")
            except DeadlineExceeded:  # the verifier itself did not answer: the request fails
                raise
            except Unavailable as e:  # the drafter's part (through the kvstore) cannot be made
                self._lose_drafter(g, e)
                return False
            _record_selection(g, prep.selection)
            g.stats.store_bytes_written += prep.bytes_written
            g.stats.store_s += prep.store_seconds
            req.apply_selection = prep.selection_deltas > 0
            self._prepared[g.rid] = False
        elif self._prepared[g.rid]:  # the last Attach may have made a session: free it
            self._release_on(self.drafter, g.rid)
        try:
            attached = self._attach(g, req)
        except Unavailable as e:
            self._prepared[g.rid] = isinstance(e, DeadlineExceeded)
            self._drafter_down_until = time.monotonic() + DRAFTER_RETRY_S
            return False
        self._unattached.pop(g.rid, None)
        self._prepared.pop(g.rid, None)
        return attached

    def _lose_drafter(self, g: Generation, e: VeriCacheError) -> None:
        """`g`'s drafter session is gone or unreachable: it goes on without it
        (`Generation.lose_drafter`), or, in lossy mode, fails with `e`."""
        if g.stats.drafter_lost:  # lost already (a round of the other lane found it first)
            return
        if not g.lose_drafter(str(e)):
            raise e
        log.warning("%s: %s; decoding on in plain full-KV steps", g.rid, e)
        self._forget(g.rid)
        if isinstance(e, Unavailable):
            self._drafter_down_until = time.monotonic() + DRAFTER_RETRY_S

    def draft_ahead(self, batch: list[tuple[Generation, int]]) -> int:
        batch = [(g, k) for g, k in batch if g.rid not in self._unattached]
        if not batch:
            return 0
        try:
            return call(self.drafter.DraftAhead, _orders(batch), self.timeout,
                        "drafter DraftAhead").drafted
        except (Unavailable, NotFound):
            return 0  # a guess lost; the next Draft or Commit finds the drafter gone

    def verify(self, batch: list[tuple[Generation, DraftOut]],
               finish: dict[str, Finish] | None = None) -> list[Verdict]:
        items = []
        for g, d in batch:
            f = (finish or {}).get(g.rid, NO_FINISH)
            items.append(vpb.VerifyItem(request_id=g.rid, draft_tokens=d.tokens,
                                        draft_probs=probs_to_bytes(d.q),
                                        refresh_draft=g.refreshes_draft and bool(d.tokens),
                                        finish_remaining=f.remaining, finish_within=f.within))
        res = call(self.verifier.Verify, vpb.VerifyRequest(items=items), self.timeout, "verifier Verify")
        self._tier_s[0] += res.stall_seconds
        self._tier_s[1] += res.load_seconds
        for (g, d), r in zip(batch, res.results):
            self._refresh[g.rid] = g.refreshes_draft and bool(d.tokens)
            self._moved[g.rid] = r.selection_deltas > 0
            _record_selection(g, r.selection)
        return [Verdict(r.accepted, r.bonus, [_logprob(m) for m in r.logprobs]
                        if g.params.logprobs is not None else None, held=r.held)
                for (g, _), r in zip(batch, res.results)]

    def tier_counters(self) -> tuple[float, float]:
        """The verifier service's (stall, load) seconds over this client's passes, from each
        VerifyResponse: the gateway's cost model prices its loads as in process."""
        return self._tier_s[0], self._tier_s[1]

    def commit(self, g: Generation, accepted: int, bonus: int | None) -> None:
        if g.stats.drafter_lost:
            return
        moved = self._moved.pop(g.rid, False)
        refresh = self._refresh.pop(g.rid, False) and bonus is not None
        if g.rid in self._unattached or (bonus is not None and not self._drafted.get(g.rid, True)
                                         and not moved):
            self._plain.setdefault(g.rid, []).append(bonus)  # sent with the next Draft order
            return
        req = dpb.CommitRequest(request_id=g.rid, accepted=accepted, refresh_draft=refresh,
                                apply_selection=moved)
        if bonus is not None:
            req.bonus = bonus
        try:
            for tok in self._plain.pop(g.rid, []):  # (none after a Draft: it took them)
                call(self.drafter.Commit, dpb.CommitRequest(request_id=g.rid, accepted=0, bonus=tok),
                     self.timeout, "drafter Commit")
            call(self.drafter.Commit, req, self.timeout, "drafter Commit")
        except (Unavailable, NotFound) as e:
            self._lose_drafter(g, e)

    def release(self, g: Generation) -> None:
        """Free both sides, off the caller's thread (the engine ends the request at once; a
        service that does not answer holds only a releaser thread, for its deadline); never
        raises (a lost service frees its sessions by TTL)."""
        self._forget(g.rid)
        self._releaser.submit(self._release, g.rid)

    def _forget(self, rid: str) -> None:
        """Drop what this side keeps of a request's drafter session."""
        for state in (self._moved, self._plain, self._drafted, self._refresh, self._unattached,
                      self._prepared):
            state.pop(rid, None)

    def _release(self, rid: str) -> None:
        self._release_on(self.drafter, rid)
        self._release_on(self.verifier, rid)

    def _release_on(self, stub, rid: str) -> None:
        """Release is idempotent: tried once more on UNAVAILABLE (a reset connection); never
        raises."""
        timeout = min(RELEASE_TIMEOUT_S, self.timeout)
        for attempt in (0, 1):
            try:
                stub.Release(vpb.ReleaseRequest(request_id=rid), timeout=timeout)
                return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    return

    def health(self, timeout_s: float = 2.0) -> dict[str, bool]:
        """Whether each service answers its Health now (never raises)."""
        out = {}
        for name, stub in (("drafter", self.drafter), ("verifier", self.verifier)):
            try:
                out[name] = bool(stub.Health(vpb.ServiceHealthRequest(), timeout=timeout_s).ok)
            except grpc.RpcError:
                out[name] = False
        return out

    def service_health(self, timeout_s: float = 10.0) -> dict:
        """Each service's ServiceHealthResponse ({"drafter": ..., "verifier": ...}: sessions,
        KV tier, KV budget and use); raises Unavailable when one is down."""
        return {name: call(stub.Health, vpb.ServiceHealthRequest(), timeout_s, f"{name} Health")
                for name, stub in (("drafter", self.drafter), ("verifier", self.verifier))}

    def budgets(self, wait_s: float) -> tuple[str, int | None, int | None, int | None]:
        """(the verifier's KV tier, the drafter's and the verifier's KV budgets in bytes, None
        where unbounded, and the K/V bytes a token of the drafter's sessions takes, None where
        it does not say), from their Health, waiting up to `wait_s` for them to answer."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                h = self.service_health(timeout_s=max(1.0, min(10.0, deadline - time.monotonic())))
                break
            except Unavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1.0)
        return (h["verifier"].kv_tier or "resident", h["drafter"].kv_budget_bytes or None,
                h["verifier"].kv_budget_bytes or None, h["drafter"].kv_bytes_per_token or None)

    def prefill_into_store(self, rid: str, ids: list[int], compressor: str, chunk_size: int,
                           namespace: str) -> None:
        """Prefill a prompt on the verifier (full and compressed chunks into the kvstore) and
        release it: a warm prefix cache for later requests."""
        try:
            call(self.verifier.Prefill, vpb.PrefillRequest(
                request_id=rid, token_ids=ids, compressor=compressor, chunk_size=chunk_size,
                extra_capacity=1, namespace=namespace), self.timeout, "verifier Prefill")
        finally:
            call(self.verifier.Release, vpb.ReleaseRequest(request_id=rid), self.timeout,
                 "verifier Release")

    def close(self) -> None:
        self._releaser.shutdown(wait=True)
        for ch in self._channels:
            ch.close()
