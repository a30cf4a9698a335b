"""The verifier side: per-request full KV, prefill, and batched verification.

Methods and when they are called:
- `prefill(rid, prompt_ids, ...)`: once per request: computes the full KV (after the longest
  prefix cached in the store, when there is a store), compresses the chunks before the
  exact tail, writes new chunks (and, for a remote drafter, the exact tail) to the store,
  and returns the first token (from full-KV logits) with the new compressed chunks.
- `verify(batch)`: once per round for every verifying request together: ONE forward pass of
  [x_0, d_1..d_k] per request over its full KV; processes each row's logits
  (`vericache.spec.processors`: row i's context is the generated tokens and d_1..d_i; with
  a grammar, row i is masked at the matcher's position after d_1..d_i, `vericache.spec.grammar`,
  and the matcher then takes only the emitted tokens);
  accepts by `vericache.spec.accept`; crops the cache to the accepted tokens. Returns a
  `Verdict` per request: (accepted, bonus) and, when the request asked, the raw logprobs of
  the emitted tokens (`vericache.spec.logprobs`). With an offloaded tier, `finish` asks the
  verifier to hold a request's loaded working copy when few tokens are left (`Finish`): its
  next passes, plain decode steps in the same verify job, then load nothing.
- `prepare_draft(rid)`: for a request prefilled with `draft_later`, right before its drafter
  attaches: what prefill left for the drafter (the exact tail into the store, the
  selection's first moves), so a request that never drafts never pays for them.
- `take_deltas(rid)`: after prefill and after each verification, for requests with a
  selection policy (`vericache.select`): the moves of the drafter's set made since the last
  call, in order, for the drafter to apply (`Drafter.apply_delta`).
- `release(rid)`: once, when the request ends or fails.

Where the full KV lives between rounds is a tier (`vericache.engine.kvtier`): resident (the
default) or offloaded, in which case prefill moves it into the tier and each verification
loads it layer by layer while computing, then writes the accepted tokens' KV back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import torch

from vericache.compress.base import CompressedChunk, Compressor, KVSpan
from vericache.engine.budget import Ledger
from vericache.engine.prefill import compress_prompt, prefill, tail_start
from vericache.engine.kvtier import OffloadedTier, StreamedKV
from vericache.errors import InvalidArgument, NotFound, Unavailable, VeriCacheError
from vericache.store.base import ChunkStore
from vericache.store.prefix import PrefixCache, TransferStats
from vericache.model.kvcache import KVCache
from vericache.model.runner import Runner, SeqBatchItem
from vericache.select.base import SelectionDelta, SelectionPolicy, SelectionState
from vericache.spec.accept import greedy_accept, speculative_accept
from vericache.spec.grammar import Grammars, GrammarState, start_matcher
from vericache.spec.logprobs import TokenLogprob, token_logprobs
from vericache.spec.processors import GREEDY, Processing, TokenHistory, choose, process, target

log = logging.getLogger(__name__)


@dataclass
class SelectionRecord:
    """A request's selection on the verifier: the policy, its record of the drafter's set, the
    moves not yet taken by the drafter, and what selecting cost."""

    policy: SelectionPolicy
    state: SelectionState
    compressor: Compressor
    deltas: list[SelectionDelta] = field(default_factory=list)
    seconds: float = 0.0
    delta_bytes: int = 0

    def add(self, delta: SelectionDelta | None) -> None:
        if delta is None:
            return
        delta.k, delta.v = self.compressor.requantize(delta.k, delta.v)
        self.deltas.append(delta)
        self.delta_bytes += delta.nbytes()


@dataclass
class VerifySession:
    cache: KVCache  # every verified token but the last
    pending: list[int]  # [x_0]
    sampling: Processing = GREEDY
    history: TokenHistory | None = None  # what the penalties read (None: no penalties)
    grammar: GrammarState | None = None  # matcher over the emitted tokens (None: no grammar)
    top_logprobs: int | None = None  # None: no logprobs; n: each emitted token's and n more
    gen: torch.Generator = field(default_factory=torch.Generator)
    selection: SelectionRecord | None = None
    limit: int = 0  # tokens its KV may hold: prompt + extra_capacity (what its budget charged)
    bitwise: bool = False  # its passes are invariant ones (GenParams.exact == "bitwise")
    # offloaded tier: the full KV its next pass runs on, loading nothing: the prefilled cache
    # until its first verification ends, then the working copy a pass kept (`Finish`)
    held: KVCache | StreamedKV | None = None


@dataclass(frozen=True)
class Finish:
    """Finish a request on the full KV its verification loaded, not on another load.

    With an offloaded tier every verification loads the request's whole full KV over the link.
    When the tokens left after a pass are few, another round (drafts, then a load for them)
    costs more than plain decode steps on the working copy already loaded: the pass keeps the
    copy (`Verdict.held`) if 0 < `remaining` - emitted <= `within`, and the request's next
    passes, plain steps (no drafts) in the same verify job, run on it and load nothing. Plain
    steps are full-KV decoding, so the output is what it was. `remaining`: tokens the request
    may still emit, this pass's among them; `within`: the most steps that cost less than a
    load (`CostModel.finish_within`)."""

    remaining: int
    within: int

    def holds(self, emitted: int) -> bool:
        return 0 < self.remaining - emitted <= self.within


NO_FINISH = Finish(0, 0)  # a request not asked to finish: it never holds


@dataclass
class Verdict:
    """What the verifier decided after a pass: `accepted` drafts, then its `bonus` token
    (after a prefill: no drafts, the first token), and the raw logprobs of each emitted
    token (drafts[:accepted] + [bonus]) when the request asked for them."""

    accepted: int
    bonus: int
    logprobs: list[TokenLogprob] | None = None
    held: bool = False  # the pass kept its loaded working copy for the next (`Finish`)


@dataclass
class PrefillOut:
    first_token: int
    chunks: list[CompressedChunk]  # newly compressed chunks before the exact tail
    cached_tokens: int = 0  # prompt tokens whose full KV came from the store
    tail_start: int = 0  # first token of the drafter's exact tail
    transfer: TransferStats = field(default_factory=TransferStats)
    first_logprob: TokenLogprob | None = None  # when asked for (top_logprobs set)


def _drop_quietly(store: ChunkStore, key: str) -> None:
    try:
        store.delete(key)
    except VeriCacheError as e:  # its TTL drops it then
        log.info("could not drop %s: %s", key, e)


class Verifier:
    def __init__(self, runner: Runner, store: ChunkStore | None = None, model_id: str = "",
                 tier: OffloadedTier | None = None, ledger: Ledger | None = None,
                 grammars: Grammars | None = None):
        """With a store, prefill reuses cached prefixes and writes new chunks back. With a
        tier, the full KV is offloaded between rounds (None: resident). With a ledger, a
        resident session's full KV is charged to it before prefill allocates (an offloaded
        one's copies live in host memory; its working copy is the scheduler's to bound).
        `grammars`: compiles the grammars of structured-output requests (None: refused)."""
        self.runner, self.store, self.model_id = runner, store, model_id
        self.grammars = grammars
        self.tier = tier
        self.ledger = ledger or Ledger(None, "")
        self.sessions: dict[str, VerifySession] = {}
        self._exact: dict[str, KVSpan] = {}  # rid -> exact KV of its last verified tokens
        # rid -> the store key of the exact tail its prefill wrote for the drafter: a drafter
        # attach reads and deletes it; a request that ends before that (its drafter down or
        # never reached) would leave it in the store until a TTL, so release deletes it too
        self._tails: dict[str, str] = {}
        # rid -> what its prefill left for the drafter (`draft_later`): (cache, stats) -> record
        self._deferred: dict = {}
        self._dropper = (ThreadPoolExecutor(1, thread_name_prefix="tail-drop")
                         if store is not None else None)

    def _get(self, rid: str) -> VerifySession:
        try:
            return self.sessions[rid]
        except KeyError:
            raise NotFound(f"no verifier session {rid!r}") from None

    def prefill(self, rid: str, prompt_ids: list[int], extra_capacity: int, chunk_size: int,
                compressor: Compressor | None = None, sampling: Processing = GREEDY, seed: int = 0,
                namespace: str = "", save_tail: bool = False,
                selection: SelectionPolicy | None = None,
                top_logprobs: int | None = None, bitwise: bool = False,
                draft_later: bool = False, arena=None) -> PrefillOut:
        """`selection`: the policy that moves the drafter's set (None or one that cannot move
        anything, as with a compressor that keeps every token: the base set stays).
        `sampling`: the request's logits processing; `top_logprobs`: None, or return each
        emitted token's raw logprob with that many alternatives. `bitwise`: its passes (verify
        and plain steps) run in the runner's invariant pass, a row's bits whatever shares it.
        `draft_later`: the exact tail and the selection wait for `prepare_draft` (with a
        resident KV only: an offloaded one leaves the device here). `arena`: the runner pool key
        its cache sits in (`Runner.new_cache`; the engine's: its group's)."""
        if rid in self.sessions:  # two callers with one id would share (and corrupt) a cache
            raise InvalidArgument(f"request id {rid!r} already has a verifier session", "request_id")
        per_token = self.runner.kv_bytes_per_token()
        resident = 0 if self.tier else (len(prompt_ids) + extra_capacity) * per_token
        with self.ledger.hold(rid, resident):
            out = self._prefill(rid, prompt_ids, extra_capacity, chunk_size, compressor,
                                sampling, seed, namespace, save_tail, selection, top_logprobs,
                                draft_later and self.tier is None, arena)
        self.sessions[rid].bitwise = bitwise
        return out

    def _prefill(self, rid, prompt_ids, extra_capacity, chunk_size, compressor, sampling,
                 seed, namespace, save_tail, selection, top_logprobs, draft_later,
                 arena=None) -> PrefillOut:
        ts = tail_start(compressor, len(prompt_ids), chunk_size) if compressor else 0
        salient = compressor.salient_budget(ts) if compressor is not None else 0
        if selection is not None and (compressor is None or not (compressor.drops_tokens or salient)
                                      or not selection.moves or ts == 0):
            selection = None
        qwin = selection.window if selection is not None else 0
        stats = TransferStats()
        pc = PrefixCache(self.store, self.model_id, chunk_size, namespace) if self.store else None
        new_cache = None
        if self._in_tier_memory:
            new_cache = self._host_cache
        elif self.tier is None and arena is not None:
            new_cache = partial(self.runner.new_cache, arena=arena)
        cached = None
        if pc is not None:
            try:
                cached = pc.load_full(prompt_ids, compressor.spec if compressor else None, ts,
                                      extra_capacity, stats, new_cache)
            except Unavailable as e:  # the store is a cache: without it, compute the prompt
                log.warning("%s: prefix store unavailable (%s); prefilling without it", rid, e)
                stats.store_errors += 1
        first_chunk = cached.length // chunk_size if cached is not None else 0
        if cached is None and self._in_tier_memory:
            cached = new_cache(len(prompt_ids) + extra_capacity)  # empty: prefill fills it
        window = compressor.observation_window if compressor else 0
        pre = prefill(self.runner, prompt_ids, extra_capacity, chunk_size, window, cache=cached,
                      question_window=qwin, arena=None if self.tier else arena)
        gen = torch.Generator().manual_seed(seed)
        history = (TokenHistory(prompt_ids, self.runner.vocab_size, sampling)
                   if sampling.penalized else None)
        matcher = start_matcher(self.grammars, sampling.grammar)
        first, _ = choose(pre.logits, sampling, history, (), gen,
                          matcher.allowed() if matcher is not None else None)
        if history is not None:
            history.extend([first])
        if matcher is not None:
            matcher.accept([first])
        first_lp = (token_logprobs(pre.logits[None], [first], top_logprobs)[0]
                    if top_logprobs is not None else None)
        chunks = (compress_prompt(compressor, pre, len(prompt_ids), chunk_size, first_chunk)
                  if compressor else [])
        if pc is not None and not stats.store_errors:
            try:
                pc.save(prompt_ids, pre.cache, chunks, first_chunk, ts, None, stats)
            except Unavailable as e:  # not published: a later request computes it again
                log.warning("%s: prefix store unavailable (%s); prefix not saved", rid, e)
                stats.store_errors += 1
        n = len(prompt_ids)
        chunk_kept = ([compressor.kept_positions(c) for c in chunks]
                      if selection is not None and compressor.drops_tokens else [])
        window_votes, window_rows = pre.window_votes, pre.window_rows

        def drafter_part(cache: KVCache, stats: TransferStats) -> SelectionRecord | None:
            """The exact tail into the store; the selection's record and first moves."""
            if pc is not None and save_tail:
                pc.save_tail(rid, cache, ts, n, stats)
                self._tails[rid] = pc.tail_key(rid)
            if selection is None:
                return None
            t = time.perf_counter()
            # the base set: stored chunks before those computed here (a cached prefix may
            # reach past the compressed region, into the exact tail), then the new ones
            if compressor.drops_tokens:
                stored = min(first_chunk, ts // chunk_size)
                kept = pc.load_kept_positions(prompt_ids, compressor, stored, stats) if stored else []
                state = SelectionState(torch.cat(kept + chunk_kept, dim=2), ts)
            else:  # every token kept, quantized: the policy moves precision (a salient set)
                state = SelectionState.empty_salient(self.runner.num_layers,
                                                     self.runner.num_kv_heads, salient, ts)
            record = SelectionRecord(selection, state, compressor)
            record.add(selection.after_prefill(state, window_votes, window_rows,
                                               *cache.view(0, n)))
            record.seconds += time.perf_counter() - t
            return record

        record = None
        if draft_later:
            self._deferred[rid] = drafter_part
        else:
            record = drafter_part(pre.cache, stats)
        cache = pre.cache if self.tier is None else self.tier.offload(pre.cache)
        # offloaded: the prefilled full KV is still in the compute's memory, so the first
        # verification runs on it and loads nothing (the scheduler charges it until then)
        self.sessions[rid] = VerifySession(cache, [first], sampling, history, matcher,
                                           top_logprobs, gen, record,
                                           len(prompt_ids) + extra_capacity,
                                           held=None if self.tier is None else pre.cache)
        return PrefillOut(first, chunks, first_chunk * chunk_size, ts, stats, first_lp)

    @property
    def _in_tier_memory(self) -> bool:
        """An offloaded full KV is computed in the tier's host memory: a CPU runner's cache
        is its own host copy (`OffloadedTier.offload` adopts it)."""
        return self.tier is not None and self.runner.device.type == "cpu"

    def _host_cache(self, capacity: int) -> KVCache:
        """An empty cache for an offloaded request's full KV, from the tier's host memory."""
        r = self.runner
        return self.tier.host_cache(capacity, r.num_layers, r.num_kv_heads, r.head_dim, r.dtype)

    def prepare_draft(self, rid: str) -> TransferStats:
        """What the request's prefill left for its drafter (`draft_later`), done now: its
        exact tail into the store, its selection's record and first moves (`take_deltas`).
        Nothing where nothing was left."""
        s, stats = self._get(rid), TransferStats()
        part = self._deferred.pop(rid, None)
        if part is not None:
            s.selection = part(s.cache, stats)
        return stats

    def take_deltas(self, rid: str) -> list[SelectionDelta]:
        """The moves of the drafter's set made since the last call (see the module docstring)."""
        rec = self._get(rid).selection
        if rec is None or not rec.deltas:
            return []
        out, rec.deltas = rec.deltas, []
        return out

    def selection(self, rid: str) -> SelectionRecord | None:
        return self._get(rid).selection

    def cache(self, rid: str) -> KVCache:
        """The request's full KV (an offloaded one once its offload has landed)."""
        return self._landed(self._get(rid).cache)

    def _landed(self, cache: KVCache) -> KVCache:
        if self.tier is not None:
            self.tier.landed(cache)
        return cache

    def _verified_span(self, rid: str, since: int) -> KVSpan:
        """The exact KV of the tokens verified from cache position `since` on, and of the one
        before them (a drafter may not have fed it yet)."""
        c = self._landed(self._get(rid).cache)
        lo = max(0, since - 1)
        return KVSpan(c.k[:, :, lo:c.length].cpu(), c.v[:, :, lo:c.length].cpu(), lo)

    def verify(self, batch: list[tuple[str, list[int], torch.Tensor | None]],
               refresh: Collection[str] = (), finish: Mapping[str, Finish] | None = None) -> list[Verdict]:
        """For each (rid, drafts, q): one pass over the full KV, accept, crop. For the rids in
        `refresh`, the exact KV of the tokens verified is kept for `take_exact`. `finish`
        (offloaded tier): rids whose loaded working copy is held after the pass when few
        tokens are left (`Finish`); a request with a held copy passes on it, loading nothing."""
        if not batch:
            return []
        fin = [(finish or {}).get(rid, NO_FINISH) for rid, _, _ in batch]
        sess = [self._get(rid) for rid, _, _ in batch]
        for s, (rid, drafts, _) in zip(sess, batch):
            if s.cache.length + len(s.pending) + len(drafts) > s.limit:
                raise InvalidArgument(f"request {rid}: {len(drafts)} drafts would take its KV past "
                                      f"the {s.limit} tokens reserved (prompt + extra_capacity)",
                                      "draft_tokens")
        for s, (_, drafts, _) in zip(sess, batch):  # a held copy takes plain steps only
            if s.held is not None and s.held.length + len(s.pending) + len(drafts) > s.held.capacity:
                s.held = None
        before = {rid: self._get(rid).cache.length for rid in refresh}
        caches = [s.cache if s.held is None else s.held for s in sess]
        on_held = [s.held is not None for s in sess]
        if self.tier is not None:  # working copies, filled layer by layer during the pass
            load = [i for i, s in enumerate(sess) if s.held is None]
            if load:
                # with room for the steps a held copy may take after this pass (`Finish.within`)
                opened = self.tier.open([sess[i].cache for i in load], [
                    min(len(sess[i].pending) + len(batch[i][1]) + fin[i].within,
                        sess[i].limit - sess[i].cache.length) for i in load])
                for i, c in zip(load, opened):
                    caches[i] = c
        items = []
        for s, c, (_, drafts, _) in zip(sess, caches, batch):
            toks = s.pending + list(drafts)
            pos0 = c.length
            # (a full salient set cannot move: its passes take the fast path, no votes)
            votes = (bool(drafts) and s.selection is not None and s.selection.policy.needs_votes
                     and not s.selection.state.full)
            items.append(SeqBatchItem(torch.tensor(toks), torch.arange(pos0, pos0 + len(toks)),
                                      c, logits="all", votes=votes, bitwise=s.bitwise))
        logits = self.runner.forward(items)
        out = []
        for s, c, it, f, held, (_, drafts, q), lg in zip(sess, caches, items, fin, on_held,
                                                            batch, logits):
            k, drafts = len(drafts), list(drafts)
            allowed = s.grammar.row_masks(drafts) if s.grammar is not None else None
            x = process(lg, s.sampling, s.history, drafts, allowed)  # [k + 1, V] processed logits
            if s.sampling.greedy:
                a, bonus = greedy_accept(drafts, x.argmax(dim=-1).tolist())
            else:
                p = target(x, s.sampling).cpu()  # (beside the drafts' q, on the host)
                a, bonus = speculative_accept(drafts, q if k else p[:0], p, s.gen)
            emitted = drafts[:a] + [bonus]
            if s.history is not None:
                s.history.extend(emitted)
            if s.grammar is not None:
                s.grammar.accept(emitted)
            if s.selection is not None and k:
                rec, t = s.selection, time.perf_counter()
                rec.add(rec.policy.after_verify(rec.state, it.attn_votes, len(it.tokens), a, k,
                                                *c.view()))
                rec.seconds += time.perf_counter() - t
            c.crop(c.length - k + a)
            if isinstance(c, StreamedKV):
                self.tier.write_back(c)
            elif held:  # the prefilled cache (a CPU runner's is its own host copy)
                self.tier.store_new(s.cache, c, int(it.positions[0]))
            s.held = c if (held or c is not s.cache) and f.holds(len(emitted)) else None
            s.pending = [bonus]
            out.append(Verdict(a, bonus, None if s.top_logprobs is None
                               else token_logprobs(lg, emitted, s.top_logprobs), held=s.held is not None))
        for rid, since in before.items():
            self._exact[rid] = self._verified_span(rid, since)
        return out

    def take_exact(self, rid: str) -> KVSpan | None:
        """The exact KV `verify(..., refresh=)` kept for `rid` (once): what its drafter copies
        over its own KV of those tokens (`Drafter.commit(exact=...)`), in process or through
        the store."""
        return self._exact.pop(rid, None)

    def release(self, rid: str) -> None:
        """Free the request's session; its exact tail, if a drafter never read it, leaves the
        store off this thread (a store that does not answer must not hold the caller)."""
        s = self.sessions.pop(rid, None)
        self._exact.pop(rid, None)
        self._deferred.pop(rid, None)
        if s is not None and self.tier is not None:
            # its host copy (offload's, or a CPU runner's own cache) holds a later request's KV
            self.tier.recycle(s.cache)
        tail = self._tails.pop(rid, None)
        if tail is not None:
            self._dropper.submit(_drop_quietly, self.store, tail)
        self.ledger.refund(rid)
