"""The verifier servicer: translates Verifier RPCs (proto/vericache/v1/verifier.proto) into
`vericache.engine.verifier.Verifier` calls. Model work is serialised by one lock."""

from __future__ import annotations

import time

from services.common.convert import (MAX_DRAFT_TOKENS, batch_items, bounded_int, bounded_str,
                                     chunk_size, logprob_message, request_id, sampling,
                                     token_list, top_logprobs)
from services.common.modelsvc import ModelService, SessionServicer
from vericache._proto import load
from vericache.compress import make_compressor
from vericache.engine.generation import EXACT
from vericache.engine.verifier import Finish, Verifier
from vericache.select import make_selection
from vericache.spec.grammar import Grammars
from vericache.store.codec import encode_deltas, encode_full, probs_from_bytes
from vericache.store.keys import refresh_key, select_key
from vericache.errors import InvalidArgument

pb, pb_grpc = load("verifier")


class VerifierServicer(SessionServicer, pb_grpc.VerifierServicer):
    def __init__(self, svc: ModelService):
        self.svc = svc
        self.core = Verifier(svc.lm.runner, svc.store, svc.lm.model_id, svc.tier, svc.ledger,
                             Grammars.of(svc.lm))
        self.vocab = svc.lm.runner.vocab_size

    def Prefill(self, req, context):
        rid = request_id(req.request_id)
        ids = token_list(req.token_ids, self.vocab)
        bounded_str(req.namespace, "namespace")
        if len(ids) + req.extra_capacity > self.svc.lm.max_context:
            raise InvalidArgument(f"prompt ({len(ids)} tokens) + {req.extra_capacity} more exceed "
                                  f"the model's {self.svc.lm.max_context}-token context", "token_ids")
        comp = make_compressor(bounded_str(req.compressor, "compressor")) if req.compressor else None
        size = chunk_size(req.chunk_size)
        sel = make_selection(bounded_str(req.selection, "selection")) if req.selection else None
        if req.exact not in ("", *EXACT):
            raise InvalidArgument(f"unknown exact {req.exact!r}; valid: {', '.join(EXACT)}", "exact")
        proc = sampling(req.temperature, req.sampling, self.vocab)
        t = time.perf_counter()
        with self.svc.lock:
            out = self.core.prefill(rid, ids, req.extra_capacity, size,
                                    comp, proc, req.seed, req.namespace, req.save_tail,
                                    selection=sel, top_logprobs=top_logprobs(req),
                                    bitwise=req.exact == "bitwise", draft_later=req.draft_later,
                                    arena="verify")
            deltas = self.core.take_deltas(rid)
        moved = self._leave_deltas(rid, deltas)
        tr = out.transfer
        return pb.PrefillResponse(first_token=out.first_token, cached_tokens=out.cached_tokens,
                                  tail_start=out.tail_start, store_hits=tr.hits,
                                  bytes_read=tr.bytes_read, bytes_written=tr.bytes_written,
                                  seconds=time.perf_counter() - t, store_seconds=tr.seconds,
                                  selection_deltas=moved, selection=self._selection_stats(rid),
                                  first_logprob=logprob_message(pb, out.first_logprob))

    def PrepareDraft(self, req, context):
        rid = request_id(req.request_id)
        t = time.perf_counter()
        with self.svc.lock:
            tr = self.core.prepare_draft(rid)
            deltas = self.core.take_deltas(rid)
        moved = self._leave_deltas(rid, deltas)
        return pb.PrefillResponse(bytes_written=tr.bytes_written, store_seconds=tr.seconds,
                                  seconds=time.perf_counter() - t, selection_deltas=moved,
                                  selection=self._selection_stats(rid))

    def _leave_deltas(self, rid: str, deltas) -> int:
        """After Prefill or PrepareDraft: the moves into the store for the drafter (dropped
        again when the request was released while the put ran); how many."""
        moved = self._put_deltas(rid, deltas)
        if moved and rid not in self.core.sessions:
            self.drop_request_keys(rid)
        self.svc.clock.touch(rid, time.monotonic())
        return moved

    def _put_deltas(self, rid: str, deltas) -> int:
        """Leave moves of the drafter's set in the store for the drafter; returns how many."""
        if deltas:
            self.svc.store.put(select_key(rid), encode_deltas(deltas))
        return len(deltas)

    def _selection_stats(self, rid: str):
        rec = self.core.selection(rid)
        if rec is None:
            return pb.SelectionStats()
        return pb.SelectionStats(seconds=rec.seconds, moves=rec.state.moves,
                                 moved_tokens=rec.state.moved_tokens, delta_bytes=rec.delta_bytes)

    def Verify(self, req, context):
        batch = []
        for it in batch_items(req.items):
            bounded_int(len(it.draft_tokens), "draft_tokens", MAX_DRAFT_TOKENS)
            drafts = token_list(it.draft_tokens, self.vocab, "draft_tokens", allow_empty=True)
            batch.append((it.request_id, drafts, probs_from_bytes(it.draft_probs, len(drafts), self.vocab)))
        refresh = [it.request_id for it in req.items if it.refresh_draft]
        finish = {it.request_id: Finish(it.finish_remaining, it.finish_within) for it in req.items}
        t = time.perf_counter()
        with self.svc.lock:
            tier0 = self._tier_counters()
            res = self.core.verify(batch, refresh, finish)
            tier1 = self._tier_counters()
            spans = {rid: self.core.take_exact(rid) for rid in refresh}
            deltas = {rid: self.core.take_deltas(rid) for rid, _, _ in batch}
        for rid, sp in spans.items():  # outside the lock: the store's link may be slow
            self.svc.store.put(refresh_key(rid), encode_full(sp.k, sp.v, start=sp.start))
        moved = {rid: self._put_deltas(rid, d) for rid, d in deltas.items()}
        for rid, _, _ in batch:  # released while this put ran: Release's delete may be past
            if rid not in self.core.sessions and (rid in spans or moved[rid]):
                self.drop_request_keys(rid)
        now = time.monotonic()
        for rid, _, _ in batch:
            self.svc.clock.touch(rid, now)
        return pb.VerifyResponse(results=[
            pb.VerifyResult(accepted=v.accepted, bonus=v.bonus, selection_deltas=moved[rid],
                            selection=self._selection_stats(rid),
                            logprobs=[logprob_message(pb, lp) for lp in v.logprobs or []],
                            held=v.held)
            for (rid, _, _), v in zip(batch, res)], seconds=time.perf_counter() - t,
            stall_seconds=tier1[0] - tier0[0], load_seconds=tier1[1] - tier0[1])

    def _tier_counters(self) -> tuple[float, float]:
        """The offloaded tier's (stall, load) seconds so far; (0, 0) when resident."""
        return (0.0, 0.0) if self.core.tier is None else self.core.tier.counters()
