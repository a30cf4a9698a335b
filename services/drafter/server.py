"""The drafter servicer: translates Drafter RPCs (proto/vericache/v1/drafter.proto) into
`vericache.engine.drafter.Drafter` calls. Model work is serialised by one lock."""

from __future__ import annotations

import time

from services.common.convert import (MAX_DRAFT_TOKENS, MAX_PLAIN_TOKENS, batch_items, bounded_int,
                                     bounded_str, chunk_size, request_id, sampling, token_list)
from vericache.errors import InvalidArgument
from services.common.modelsvc import ModelService, SessionServicer
from vericache._proto import load
from vericache.compress import make_compressor
from vericache.engine.drafter import Drafter
from vericache.spec.grammar import Grammars
from vericache.store.codec import decode_deltas, decode_full, probs_to_bytes
from vericache.store.keys import refresh_key, select_key

pb, pb_grpc = load("drafter")


class DrafterServicer(SessionServicer, pb_grpc.DrafterServicer):
    drafts = True  # its Health reports the draft_dtype's bytes a token

    def __init__(self, svc: ModelService):
        self.svc = svc
        self.core = Drafter(svc.lm.runner, svc.lm.eos_token_ids, svc.store, svc.lm.model_id,
                            svc.ledger, Grammars.of(svc.lm))
        self.vocab = svc.lm.runner.vocab_size

    def Attach(self, req, context):
        rid = request_id(req.request_id)
        ids = token_list(req.token_ids, self.vocab)
        first = token_list([req.first_token], self.vocab, "first_token")[0]
        comp = make_compressor(bounded_str(req.compressor, "compressor"))
        size = chunk_size(req.chunk_size)
        bounded_int(req.tail_start, "tail_start", len(ids))
        bounded_int(req.extra_capacity, "extra_capacity", self.svc.lm.max_context - len(ids))
        proc = sampling(req.temperature, req.sampling, self.vocab)
        with self.svc.lock:
            tr = self.core.attach_from_store(rid, ids, comp, size, req.tail_start, first,
                                             req.extra_capacity, proc, req.seed,
                                             bounded_str(req.namespace, "namespace"), arena="draft")
        if req.apply_selection:
            self._apply_selection(rid)
        self.svc.clock.touch(rid, time.monotonic())
        return pb.AttachResponse(bytes_read=tr.bytes_read, store_hits=tr.hits, seconds=tr.seconds)

    def _orders(self, req) -> list[tuple[str, int]]:
        items = batch_items(req.items)
        for it in items:
            bounded_int(it.k, "k", MAX_DRAFT_TOKENS)
            if len(it.plain_tokens) > MAX_PLAIN_TOKENS:
                raise InvalidArgument(f"{len(it.plain_tokens)} plain_tokens, at most {MAX_PLAIN_TOKENS}",
                                      "plain_tokens")
            if it.plain_tokens:
                token_list(it.plain_tokens, self.vocab, "plain_tokens")
        return [(it.request_id, it.k) for it in items]

    def _feed_plain(self, req) -> None:
        """Queue each item's plain-step tokens, as Commits without drafts would (under the lock)."""
        for it in req.items:
            for tok in it.plain_tokens:
                self.core.commit(it.request_id, 0, tok)

    def _touch(self, orders: list[tuple[str, int]]) -> None:
        now = time.monotonic()
        for rid, _ in orders:
            self.svc.clock.touch(rid, now)

    def Draft(self, req, context):
        orders = self._orders(req)
        t = time.perf_counter()
        with self.svc.lock:
            self._feed_plain(req)
            outs = self.core.draft(orders)
        self._touch(orders)
        return pb.DraftResponse(results=[pb.DraftResult(tokens=o.tokens, probs=probs_to_bytes(o.q))
                                         for o in outs], seconds=time.perf_counter() - t)

    def DraftAhead(self, req, context):
        orders = self._orders(req)
        t = time.perf_counter()
        with self.svc.lock:
            self._feed_plain(req)
            drafted = self.core.draft_ahead(orders)
        self._touch(orders)
        return pb.DraftAheadResponse(drafted=drafted, seconds=time.perf_counter() - t)

    def _apply_selection(self, rid: str) -> None:
        """Apply the moves of the kept set the verifier left in the store (an evicted key
        only leaves the set where it was: drafting stays lossless either way)."""
        data = self.svc.store.get(select_key(rid))
        if data is None:
            return
        self.svc.store.delete(select_key(rid))
        deltas = decode_deltas(data)
        with self.svc.lock:
            for d in deltas:
                self.core.apply_delta(rid, d)

    def Commit(self, req, context):
        request_id(req.request_id)
        bounded_int(req.accepted, "accepted", MAX_DRAFT_TOKENS)
        bonus = token_list([req.bonus], self.vocab, "bonus")[0] if req.HasField("bonus") else None
        exact = None
        if req.refresh_draft and bonus is not None:  # the verifier wrote the exact KV
            data = self.svc.store.get(refresh_key(req.request_id))
            if data is not None:
                exact = decode_full(data)
                self.svc.store.delete(refresh_key(req.request_id))
        with self.svc.lock:
            self.core.commit(req.request_id, req.accepted, bonus, exact)
        if req.apply_selection:
            self._apply_selection(req.request_id)
        self.svc.clock.touch(req.request_id, time.monotonic())
        return pb.CommitResponse()
