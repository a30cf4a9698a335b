"""Grammar-constrained decoding (structured output) under speculation, with xgrammar.

Words (besides those of `vericache.spec.processors` and `vericache.spec.accept`):
- grammar: what a request's output must match, named by its source (`GrammarSpec`, carried
  as text in `Processing.grammar`): any JSON object (`json_object`) or a JSON schema
  (`json_schema`), optionally between a fixed prefix and suffix (a tool call's
  `<tool_call>` wrapper). JSON is compact: `", "` and `": "` separators, no other whitespace.
- matcher: one request's position in its grammar on one side (`GrammarState`): it has taken
  the verified tokens and, on the drafter, this round's drafts after them.
- mask: the tokens the grammar allows at the matcher's position (only end of sequence once
  the grammar is complete). The grammar processor (`processors.constrain`) sets the others'
  processed logits to -inf: greedy takes the argmax of what is left, sampling renormalises.
- Row i of a verify pass of [x_0, d_1..d_k] is masked at the position after d_1..d_i
  (`GrammarState.row_masks`); the drafter's step for d_{i+1} is masked at the same position.
  Both sides constrain the same target, so greedy acceptance emits constrained full greedy
  decoding, and speculative sampling samples the constrained target.
- rollback: drafts the verifier rejected leave the drafter's matcher (`GrammarState.rollback`),
  so a matcher never holds a token that is not verified or a live draft.

Why xgrammar (benchmarks/grammar.py measures both engines on the model's tokenizer): its
mask costs ~16 us a token against llguidance's ~110 us (p99 0.2 ms against 2.5 ms), and a
mask is computed per draft step and per verify row; its compile (~30 ms a schema against
~1 ms) happens once a request, and compiled grammars are cached by source.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vericache.errors import InvalidArgument

KINDS = ("json_object", "json_schema")
MAX_SOURCE_CHARS = 1 << 20  # a grammar's source text, at most
SEPARATORS = (", ", ": ")  # the JSON the grammar allows: compact, one space after , and :


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar by its source: `kind` (KINDS); `schema`: the JSON schema's text (json_schema);
    `prefix` and `suffix`: fixed text before and after the JSON."""

    kind: str
    schema: str = ""
    prefix: str = ""
    suffix: str = ""

    def source(self) -> str:
        """The canonical text that names this grammar (what travels in `Processing.grammar`)."""
        return json.dumps({"type": self.kind, "schema": self.schema, "prefix": self.prefix,
                           "suffix": self.suffix}, sort_keys=True)

    @classmethod
    def json_schema(cls, schema: dict | str, prefix: str = "", suffix: str = "") -> "GrammarSpec":
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text, prefix, suffix)

    def grammar(self):
        """The tokenizer-free xgrammar Grammar; an unsupported schema is InvalidArgument."""
        import xgrammar as xgr

        schema = self.schema if self.kind == "json_schema" else '{"type": "object"}'
        try:
            parts = [xgr.Grammar.from_json_schema(schema, any_whitespace=False,
                                                  separators=SEPARATORS)]
            if self.prefix:
                parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(self.prefix)}"))
            if self.suffix:
                parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(self.suffix)}"))
        except Exception as e:  # noqa: BLE001 -- xgrammar reports bad input as RuntimeError
            why = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", (str(e).strip() or "?").splitlines()[0])
            raise InvalidArgument(f"unsupported JSON schema: {why[:300]}",
                                  "response_format") from None
        return xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0]


@functools.lru_cache(maxsize=256)
def parse(source: str) -> GrammarSpec:
    """The GrammarSpec a source names, checked (the schema is converted once; InvalidArgument
    names `response_format` when it cannot be)."""
    if len(source) > MAX_SOURCE_CHARS:
        raise InvalidArgument(f"the grammar has {len(source)} characters, more than "
                              f"{MAX_SOURCE_CHARS}", "response_format")
    try:
        d = json.loads(source)
        spec = GrammarSpec(d["type"], d.get("schema", ""), d.get("prefix", ""), d.get("suffix", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise InvalidArgument("a grammar is GrammarSpec.source() text", "response_format") from None
    if spec.kind not in KINDS or not all(isinstance(x, str) for x in
                                         (spec.schema, spec.prefix, spec.suffix)):
        raise InvalidArgument(f"unknown grammar type {spec.kind!r}; valid: {', '.join(KINDS)}",
                              "response_format")
    spec.grammar()
    return spec


def allowed_from_bitmask(bitmask: torch.Tensor, vocab: int, eos: int) -> torch.Tensor:
    """[R, V] bool from xgrammar's int32 bitmask [R, ceil(V / 32)] (bit j of word w: token
    32 w + j). A row that allows nothing (a schema no value satisfies) allows `eos`: the
    answer ends there."""
    bits = (bitmask[..., None] >> torch.arange(32, dtype=torch.int32)) & 1  # [R, W, 32]
    out = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    out[~out.any(dim=-1), eos] = True
    return out


class Grammars:
    """Compiles grammars for one tokenizer (each source once, cached) and makes matchers; the
    tokenizer's grammar tables are built on first use (~0.3 s). `seconds`: time spent in
    masks, advances and rollbacks of every matcher made here (what the grammar costs);
    `compile_s`: time spent compiling."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer, self.vocab, self.eos = tokenizer, vocab_size, list(eos_token_ids)
        self._compiler = None
        self.seconds = 0.0
        self.masks = 0  # masks computed
        self.compile_s = 0.0

    @classmethod
    def of(cls, lm) -> "Grammars":
        """For a loaded model (`.tokenizer`, `.vocab_size`, `.eos_token_ids`)."""
        return cls(lm.tokenizer, lm.vocab_size, lm.eos_token_ids)

    def compile(self, source: str):
        import xgrammar as xgr

        t = time.perf_counter()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab,
                                                      stop_token_ids=self.eos)
            self._compiler = xgr.GrammarCompiler(info)
        out = self._compiler.compile_grammar(parse(source).grammar())
        self.compile_s += time.perf_counter() - t
        return out

    def state(self, source: str) -> "GrammarState":
        """A matcher at the start of the grammar `source` names."""
        return GrammarState(self, self.compile(source))


class GrammarState:
    """A request's matcher on one side (see the module docstring)."""

    def __init__(self, owner: Grammars, compiled):
        import xgrammar as xgr

        self.owner = owner
        self.matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, owner.vocab)

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.matcher.is_terminated():  # after end of sequence: no token follows; allow all
            bitmask[row] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        self.owner.masks += 1

    def allowed(self) -> torch.Tensor:
        """[1, V] bool: the mask at the matcher's position."""
        t = time.perf_counter()
        self._fill(self._bitmask, 0)
        out = allowed_from_bitmask(self._bitmask, self.owner.vocab, self.owner.eos[0])
        self.owner.seconds += time.perf_counter() - t
        return out

    def accept(self, tokens: Sequence[int]) -> int:
        """Take `tokens` in order; returns how many the grammar allowed (it stops at the first
        it does not)."""
        t = time.perf_counter()
        n = 0
        for tok in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(tok)):
                break
            n += 1
        self.owner.seconds += time.perf_counter() - t
        return n

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens taken."""
        if n > 0:
            t = time.perf_counter()
            self.matcher.rollback(n)
            self.owner.seconds += time.perf_counter() - t

    def row_masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """[len(drafts) + 1, V] bool: row i masked at the position after d_1..d_i. The
        matcher ends where it started. Rows past a draft the grammar does not allow copy the
        row before (they are never reached: that draft is masked out, so rejected)."""
        import xgrammar as xgr

        t = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, self.owner.vocab)
        taken = 0
        for i in range(len(drafts) + 1):
            if i == taken:
                self._fill(bitmask, i)
            else:
                bitmask[i] = bitmask[i - 1]
            if i < len(drafts) and i == taken and not self.matcher.is_terminated() \
                    and self.matcher.accept_token(int(drafts[i])):
                taken += 1
        self.matcher.rollback(taken)
        out = allowed_from_bitmask(bitmask, self.owner.vocab, self.owner.eos[0])
        self.owner.seconds += time.perf_counter() - t
        return out


def start_matcher(grammars: Grammars | None, source: str,
                  verified: Sequence[int] = ()) -> GrammarState | None:
    """A request's matcher on a side with `grammars` (None when `source` is ""), having taken
    its `verified` tokens."""
    if not source:
        return None
    if grammars is None:
        raise InvalidArgument("this server does not constrain output to grammars",
                              "response_format")
    state = grammars.state(source)
    if state.accept(verified) != len(verified):
        raise InvalidArgument("the verified tokens do not match the request's grammar",
                              "response_format")
    return state
