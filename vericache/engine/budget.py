"""KV memory budgets: what a request costs the drafter and the verifier, and the defaults.

A request holds, while admitted:
- on the drafter, the tokens its compressor keeps and the exact tail
  (`vericache.engine.prefill.drafter_tokens`, decompressed in the drafter's K/V dtype,
  `Runner.draft_dtype`) plus room for its output and one draft;
- on the verifier, its full KV (prompt + output + one draft): resident the whole time, or,
  with the offloaded tier, a working copy only while one of its verifications runs.
The scheduler (`vericache.engine.scheduler`) admits requests in arrival order while both
budgets hold; a request that could never fit alone is refused at submission.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from vericache.engine.generation import Generation
from vericache.engine.prefill import drafter_tokens
from vericache.errors import InvalidArgument, ResourceExhausted

MB = 1 << 20
# the share of the memory free at start-up that KV may take by default, per side
DEFAULT_SHARE = {"verifier": 0.5, "drafter": 0.2}


def request_cost(kv_per_token: int, tier: str = "resident", draft_per_token: int | None = None):
    """The scheduler's cost function: (draft_bytes, resident_bytes, load_bytes) of a request.
    `draft_per_token`: a token's K/V bytes on the drafter (`Runner.kv_bytes_per_token` of its
    `draft_dtype`; None: `kv_per_token`)."""
    per_draft = draft_per_token or kv_per_token

    def cost(g: Generation) -> tuple[int, int, int]:
        full = len(g.prompt) * kv_per_token + g.extra_capacity * kv_per_token
        draft = 0 if g.compressor is None else \
            (drafter_tokens(g.compressor, len(g.prompt), g.params.chunk_size)
             + g.extra_capacity) * per_draft
        if g.params.mode == "lossy":
            return draft, 0, 0
        return (draft, full, 0) if tier == "resident" else (draft, 0, full)
    return cost


def free_bytes(device: torch.device | str = "cpu") -> int:
    """Memory free now on `device` (CUDA: the device's; CPU: the host's available memory, or
    what the container's cgroup limit leaves, whichever is less)."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    if free is None:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    left = cgroup_room()
    return free if left is None else min(free, left)


def cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's cgroup may still take (its memory limit minus its use; v2, then
    v1), or None where no limit is set (a Kubernetes or compose limit shows here, not in
    /proc/meminfo)."""
    for limit_file, use_file in ((f"{root}/memory.max", f"{root}/memory.current"),
                                 (f"{root}/memory/memory.limit_in_bytes",
                                  f"{root}/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(use_file) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - used)
    return None


def budget_bytes(mb: float | None, side: str, device: torch.device | str = "cpu",
                 reserved: int = 0) -> int:
    """A side's KV budget in bytes: `mb` when given (> 0), else its default share of the
    memory free now, less `reserved` (memory the process will take for something else)."""
    if mb is None:
        return int(max(0, free_bytes(device) - reserved) * DEFAULT_SHARE[side])
    if not mb > 0:
        raise InvalidArgument(f"the {side}'s KV budget must be > 0 MB (got {mb})", "kv_budget_mb")
    return int(mb * MB)


def check_fits(cost: tuple[int, int, int], draft_budget: int | None, verify_budget: int | None) -> None:
    """Refuse a request that could never be admitted, naming the limit it exceeds."""
    draft, resident, load = cost
    if draft_budget is not None and draft > draft_budget:
        raise InvalidArgument(f"this request needs {draft / MB:.1f} MB of drafter KV memory, more "
                              f"than the whole budget of {draft_budget / MB:.1f} MB "
                              "(--draft-kv-budget-mb); shorten the prompt or max_tokens", "max_tokens")
    if verify_budget is not None and resident + load > verify_budget:
        raise InvalidArgument(f"this request needs {(resident + load) / MB:.1f} MB of verifier KV "
                              f"memory, more than the whole budget of {verify_budget / MB:.1f} MB "
                              "(--kv-budget-mb); shorten the prompt or max_tokens", "max_tokens")


class Ledger:
    """A service's own KV budget: what each session holds, and refusal when a new one would
    not fit. The gateway admits by the same budget (it reads it from the service's Health), so
    a refusal means another gateway shares the service, or a budget changed under it."""

    def __init__(self, budget: int | None, flag: str):
        self.budget, self.flag = budget, flag
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return sum(self._held.values())

    def charge(self, rid: str, nbytes: int) -> None:
        """Hold `nbytes` for `rid` or raise ResourceExhausted (nothing held then)."""
        with self._lock:
            used = sum(self._held.values())
            if self.budget is not None and used + nbytes > self.budget:
                raise ResourceExhausted(
                    f"KV budget full: {rid!r} needs {nbytes / MB:.1f} MB, {used / MB:.1f} of "
                    f"{self.budget / MB:.1f} MB are held ({self.flag})")
            self._held[rid] = self._held.get(rid, 0) + nbytes

    @contextmanager
    def hold(self, rid: str, nbytes: int) -> Iterator[None]:
        """Charge `nbytes` for what the block allocates; refunded if the block raises."""
        self.charge(rid, nbytes)
        try:
            yield
        except BaseException:
            self.refund(rid)
            raise

    def refund(self, rid: str) -> None:
        with self._lock:
            self._held.pop(rid, None)
