"""The in-process driver: runs requests' state machines on the local runner.

`stream()` runs one request and yields events as tokens are verified; `generate()` collects
them. Batched drivers (several requests per pass) build on the same state machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from vericache.engine.generation import Generation, GenParams
from vericache.model.loader import LoadedModel


@dataclass
class GenEvent:
    token_ids: list[int]  # newly verified output tokens
    text: str  # text that became final with them
    finish_reason: str | None = None


@dataclass
class GenResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict
    stats: object = field(repr=False, default=None)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "usage": self.usage}


def run_round(g: Generation) -> list[int]:
    """One round of one request on the local runner; returns the tokens it emitted."""
    runner, s = g.runner, g.stats
    g.begin_round()
    out: list[int] = []
    t0 = time.perf_counter()
    while (item := g.next_draft_item()) is not None:
        out += g.apply_draft(runner.forward([item])[0])
    t1 = time.perf_counter()
    s.draft_s += t1 - t0
    if g.params.mode != "lossy":
        out += g.apply_verify(runner.forward([g.verify_item()])[0])
        s.verify_s += time.perf_counter() - t1
    return out


def stream(lm: LoadedModel, prompt_ids: list[int], params: GenParams) -> Iterator[GenEvent]:
    g = Generation(lm, prompt_ids, params)
    toks = g.start()
    yield GenEvent(toks, g.text.delta(g.finished), g.stop.finish_reason)
    while not g.finished:
        toks = run_round(g)
        yield GenEvent(toks, g.text.delta(g.finished), g.stop.finish_reason)
    stream.last = g  # the last finished generation, for callers that want its stats


def generate(lm: LoadedModel, prompt_ids: list[int], params: GenParams) -> GenResult:
    t = time.perf_counter()
    g = Generation(lm, prompt_ids, params)
    g.start()
    while not g.finished:
        run_round(g)
    return GenResult(g.text.text, list(g.output_ids), g.stop.finish_reason, g.usage(), g.stats,
                     time.perf_counter() - t)
