"""A bandwidth cost model that projects a measured run onto GPU machines.

Decoding a batch is memory-bound on these machines, so a step costs the bytes it reads over
the bandwidth it reads them at (docs/performance.md derives every line):

    full step, resident:     t_full = (W + B·F) / BW_hbm
    draft step:              t_draft = (W + B·F/r) / BW_hbm
    verify pass, offloaded:  t_load = B·F / BW_link   (overlapped with its compute, t_full)
    round, lockstep:         k·t_draft + max(t_full, t_load)
    round, staggered:        max(k·t_draft + t_full, t_load)   (one group's load under the
                             other's draft; both lanes share the HBM)

W: weight bytes, F: full KV bytes of one request, r: compression (full over compressed
bytes), k: drafts per round, τ: tokens per round, B: requests decoding at once. The full
resident baseline holds at most (M_hbm − W) / F requests. Limits (all three are unit-tested):

- drafting speedup cap: with w = W / (W + B·F), no acceptance makes VeriCache faster than
  1 / (w + (1 − w)/r) times full-resident decoding at the same batch;
- link ceiling: offloaded verification emits at most τ·BW_link/F tokens/s (all requests);
- break-even τ* ≈ BW_hbm / BW_link: the τ at which the link ceiling reaches the resident
  baseline's KV-bound rate BW_hbm/F.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Machine:
    """Peak figures from the vendors' data sheets; `efficiency` scales both bandwidths."""

    name: str
    hbm_gb: float  # GPU memory, GB
    hbm_gbps: float  # GPU memory bandwidth, GB/s
    link_gbps: float  # host <-> GPU bandwidth, one direction, GB/s
    efficiency: float = 0.8

    @property
    def bw_hbm(self) -> float:
        return self.hbm_gbps * GB * self.efficiency

    @property
    def bw_link(self) -> float:
        return self.link_gbps * GB * self.efficiency


MACHINES = {
    "h200-pcie5": Machine("h200-pcie5", 141, 4800, 64),  # H200 SXM, PCIe 5.0 x16 to the host
    "h100-pcie5": Machine("h100-pcie5", 80, 2000, 64),  # H100 PCIe card, PCIe 5.0 x16
    "gh200": Machine("gh200", 96, 4000, 450),  # Grace Hopper: NVLink-C2C 900 GB/s both ways
}


def machine(name: str) -> Machine:
    try:
        return MACHINES[name]
    except KeyError:
        raise ValueError(f"unknown machine {name!r}; valid: {', '.join(MACHINES)}") from None


def draft_speedup_cap(w: float, r: float) -> float:
    """1 / (w + (1 − w)/r): a draft step's cost relative to a full step, inverted."""
    return 1.0 / (w + (1.0 - w) / r)


def link_ceiling_tps(tau: float, bw_link: float, full_kv_bytes: float) -> float:
    """τ·BW_link/F: tokens/s that offloaded verification can emit at most."""
    return tau * bw_link / full_kv_bytes


def break_even_tau(bw_hbm: float, bw_link: float) -> float:
    """τ* ≈ BW_hbm/BW_link."""
    return bw_hbm / bw_link


def project(m: Machine, tau: float, k: float, r: float, weight_bytes: float,
            full_kv_bytes: float, batch: int) -> dict:
    """Tokens/s of VeriCache (offloaded full KV) and of the full-KV baselines on `m`."""
    W, F, B = weight_bytes, full_kv_bytes, batch
    fit = max(1, min(B, int((m.hbm_gb * GB - W) // F)))  # resident baseline's batch
    t_full_res = (W + fit * F) / m.bw_hbm
    t_full = (W + B * F) / m.bw_hbm
    t_draft = (W + B * F / r) / m.bw_hbm
    t_load = B * F / m.bw_link
    lock = k * t_draft + max(t_full, t_load)
    stag = max(k * t_draft + t_full, t_load)
    full_resident = fit / t_full_res
    full_offloaded = B / max(t_full, t_load)
    vc_lock, vc_stag = B * tau / lock, B * tau / stag
    return {
        "machine": m.name, "batch": B, "full_resident_batch": fit,
        "full_resident_tps": full_resident, "full_offloaded_tps": full_offloaded,
        "vericache_lockstep_tps": vc_lock, "vericache_staggered_tps": vc_stag,
        "throughput_ratio_vs_full_resident": vc_stag / full_resident,
        "throughput_ratio_vs_full_offloaded": vc_stag / full_offloaded,
        "staggered_vs_lockstep": vc_stag / vc_lock,
        "draft_speedup_cap": draft_speedup_cap(W / (W + B * F), r),
        "link_ceiling_tps": link_ceiling_tps(tau, m.bw_link, F),
        "break_even_tau": break_even_tau(m.bw_hbm, m.bw_link),
        "inputs": {"tau": tau, "k": k, "compression": r, "weight_bytes": W,
                   "full_kv_bytes": F, "bw_hbm": m.bw_hbm, "bw_link": m.bw_link},
    }


def project_remote_prefix(m: Machine, tau: float, k: float, r: float, weight_bytes: float,
                          prefix_kv_bytes: float, batch: int, slow_gbps: float, fast_gbps: float,
                          max_tokens: int) -> dict:
    """Remote prefix caching on `m`: B requests share a prefix of P bytes of full KV and
    decode T tokens each. Full decoding on the far node waits for P over the slow link, then
    decodes T steps. VeriCache's verifier (next to the store) reads P over the fast link and
    answers at once; its rounds carry no drafts until the compressed prefix (P/r) has crossed
    the slow link, then emit τ tokens per request per round of k draft steps and one verify
    pass (about one decode step's bytes on a GPU). Full decoding next to the store (near)
    reads P over the fast link and decodes T steps: the baseline to beat where a node can
    sit next to the store."""
    W, P, B, T = weight_bytes, prefix_kv_bytes, batch, max_tokens
    slow, fast = slow_gbps * 1e9 / 8, fast_gbps * 1e9 / 8
    t_full = (W + B * P) / m.bw_hbm
    t_draft = (W + B * P / r) / m.bw_hbm
    far_ttft = P / slow + t_full
    far_total = P / slow + T * t_full
    near_ttft = P / fast + t_full
    near_total = P / fast + T * t_full
    vc_ttft = P / fast + t_full
    t, done, ready = vc_ttft, 1, P / fast + P / (r * slow)
    while done < T and t < ready:  # plain decode steps on the verifier until drafts can start
        t, done = t + t_full, done + 1
    rounds = max(0.0, (T - done) / tau)
    vc_total = t + rounds * (k * t_draft + t_full)
    return {
        "machine": m.name, "scenario": "remote-prefix", "batch": B, "max_tokens": T,
        "full_far_ttft_s": far_ttft, "vericache_ttft_s": vc_ttft,
        "ttft_ratio_vs_full": far_ttft / vc_ttft,
        "full_far_tps": B * T / far_total, "vericache_tps": B * T / vc_total,
        "throughput_ratio_vs_full_far": far_total / vc_total,
        "full_near_ttft_s": near_ttft, "full_near_tps": B * T / near_total,
        "ttft_ratio_vs_full_near": near_ttft / vc_ttft,
        "throughput_ratio_vs_full_near": near_total / vc_total,
        "inputs": {"tau": tau, "k": k, "compression": r, "weight_bytes": W,
                   "prefix_kv_bytes": P, "slow_link_bytes_s": slow, "fast_link_bytes_s": fast,
                   "bw_hbm": m.bw_hbm},
    }


def measured_round(doc: dict) -> tuple[dict, float, float, float]:
    """VeriCache's row of a scenario document and what a round measured there: τ, drafts
    per round k (= (τ − 1) / acceptance, within [1, k_max]) and compression r."""
    rows = {r["variant"]: r for r in doc["variants"]}
    vc = rows[doc["summary"]["vericache_variant"]]
    tau = vc["tau_mean"] or 1.0
    acc, kmax = vc["acceptance_rate"], doc["settings"]["draft_len"]
    k = min(max((tau - 1) / acc if acc else kmax, 1.0), kmax)
    full = vc["full_kv_bytes_per_request"]
    comp = vc["compressed_kv_bytes_per_request"] or full
    return vc, tau, k, full / comp


def project_run(doc: dict, machine_name: str, weight_bytes: float) -> dict:
    """Project a scenario document (`vericache.bench.scenario.run_scenario`) onto a machine:
    τ, drafts per round and compression as measured; F and B as in the run."""
    vc, tau, k, r = measured_round(doc)
    st = doc["settings"]
    if doc.get("scenario") == "remote-prefix":
        prefix = st["shared_prefix_tokens"] * st["kv_bytes_per_token"]
        return project_remote_prefix(machine(machine_name), tau, k, r, weight_bytes, prefix,
                                     vc["requests"], st["drafter_link_gbps"], st["link_gbps"],
                                     st["max_tokens"])
    return project(machine(machine_name), tau, k, r, weight_bytes, vc["full_kv_bytes_per_request"],
                   vc["requests"])


def project_measured(doc: dict, gpu: dict, hbm_bytes: float | None = None) -> list[dict]:
    """A long-context run's τ, drafts per round and compression with pass times measured on a
    device (`benchmarks/gpu_timing.py`): per measured point (batch B, context N), the same
    round formulas as `project` with t_full, t_verify and t_draft as measured and
    t_load = B·F / the measured host-to-device rate. The resident baseline holds
    min(B, (hbm_bytes − W) / F) requests; at fewer than B its step is the measured one scaled
    by its bytes, (W + fit·F) / (W + B·F). `hbm_bytes`: default the device's from the file.
    The draft steps were measured at the file's compression, not the run's (both reported)."""
    _, tau, k, r = measured_round(doc)
    h2d = gpu["h2d_gb_s"] * GB
    W = gpu["weight_bytes"]
    hbm = hbm_bytes if hbm_bytes is not None else gpu.get("memory_bytes")
    out = []
    for p in gpu["points"]:
        B, F = p["batch"], p["full_kv_bytes_per_request"]
        fit = B if hbm is None else max(1, min(B, int((hbm - W) // F)))
        t_full_res = p["full_step_s"] * (W + fit * F) / (W + B * F)
        t_load = B * F / h2d
        lock = k * p["draft_step_s"] + max(p["verify_pass_s"], t_load)
        stag = max(k * p["draft_step_s"] + p["verify_pass_s"], t_load)
        full_resident, full_offloaded = fit / t_full_res, B / max(p["full_step_s"], t_load)
        out.append({
            "device": gpu["device"], "shape": gpu["shape"], "batch": B, "context": p["context"],
            "full_resident_batch": fit, "full_resident_tps": full_resident,
            "full_offloaded_tps": full_offloaded,
            "vericache_lockstep_tps": B * tau / lock, "vericache_staggered_tps": B * tau / stag,
            "throughput_ratio_vs_full_resident": B * tau / stag / full_resident,
            "throughput_ratio_vs_full_offloaded": B * tau / stag / full_offloaded,
            # the τ at which the link's ceiling, B·τ / t_load, reaches the resident rate
            "break_even_tau": t_load * fit / (B * t_full_res),
            "inputs": {"tau": tau, "k": k, "compression_run": r,
                       "compression_measured": p["ratio"], "t_full_s": p["full_step_s"],
                       "t_verify_s": p["verify_pass_s"], "t_draft_s": p["draft_step_s"],
                       "t_load_s": t_load, "h2d_bytes_s": h2d},
        })
    return out
