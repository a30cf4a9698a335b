"""Logits processing: how the model's logits at one position become the token chosen there,
as pure functions (OpenAI / vLLM semantics).

Words, defined once:
- raw logits: the model's output at a position, before anything here.
- generated tokens: the tokens a request has emitted after its prompt (verified ones).
- context of a row: what the penalties read at a position: the prompt, the generated tokens,
  and the drafts before the position. Row i of a verify pass of [x_0, d_1..d_k] and the
  drafter's step for d_{i+1} have the same context: prompt + generated + d_1..d_i.
- processed logits: raw logits + logit_bias (by token id), then the penalties, in vLLM's
  order: repetition (HF: a logit l of a token in the prompt or the generated tokens becomes
  l / r if l > 0, else l * r), frequency (minus f x the token's count in the generated
  tokens), presence (minus p if the token was generated). Greedy is their argmax.
- target distribution: softmax(processed logits / temperature), then min_p (drop tokens
  under min_p x the largest probability), top_k (keep the k largest logits, ties kept),
  top_p (keep the most likely tokens whose mass reaches top_p), renormalised. A filter
  never drops the most likely token, so greedy (temperature 0) ignores the filters.
- grammar mask: with a grammar (`Processing.grammar`, structured output), the tokens it allows
  at the row (`vericache.spec.grammar`); `constrain` sets the processed logits of the others
  to -inf, last, so greedy and the target distribution only ever choose allowed tokens.

The drafter (its q) and the verifier (its p) process each row with its own context, so the
speculative accept rule (`vericache.spec.accept`, itself unchanged) emits tokens distributed
exactly as the target distribution of plain decoding with the same processing, and greedy
acceptance emits plain greedy decoding of the processed logits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from vericache.errors import InvalidArgument
from vericache.spec import grammar as grammars

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
PENALTY_LIMIT = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]
REPETITION_LIMITS = (1e-3, 1e3)  # repetition_penalty's range (logits / it stay finite in fp32)


@dataclass(frozen=True)
class Processing:
    """A request's processing parameters; the defaults process nothing."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    grammar: str = ""  # "": none; else a `vericache.spec.grammar.GrammarSpec` source

    def __post_init__(self):
        def bad(name: str, rule: str):
            raise InvalidArgument(f"{name} must be {rule} (got {getattr(self, name)!r})", name)

        for n in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty"):
            if not math.isfinite(float(getattr(self, n))):
                bad(n, "finite")
        if self.temperature < 0:
            bad("temperature", ">= 0")
        if self.top_k < 0:
            bad("top_k", ">= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        for n in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, n) <= PENALTY_LIMIT:
                bad(n, f"in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]")
        if not REPETITION_LIMITS[0] <= self.repetition_penalty <= REPETITION_LIMITS[1]:
            # logits divided by a tinier one overflow fp32 (5e-324 made them inf, then nan)
            bad("repetition_penalty", f"in [{REPETITION_LIMITS[0]:g}, {REPETITION_LIMITS[1]:g}] (1: off)")
        for tok, b in self.logit_bias.items():
            if int(tok) < 0 or not (math.isfinite(b) and abs(b) <= LOGIT_BIAS_LIMIT):
                raise InvalidArgument(f"logit_bias maps token ids >= 0 to values in "
                                      f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}] "
                                      f"(got {tok!r}: {b!r})", "logit_bias")
        if self.grammar:
            grammars.parse(self.grammar)  # an unknown or unsupported grammar fails here, named

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether the processed logits differ from the raw ones (bias or a penalty)."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or \
            self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    def check_vocab(self, vocab_size: int) -> None:
        """logit_bias names token ids of the model."""
        if self.logit_bias and max(int(t) for t in self.logit_bias) >= vocab_size:
            raise InvalidArgument(f"logit_bias names a token id outside [0, {vocab_size})",
                                  "logit_bias")


GREEDY = Processing()
MIN_TEMPERATURE = 1e-6  # sampling below it samples at it (one-hot but for near-ties)


class TokenHistory:
    """What the penalties read of a request's tokens: which tokens its prompt holds and how
    often each generated token occurs. `extend` with each verified token, in order."""

    def __init__(self, prompt: Sequence[int], vocab_size: int, processing: Processing):
        self.vocab = vocab_size
        self.counts = torch.zeros(vocab_size)  # [V] generated tokens' counts
        self.prompt_mask = None  # [V] bool: in the prompt (only the repetition penalty reads it)
        if processing.repetition_penalty != 1 and len(prompt):
            self.prompt_mask = torch.bincount(torch.tensor(list(prompt)), minlength=vocab_size) > 0

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.counts[t] += 1

    def counts_after(self, drafts: Sequence[int]) -> torch.Tensor:
        """[V]: the generated tokens' counts and all of `drafts`."""
        out = self.counts.clone()
        for d in drafts:
            out[d] += 1
        return out

    def row_counts(self, drafts: Sequence[int]) -> torch.Tensor:
        """[len(drafts) + 1, V]: row i counts the generated tokens and drafts d_1..d_i."""
        rows = self.counts.expand(len(drafts) + 1, self.vocab).clone()
        for i, d in enumerate(drafts):
            rows[i + 1:, d] += 1
        return rows


def penalize(logits: torch.Tensor, p: Processing, counts: torch.Tensor,
             prompt_mask: torch.Tensor | None) -> torch.Tensor:
    """Processed logits [R, V] from raw logits [R, V], each row's generated-token counts
    [R, V] and the prompt's tokens [V] (see the module docstring). The counts may live on
    the host; the result is on the logits' device."""
    x = logits.float().clone()
    dev = x.device
    if p.logit_bias:
        ids = torch.tensor([int(t) for t in p.logit_bias], device=dev)
        x[:, ids] += torch.tensor([float(b) for b in p.logit_bias.values()], device=dev)
    counts = counts.to(dev)
    generated = counts > 0
    if p.repetition_penalty != 1:
        seen = generated if prompt_mask is None else generated | prompt_mask.to(dev)
        r = p.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if p.frequency_penalty:
        x = x - p.frequency_penalty * counts
    if p.presence_penalty:
        x = x - p.presence_penalty * generated.float()
    return x


def target(logits: torch.Tensor, p: Processing) -> torch.Tensor:
    """The target distribution [R, V] from processed logits [R, V] (temperature > 0)."""
    x = logits.float()
    # finite for any temperature: the max goes first, and fp32 cannot divide by less than
    # MIN_TEMPERATURE (a smaller one would round to 0: 0 / 0 = nan)
    t = max(p.temperature, MIN_TEMPERATURE)
    x = (x - x.max(dim=-1, keepdim=True).values) / t
    if p.min_p > 0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < p.min_p * probs.max(dim=-1, keepdim=True).values, -math.inf)
    if 0 < p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if p.top_p < 1:
        srt, idx = torch.sort(x, dim=-1)  # ascending
        below = torch.softmax(srt, dim=-1).cumsum(dim=-1) <= 1 - p.top_p
        below[:, -1] = False  # the most likely token always stays
        x = x.masked_fill(torch.zeros_like(below).scatter(-1, idx, below), -math.inf)
    return torch.softmax(x, dim=-1)


def constrain(x: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Processed logits [R, V] under a grammar mask (allowed [R, V] bool; None: no grammar)."""
    if allowed is None:
        return x
    return x.masked_fill(~allowed.to(x.device), -math.inf)


def process(logits: torch.Tensor, p: Processing, history: TokenHistory | None,
            drafts: Sequence[int] = (), allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Processed logits of the raw logits [len(drafts) + 1, V] of a verify pass of
    [x_0, d_1..d_k]: row i's context holds the generated tokens and d_1..d_i; `allowed`: the
    rows' grammar masks [k + 1, V] (`GrammarState.row_masks`)."""
    if not p.penalized or history is None:
        return constrain(logits.float(), allowed)
    return constrain(penalize(logits, p, history.row_counts(drafts), history.prompt_mask), allowed)


def choose(logits: torch.Tensor, p: Processing, history: TokenHistory | None,
           drafts: Sequence[int], gen: torch.Generator,
           allowed: torch.Tensor | None = None) -> tuple[int, torch.Tensor | None]:
    """One position's token from its raw logits [V], its context holding every draft in
    `drafts` (and `allowed`: its grammar mask [1, V]): the argmax of the processed logits
    (greedy), or a sample of the target distribution, returned with that distribution."""
    x = logits[None].float()
    if p.penalized and history is not None:
        x = penalize(x, p, history.counts_after(drafts)[None], history.prompt_mask)
    x = constrain(x, allowed)
    if p.greedy:
        return int(torch.argmax(x[0])), None
    probs = target(x, p)[0].cpu()  # (drawn on the host: the request's generator lives there)
    return int(torch.multinomial(probs, 1, generator=gen)), probs
