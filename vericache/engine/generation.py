"""One request's bookkeeping (no tensors): parameters, stop rules, draft length, stats.

Modes:
- full: plain full-KV decoding, one token per forward step (the reference).
- lossy: decoding over the compressed cache only (the baseline that drifts).
- vericache: rounds of draft (k steps over the compressed cache) and verify (one pass of
  k + 1 tokens over the full KV); see `vericache.spec.accept` for the words.

The drafter and verifier sides (`vericache.engine.drafter`, `.verifier`) hold the caches;
`vericache.engine.rounds` runs rounds over them, in-process or over gRPC, and feeds the
outcome back here. Every token this object emits was chosen from full-KV logits (except in
lossy mode, the baseline).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from vericache.compress import make_compressor
from vericache.select import make_selection
from vericache.engine.stop import IncrementalText, StopChecker
from vericache.errors import ContextTooLong, InvalidArgument
from vericache.spec.draftlen import DraftLength
from vericache.spec.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from vericache.spec.processors import Processing

MODES = ("full", "lossy", "vericache")
EXACT = ("fast", "bitwise")  # how full-KV passes run: batched, or invariant (Runner.forward)


@dataclass
class GenParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # logits processing (vericache.spec.processors); the defaults are off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: str = ""  # structured output: a vericache.spec.grammar.GrammarSpec source ("": none)
    logprobs: int | None = None  # None: none; n: each token's logprob and its n top alternatives
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    mode: str = "vericache"
    compressor: str = "snapkv"
    ratio: float | None = None
    draft_len: int = 16
    adaptive: bool = True
    chunk_size: int = 256
    refresh_draft: bool = True  # overwrite the drafter's KV of accepted tokens with the exact KV
    selection: str = "question"  # how the drafter's set moves (vericache.select): static|question|verify
    namespace: str = ""  # tenant: prefix-cache keys are namespaced by it
    exact: str = "fast"  # bitwise: full-KV passes invariant: verify = steps, bit for bit (EXACT)
    sampling: Processing = field(init=False, repr=False, compare=False)  # from the fields above

    @property
    def extra_capacity(self) -> int:
        """Cache slots a request of these settings reserves past its prompt."""
        return self.max_tokens + self.draft_len + 2

    def __post_init__(self):
        if self.mode not in MODES:
            raise InvalidArgument(f"unknown mode {self.mode!r}; valid: {', '.join(MODES)}", "mode")
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1 (got {self.max_tokens})", "max_tokens")
        if not 0 <= self.temperature < float("inf"):
            raise InvalidArgument(f"temperature must be finite and >= 0 (got {self.temperature})",
                                  "temperature")
        # the logits processing these fields ask for; one out of range fails here, named
        self.sampling = Processing(self.temperature, self.top_k, self.top_p, self.min_p,
                                   self.presence_penalty, self.frequency_penalty,
                                   self.repetition_penalty,
                                   {int(t): float(b) for t, b in self.logit_bias.items()},
                                   self.grammar)
        if self.logprobs is not None:
            if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidArgument(f"logprobs asks for 0..{MAX_TOP_LOGPROBS} alternatives "
                                      f"(got {self.logprobs})", "logprobs")
            if self.mode == "lossy":
                raise InvalidArgument("logprobs come from full-KV logits; lossy mode has none",
                                      "logprobs")
        if self.exact not in EXACT:
            raise InvalidArgument(f"unknown exact {self.exact!r}; valid: {', '.join(EXACT)}", "exact")
        if self.draft_len < 1:
            raise InvalidArgument(f"draft_len must be >= 1 (got {self.draft_len})", "draft_len")
        if self.chunk_size < 1:
            raise InvalidArgument("chunk_size must be >= 1", "chunk_size")
        make_selection(self.selection)  # unknown names and bad parameters fail here


@dataclass
class GenStats:
    prompt_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    round_emitted: list[int] = field(default_factory=list)  # tokens emitted per round (tau)
    k_hist: dict[int, int] = field(default_factory=dict)  # rounds by drafts verified (0: plain step)
    draft_steps: int = 0
    verify_tokens: int = 0
    prefill_s: float = 0.0
    compress_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    full_kv_bytes: int = 0
    draft_kv_bytes: int = 0
    cached_tokens: int = 0  # prompt tokens whose full KV came from the store
    store_hits: int = 0
    store_bytes_read: int = 0
    store_bytes_written: int = 0
    store_s: float = 0.0
    select_s: float = 0.0  # verifier time spent choosing the drafter's set
    select_moves: int = 0  # deltas applied to the drafter's set
    select_moved_tokens: int = 0  # tokens moved in, over layers and KV heads
    select_delta_bytes: int = 0  # bytes of those deltas (K/V + slots + positions)
    held_steps: int = 0  # plain steps on a verification's loaded full KV (`on_held_step`)
    drafter_lost: str = ""  # why the drafter stopped serving a vericache request (see lose_drafter)

    def record_selection(self, seconds: float, moves: int, moved_tokens: int, delta_bytes: int) -> None:
        """Take a request's selection totals so far (from the verifier, here or a service)."""
        self.select_s, self.select_moves = seconds, moves
        self.select_moved_tokens, self.select_delta_bytes = moved_tokens, delta_bytes

    def record_transfer(self, cached_tokens: int, t) -> None:
        """Add a store transfer (vericache.store.prefix.TransferStats)."""
        self.cached_tokens += cached_tokens
        self.store_hits += t.hits
        self.store_bytes_read += t.bytes_read
        self.store_bytes_written += t.bytes_written
        self.store_s += t.seconds

    @property
    def tokens_per_round(self) -> float:
        return sum(self.round_emitted) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


_ids = itertools.count(1)
# How an output token came (the words of vericache.spec.accept), as streams report it:
TOKEN_KINDS = {
    "prefill": "the first token, from the prefill's full-KV logits",
    "draft": "a draft token the verifier accepted",
    "bonus": "the verifier's own token after a round's drafts (all accepted or the first "
             "rejected)",
    "plain": "a plain full-KV decode step: a round without drafts (full mode, or k = 0)",
    "lossy": "the lossy baseline's unverified draft token",
}


class Generation:
    def __init__(self, lm, prompt_ids: list[int], params: GenParams, request_id: str | None = None):
        """`lm` needs .tokenizer, .eos_token_ids and .max_context (a LoadedModel does)."""
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty", "prompt")
        need = len(prompt_ids) + params.max_tokens + 1
        if need > lm.max_context:
            raise ContextTooLong(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                                 f"exceeds the model's {lm.max_context}-token context", "max_tokens")
        self.rid = request_id or f"gen-{next(_ids)}"
        self.params = params
        self.sampling = params.sampling
        self.sampling.check_vocab(lm.vocab_size)
        self.prompt = list(prompt_ids)
        self.compressor = None if params.mode == "full" else make_compressor(params.compressor, params.ratio)
        self.selection = None if params.mode == "full" else make_selection(params.selection)
        self.text = IncrementalText(lm.tokenizer, params.stop)
        self.stop = StopChecker(params.max_tokens, lm.eos_token_ids, self.text, params.ignore_eos)
        self.draftlen = DraftLength(params.draft_len, adaptive=params.adaptive)
        self.stats = GenStats(prompt_tokens=len(prompt_ids))
        self.round_draft_s = 0.0  # the last draft phase's seconds (for the cost model's round time)
        # a round has asked for its drafts: its drafter's part is prepared and loading (the
        # cost model starts a drafter only where drafting clearly pays: START_MARGIN)
        self.drafter_started = False
        # one per output token (params.logprobs set), from full-KV logits
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.emitted_kinds: list[str] = []  # how each token of the last emit came (TOKEN_KINDS)
        # the scheduler's group (set at admission; 0 outside an engine): its caches sit in its
        # group's pools (`Runner.new_cache`), so a group's passes copy no cache to batch them
        self.group = 0

    @property
    def finished(self) -> bool:
        return self.stop.finish_reason is not None

    @property
    def output_ids(self) -> list[int]:
        return self.stop.tokens

    @property
    def refreshes_draft(self) -> bool:
        """Whether each verification's exact KV overwrites the drafter's KV of the verified
        tokens (`Verifier.take_exact` -> `Drafter.commit(exact=...)`)."""
        return self.params.refresh_draft and self.params.mode == "vericache"

    @property
    def seed(self) -> int:
        return self.params.seed if self.params.seed is not None else 0

    @property
    def extra_capacity(self) -> int:
        """Cache slots to reserve past the prompt."""
        return self.params.extra_capacity

    def _emit(self, tokens: list[int], kinds: list[str],
              logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Hand verified tokens (and their logprobs, when asked for) to the stop checker;
        returns those that are part of the output (a prefix of `tokens`) and keeps how each
        came in `emitted_kinds` (see TOKEN_KINDS)."""
        out = []
        for i, t in enumerate(tokens):
            if self.finished:
                break
            n = len(self.stop.tokens)
            self.stop.add(t)
            if len(self.stop.tokens) > n:
                out.append(t)
                if self.logprobs is not None:
                    if logprobs is None:
                        raise RuntimeError(f"{self.rid}: logprobs were asked for but not returned")
                    self.logprobs.append(logprobs[i])
        self.emitted_kinds = kinds[:len(out)]
        return out

    def on_first(self, token: int, logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """The first token, chosen from the prefill's full-KV logits."""
        return self._emit([token], ["prefill"], logprobs)

    def k_cap(self) -> int:
        """The most drafts this round can use: k_max, less near max_tokens."""
        return max(0, min(self.draftlen.k_max, self.stop.remaining - 1))

    @property
    def context(self) -> int:
        """Tokens of the sequence so far (prompt and output)."""
        return len(self.prompt) + len(self.stop.tokens)

    def k_for_round(self) -> int:
        """Drafts to ask for this round (0 in full mode, or when the cost model chose a plain
        decode step)."""
        if self.params.mode == "full":
            return 0
        if self.params.mode == "lossy":
            return 1
        return max(0, min(self.draftlen.k, self.stop.remaining - 1))

    def k_ahead(self, drafted: int) -> int:
        """Drafts to ask for past this round's `drafted` tokens (draft ahead): next round's k
        if this round's drafts and bonus are all accepted."""
        if self.params.mode != "vericache":
            return 0
        return max(0, min(self.draftlen.k, self.stop.remaining - drafted - 2))

    def on_round(self, drafted: list[int], accepted: int, bonus: int,
                 logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """A verified round: drafts[:accepted] + [bonus] extend the output."""
        s = self.stats
        s.rounds += 1
        s.drafted += len(drafted)
        s.accepted += accepted
        s.verify_tokens += len(drafted) + 1
        s.round_emitted.append(accepted + 1)
        s.k_hist[len(drafted)] = s.k_hist.get(len(drafted), 0) + 1
        self.draftlen.update(len(drafted), accepted)
        return self._emit(list(drafted[:accepted]) + [bonus],
                          ["draft"] * accepted + ["bonus" if drafted else "plain"], logprobs)

    def on_held_step(self, token: int, logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """A plain full-KV decode step on the working copy a verification loaded and held
        (`vericache.engine.verifier.Finish`): not a round (it loaded nothing), so τ and the
        k histogram do not count it; `held_steps` does."""
        self.stats.held_steps += 1
        return self._emit([token], ["plain"], logprobs)

    def lose_drafter(self, reason: str) -> bool:
        """The drafter can no longer serve this request (its service died or restarted, or
        the store evicted a chunk its attach reads). A `vericache` request goes on with plain
        full-KV decode steps, what `full` mode does: the verifier decides every token as
        before, so the output is the same; returns True. A `lossy` request decodes on the
        drafter and cannot: False (the caller fails it)."""
        if self.params.mode != "vericache":
            return False
        self.params = replace(self.params, mode="full")
        self.stats.drafter_lost = reason
        return True

    def on_lossy(self, token: int) -> list[int]:
        """The lossy baseline's token, taken unverified."""
        self.stats.rounds += 1
        self.stats.round_emitted.append(1)
        return self._emit([token], ["lossy"])

    def usage(self) -> dict:
        s = self.stats
        return {"prompt_tokens": s.prompt_tokens, "completion_tokens": len(self.stop.tokens),
                "total_tokens": s.prompt_tokens + len(self.stop.tokens), "rounds": s.rounds,
                "tokens_per_round": round(s.tokens_per_round, 3),
                "acceptance_rate": round(s.acceptance_rate, 4),
                "selection": self.selection.spec if self.selection is not None else None,
                "exact": self.params.exact,
                "selection_moves": s.select_moves,
                "selection_moved_tokens": s.select_moved_tokens,
                "plain_rounds": (s.k_hist.get(0, 0) if self.params.mode == "vericache" or s.drafter_lost
                                 else 0),
                # why a vericache request finished on plain steps without its drafter (None: it did not)
                "drafter_lost": s.drafter_lost or None,
                "held_steps": s.held_steps,
                "draft_len_mean": round(s.drafted / s.rounds, 3) if s.rounds else 0.0}
