"""What the engine's rounds need from a drafter and a verifier: the `Backends` interface.

A backend pair serves requests (`Generation`s) by id:
- `admit`: prefill on the verifier (full KV, compressed chunks) and attach on the drafter;
  returns the first token as a `Verdict` with no drafts (and its logprob when asked for);
- `draft` and `verify`: batched across requests, one call per phase of a round (and, where
  a verify pass held a request's loaded full KV, one per plain step that finishes it);
- `draft_ahead`: while a request's drafts are in verification, draft past them on the guess
  that all are accepted (the staggered schedule's idle drafter lane); returns tokens drafted;
- `commit`: tell the drafter a verification's outcome;
- `release`: free both sides (never raises);
- `health`: whether each side answers now (never raises);
- `sessions`: per-request KV sessions each side holds in this process (empty when the sides
  run elsewhere and report their own);
- `tier_counters`: the offloaded tier's running (stall, load) seconds, where the verifier
  in this process loads its full KV for each pass (the cost model prices a pass by them).

Two implementations, both here in the core: `vericache.engine.rounds.LocalBackends` (this
process's runner) and `vericache.engine.remote.RemoteBackends` (the drafter and verifier
services over gRPC). Rounds, lanes and the serving engine see only this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from vericache.engine.drafter import DraftOut
from vericache.engine.generation import Generation
from vericache.engine.verifier import Finish, Verdict


class Backends(ABC):
    @abstractmethod
    def admit(self, g: Generation) -> Verdict:
        """Prefill `g` and attach its drafter; returns Verdict(0, first token, its logprobs)."""

    @abstractmethod
    def draft(self, batch: list[tuple[Generation, int]]) -> list[DraftOut]:
        """Up to k drafts per (request, k), in order (fewer at EOS; none while detached)."""

    @abstractmethod
    def draft_ahead(self, batch: list[tuple[Generation, int]]) -> int:
        """Draft up to k more past each request's drafts in verification; tokens drafted."""

    @abstractmethod
    def verify(self, batch: list[tuple[Generation, DraftOut]],
               finish: dict[str, Finish] | None = None) -> list[Verdict]:
        """(accepted drafts, bonus token, logprobs when asked) per request, from one pass over
        the full KV; `finish`: the requests whose loaded full KV the pass holds when few
        tokens are left (`vericache.engine.verifier.Finish`; `Verdict.held`)."""

    @abstractmethod
    def commit(self, g: Generation, accepted: int, bonus: int | None) -> None:
        """The outcome of `g`'s verification, to its drafter (bonus None: lossy mode)."""

    @abstractmethod
    def release(self, g: Generation) -> None:
        """Free `g` on both sides; never raises."""

    @abstractmethod
    def health(self) -> dict[str, bool]:
        """{"drafter": answers, "verifier": answers}; never raises."""

    def sessions(self) -> dict[str, int]:
        """Sessions held in this process, per side ({} when the sides run elsewhere)."""
        return {}

    def tier_counters(self) -> tuple[float, float]:
        """(seconds verify passes waited for layers, seconds the loader moved them) so far,
        over the offloaded tier; (0, 0) where the full KV is resident or elsewhere."""
        return 0.0, 0.0

    def close(self) -> None:
        """Stop background work and close connections."""
