"""Protobuf <-> core conversions for the drafter and verifier services, in one place, with
the size limits on every RPC input (token counts, draft lengths, batch sizes, string
lengths): a call over a limit is INVALID_ARGUMENT before any model work or allocation."""

from __future__ import annotations

from vericache.errors import InvalidArgument
from vericache.spec.grammar import MAX_SOURCE_CHARS
from vericache.spec.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from vericache.spec.processors import Processing

MAX_PROMPT_TOKENS = 1 << 20
MAX_DRAFT_TOKENS = 256  # draft tokens per request per round (k)
MAX_PLAIN_TOKENS = 1 << 16  # plain-step tokens one Draft item may carry
MAX_BATCH_ITEMS = 1024  # requests in one Draft or Verify call
MAX_ID_CHARS = 256  # request ids
MAX_NAME_CHARS = 256  # compressor specs, namespaces
MAX_CHUNK_SIZE = 1 << 16


def bounded_str(value: str, param: str, limit: int = MAX_NAME_CHARS,
                allow_empty: bool = True) -> str:
    """`value` unless it is longer than `limit` characters (or empty when not allowed)."""
    if len(value) > limit:
        raise InvalidArgument(f"{param} has {len(value)} characters, more than {limit}", param)
    if not value and not allow_empty:
        raise InvalidArgument(f"{param} is empty", param)
    return value


def request_id(value: str) -> str:
    return bounded_str(value, "request_id", MAX_ID_CHARS, allow_empty=False)


def bounded_int(value: int, param: str, limit: int, low: int = 0) -> int:
    if not low <= value <= limit:
        raise InvalidArgument(f"{param} must lie in [{low}, {limit}] (got {value})", param)
    return value


def batch_items(items, param: str = "items") -> list:
    """The items of a batched call, at most MAX_BATCH_ITEMS, each with a bounded request id."""
    out = list(items)
    bounded_int(len(out), param, MAX_BATCH_ITEMS)
    for it in out:
        request_id(it.request_id)
    return out


def chunk_size(value: int) -> int:
    """0 means the default (256)."""
    return bounded_int(value, "chunk_size", MAX_CHUNK_SIZE) or 256


def token_list(ids, vocab_size: int, param: str = "token_ids", allow_empty: bool = False) -> list[int]:
    out = list(ids)
    if not out and not allow_empty:
        raise InvalidArgument(f"{param} is empty", param)
    if len(out) > MAX_PROMPT_TOKENS:
        raise InvalidArgument(f"{param} has {len(out)} tokens, more than {MAX_PROMPT_TOKENS}", param)
    if out and (min(out) < 0 or max(out) >= vocab_size):
        raise InvalidArgument(f"{param} holds a token id outside [0, {vocab_size})", param)
    return out


def sampling(temperature: float, msg, vocab_size: int) -> Processing:
    """A Prefill's or Attach's logits processing (a `Sampling` message and the temperature);
    a value out of range is INVALID_ARGUMENT naming it."""
    bounded_int(len(msg.logit_bias), "logit_bias", vocab_size)
    p = Processing(temperature, msg.top_k, msg.top_p if msg.HasField("top_p") else 1.0,
                   msg.min_p, msg.presence_penalty, msg.frequency_penalty,
                   msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
                   dict(msg.logit_bias),
                   bounded_str(msg.grammar, "grammar", MAX_SOURCE_CHARS))
    p.check_vocab(vocab_size)
    return p


def top_logprobs(req) -> int | None:
    """A Prefill's top_logprobs: None (no logprobs) or 0..MAX_TOP_LOGPROBS."""
    if not req.HasField("top_logprobs"):
        return None
    return bounded_int(req.top_logprobs, "top_logprobs", MAX_TOP_LOGPROBS)


def logprob_message(pb, lp: TokenLogprob | None):
    """A core TokenLogprob as the `TokenLogprob` message of module `pb` (None: unset)."""
    if lp is None:
        return None
    return pb.TokenLogprob(token=lp.token, logprob=lp.logprob, top_tokens=[t for t, _ in lp.top],
                           top_logprobs=[v for _, v in lp.top])
