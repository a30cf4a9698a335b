"""Structured output: the grammar's masks on both sides of a round keep the output token for
token the constrained full greedy output, and rejected drafts roll the matchers back. (The
official openai client with response_format and tools: tests/test_gateway.py against
`vericache serve`, tests/test_services_e2e.py through the four services.)"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from conftest import chat_ids
from vericache.engine.generation import Generation, GenParams
from vericache.engine.lanes import run_requests
from vericache.engine.rounds import LocalBackends
from vericache.errors import InvalidArgument
from vericache.spec.grammar import Grammars, GrammarSpec, parse

N = 32
# short answers: a person (14 tokens) under the schema, {"ok": true} as any object
ASK = {"json_schema": "Give a person's name and age as a JSON object.",
       "json_object": 'Return {"ok": true} as JSON.'}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
GRAMMARS = {"json_schema": GrammarSpec.json_schema(PERSON).source(),
            "json_object": GrammarSpec("json_object").source()}


# the vericache runs, batched: (grammar, k, extra params); ROLLBACK drafts from a KV that
# drops most of the prompt (streamingllm at ratio 8 over 16-token chunks), so drafts are rejected
ROLLBACK = 1
RUNS = [("json_schema", 4, {}),
        ("json_schema", 16, {"compressor": "streamingllm", "ratio": 8, "chunk_size": 16}),
        ("json_object", 4, {}), ("json_object", 16, {})]


@pytest.fixture(scope="module")
def ids(lm) -> dict[str, list[int]]:
    return {name: chat_ids(lm, q) for name, q in ASK.items()}


def _batch(lm, gens: list[Generation], **kw) -> None:
    """Run `gens` to the end as one batch of the serving engine's executor (one torch
    thread: on a small shared CPU, OpenMP threads that wait on each other are slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_requests(LocalBackends(lm), gens, **kw)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def full(lm, ids) -> dict[str, Generation]:
    """Constrained full greedy decoding (the reference), per grammar."""
    gens = {name: Generation(lm, ids[name], GenParams(mode="full", max_tokens=N, grammar=src))
            for name, src in GRAMMARS.items()}
    _batch(lm, list(gens.values()))
    return gens


@pytest.fixture(scope="module")
def constrained(lm, ids) -> list[Generation]:
    """The RUNS in vericache mode, k fixed, in one batch; staggered lanes with draft-ahead,
    so ahead drafts are taken by the drafter's matcher and rolled back too."""
    gens = [Generation(lm, ids[name], GenParams(mode="vericache", max_tokens=N, draft_len=k,
                                                adaptive=False, grammar=GRAMMARS[name], **kw))
            for name, k, kw in RUNS]
    _batch(lm, gens, schedule="staggered", draft_ahead=True)
    return gens


def test_matcher_rows_and_rollback(lm):
    """row_masks masks row i after d_1..d_i and leaves the matcher where it was; rollback
    forgets tokens taken; a token the grammar refuses is not taken."""
    state = Grammars.of(lm).state(GRAMMARS["json_schema"])
    toks = lm.tokenizer('{"name": "Al", "age": 3}')["input_ids"]
    rows = state.row_masks(toks[:3])
    assert rows.shape == (4, lm.vocab_size)
    for i, t in enumerate(toks[:3]):
        assert rows[i, t]  # each draft allowed at its row
    assert not rows[0, toks[1]] or toks[0] == toks[1]  # row 0 is the start: '{' first
    assert torch.equal(state.allowed()[0], rows[0])  # the matcher is back at the start
    assert state.accept(toks) == len(toks)
    allowed = state.allowed()[0]
    assert allowed.sum() == 1 and allowed[lm.eos_token_ids[0]]  # complete: only EOS
    state.rollback(len(toks) - 3)
    assert torch.equal(state.allowed()[0], rows[3])
    assert state.accept(lm.tokenizer("]")["input_ids"]) == 0


def test_bad_grammars_are_named():
    with pytest.raises(InvalidArgument) as e:
        parse(GrammarSpec.json_schema({"type": "objekt"}).source())
    assert e.value.param == "response_format"
    with pytest.raises(InvalidArgument):
        GenParams(grammar="not a grammar")


@pytest.mark.parametrize("i", range(len(RUNS)), ids=[f"{n}-k{k}" for n, k, _ in RUNS])
def test_constrained_vericache_equals_constrained_full(full, constrained, i):
    name, k, _ = RUNS[i]
    ref, got = full[name], constrained[i]
    assert got.output_ids == ref.output_ids and ref.stop.finish_reason == "stop"
    value = json.loads(got.text.text)
    assert isinstance(value, dict)
    if name == "json_schema":
        jsonschema.validate(value, PERSON)
    assert got.stats.tokens_per_round > 1


def test_rejected_drafts_roll_back_and_stay_exact(full, constrained):
    """The drafter that drops most of the prompt (ROLLBACK) has drafts rejected under the
    grammar; the matchers roll back and the output is still constrained full greedy's."""
    got = constrained[ROLLBACK]
    s = got.stats
    print(f"rollback case: acceptance {s.acceptance_rate:.3f}, tau {s.tokens_per_round:.2f}")
    assert s.accepted < s.drafted  # drafts were rejected
    assert got.output_ids == full[RUNS[ROLLBACK][0]].output_ids
