"""Prometheus text exposition (format 0.0.4), written by hand.

A `MetricsRegistry` holds collectors: functions called at scrape time that return metric
families. The engine's collector (`engine_collector`) and the gateway's HTTP counter are
registered by the app; later parts (the KV store's hits and bytes) register their own
collector the same way, without touching this file's callers.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TAU_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass
class Family:
    """One metric: name, type (counter, gauge, histogram), help, and its samples."""

    name: str
    kind: str
    help: str
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, suffix: str = "", **labels: str) -> Family:
        self.samples.append((self.name + suffix, labels, value))
        return self


def histogram(name: str, help: str, counts: dict[int | float, int],
              buckets: Iterable[float]) -> Family:
    """A histogram family from observed value -> count (cumulative buckets, +Inf, sum, count)."""
    fam = Family(name, "histogram", help)
    for le in buckets:
        fam.add(sum(n for v, n in counts.items() if v <= le), "_bucket", le=_fmt(le))
    fam.add(sum(counts.values()), "_bucket", le="+Inf")
    fam.add(sum(v * n for v, n in counts.items()), "_sum")
    return fam.add(sum(counts.values()), "_count")


def _fmt(v: float) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(families: Iterable[Family]) -> str:
    lines = []
    for fam in families:
        lines.append(f"# HELP {fam.name} {fam.help}")
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        for name, labels, value in fam.samples:
            lab = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            lines.append(f"{name}{{{lab}}} {_fmt(value)}" if lab else f"{name} {_fmt(value)}")
    return "\n".join(lines) + "\n"


Collector = Callable[[], Iterable[Family]]


class MetricsRegistry:
    def __init__(self):
        self._collectors: list[Collector] = []

    def register(self, collector: Collector) -> None:
        self._collectors.append(collector)

    def render(self) -> str:
        return render(fam for c in self._collectors for fam in c())


class HttpCounter:
    """Responses the gateway sent, by route and status code (errors included)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, int], int] = {}

    def observe(self, route: str, status: int) -> None:
        with self._lock:
            self._counts[route, status] = self._counts.get((route, status), 0) + 1

    def __call__(self) -> list[Family]:
        fam = Family("vericache_http_responses_total", "counter",
                     "HTTP responses sent by the gateway, by route and status code")
        with self._lock:
            for (route, status), n in sorted(self._counts.items()):
                fam.add(n, route=route, code=str(status))
        return [fam]


def engine_collector(engine) -> Collector:
    """Counters, the tokens-per-round histogram and gauges of an `Engine`."""
    def collect() -> list[Family]:
        m = engine.metrics()
        c, tau = m.get("counters", {}), m.get("tau_hist", {})

        def counter(name: str, key: str, help: str) -> Family:
            return Family(name, "counter", help).add(c.get(key, 0))

        return [
            counter("vericache_requests_total", "requests", "requests accepted by the engine"),
            counter("vericache_request_errors_total", "errors", "requests that ended in an error"),
            counter("vericache_tokens_total", "tokens", "verified output tokens emitted"),
            counter("vericache_rounds_total", "rounds", "draft/verify rounds of finished requests"),
            histogram("vericache_tokens_per_round", "tokens emitted per round (tau)", tau,
                      TAU_BUCKETS),
            counter("vericache_draft_seconds_total", "draft_s", "time spent drafting"),
            counter("vericache_verify_seconds_total", "verify_s", "time spent verifying"),
            counter("vericache_prefill_seconds_total", "prefill_s", "time spent in prefill"),
            counter("vericache_overlapped_rounds_total", "overlapped_rounds",
                    "verify jobs during which the drafter lane drafted (staggered schedule)"),
            counter("vericache_ahead_drafted_tokens_total", "ahead_drafted",
                    "tokens drafted ahead past drafts in verification (staggered schedule)"),
            counter("vericache_draft_lane_busy_seconds_total", "draft_busy_s",
                    "time the executor's drafter lane ran jobs"),
            counter("vericache_verify_lane_busy_seconds_total", "verify_busy_s",
                    "time the executor's verifier lane ran jobs (prefill and verify)"),
            counter("vericache_store_hits_total", "store_hits", "KV chunks read from the store"),
            counter("vericache_store_read_bytes_total", "store_bytes_read",
                    "KV bytes read from the store"),
            counter("vericache_store_written_bytes_total", "store_bytes_written",
                    "KV bytes written to the store"),
            counter("vericache_cached_prompt_tokens_total", "cached_tokens",
                    "prompt tokens whose full KV came from the prefix cache"),
            counter("vericache_selection_seconds_total", "select_s",
                    "verifier time spent choosing the drafter's kept tokens"),
            counter("vericache_selection_moved_tokens_total", "select_moved_tokens",
                    "tokens moved into drafters' kept sets (over layers and KV heads)"),
            counter("vericache_selection_delta_bytes_total", "select_delta_bytes",
                    "bytes of the moves of drafters' kept sets"),
            _by_policy(c),
            *_draft_len_families(m.get("k_hist", {}), m.get("costs", {})),
            Family("vericache_queue_depth", "gauge", "requests waiting to start")
            .add(engine.queue_depth),
            Family("vericache_active_requests", "gauge", "requests being decoded")
            .add(engine.active),
            *_session_gauges(engine),
            *_kv_families(m.get("kv_bytes", {})),
        ]
    return collect


def _kv_families(kv: dict) -> list[Family]:
    """KV bytes the admitted requests hold, and the budgets admission keeps them within."""
    used = Family("vericache_kv_bytes", "gauge", "KV bytes charged to admitted requests, per side")
    budget = Family("vericache_kv_budget_bytes", "gauge",
                    "KV memory budget per side (absent: unbounded)")
    for side, v in sorted(kv.items()):
        used.add(v["in_use"], side=side)
        if v["budget"] is not None:
            budget.add(v["budget"], side=side)
    return [used, budget]


def _draft_len_families(k_hist: dict, costs: dict) -> list[Family]:
    """What the cost model chose (rounds at each k, plain steps) and what it expects."""
    rounds = Family("vericache_draft_len_rounds_total", "counter",
                    "vericache rounds of finished requests by drafts verified (k=0: plain "
                    "full-KV decode steps chosen by the cost model)")
    for k in sorted(k_hist):
        rounds.add(k_hist[k], k=str(k))
    total = sum(k_hist.values())
    return [
        rounds,
        Family("vericache_plain_round_share", "gauge",
               "share of vericache rounds that were plain decode steps (k=0)")
        .add(k_hist.get(0, 0) / total if total else 0.0),
        Family("vericache_cost_model_predicted_tokens_per_second", "gauge",
               "goodput the cost model expected of its chosen draft lengths (running mean)")
        .add(costs.get("predicted_tps", 0.0)),
        Family("vericache_cost_model_measured_tokens_per_second", "gauge",
               "goodput measured over the same rounds (running mean)")
        .add(costs.get("measured_tps", 0.0)),
        Family("vericache_cost_model_fitted", "gauge",
               "1 once the cost model has seen enough rounds to choose k (0: exploring)")
        .add(1.0 if costs.get("fitted") else 0.0),
    ]


def _by_policy(counters: dict) -> Family:
    """Finished requests per selection policy."""
    fam = Family("vericache_selection_requests_total", "counter",
                 "finished requests by the selection policy that moved their drafter's set")
    for key in sorted(k for k in counters if k.startswith("selection:")):
        fam.add(counters[key], policy=key.partition(":")[2])
    return fam


def _session_gauges(engine) -> list[Family]:
    """Sessions held by in-process drafter and verifier (embedded engine only; the services
    report theirs in their own Health)."""
    sides = engine.sessions()
    if not sides:
        return []
    fam = Family("vericache_sessions", "gauge", "per-request KV sessions held in this process")
    for side, n in sides.items():
        fam.add(n, side=side)
    return [fam]


def store_collector(store) -> Collector:
    """The kvstore's own counters (`ChunkStore.stats()`), read at each scrape."""
    def collect() -> list[Family]:
        try:
            st = store.stats()
        except Exception:  # the store being down must not break /metrics
            return [Family("vericache_kvstore_up", "gauge", "whether the kvstore answered").add(0)]
        out = [Family("vericache_kvstore_up", "gauge", "whether the kvstore answered").add(1)]
        for key in ("hits", "misses", "bytes_in", "bytes_out"):
            out.append(Family(f"vericache_kvstore_{key}_total", "counter",
                              f"kvstore {key.replace('_', ' ')}").add(st.get(key, 0)))
        return out
    return collect
