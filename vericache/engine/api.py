"""What a front end (the OpenAI gateway, the CLI) needs from an engine.

- `submit(prompt_ids, params)`: once per request, from any thread. Validates synchronously
  (raises InvalidArgument, ContextTooLong, ResourceExhausted) and returns a RequestStream
  whose events carry only verified tokens; the last event has finish_reason or error set,
  and usage.
- `queue_depth`, `active`: cheap reads for health, metrics and admission control.
- `metrics()`: counters and the tau histogram for /metrics.
- `health()`, `sessions()`: the backends' answers (`vericache.engine.backends.Backends`).
- `close()`: once, at shutdown; frees every session.
The embedded engine (`BatchEngine`) runs everything in this process; the remote engine runs
the same state machines against the drafter and verifier services.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class Engine(ABC):
    model_name: str
    tokenizer: object
    max_context: int

    @abstractmethod
    def submit(self, prompt_ids: list[int], params):
        """Queue a request; returns its RequestStream."""

    @property
    @abstractmethod
    def queue_depth(self) -> int:
        """Requests waiting to start."""

    @property
    @abstractmethod
    def active(self) -> int:
        """Requests being decoded."""

    @abstractmethod
    def metrics(self) -> dict:
        """{"counters": {...}, "tau_hist": {tokens_per_round: rounds}}."""

    @abstractmethod
    def health(self) -> dict[str, bool]:
        """Whether each backend service answers now; never raises."""

    @abstractmethod
    def sessions(self) -> dict[str, int]:
        """Per-request KV sessions held in this process, per side ({} when remote)."""

    @abstractmethod
    def close(self) -> None:
        """Stop, releasing every request's state."""
