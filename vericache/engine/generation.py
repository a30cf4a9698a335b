"""One request's generation as a state machine, in three modes.

- full: plain full-KV decoding, one token per forward step (the reference).
- lossy: decoding over the compressed cache only (the baseline that drifts).
- vericache: rounds of draft (k steps over the compressed cache) and verify (one pass of
  k + 1 tokens over the full KV); see `vericache.spec.accept` for the words.

The state machine hands out forward items and takes their logits back, so one driver can
batch many requests' items into one pass (`next_draft_item`/`apply_draft`,
`verify_item`/`apply_verify`). Every token it emits has been chosen from full-KV logits.

Caches and pending tokens: the full cache holds every verified token but the last (x_0,
pending); the drafter's cache holds the compressed prompt, the exact tail and the verified
tokens it has fed, and its pending list holds the verified tokens it has not fed yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vericache.compress import make_compressor
from vericache.engine.prefill import build_draft_cache, compress_prompt, prefill
from vericache.engine.stop import IncrementalText, StopChecker
from vericache.errors import ContextTooLong, InvalidArgument
from vericache.model.loader import LoadedModel
from vericache.model.runner import SeqBatchItem
from vericache.spec.accept import greedy_accept, speculative_accept
from vericache.spec.draftlen import DraftLength

MODES = ("full", "lossy", "vericache")


@dataclass
class GenParams:
    max_tokens: int = 256
    temperature: float = 0.0
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

    def __post_init__(self):
        if self.mode not in MODES:
            raise InvalidArgument(f"unknown mode {self.mode!r}; valid: {', '.join(MODES)}", "mode")
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1 (got {self.max_tokens})", "max_tokens")
        if self.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0 (got {self.temperature})", "temperature")
        if self.draft_len < 1:
            raise InvalidArgument(f"draft_len must be >= 1 (got {self.draft_len})", "draft_len")
        if self.chunk_size < 1:
            raise InvalidArgument("chunk_size must be >= 1", "chunk_size")


@dataclass
class GenStats:
    prompt_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    round_emitted: list[int] = field(default_factory=list)  # tokens emitted per round (tau)
    draft_steps: int = 0
    verify_tokens: int = 0
    prefill_s: float = 0.0
    compress_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    full_kv_bytes: int = 0
    draft_kv_bytes: int = 0

    @property
    def tokens_per_round(self) -> float:
        return sum(self.round_emitted) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Generation:
    def __init__(self, lm: LoadedModel, prompt_ids: list[int], params: GenParams):
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty", "prompt")
        need = len(prompt_ids) + params.max_tokens + 1
        if need > lm.max_context:
            raise ContextTooLong(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                                 f"exceeds the model's {lm.max_context}-token context", "max_tokens")
        self.lm, self.runner, self.params = lm, lm.runner, params
        self.prompt = list(prompt_ids)
        self.compressor = None if params.mode == "full" else make_compressor(params.compressor, params.ratio)
        self.text = IncrementalText(lm.tokenizer, params.stop)
        self.stop = StopChecker(params.max_tokens, lm.eos_token_ids, self.text, params.ignore_eos)
        self.draftlen = DraftLength(params.draft_len, adaptive=params.adaptive)
        self.gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
        self.stats = GenStats(prompt_tokens=len(prompt_ids))
        self.full = None
        self.draft = None
        self.full_pending: list[int] = []
        self.draft_pending: list[int] = []
        self._drafts: list[int] = []
        self._q: list[torch.Tensor] = []
        self._k_round = 0
        self._draft_len_before = 0

    # ---- common --------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.stop.finish_reason is not None

    @property
    def output_ids(self) -> list[int]:
        return self.stop.tokens

    def _choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """Greedy argmax, or a sample at the temperature (returns its distribution too)."""
        if self.params.temperature == 0:
            return int(torch.argmax(logits)), None
        probs = torch.softmax(logits.float() / self.params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.gen)), probs

    def _emit(self, tokens: list[int]) -> list[int]:
        """Hand verified tokens to the stop checker; returns those that are part of the output."""
        out = []
        for t in tokens:
            if self.finished:
                break
            n = len(self.stop.tokens)
            self.stop.add(t)
            if len(self.stop.tokens) > n:
                out.append(t)
        return out

    def start(self) -> list[int]:
        """Prefill (and compress); emits the first token, chosen from the full-KV logits."""
        p, room = self.params, self.params.max_tokens + self.params.draft_len + 2
        t0 = time.perf_counter()
        window = self.compressor.observation_window if self.compressor else 0
        pre = prefill(self.runner, self.prompt, room, p.chunk_size, window)
        t1 = time.perf_counter()
        self.full = pre.cache
        if self.compressor is not None:
            chunks = compress_prompt(self.compressor, pre, len(self.prompt), p.chunk_size)
            self.draft = build_draft_cache(self.compressor, chunks, self.full, len(self.prompt),
                                           p.chunk_size, room)
            self.stats.draft_kv_bytes = (sum(c.nbytes() for c in chunks)
                                         + (len(self.prompt) - len(chunks) * p.chunk_size)
                                         * self.runner.kv_bytes_per_token())
            if p.mode == "lossy":
                self.full = None  # the lossy baseline never touches the full KV again
        self.stats.full_kv_bytes = len(self.prompt) * self.runner.kv_bytes_per_token()
        self.stats.prefill_s, self.stats.compress_s = t1 - t0, time.perf_counter() - t1
        first, _ = self._choose(pre.logits)
        self.full_pending = [first]
        self.draft_pending = [first]
        return self._emit([first])

    # ---- drafting ------------------------------------------------------------------
    def begin_round(self) -> None:
        self._drafts, self._q = [], []
        if self.params.mode == "full":
            self._k_round = 0
        elif self.params.mode == "lossy":
            self._k_round = 1
        else:
            self._k_round = max(0, min(self.draftlen.k, self.stop.remaining - 1))
        self._draft_len_before = self.draft.length if self.draft is not None else 0
        self._pos_before = self._verified_len() - len(self.draft_pending)

    def next_draft_item(self) -> SeqBatchItem | None:
        """The drafter's next step for this round, or None when the round's drafts are done."""
        d = self._drafts
        if len(d) >= self._k_round or (d and d[-1] in self.lm.eos_token_ids):
            return None
        base = self._verified_len()
        if not d:
            toks = self.draft_pending
            pos0 = base - len(toks)
        else:
            toks = [d[-1]]
            pos0 = base + len(d) - 1
        return SeqBatchItem(torch.tensor(toks), torch.arange(pos0, pos0 + len(toks)), self.draft)

    def apply_draft(self, logits: torch.Tensor) -> list[int]:
        """Take the drafter's logits ([1, V]); returns tokens emitted (lossy mode only)."""
        tok, q = self._choose(logits[-1])
        self._drafts.append(tok)
        self._q.append(q)
        self.stats.draft_steps += 1
        if self.params.mode != "lossy":
            return []
        self.draft_pending = [tok]
        self.stats.rounds += 1
        self.stats.round_emitted.append(1)
        return self._emit([tok])

    def _verified_len(self) -> int:
        """Tokens of the sequence verified so far (prompt + output, pending included)."""
        return len(self.prompt) + len(self.stop.tokens)

    # ---- verification --------------------------------------------------------------
    def verify_item(self) -> SeqBatchItem:
        toks = self.full_pending + self._drafts
        pos0 = self.full.length
        return SeqBatchItem(torch.tensor(toks), torch.arange(pos0, pos0 + len(toks)), self.full,
                            logits="all")

    def apply_verify(self, logits: torch.Tensor) -> list[int]:
        """Take the verifier's logits ([k + 1, V]): accept, roll back both caches, emit."""
        drafts, k = self._drafts, len(self._drafts)
        if self.params.temperature == 0:
            a, bonus = greedy_accept(drafts, logits.argmax(dim=-1).tolist())
        else:
            p = torch.softmax(logits.float() / self.params.temperature, dim=-1)
            q = torch.stack(self._q) if k else p[:0]
            a, bonus = speculative_accept(drafts, q, p, self.gen)
        self.full.crop(self.full.length - k + a)
        if self.draft is not None:
            if k:
                keep = min(a, k - 1)
                n = len(self.draft_pending) + keep
                self.draft.crop(self._draft_len_before + n)
                if self.params.refresh_draft:
                    # the verify pass computed these tokens' exact KV: the drafter gets it
                    d0, p0 = self._draft_len_before, self._pos_before
                    self.draft.k[:, :, d0:d0 + n] = self.full.k[:, :, p0:p0 + n]
                    self.draft.v[:, :, d0:d0 + n] = self.full.v[:, :, p0:p0 + n]
                self.draft_pending = drafts[keep:a] + [bonus]
            else:
                self.draft_pending = self.draft_pending + [bonus]
        self.full_pending = [bonus]
        self.draftlen.update(k, a)
        s = self.stats
        s.rounds += 1
        s.drafted += k
        s.accepted += a
        s.verify_tokens += k + 1
        emitted = self._emit(drafts[:a] + [bonus])
        s.round_emitted.append(a + 1)
        return emitted

    # ---- results -------------------------------------------------------------------
    def usage(self) -> dict:
        s = self.stats
        return {"prompt_tokens": s.prompt_tokens, "completion_tokens": len(self.stop.tokens),
                "total_tokens": s.prompt_tokens + len(self.stop.tokens), "rounds": s.rounds,
                "tokens_per_round": round(s.tokens_per_round, 3),
                "acceptance_rate": round(s.acceptance_rate, 4)}
