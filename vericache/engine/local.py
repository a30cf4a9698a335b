"""Run one request in this thread on the local runner (the CLI and tests use it).

`stream()` yields events as tokens are verified; `generate()` collects them. The batched,
threaded engine (`BatchEngine`) runs the same rounds for many requests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from vericache.engine.generation import Generation, GenParams
from vericache.engine.rounds import LocalBackends, run_round, start
from vericache.model.loader import LoadedModel
from vericache.spec.costmodel import CostModel


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
    logprobs: list | None = field(repr=False, default=None)  # TokenLogprob per token, when asked

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "usage": self.usage}


class Stream:
    """One request run in this thread: iterate for its events; `.gen` holds its state (usage,
    stats) during and after the run. Both sides' state is released when iteration ends."""

    def __init__(self, lm: LoadedModel, prompt_ids: list[int], params: GenParams,
                 backends: LocalBackends | None = None, costs: CostModel | None = None):
        """`costs`: the cost model choosing k (share one across calls to keep what it
        learned; a new one per call otherwise)."""
        self.backends = backends or LocalBackends(lm)
        self.costs = costs or CostModel()
        self.gen = Generation(lm, prompt_ids, params)

    def __iter__(self) -> Iterator[GenEvent]:
        g, b = self.gen, self.backends
        try:
            toks = start(b, g)
            yield GenEvent(toks, g.text.delta(g.finished), g.stop.finish_reason)
            while not g.finished:
                toks = run_round(b, [g], self.costs)[g.rid]
                yield GenEvent(toks, g.text.delta(g.finished), g.stop.finish_reason)
        finally:
            b.release(g)


def stream(lm: LoadedModel, prompt_ids: list[int], params: GenParams,
           backends: LocalBackends | None = None, costs: CostModel | None = None) -> Stream:
    return Stream(lm, prompt_ids, params, backends, costs)


def generate(lm: LoadedModel, prompt_ids: list[int], params: GenParams,
             backends: LocalBackends | None = None, costs: CostModel | None = None) -> GenResult:
    t = time.perf_counter()
    s = Stream(lm, prompt_ids, params, backends, costs)
    for _ in s:
        pass
    g = s.gen
    return GenResult(g.text.text, list(g.output_ids), g.stop.finish_reason, g.usage(), g.stats,
                     time.perf_counter() - t, g.logprobs)
