"""Per-request draft length k: grows while rounds are fully accepted, shrinks after early
mismatches, always within [k_min, k_max]."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftLength:
    k_max: int
    k_min: int = 1
    adaptive: bool = True
    k: int = 0  # current; starts at k_max

    def __post_init__(self):
        if self.k_max < 1 or not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max (got {self.k_min}, {self.k_max})")
        self.k = self.k or self.k_max

    def update(self, drafted: int, accepted: int) -> None:
        """Feed back one round: `accepted` of `drafted` tokens were accepted."""
        if not self.adaptive or drafted == 0:
            return
        if accepted >= drafted:
            self.k = min(self.k_max, max(self.k + 1, 2 * self.k))
        else:
            # next round: a little past what was accepted, halfway from the current k
            self.k = max(self.k_min, min(self.k, (self.k + accepted + 1) // 2))
