"""The long-context scenario: many long requests at once, VeriCache against its baselines.

Every variant runs the same prompts (one per request, `concurrency` at once) through the
two-lane engine (`vericache.engine.lanes`) in this process, under the same verifier memory
budget and, where the full KV is offloaded, behind the same link:

- full_resident: full-KV greedy decoding, KV resident; the budget bounds how many requests
  are admitted at once.
- full_offloaded: full-KV greedy decoding with the KV in the offloaded tier: every step
  loads it over the link (layer by layer, overlapped with compute).
- lossy: decoding over the compressed KV only (the baseline that drifts).
- vericache_lockstep / vericache_staggered: draft over the compressed KV, verify over the
  offloaded full KV; all draft then all verify, or one group verifies while another drafts.

Each output is compared with single-request full greedy decoding of the same prompt, run
first in the same process. Figures per variant are in `vericache.bench.scenario_metrics`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vericache.bench.scenario_metrics import summarize, variant_measures
from vericache.compress.registry import make_compressor
from vericache.engine.generation import Generation, GenParams
from vericache.engine.kvtier import make_tier
from vericache.engine.lanes import run_requests
from vericache.engine.local import generate
from vericache.engine.rounds import LocalBackends
from vericache.errors import InvalidArgument

SCENARIOS = ("long-context",)
VARIANTS = ("full_resident", "full_offloaded", "lossy", "vericache_lockstep", "vericache_staggered")
MB = 1 << 20


@dataclass
class ScenarioConfig:
    """The settings every variant of a run shares."""

    concurrency: int = 4
    max_tokens: int = 32
    compressor: str = "snapkv"
    ratio: float | None = 4.0
    draft_len: int = 8
    adaptive: bool = True
    chunk_size: int = 256
    link_gbps: float | None = 4.0  # the offloaded tier's link; None: memory-copy speed
    verify_budget_mb: float | None = None  # verifier KV memory; None: unbounded
    draft_budget_mb: float | None = None
    groups: int = 2
    schedule: str = "lockstep"  # VeriCache's headline schedule in the ratios

    def __post_init__(self):
        if self.concurrency < 1:
            raise InvalidArgument("--concurrency must be >= 1", "concurrency")
        if self.max_tokens < 2:
            raise InvalidArgument("--max-tokens must be >= 2", "max_tokens")
        if self.link_gbps is not None and self.link_gbps <= 0:
            raise InvalidArgument("--link-gbps must be > 0", "link_gbps")
        for name in ("verify_budget_mb", "draft_budget_mb"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be > 0", name)
        make_compressor(self.compressor, self.ratio)

    def params(self, mode: str) -> GenParams:
        return GenParams(max_tokens=self.max_tokens, mode=mode, compressor=self.compressor,
                         ratio=self.ratio, draft_len=self.draft_len, adaptive=self.adaptive,
                         chunk_size=self.chunk_size, ignore_eos=True)


def _budget(mb: float | None) -> int | None:
    return None if mb is None else int(mb * MB)


def request_cost(cfg: ScenarioConfig, kv_per_token: int, mode: str, tier: str) -> Callable:
    """(draft_bytes, resident_bytes, load_bytes) of a request, for the scheduler's budgets:
    the full KV at its longest (prompt + output + one draft) on the verifier, resident or
    loaded per verification; the compressed KV (prompt / ratio + output) on the drafter."""
    ratio = cfg.ratio or 1.0

    def cost(g: Generation) -> tuple[int, int, int]:
        full = (len(g.prompt) + g.extra_capacity) * kv_per_token
        draft = int((len(g.prompt) / ratio + g.extra_capacity) * kv_per_token) if mode != "full" else 0
        if mode == "lossy":
            return draft, 0, 0
        return (draft, full, 0) if tier == "resident" else (draft, 0, full)
    return cost


def run_variant(lm, prompts, cfg: ScenarioConfig, variant: str) -> dict:
    """Run one variant over every prompt at once; returns its raw record."""
    mode = variant.split("_")[0]
    tier_name = "resident" if variant in ("full_resident", "lossy") else "offloaded"
    schedule = "staggered" if variant.endswith("staggered") else "lockstep"
    tier = make_tier(tier_name, cfg.link_gbps, lm.runner.device)
    backends = LocalBackends(lm, tier=tier)
    gens = [Generation(lm, p.ids, cfg.params(mode), request_id=f"{variant}-{i}")
            for i, p in enumerate(prompts)]
    cost = request_cost(cfg, lm.runner.kv_bytes_per_token(), mode, tier_name)
    try:
        trace = run_requests(backends, gens, schedule, cfg.groups, _budget(cfg.draft_budget_mb),
                             _budget(cfg.verify_budget_mb), cost)
    finally:
        if tier is not None:
            tier.close()
    return {"variant": variant, "mode": mode, "tier": tier_name, "schedule": schedule,
            "gens": gens, "trace": trace, "tier_stats": tier.stats if tier is not None else None}


def run_scenario(lm, prompts, cfg: ScenarioConfig,
                 on_step: Callable[[str], None] | None = None) -> dict:
    """The reference outputs, then every variant; returns the JSON document."""
    step = on_step or (lambda label: None)
    reference = []
    for p in prompts:
        step(f"reference {p.name}")
        reference.append(generate(lm, p.ids, cfg.params("full")).token_ids)
    rows = []
    for v in VARIANTS:
        step(v)
        rows.append(variant_measures(run_variant(lm, prompts, cfg, v), reference,
                                     lm.runner.kv_bytes_per_token()))
    return {"scenario": "long-context", "model": lm.name,
            "settings": {**cfg.__dict__, "context_tokens": [len(p.ids) for p in prompts],
                         "kv_bytes_per_token": lm.runner.kv_bytes_per_token()},
            "variants": rows, "summary": summarize(rows, cfg.schedule)}
