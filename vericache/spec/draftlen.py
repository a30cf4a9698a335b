"""Per-request draft length k: the largest k, whether it adapts, the request's acceptance
profile, and how long it has been on plain steps. The engine's `CostModel.plan` chooses each
round's k from these (see `vericache.spec.costmodel` for the words); with `adaptive` off, k
stays at k_max."""

from __future__ import annotations

from dataclasses import dataclass, field

from vericache.spec.costmodel import PROBE_EVERY, AcceptanceProfile

PROBE_EVERY_MAX = 16 * PROBE_EVERY  # the longest run of plain steps between two probes


@dataclass
class DraftLength:
    k_max: int
    adaptive: bool = True
    k: int = 0  # this round's k; starts at k_max
    profile: AcceptanceProfile = field(init=False)
    plain_streak: int = 0  # rounds in a row without drafts
    probe_every: int = PROBE_EVERY  # plain steps before a probe; doubles after each probe
    # that the plan followed with plain steps again, back to PROBE_EVERY once drafting resumes
    _probed: bool = False  # the last round with drafts was a probe

    def __post_init__(self):
        if self.k_max < 1:
            raise ValueError(f"need k_max >= 1 (got {self.k_max})")
        self.k = self.k or self.k_max
        self.profile = AcceptanceProfile(self.k_max)

    @property
    def probe(self) -> bool:
        """Whether the profile is stale: plain steps for `probe_every` rounds in a row."""
        return self.plain_streak >= self.probe_every

    def choose(self, k: int) -> None:
        """This round's k, from the cost model (ignored when not adaptive)."""
        if self.adaptive:
            self.k = max(0, min(self.k_max, k))

    def update(self, drafted: int, accepted: int) -> None:
        """Feed back one round: `accepted` of `drafted` tokens were accepted."""
        self.profile.update(drafted, accepted)
        if drafted:
            self._probed = self.probe
            if not self._probed:
                self.probe_every = PROBE_EVERY
            self.plain_streak = 0
            return
        if self._probed and self.plain_streak == 0:  # a probe, and plain steps again
            self.probe_every = min(2 * self.probe_every, PROBE_EVERY_MAX)
        self.plain_streak += 1
