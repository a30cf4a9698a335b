"""`Backends` over gRPC: the engine's rounds (`vericache.engine.rounds`) run against the
drafter and verifier services exactly as against the in-process ones. Every call has a
deadline (`timeout_s`; Release and Health shorter ones of their own, at most `timeout_s`); a
failed call surfaces as the core's typed error. Only Release and Health are retried (once, on
UNAVAILABLE): Prefill, Attach, Draft, Verify and Commit change a session's state, so one that
may have run is never sent twice — the request fails instead, and its sessions are released.
An Attach that finds a chunk evicted from the store (NOT_FOUND) does not fail the request: the
verifier decodes it alone, in plain full-KV steps, so it still ends with the same tokens.

A `vericache` request attaches to the drafter when it first drafts, not at admission: until
then its rounds are plain steps that never touch the drafter, and a request the cost model
keeps on plain steps (short contexts, small batches on a CPU) never moves its draft KV (its
compressed chunks and exact tail, read by the drafter through the kvstore) and the verifier
never writes the drafter's part (its Prefill's `draft_later`: the exact tail and the
selection's first moves wait for PrepareDraft, sent right before the Attach). Its plain-step
tokens wait here and go with its first Draft order, as any plain round's do."""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from vericache._proto import load
from vericache.engine.backends import Backends
from vericache.engine.drafter import DraftOut
from vericache.engine.generation import Generation
from vericache.engine.verifier import Verdict
from vericache.errors import NotFound, Unavailable, VeriCacheError
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
            if g.params.mode != "vericache":
                raise
            log.warning("%s: %s; decoding without drafts", g.rid, e)
            g.params = dataclasses.replace(g.params, mode="full")
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
            res = call(self.drafter.Draft, _orders(orders, self._plain), self.timeout, "drafter Draft")
            for (g, _), r in zip(orders, res.results):
                out[g.rid] = DraftOut(list(r.tokens), probs_from_bytes(r.probs, len(r.tokens), self.vocab))
        for g, _ in batch:
            self._drafted[g.rid] = bool(out[g.rid].tokens)
        return [out[g.rid] for g, _ in batch]

    def _attached(self, g: Generation) -> bool:
        """Whether the drafter holds the request, attaching it now if it has not yet (the
        verifier first writes what its Prefill left for the drafter: PrepareDraft)."""
        req = self._unattached.pop(g.rid, None)
        if req is None:
            return True
        prep = call(self.verifier.PrepareDraft, vpb.PrepareDraftRequest(request_id=g.rid),
                    self.timeout, "verifier PrepareDraft")
        _record_selection(g, prep.selection)
        g.stats.store_bytes_written += prep.bytes_written
        g.stats.store_s += prep.store_seconds
        req.apply_selection = prep.selection_deltas > 0
        return self._attach(g, req)

    def draft_ahead(self, batch: list[tuple[Generation, int]]) -> int:
        batch = [(g, k) for g, k in batch if g.rid not in self._unattached]
        if not batch:
            return 0
        return call(self.drafter.DraftAhead, _orders(batch), self.timeout,
                    "drafter DraftAhead").drafted

    def verify(self, batch: list[tuple[Generation, DraftOut]]) -> list[Verdict]:
        res = call(self.verifier.Verify, vpb.VerifyRequest(items=[
            vpb.VerifyItem(request_id=g.rid, draft_tokens=d.tokens, draft_probs=probs_to_bytes(d.q),
                           refresh_draft=g.refreshes_draft and bool(d.tokens))
            for g, d in batch]), self.timeout, "verifier Verify")
        for (g, d), r in zip(batch, res.results):
            self._refresh[g.rid] = g.refreshes_draft and bool(d.tokens)
            self._moved[g.rid] = r.selection_deltas > 0
            _record_selection(g, r.selection)
        return [Verdict(r.accepted, r.bonus, [_logprob(m) for m in r.logprobs]
                        if g.params.logprobs is not None else None)
                for (g, _), r in zip(batch, res.results)]

    def commit(self, g: Generation, accepted: int, bonus: int | None) -> None:
        moved = self._moved.pop(g.rid, False)
        refresh = self._refresh.pop(g.rid, False) and bonus is not None
        if g.rid in self._unattached or (bonus is not None and not self._drafted.get(g.rid, True)
                                         and not moved):
            self._plain.setdefault(g.rid, []).append(bonus)  # sent with the next Draft order
            return
        for tok in self._plain.pop(g.rid, []):  # (none after a Draft: it took them)
            call(self.drafter.Commit, dpb.CommitRequest(request_id=g.rid, accepted=0, bonus=tok),
                 self.timeout, "drafter Commit")
        req = dpb.CommitRequest(request_id=g.rid, accepted=accepted, refresh_draft=refresh,
                                apply_selection=moved)
        if bonus is not None:
            req.bonus = bonus
        call(self.drafter.Commit, req, self.timeout, "drafter Commit")

    def release(self, g: Generation) -> None:
        """Free both sides, off the caller's thread (the engine ends the request at once; a
        service that does not answer holds only a releaser thread, for its deadline); never
        raises (a lost service frees its sessions by TTL)."""
        for state in (self._moved, self._plain, self._drafted, self._refresh, self._unattached):
            state.pop(g.rid, None)
        self._releaser.submit(self._release, g.rid)

    def _release(self, rid: str) -> None:
        """Release is idempotent: tried once more on UNAVAILABLE (a reset connection)."""
        timeout = min(RELEASE_TIMEOUT_S, self.timeout)
        for stub in (self.drafter, self.verifier):
            for attempt in (0, 1):
                try:
                    stub.Release(vpb.ReleaseRequest(request_id=rid), timeout=timeout)
                    break
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        break

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

    def budgets(self, wait_s: float) -> tuple[str, int | None, int | None]:
        """(the verifier's KV tier, the drafter's and the verifier's KV budgets in bytes, None
        where unbounded), from their Health, waiting up to `wait_s` for them to answer."""
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
                h["verifier"].kv_budget_bytes or None)

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
