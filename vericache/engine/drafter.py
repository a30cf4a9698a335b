"""The drafter side: per-request lossy caches, batched greedy (or sampled) drafting.

Methods and when they are called:
- `attach(rid, k, v, ...)`: once per request, after prefill: the lossy KV (compressed chunks +
  exact tail) becomes the request's cache; `pending` holds the verified tokens not fed yet.
- `draft(batch)`: once per round for every drafting request together: k steps, one forward
  pass per step over all requests still drafting. A request stops early at EOS. Each step's
  logits are processed as the verifier will process that row (`vericache.spec.processors`:
  the context holds the verified tokens and the drafts before it; with a grammar, the mask
  at the request's matcher, which takes each draft, `vericache.spec.grammar`).
- `draft_ahead(batch)`: optional, while the round's drafts are being verified (staggered
  lanes): go on drafting after them as if every draft will be accepted, the drafter's own
  next token standing in for the verifier's bonus token. `commit` keeps these tokens as the
  next round's first drafts when the verifier accepted every draft and its bonus equals the
  guess, and throws them (and their KV) away otherwise. Greedy requests only.
- `commit(rid, accepted, bonus, exact)`: once per round after verification: crop to the
  accepted tokens (and overwrite their KV with the exact KV when `exact` is given), queue
  the unfed verified tokens; roll the grammar's matcher back past the rejected drafts.
- `apply_delta(rid, delta)`: when the verifier moved the request's kept set
  (`vericache.select`): overwrite the named slots of the prompt region with the entering
  tokens' K/V. Any time between rounds; the region is never cropped, so it touches no draft.
- `release(rid)`: once, when the request ends or fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vericache.compress.base import Compressor, KVSpan
from vericache.engine.budget import Ledger
from vericache.errors import InvalidArgument, NotFound
from vericache.model.kvcache import KVCache
from vericache.model.runner import Runner, SeqBatchItem
from vericache.spec.grammar import Grammars, GrammarState, start_matcher
from vericache.spec.processors import GREEDY, Processing, TokenHistory, choose
from vericache.store.base import ChunkStore
from vericache.store.prefix import PrefixCache, TransferStats


@dataclass
class DraftSession:
    cache: KVCache
    pending: list[int]  # verified tokens not fed to the cache yet (the last is x_0)
    seq_len: int  # verified tokens of the sequence, pending included
    sampling: Processing = GREEDY
    history: TokenHistory | None = None  # verified tokens the penalties read (None: none)
    grammar: GrammarState | None = None  # matcher: verified tokens, then drafts (None: none)
    gen: torch.Generator = field(default_factory=torch.Generator)
    drafts: list[int] = field(default_factory=list)
    q: list[torch.Tensor | None] = field(default_factory=list)
    len_before: int = 0  # cache length where the round's first token (pending or draft) goes
    ahead: list[int] = field(default_factory=list)  # drafted past this round's drafts
    carry: list[int] = field(default_factory=list)  # confirmed ahead drafts: next round's first
    ahead_used: int = 0  # ahead tokens kept over the request's life
    ahead_wasted: int = 0  # ahead tokens thrown away
    region: int = 0  # leading cache slots holding the prompt region's kept set (movable)


@dataclass
class DraftOut:
    tokens: list[int]
    q: torch.Tensor | None  # [k, V] when sampling


class Drafter:
    def __init__(self, runner: Runner, eos_token_ids: tuple[int, ...], store: ChunkStore | None = None,
                 model_id: str = "", ledger: Ledger | None = None,
                 grammars: Grammars | None = None):
        """With a store, `attach_from_store` loads compressed chunks and the exact tail. With
        a ledger, each session's cache (kept tokens + room) is charged to it on attach.
        `grammars`: compiles the grammars of structured-output requests (None: refused)."""
        self.runner, self.eos = runner, eos_token_ids
        self.grammars = grammars
        self.store, self.model_id = store, model_id
        self.ledger = ledger or Ledger(None, "")
        self.sessions: dict[str, DraftSession] = {}

    def _get(self, rid: str) -> DraftSession:
        try:
            return self.sessions[rid]
        except KeyError:
            raise NotFound(f"no drafter session {rid!r}") from None

    def attach(self, rid: str, k: torch.Tensor, v: torch.Tensor, pending: list[int], seq_len: int,
               extra_capacity: int, sampling: Processing = GREEDY, seed: int = 0, region: int = 0,
               prompt: list[int] | None = None, pos: torch.Tensor | None = None,
               arena=None) -> None:
        """`region`: how many leading slots of k, v hold the prompt region's kept set (the
        compressed chunks' tokens, which a selection policy may move). `pending` holds every
        token generated so far (none is fed yet); `prompt`: what the repetition penalty reads
        besides them (without it drafts only match the verifier less often). `pos`: the
        slots' positions ([layers, Hkv, n], `Compressor.draft_positions`); the cache records
        them when the model's attention reads them (`Runner.positioned`: sliding-window or
        chunked layers, ALiBi; without `pos`, k, v are taken for the n tokens right before
        `pending`). `arena`: the runner pool key its cache sits in
        (`Runner.new_cache`; the engine's: its group's, so that a group drafts over one pool)."""
        if rid in self.sessions:  # two callers with one id would share (and corrupt) a cache
            raise InvalidArgument(f"request id {rid!r} already has a drafter session", "request_id")
        dtype = self.runner.draft_dtype  # (bfloat16 for a float32 model on CPU)
        nbytes = (k.shape[2] + extra_capacity) * self.runner.draft_kv_bytes_per_token()
        with self.ledger.hold(rid, nbytes):
            if self.runner.positioned and pos is None:
                p0 = seq_len - len(pending) - k.shape[2]
                pos = torch.arange(p0, p0 + k.shape[2])
            # (an offloaded full KV sits on the host: cache_from moves k, v to the runner's device)
            cache = self.runner.cache_from(k, v, extra_capacity,
                                           pos if self.runner.positioned else None, arena, dtype)
        history = None
        if sampling.penalized:
            history = TokenHistory(prompt or [], self.runner.vocab_size, sampling)
            history.extend(pending)
        matcher = start_matcher(self.grammars, sampling.grammar, pending)
        self.sessions[rid] = DraftSession(cache, list(pending), seq_len, sampling, history,
                                          matcher, torch.Generator().manual_seed(seed),
                                          region=region)

    def apply_delta(self, rid: str, delta) -> None:
        """Write a `vericache.select.SelectionDelta` into the request's prompt region."""
        s = self._get(rid)
        c = s.cache
        L, H, cap, D = c.k.shape
        valid = delta.slots >= 0  # [L, Hkv, r]
        if delta.slots.shape[:2] != (L, H) or delta.k.shape[-1] != D:
            raise InvalidArgument(f"selection delta of shape {tuple(delta.k.shape)} does not fit "
                                  f"the drafter cache {tuple(c.k.shape)}", "selection")
        if valid.any() and int(delta.slots[valid].max()) >= s.region:
            raise InvalidArgument(f"selection delta writes slot {int(delta.slots[valid].max())} "
                                  f"outside the prompt region ({s.region} slots)", "selection")
        # (layer, head, slot) indices, not a flattened view: a pooled cache is a strided view
        # (`vericache.model.kvcache.KVPool`)
        layer = torch.arange(L)[:, None, None].expand_as(delta.slots)[valid].to(c.k.device)
        head = torch.arange(H)[None, :, None].expand_as(delta.slots)[valid].to(c.k.device)
        slot = delta.slots[valid].to(c.k.device)
        c.k[layer, head, slot] = delta.k[valid].to(c.k.device, c.k.dtype)
        c.v[layer, head, slot] = delta.v[valid].to(c.v.device, c.v.dtype)
        if c.pos is not None:
            c.pos[layer, head, slot] = delta.positions[valid].to(c.pos.device)

    def load_from_store(self, rid: str, prompt: list[int], compressor: Compressor, chunk_size: int,
                        tail_start: int, namespace: str = ""
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, TransferStats]:
        """The request's drafting KV from the store (compressed chunks + exact tail) and, for a
        model whose attention reads positions (`Runner.positioned`), its slots' positions:
        thread-safe, so it may run while this drafter drafts for others (`attach` it
        afterwards)."""
        if self.store is None:
            raise InvalidArgument("this drafter has no store to attach from", "kvstore")
        stats = TransferStats()
        pc = PrefixCache(self.store, self.model_id, chunk_size, namespace)
        k, v, pos = pc.load_draft(prompt, compressor, tail_start, rid, stats,
                                  self.runner.positioned, self.runner.draft_dtype)
        return k, v, pos, stats

    def attach_from_store(self, rid: str, prompt: list[int], compressor: Compressor, chunk_size: int,
                          tail_start: int, first_token: int, extra_capacity: int,
                          sampling: Processing = GREEDY, seed: int = 0, namespace: str = "",
                          arena=None) -> TransferStats:
        k, v, pos, stats = self.load_from_store(rid, prompt, compressor, chunk_size, tail_start,
                                                namespace)
        self.attach(rid, k, v, [first_token], len(prompt) + 1, extra_capacity, sampling, seed,
                    region=k.shape[2] - (len(prompt) - tail_start), prompt=prompt, pos=pos,
                    arena=arena)
        return stats

    def _next_item(self, s: DraftSession, k: int) -> SeqBatchItem | None:
        """The next draft step's input, or None when the request is done drafting: the round's
        drafts then its ahead drafts continue one sequence (k counts both together)."""
        d = s.drafts + s.ahead
        if len(d) >= k or (d and d[-1] in self.eos):
            return None
        if not d:
            toks, pos0 = s.pending, s.seq_len - len(s.pending)
        else:
            toks, pos0 = [d[-1]], s.seq_len + len(d) - 1
        return SeqBatchItem(torch.tensor(toks), torch.arange(pos0, pos0 + len(toks)), s.cache)

    def _step_all(self, sess: list[DraftSession], ks: list[int], into: str) -> None:
        """Draft step by step for every session together until each has its k tokens;
        new tokens go to `s.drafts` or `s.ahead` (`into`)."""
        live = list(range(len(sess)))
        while live:
            items = [(i, self._next_item(sess[i], ks[i])) for i in live]
            live = [i for i, it in items if it is not None]
            if not live:
                break
            logits = self.runner.forward([it for _, it in items if it is not None])
            for i, lg in zip(live, logits):
                s = sess[i]
                allowed = s.grammar.allowed() if s.grammar is not None else None
                tok, q = choose(lg[-1], s.sampling, s.history, s.drafts + s.ahead, s.gen, allowed)
                if s.grammar is not None:
                    s.grammar.accept([tok])
                getattr(s, into).append(tok)
                if into == "drafts":
                    s.q.append(q)

    def draft(self, batch: list[tuple[str, int]]) -> list[DraftOut]:
        """Draft up to k tokens for each (rid, k), all requests stepping together. A request's
        confirmed ahead drafts (`carry`) are its first drafts; only the rest is computed."""
        sess = [self._get(rid) for rid, _ in batch]
        ks = [k for _, k in batch]
        for s, k in zip(sess, ks):
            s.q, s.ahead = [], []
            if s.carry:
                keep = s.carry[:k]
                # the cache holds the carried drafts but the last; drop KV of those past k
                s.cache.crop(s.len_before + max(0, len(keep) - 1))
                if s.grammar is not None:
                    s.grammar.rollback(len(s.carry) - len(keep))
                s.drafts, s.carry = keep, []
                s.q = [None] * len(keep)
            else:
                s.drafts, s.len_before = [], s.cache.length
        self._step_all(sess, ks, "drafts")
        return [DraftOut(list(s.drafts), torch.stack(s.q) if s.q and s.q[0] is not None else None)
                for s in sess]

    def draft_ahead(self, batch: list[tuple[str, int]]) -> int:
        """Draft up to k more tokens past each (rid, k)'s round drafts (see the module
        docstring); returns the tokens drafted. Sampling requests and drafts that end at EOS
        are skipped."""
        sess = [self._get(rid) for rid, _ in batch]
        todo = [(s, len(s.drafts) + k) for s, (_, k) in zip(sess, batch)
                if k > 0 and s.sampling.greedy and s.drafts and not s.ahead
                and s.drafts[-1] not in self.eos]
        if not todo:
            return 0
        self._step_all([s for s, _ in todo], [k for _, k in todo], "ahead")
        return sum(len(s.ahead) for s, _ in todo)

    def commit(self, rid: str, accepted: int, bonus: int | None, exact: KVSpan | None = None) -> None:
        """The verifier accepted `accepted` drafts and chose `bonus` (None: lossy, no verifier)."""
        s = self._get(rid)
        k = len(s.drafts)
        if not 0 <= accepted <= k:  # a commit of another round, or of this one twice
            raise InvalidArgument(f"request {rid} has {k} drafts to commit, not {accepted}",
                                  "accepted")
        new = s.drafts[:accepted] + ([] if bonus is None else [bonus])
        if s.history is not None:
            s.history.extend(new)
        if s.ahead and accepted == k and s.ahead[0] == bonus:
            # the guess held: drafts and bonus are fed already; the rest drafts the next round
            n = len(s.pending) + k  # verified tokens fed this round, the bonus aside
            if exact is not None:
                self._refresh(s, exact, n)
            if len(s.ahead) > 1:
                s.len_before += n + 1
                s.pending, s.carry = [], s.ahead[1:]
            else:  # only the bonus was guessed: it is not fed yet
                s.len_before += n
                s.pending = [bonus]
            s.ahead_used += len(s.ahead)
            s.seq_len += len(new)
            s.drafts, s.q, s.ahead = [], [], []
            return
        s.ahead_wasted += len(s.ahead)
        if s.carry:  # a round without drafts (a plain step) after a held guess: its token
            # stands where carry[0] was guessed, so the carried drafts and their KV go
            s.ahead_used -= len(s.carry)
            s.ahead_wasted += len(s.carry)
            if s.grammar is not None:
                s.grammar.rollback(len(s.carry))
            s.cache.crop(s.len_before)
            s.carry = []
        if s.grammar is not None:  # it took every draft and ahead draft; keep the verified
            s.grammar.rollback(k + len(s.ahead) - accepted)
            s.grammar.accept([] if bonus is None else [bonus])
        s.ahead = []
        if k:
            keep = min(accepted, k - 1)
            n = len(s.pending) + keep
            s.cache.crop(s.len_before + n)
            if exact is not None:  # the verify pass computed these tokens' exact KV
                self._refresh(s, exact, n)
            s.pending = s.drafts[keep:accepted] + ([] if bonus is None else [bonus])
        else:
            s.pending = s.pending + new
        s.seq_len += len(new)
        s.drafts, s.q = [], []

    @staticmethod
    def _refresh(s: DraftSession, exact: KVSpan, n: int) -> None:
        """Overwrite the KV of the round's first `n` fed tokens with the exact KV
        (`Verifier.take_exact`: k, v [layers, Hkv, T, D] from sequence position `exact.start`);
        a span that does not cover them is ignored (refreshing only raises τ)."""
        p0 = s.seq_len - len(s.pending)
        lo = p0 - exact.start
        if n <= 0 or lo < 0 or lo + n > exact.k.shape[2]:
            return
        s.cache.k[:, :, s.len_before:s.len_before + n] = exact.k[:, :, lo:lo + n]
        s.cache.v[:, :, s.len_before:s.len_before + n] = exact.v[:, :, lo:lo + n]

    def release(self, rid: str) -> None:
        self.sessions.pop(rid, None)
        self.ledger.refund(rid)
