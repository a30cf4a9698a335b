"""Per-request draft length k: the largest k, whether it adapts, the request's acceptance
profile, and how long it has been on plain steps. The engine's `CostModel.plan` chooses each
round's k from these (see `vericache.spec.costmodel` for the words); with `adaptive` off, k
stays at k_max."""

from __future__ import annotations

from dataclasses import dataclass, field

from vericache.spec.costmodel import PROBE_EVERY, AcceptanceProfile


@dataclass
class DraftLength:
    k_max: int
    adaptive: bool = True
    k: int = 0  # this round's k; starts at k_max
    profile: AcceptanceProfile = field(init=False)
    plain_streak: int = 0  # rounds in a row without drafts

    def __post_init__(self):
        if self.k_max < 1:
            raise ValueError(f"need k_max >= 1 (got {self.k_max})")
        self.k = self.k or self.k_max
        self.profile = AcceptanceProfile(self.k_max)

    @property
    def probe(self) -> bool:
        """Whether the profile is stale: plain steps for PROBE_EVERY rounds in a row."""
        return self.plain_streak >= PROBE_EVERY

    def choose(self, k: int) -> None:
        """This round's k, from the cost model (ignored when not adaptive)."""
        if self.adaptive:
            self.k = max(0, min(self.k_max, k))

    def update(self, drafted: int, accepted: int) -> None:
        """Feed back one round: `accepted` of `drafted` tokens were accepted."""
        self.profile.update(drafted, accepted)
        self.plain_streak = self.plain_streak + 1 if drafted == 0 else 0
