"""The concurrent scenarios: many requests at once, VeriCache against its baselines.

Every variant of a run decodes the same prompts (`concurrency` requests arriving together,
sharing one long code document and each asking its own question) through the two-lane engine
(`vericache.engine.lanes`) in this process. Each output is compared with single-request full
greedy decoding of the same prompt, run first in the same process.

long-context: the full KV is the expensive thing to keep; the KV memory budget (drafter and
verifier together: VeriCache's compressed KV is charged to the same memory as the baselines'
full KV) and, where the full KV is offloaded, its link are the same for every variant:
- full_resident: full-KV greedy decoding, KV resident; the budget bounds how many requests
  are admitted at once.
- full_offloaded: full-KV greedy decoding with the KV in the offloaded tier: every step
  loads it over the link (layer by layer, overlapped with compute), but for a request's
  last steps once they cost less than a load: those run on the copy the step before loaded
  (the rule VeriCache's verifications follow, `vericache.engine.verifier.Finish`).
- lossy: decoding over the compressed KV only (the baseline that drifts).
- vericache_lockstep / vericache_staggered: draft over the compressed KV, verify over the
  offloaded full KV; all draft then all verify, or one group verifies while another drafts
  (and, with draft-ahead, the drafter drafts past drafts in verification when it is free).
The prompts' prefill is computed once, before the variants, into an in-memory prefix cache
that every variant (and the reference) loads from: the variants differ in decoding, and an
8k prefill per request per variant would dominate a CPU run. Each request still holds (and
each offloaded verification loads) its own whole full KV. An offloaded variant's tier has
its host memory in place before the timed run (`OffloadedTier.preallocate`: one host cache
per request), and every local variant's caches come from the runner's pooled arenas,
faulted in before its timed run as far as the run reaches (`warm_pools`): a server that has
run a while holds both, and no variant pays the OS for fresh pages that another does not.

remote-prefix: the shared prefix's full and compressed chunks sit in a store (published by
an earlier request); the decoding node reaches it over a slow link (`drafter_link_gbps`), a
verifier next to the store over a fast one (`link_gbps`). Each node keeps what it read
(`vericache.store.node.NodeCache`), so requests that share the prefix load it once:
- full_far: full-KV decoding on the far node: the full prefix crosses the slow link.
- full_near: full-KV decoding next to the store (fast link).
- lossy: decoding over the compressed prefix, loaded over the slow link.
- vericache_lockstep / vericache_staggered: the verifier loads the full prefix over the fast
  link and answers the first token; once the cost model first plans a request to draft, the
  drafter loads its compressed prefix over the slow link in the background and drafts once it
  has landed (until then rounds are plain full-KV decode steps; a request kept on plain steps
  moves nothing over the slow link). Figures per variant are in `vericache.bench.scenario_metrics`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from vericache.bench.scenario_metrics import summarize, variant_measures
from vericache.compress.registry import make_compressor
from vericache.engine.budget import MB, request_cost
from vericache.engine.calibrate import calibrate
from vericache.engine.generation import Generation, GenParams
from vericache.engine.kvtier import TierStats, make_tier
from vericache.engine.lanes import run_requests
from vericache.engine.local import generate
from vericache.engine.rounds import LocalBackends, arena
from vericache.engine.verifier import Verifier
from vericache.errors import InvalidArgument
from vericache.select import make_selection
from vericache.spec.costmodel import CostModel
from vericache.store.memory import MemoryStore
from vericache.store.node import LinkedStore, NodeCache

SCENARIOS = ("long-context", "remote-prefix")
VARIANTS = {
    "long-context": ("full_resident", "full_offloaded", "lossy", "vericache_lockstep",
                     "vericache_staggered"),
    "remote-prefix": ("full_near", "full_far", "lossy", "vericache_lockstep", "vericache_staggered"),
}
# which variant stands for "full KV resident" and "full KV offloaded" in the summary
BASELINES = {"long-context": ("full_resident", "full_offloaded"),
             "remote-prefix": ("full_near", "full_far")}
DEFAULT_LINKS = {"long-context": 4.0, "remote-prefix": 200.0}  # the verifier's link, Gbit/s


@dataclass
class ScenarioConfig:
    """The settings every variant of a run shares."""

    scenario: str = "long-context"
    concurrency: int = 4
    max_tokens: int = 32
    compressor: str = "snapkv"
    ratio: float | None = 4.0
    draft_len: int = 8
    adaptive: bool = True
    chunk_size: int = 256
    link_gbps: float | None = None  # verifier's link (tier or store); None: the scenario's
    # default; 0: unpaced (memory-copy speed: on a CPU the "host tier" is the same memory)
    drafter_link_gbps: float | None = 1.0  # remote-prefix: the far node's link to the store
    # KV memory of each variant, drafter and verifier together (one machine's memory: the
    # drafter's compressed KV counts against the same budget as the full KV); None: unbounded
    kv_budget_mb: float | None = None
    kv_budget_caches: float | None = None  # the same, in full caches of the longest request
    draft_budget_mb: float | None = None  # an extra bound on the drafter's share
    groups: int = 2
    schedule: str = "lockstep"  # VeriCache's headline schedule in the ratios
    draft_ahead: bool = True  # in the staggered variant
    services: dict | None = None  # {"drafter": HOST:PORT, "verifier": HOST:PORT}: run through them
    # selection policies: the first is the headline (and lossy's); each other one runs the
    # `schedule` variant again, named "vericache_<schedule>:<policy>"
    selections: list[str] = field(default_factory=lambda: ["question"])
    # each adaptive vericache variant, and each variant over the offloaded tier (the cost
    # model prices when a loaded copy finishes a request: `vericache.engine.verifier.Finish`),
    # calibrates its cost model through its own backends (and tier or links) before its timed
    # run, as `vericache serve` does at start-up; False: it starts cold and explores (and
    # finishes no request on a loaded copy until its fit has seen enough passes)
    calibrate: bool = True
    # ... and then serves this many requests about another document (untimed; `run_scenario`'s
    # `warm_prompts`), so that it plans the timed run from the acceptance a server that has
    # been up has pooled, not from the prior rate; 0: the timed requests are its first
    warm_requests: int = 0
    # also run both vericache schedules with k fixed at `draft_len` (rows "<variant>:fixed"):
    # the cost model's choice against a fixed k, in the same run (needs `adaptive`)
    with_fixed: bool = False
    # run every variant this many times, interleaved (each variant once, then again): each
    # row is the median run by throughput, `throughput_runs` lists them all. Two runs of the
    # same variant differ by up to 10-30% on a shared 2-core VM, one after another
    repeats: int = 1

    def __post_init__(self):
        if self.scenario not in SCENARIOS:
            raise InvalidArgument(f"unknown scenario {self.scenario!r}; valid: {', '.join(SCENARIOS)}",
                                  "scenario")
        if self.link_gbps is None:
            self.link_gbps = DEFAULT_LINKS[self.scenario]
        if self.concurrency < 1:
            raise InvalidArgument("--concurrency must be >= 1", "concurrency")
        if self.warm_requests < 0:
            raise InvalidArgument("--warm-requests must be >= 0", "warm_requests")
        if self.repeats < 1:
            raise InvalidArgument("--repeats must be >= 1", "repeats")
        if self.with_fixed and not self.adaptive:
            raise InvalidArgument("--with-fixed-k compares the adaptive k with a fixed one: "
                                  "drop --fixed-draft-len", "with_fixed")
        if self.max_tokens < 2:
            raise InvalidArgument("--max-tokens must be >= 2", "max_tokens")
        if self.link_gbps < 0:
            raise InvalidArgument("--link-gbps must be >= 0 (0: unpaced)", "link_gbps")
        for name in ("drafter_link_gbps", "kv_budget_mb", "kv_budget_caches", "draft_budget_mb"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be > 0", name)
        if self.kv_budget_mb is not None and self.kv_budget_caches is not None:
            raise InvalidArgument("give --kv-budget-mb or --kv-budget-caches, not both", "kv_budget")
        make_compressor(self.compressor, self.ratio)
        if not self.selections:
            raise InvalidArgument("--selection is empty", "selection")
        for s in self.selections:
            make_selection(s)

    def params(self, mode: str) -> GenParams:
        return GenParams(max_tokens=self.max_tokens, mode=mode, compressor=self.compressor,
                         ratio=self.ratio, draft_len=self.draft_len, adaptive=self.adaptive,
                         chunk_size=self.chunk_size, ignore_eos=True, selection=self.selections[0])

    def variants(self, names: tuple[str, ...]) -> list[tuple[str, "ScenarioConfig"]]:
        """(row name, settings) of every variant to run: `names` with the headline selection,
        then the `schedule` variant once per other selection, then (`with_fixed`) each
        vericache variant with k fixed."""
        out = [(v, self) for v in names]
        for s in self.selections[1:]:
            out.append((f"vericache_{self.schedule}:{s}", replace(self, selections=[s])))
        if self.with_fixed:
            fixed = replace(self, adaptive=False, with_fixed=False, selections=self.selections[:1])
            out += [(f"{v}:fixed", fixed) for v in names if v.startswith("vericache_")]
        return out

    def kv_budget(self, longest_prompt: int, kv_per_token: int) -> int | None:
        """Each variant's KV budget in bytes, drafter and verifier together."""
        if self.kv_budget_caches is not None:
            per_cache = (longest_prompt + self.params("full").max_tokens + self.draft_len + 2) * kv_per_token
            return int(self.kv_budget_caches * per_cache)
        return None if self.kv_budget_mb is None else int(self.kv_budget_mb * MB)


def drop_new_keys(store: MemoryStore, keep: set[str]) -> None:
    """Delete the keys of `store` not in `keep`: a decode's own chunks are not the next
    decode's cache (the scenario and the probes under benchmarks/)."""
    for key in store.keys():
        if key not in keep:
            store.delete(key)


def warm_pools(lm, prompts, cfg: ScenarioConfig, budget: int | None) -> None:
    """Fault in the runner's arena pools (`Runner.new_cache(arena=)`) as far as a run of
    `prompts` at `budget` reaches, on both sides (every pool of `arena`'s), as a server that
    has served such requests holds them (the offloaded tier's host memory is in place the
    same way: `OffloadedTier.preallocate`). The pools live as long as the runner, and a slot
    is faulted in by the first cache that writes it, so without this the variant that
    runs first pays for every variant after it: on a 2-vCPU Xeon at 16 x 8k, full_resident's
    prefill jobs took 9.10 s (61387 page faults) the first time and 7.98 s (636) the second;
    with the pools warmed first, 8.17 s (663) and 8.15 s (docs/performance.md,
    thirty-second session: with the pool in small pages and a full slot in huge pages)."""
    r = lm.runner
    if not r.arena_slots or r.device.type != "cpu":
        return
    tokens = max(len(p.ids) for p in prompts) + cfg.params("full").extra_capacity
    per_cache = tokens * r.kv_bytes_per_token()
    n = len(prompts) if budget is None else max(1, min(len(prompts), budget // per_cache))
    pools = {(arena(r, side, g), dtype, positions) for g in range(cfg.groups)
             for side, dtype, positions in (("verify", r.dtype, False),
                                            ("draft", r.draft_dtype, r.positioned))}
    for key, dtype, positions in pools:
        caches = [r.new_cache(tokens, positions, key, dtype) for _ in range(min(n, r.arena_slots))]
        for c in caches:  # zeros are what `KVPool.ready` would write there anyway
            c.k[:, :, :tokens].zero_()
            c.v[:, :, :tokens].zero_()
        del caches, c  # their slots are free again, and in place


def _run(lm, prompts, cfg: ScenarioConfig, variant: str, backends, tier, tier_name: str,
         budget: int | None, namespace: str = "", after_calibration: Callable[[], None] | None = None,
         warm_prompts=(), warm: bool = False) -> dict:
    """Run `variant` over every prompt at once on `backends` (closed afterwards, with `tier`).
    An adaptive vericache variant, and any variant over the offloaded `tier`, first calibrates
    its cost model over them (untimed, as a server's start-up; `cfg.calibrate`); an adaptive
    one then serves `warm_prompts` (untimed, as a server's earlier traffic;
    `cfg.warm_requests` of them); then `after_calibration` resets the
    caller's transfer counters (its tier's or its links'), so they count the run alone.
    `warm`: the runner's arena pools are faulted in first (`warm_pools`)."""
    mode = variant.split("_")[0]
    schedule = "staggered" if variant.partition(":")[0].endswith("staggered") else "lockstep"
    params = cfg.params(mode)
    params.namespace = namespace
    prefix = f"{namespace}-" if namespace else ""
    gens = [Generation(lm, p.ids, params, request_id=f"{prefix}{variant}-{i}")
            for i, p in enumerate(prompts)]
    cost = request_cost(lm.runner.kv_bytes_per_token(), tier_name,
                        lm.runner.draft_kv_bytes_per_token())
    costs, calibration, warm = CostModel(), None, None
    draft_budget = None if cfg.draft_budget_mb is None else int(cfg.draft_budget_mb * MB)

    def serve(requests: list[Generation]):
        return run_requests(backends, requests, schedule, cfg.groups, draft_budget, None, cost,
                            draft_ahead=cfg.draft_ahead and schedule == "staggered",
                            costs=costs, total_budget=budget)
    try:
        # the cost model prices k (adaptive) and, over an offloaded tier, when a loaded copy
        # finishes a request (`vericache.engine.verifier.Finish`, the full-KV baseline's too)
        adaptive = mode == "vericache" and params.adaptive
        if adaptive or (mode != "lossy" and tier_name == "offloaded"):
            if cfg.calibrate:
                calibration = calibrate(backends, lm, costs, params)
            if warm_prompts and adaptive:
                t0 = time.perf_counter()
                earlier = [Generation(lm, p.ids, params, request_id=f"{prefix}{variant}-warm-{i}")
                           for i, p in enumerate(warm_prompts)]
                serve(earlier)
                costs.warmed()
                warm = {"requests": len(warm_prompts), "seconds": round(time.perf_counter() - t0, 3),
                        "drafted": sum(g.stats.drafted for g in earlier),
                        "pooled_acceptance": round(costs.prior_rate, 4),
                        "pooled_profile": [round(r, 3) for r in costs.pooled.rates(len(costs.pooled.reached))],
                        "pooled_reached": list(costs.pooled.reached)}
            if after_calibration is not None:
                after_calibration()
        if warm:
            warm_pools(lm, prompts, cfg, budget)
        trace = serve(gens)
    finally:
        backends.close()
        if tier is not None:
            tier.close()
    return {"variant": variant, "mode": mode, "tier": tier_name, "schedule": schedule,
            "gens": gens, "trace": trace, "tier_stats": tier.stats if tier is not None else None,
            "calibration": calibration, "warm": warm}


def run_long_context_variant(lm, prompts, cfg: ScenarioConfig, variant: str, store,
                             warm_prompts=()) -> dict:
    """One long-context variant over every prompt at once; returns its raw record."""
    tier_name = "resident" if variant in ("full_resident", "lossy") else "offloaded"
    tier = make_tier(tier_name, cfg.link_gbps or None, lm.runner.device)
    longest = max(len(p.ids) for p in prompts)
    budget = cfg.kv_budget(longest, lm.runner.kv_bytes_per_token())
    if tier is not None:  # its host memory in place before the run, as a server's that has run
        r = lm.runner
        tier.preallocate(len(prompts), longest + cfg.params("full").extra_capacity,
                         r.num_layers, r.num_kv_heads, r.head_dim, r.dtype)

    def reset_tier() -> None:  # the calibration's loads are not the run's
        if tier is not None:
            tier.stats = TierStats()

    return _run(lm, prompts, cfg, variant, LocalBackends(lm, store, tier), tier, tier_name, budget,
                after_calibration=reset_tier, warm_prompts=warm_prompts, warm=True)


def run_remote_prefix_variant(lm, prompts, cfg: ScenarioConfig, variant: str, store,
                              warm_prompts=()) -> dict:
    """One remote-prefix variant: fresh (cold) nodes in front of the shared store."""
    near = NodeCache(LinkedStore(store, cfg.link_gbps or None))
    far = NodeCache(LinkedStore(store, cfg.drafter_link_gbps))
    if variant == "full_far":
        backends = LocalBackends(lm, far)
    elif variant == "full_near":
        backends = LocalBackends(lm, near)
    else:  # the verifier sits near the store; the drafter (and the lossy decoder) far from it
        backends = LocalBackends(lm, near, drafter_store=far, async_attach=variant != "lossy")

    def reset_links() -> None:  # the calibration's bytes are not the run's
        for node in (near, far):
            node.inner.bytes_read = node.inner.bytes_written = 0

    raw = _run(lm, prompts, cfg, variant, backends, None, "resident", None,
               after_calibration=reset_links, warm_prompts=warm_prompts, warm=True)
    raw["links"] = {"near_bytes_read": near.inner.bytes_read, "near_bytes_written": near.inner.bytes_written,
                    "far_bytes_read": far.inner.bytes_read, "far_bytes_written": far.inner.bytes_written}
    return raw


SERVICE_VARIANTS = ("full", "lossy", "vericache_lockstep", "vericache_staggered")


def parse_services(text: str) -> dict:
    """`drafter=HOST:PORT,verifier=HOST:PORT` as a dict (both needed)."""
    out = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        name, sep, addr = part.partition("=")
        if not sep or name not in ("drafter", "verifier") or not addr:
            raise InvalidArgument(f"--services: expected drafter=HOST:PORT,verifier=HOST:PORT, got "
                                  f"{part!r}", "services")
        out[name] = addr
    if set(out) != {"drafter", "verifier"}:
        raise InvalidArgument("--services needs both drafter=HOST:PORT and verifier=HOST:PORT",
                              "services")
    return out


def _remote(lm, cfg: ScenarioConfig):
    import os

    from vericache.engine.remote import RemoteBackends

    return RemoteBackends(cfg.services["drafter"], cfg.services["verifier"], lm.runner.vocab_size,
                          token=os.environ.get("VERICACHE_INTERNAL_TOKEN") or None)


def verifier_tier(lm, cfg: ScenarioConfig) -> str:
    """The verifier service's KV tier, from its Health."""
    b = _remote(lm, cfg)
    try:
        return b.service_health()["verifier"].kv_tier or "resident"
    finally:
        b.close()


def run_services_variant(lm, prompts, cfg: ScenarioConfig, variant: str, tier: str,
                         namespace: str, warm_prompts=()) -> dict:
    """One variant through the drafter and verifier services (RemoteBackends); the services'
    own flags set their links and the verifier's tier."""
    budget = cfg.kv_budget(max(len(p.ids) for p in prompts), lm.runner.kv_bytes_per_token())
    raw = _run(lm, prompts, cfg, variant, _remote(lm, cfg), None, tier, budget, namespace,
               warm_prompts=warm_prompts)
    if raw["mode"] == "full":
        raw["variant"] = f"full_{tier}"
    return raw


def _services_warm(lm, cfg: ScenarioConfig, warm: list[tuple[str, list[int]]], namespace: str,
                   step) -> None:
    """Prefill through the verifier service (full and compressed chunks into the kvstore),
    then release."""
    b = _remote(lm, cfg)
    spec = make_compressor(cfg.compressor, cfg.ratio).spec
    try:
        for rid, ids in warm:
            step(f"services: prefill {rid} ({len(ids)} tokens) into the kvstore")
            b.prefill_into_store(f"{namespace}-{rid}", ids, spec, cfg.chunk_size, namespace)
    finally:
        b.close()


def fill_prefix_cache(lm, store, warm: list[tuple[str, list[int]]], compressor,
                      chunk_size: int = 256, on_step: Callable[[str], None] | None = None) -> None:
    """Prefill each (request id, prompt) of `warm` once into `store`'s prefix cache (full KV
    and `compressor`'s chunks), as earlier traffic would have, then release it."""
    ver = Verifier(lm.runner, store, lm.model_id)
    for rid, ids in warm:
        if on_step is not None:
            on_step(f"prefill {rid} ({len(ids)} tokens) into the prefix cache")
        ver.prefill(rid, ids, 1, chunk_size, compressor)
        ver.release(rid)


def common_prefix(prompts) -> int:
    ids = [p.ids for p in prompts]
    n = min(len(x) for x in ids)
    for i in range(n):
        if any(x[i] != ids[0][i] for x in ids[1:]):
            return i
    return n


def median_run(runs: list[dict]) -> dict:
    """One variant's row from its repeated runs: the median run by throughput (the upper one
    of two), with `throughput_runs` (every run's, in run order); it is `identical` only if
    every run was."""
    row = dict(sorted(runs, key=lambda r: r["throughput_tps"])[len(runs) // 2])
    row["throughput_runs"] = [r["throughput_tps"] for r in runs]
    row["identical"] = all(r["identical"] for r in runs)
    row["identical_requests"] = min(r["identical_requests"] for r in runs)
    return row


def run_scenario(lm, prompts, cfg: ScenarioConfig,
                 on_step: Callable[[str], None] | None = None, warm_prompts=()) -> dict:
    """Warm the store, the reference outputs, then every variant; returns the JSON document.
    `warm_prompts`: the earlier traffic each adaptive vericache variant serves before its
    timed run (`cfg.warm_requests` of them: prompts about another document)."""
    if len(warm_prompts) != cfg.warm_requests:
        raise InvalidArgument(f"{cfg.warm_requests} warm requests set, {len(warm_prompts)} "
                              "prompts given", "warm_requests")
    step = on_step or (lambda label: None)
    store = MemoryStore()
    shared = common_prefix(prompts)
    if cfg.scenario == "long-context":  # every prompt's prefill, once
        warm = [(f"warm-{i}", p.ids) for i, p in enumerate(prompts)]
    else:  # an earlier request published the shared prefix
        warm = [("publish", prompts[0].ids[:shared])]
    fill_prefix_cache(lm, store, warm, make_compressor(cfg.compressor, cfg.ratio),
                      cfg.chunk_size, step)
    published = set(store.keys())
    reference = []
    for p in prompts:
        step(f"reference {p.name}")
        reference.append(generate(lm, p.ids, cfg.params("full"), LocalBackends(lm, store)).token_ids)
        drop_new_keys(store, published)
    runs: dict[str, list[dict]] = {}  # variant -> its rows, one per repeat
    baselines = BASELINES[cfg.scenario]
    if cfg.services is not None:
        import uuid

        tier = verifier_tier(lm, cfg)
        baselines = ("full_resident", None) if tier == "resident" else (None, "full_offloaded")
        run_id = uuid.uuid4().hex[:8]
        for rep in range(cfg.repeats):
            for i, (v, vcfg) in enumerate(cfg.variants(SERVICE_VARIANTS)):
                # remote-prefix: each variant run publishes into its own namespace, so none
                # reuses the suffix chunks another wrote; long-context: one namespace, every
                # prompt warmed
                ns = f"bench-{run_id}" + (f"-{rep}-{i}" if cfg.scenario == "remote-prefix" else "")
                if cfg.scenario == "remote-prefix" or i == rep == 0:
                    _services_warm(lm, cfg, warm, ns, step)
                step(f"services: {v}" + (f" (run {rep + 1} of {cfg.repeats})" if cfg.repeats > 1 else ""))
                raw = run_services_variant(lm, prompts, vcfg, v, tier, ns, warm_prompts)
                # (the drafter service's weight copy is its own: not known here)
                runs.setdefault(v, []).append(variant_measures(raw, reference, lm.runner.kv_bytes_per_token()))
    else:
        run_variant = (run_long_context_variant if cfg.scenario == "long-context"
                       else run_remote_prefix_variant)
        for rep in range(cfg.repeats):
            for v, vcfg in cfg.variants(VARIANTS[cfg.scenario]):
                step(v + (f" (run {rep + 1} of {cfg.repeats})" if cfg.repeats > 1 else ""))
                raw = run_variant(lm, prompts, vcfg, v, store, warm_prompts)
                drop_new_keys(store, published)
                kv, dw = lm.runner.kv_bytes_per_token(), lm.runner.draft_weight_bytes()
                runs.setdefault(v, []).append(variant_measures(raw, reference, kv, dw,
                                                               lm.runner.draft_weight_form(),
                                                               lm.runner.draft_head_form(),
                                                               lm.runner.draft_layers_form()))
    rows = [median_run(r) for r in runs.values()]
    doc = {"scenario": cfg.scenario, "model": lm.name,
           "settings": {**cfg.__dict__, "context_tokens": [len(p.ids) for p in prompts],
                        "shared_prefix_tokens": shared,
                        "kv_bytes_per_token": lm.runner.kv_bytes_per_token(),
                        "kv_budget_bytes": cfg.kv_budget(max(len(p.ids) for p in prompts),
                                                                 lm.runner.kv_bytes_per_token())},
           "variants": rows,
           "summary": summarize(rows, cfg.schedule, *baselines)}
    store.close()
    return doc
