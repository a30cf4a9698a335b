"""The gateway's Prometheus metrics, through `prometheus_client`.

Every app owns one `GatewayMetrics` and its own `CollectorRegistry` (never the process-wide
default), so several apps in one process do not collide. Two kinds of metric live in it:
- read at scrape time: `EngineCollector` turns `Engine.metrics()` (the engine keeps its own
  counters, tau and k histograms, KV bytes and budgets) into metric families, and
  `StoreCollector` does the same for the kvstore's `stats()`;
- observed as requests pass the gateway: HTTP responses by route and code, time to first
  token, time per output token and queue time (`GatewayMetrics.observe_request`).
deploy/grafana/vericache.json charts them; tests/test_page.py checks that every metric it
queries is exposed.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from vericache.engine.scheduler import LANES as EXECUTOR_LANES

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
TAU_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)
# engine counter -> (metric, help); each is a counter read from Engine.metrics()["counters"]
ENGINE_COUNTERS = {
    "requests": ("vericache_requests_total", "requests accepted by the engine"),
    "errors": ("vericache_request_errors_total", "requests that ended in an error"),
    "tokens": ("vericache_tokens_total", "verified output tokens emitted"),
    "rounds": ("vericache_rounds_total", "draft/verify rounds of finished requests"),
    "draft_s": ("vericache_draft_seconds_total", "time spent drafting"),
    "verify_s": ("vericache_verify_seconds_total", "time spent verifying"),
    "prefill_s": ("vericache_prefill_seconds_total", "time spent in prefill"),
    "store_s": ("vericache_transfer_seconds_total",
                "time spent moving KV to and from the store (prefix reads and writes, the "
                "drafter's attach)"),
    "overlapped_rounds": ("vericache_overlapped_rounds_total",
                          "verify jobs during which the drafter lane drafted (staggered "
                          "schedule)"),
    "ahead_drafted": ("vericache_ahead_drafted_tokens_total",
                      "tokens drafted ahead past drafts in verification (staggered schedule)"),
    "draft_busy_s": ("vericache_draft_lane_busy_seconds_total",
                     "time the executor's drafter lane ran jobs"),
    "verify_busy_s": ("vericache_verify_lane_busy_seconds_total",
                      "time the executor's verifier lane ran jobs (verify; prefill in lockstep)"),
    "admit_busy_s": ("vericache_admit_lane_busy_seconds_total",
                     "time the executor's admission lane ran prefill jobs (staggered schedule)"),
    "store_hits": ("vericache_store_hits_total", "KV chunks read from the store"),
    "store_bytes_read": ("vericache_store_read_bytes_total", "KV bytes read from the store"),
    "store_bytes_written": ("vericache_store_written_bytes_total", "KV bytes written to the store"),
    "cached_tokens": ("vericache_cached_prompt_tokens_total",
                      "prompt tokens whose full KV came from the prefix cache"),
    "select_s": ("vericache_selection_seconds_total",
                 "verifier time spent choosing the drafter's kept tokens"),
    "select_moved_tokens": ("vericache_selection_moved_tokens_total",
                            "tokens moved into drafters' kept sets (over layers and KV heads)"),
    "select_delta_bytes": ("vericache_selection_delta_bytes_total",
                           "bytes of the moves of drafters' kept sets"),
}
LANES = {lane: f"{lane}_busy_s" for lane in EXECUTOR_LANES}


def histogram(name: str, help: str, counts: dict[int | float, int],
              buckets: tuple[float, ...]) -> HistogramMetricFamily:
    """A histogram family from observed value -> count."""
    cum = [(floatToGoString(le), sum(n for v, n in counts.items() if v <= le)) for le in buckets]
    cum.append(("+Inf", sum(counts.values())))
    return HistogramMetricFamily(name, help, buckets=cum,
                                 sum_value=sum(v * n for v, n in counts.items()))


class LaneUtilisation:
    """Busy share of each lane over the last `window_s`: the growth of its busy-seconds
    counter between now and the newest reading at least `window_s` old (the engine's whole
    life until one is). A job's time counts when the job ends, so one reading may pass 1:
    it is clamped."""

    def __init__(self, window_s: float = 10.0, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._start = clock()
        self._readings: deque[tuple[float, dict[str, float]]] = deque()
        self._lock = threading.Lock()

    def __call__(self, busy: dict[str, float]) -> dict[str, float]:
        now = self.clock()
        with self._lock:
            while len(self._readings) > 1 and now - self._readings[1][0] >= self.window_s:
                self._readings.popleft()
            if self._readings and now - self._readings[0][0] >= self.window_s:
                t0, before = self._readings[0]
            else:
                t0, before = self._start, {}
            self._readings.append((now, dict(busy)))
        span = max(now - t0, 1e-9)
        return {lane: min(1.0, max(0.0, (b - before.get(lane, 0.0)) / span))
                for lane, b in busy.items()}


class EngineCollector(Collector):
    """The engine's counters, histograms and gauges, read from `engine.metrics()` at scrape."""

    def __init__(self, engine):
        self.engine = engine
        self.utilisation = LaneUtilisation()

    def collect(self):
        m = self.engine.metrics()
        c = m.get("counters", {})
        for key, (name, help) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, help, value=c.get(key, 0))
        yield histogram("vericache_tokens_per_round", "tokens emitted per round (tau)",
                        m.get("tau_hist", {}), TAU_BUCKETS)
        fam = CounterMetricFamily("vericache_selection_requests_total", "finished requests by "
                                  "the selection policy that moved their drafter's set",
                                  labels=["policy"])
        for key in sorted(k for k in c if k.startswith("selection:")):
            fam.add_metric([key.partition(":")[2]], c[key])
        yield fam
        yield from _draft_len_families(m.get("k_hist", {}), m.get("costs", {}))
        yield GaugeMetricFamily("vericache_queue_depth", "requests waiting to start",
                                value=self.engine.queue_depth)
        yield GaugeMetricFamily("vericache_active_requests", "requests being decoded",
                                value=self.engine.active)
        util = GaugeMetricFamily("vericache_lane_utilisation", "share of the last 10 s the "
                                 "executor's lane ran jobs (draft: drafter, verify: verifier)",
                                 labels=["lane"])
        for lane, share in self.utilisation({lane: c.get(key, 0.0)
                                             for lane, key in LANES.items()}).items():
            util.add_metric([lane], share)
        yield util
        sides = self.engine.sessions()
        if sides:  # embedded engine only: the services report theirs in their own Health
            fam = GaugeMetricFamily("vericache_sessions", "per-request KV sessions held in "
                                    "this process", labels=["side"])
            for side, n in sides.items():
                fam.add_metric([side], n)
            yield fam
        yield from _kv_families(m.get("kv_bytes", {}))


def _kv_families(kv: dict):
    """KV bytes the admitted requests hold, and the budgets admission keeps them within."""
    used = GaugeMetricFamily("vericache_kv_bytes", "KV bytes charged to admitted requests, "
                             "per side", labels=["side"])
    budget = GaugeMetricFamily("vericache_kv_budget_bytes", "KV memory budget per side "
                               "(absent: unbounded)", labels=["side"])
    for side, v in sorted(kv.items()):
        used.add_metric([side], v["in_use"])
        if v["budget"] is not None:
            budget.add_metric([side], v["budget"])
    return [used, budget]


def _draft_len_families(k_hist: dict, costs: dict):
    """What the cost model chose (rounds at each k, plain steps) and what it expects."""
    rounds = CounterMetricFamily("vericache_draft_len_rounds_total", "vericache rounds of "
                                 "finished requests by drafts verified (k=0: plain full-KV "
                                 "decode steps chosen by the cost model)", labels=["k"])
    for k in sorted(k_hist):
        rounds.add_metric([str(k)], k_hist[k])
    total = sum(k_hist.values())
    return [
        rounds,
        GaugeMetricFamily("vericache_plain_round_share", "share of vericache rounds that were "
                          "plain decode steps (k=0)",
                          value=k_hist.get(0, 0) / total if total else 0.0),
        GaugeMetricFamily("vericache_cost_model_predicted_tokens_per_second", "goodput the cost "
                          "model expected of its chosen draft lengths (running mean)",
                          value=costs.get("predicted_tps", 0.0)),
        GaugeMetricFamily("vericache_cost_model_measured_tokens_per_second", "goodput measured "
                          "over the same rounds (running mean)",
                          value=costs.get("measured_tps", 0.0)),
        GaugeMetricFamily("vericache_cost_model_fitted", "1 once the cost model has seen "
                          "enough rounds to choose k (0: exploring)",
                          value=1.0 if costs.get("fitted") else 0.0),
        GaugeMetricFamily("vericache_cost_model_calibration_seconds", "how long the start-up "
                          "calibration's timed rounds took (0: none ran)",
                          value=(costs.get("calibration") or {}).get("seconds", 0.0)),
        GaugeMetricFamily("vericache_cost_model_commit_seconds", "what committing one drafting "
                          "request's outcome to its drafter costs a round (running mean)",
                          value=costs.get("commit_s", 0.0)),
    ]


class StoreCollector(Collector):
    """The kvstore's own counters (`ChunkStore.stats()`), read at each scrape."""

    def __init__(self, store):
        self.store = store

    def collect(self):
        try:
            st = self.store.stats()
        except Exception:  # noqa: BLE001 -- the store being down must not break /metrics
            yield GaugeMetricFamily("vericache_kvstore_up", "whether the kvstore answered", value=0)
            return
        yield GaugeMetricFamily("vericache_kvstore_up", "whether the kvstore answered", value=1)
        for key in ("hits", "misses", "bytes_in", "bytes_out"):
            yield CounterMetricFamily(f"vericache_kvstore_{key}_total",
                                      f"kvstore {key.replace('_', ' ')}", value=st.get(key, 0))


class GatewayMetrics:
    """One app's registry: the engine's and store's collectors, and what the gateway observes."""

    def __init__(self, engine, store=None):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine))
        if store is not None:
            self.registry.register(StoreCollector(store))
        r = self.registry
        self.http = Counter("vericache_http_responses", "HTTP responses sent by the gateway, by "
                            "route and status code", ["route", "code"], registry=r)
        self.ttft = Histogram("vericache_time_to_first_token_seconds", "time from a request's "
                              "arrival to its first output token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("vericache_time_per_output_token_seconds", "time between a "
                              "request's first and last output token, per token after the "
                              "first", buckets=TPOT_BUCKETS, registry=r)
        self.queue = Histogram("vericache_queue_seconds", "time a request waited before its "
                               "prefill: time to first token less the prefill's own seconds",
                               buckets=QUEUE_BUCKETS, registry=r)

    def observe_response(self, route: str, status: int) -> None:
        self.http.labels(route=route, code=str(status)).inc()

    def observe_request(self, ttft_s: float | None, tokens: int, decode_s: float,
                        prefill_s: float) -> None:
        """A finished request: seconds to its first token (None: it emitted none), its output
        tokens, the seconds from its first to its last token, its prefill's seconds."""
        if ttft_s is None:
            return
        self.ttft.observe(ttft_s)
        self.queue.observe(max(0.0, ttft_s - prefill_s))
        if tokens > 1:
            self.tpot.observe(decode_s / (tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
