"""Figures of a scenario run: per variant, and the ratios between variants.

Per variant: throughput (emitted tokens over the wall time from the first admission to the
last token), TTFT (mean over requests, from the run's start: queueing under the memory
budget counts), time per output token (mean over requests of (finish − first token) /
(tokens − 1)), τ (tokens per round over all rounds; the plain steps that finish a request on
a verification's held copy, `held_steps`, are not rounds: they load nothing), bytes of full KV
moved over the link per emitted token (verify loads and write-backs; the prefill's offload is
reported apart) and the loads, and how much of the link's transfer time was hidden:
- by layer prefetch: transfer time during which the forward pass did not wait;
- by staggering: the forward pass's waits that fell while the drafter lane was busy;
- transfer_hidden_share: the sum of the two, over the transfer time.
In the remote-prefix scenario the bytes each node read over its link are reported too
(`link_bytes`), and the summary's ttft_ratio_vs_full is full_far's mean TTFT over VeriCache's.
Selection (`vericache.select`): the policy, the verifier's seconds choosing the drafter's set
as a share of the requests' draft and verify time, and the bytes of the set's moves per
emitted token; the summary has τ and the throughput ratios per policy (`by_selection`).
"""

from __future__ import annotations

from vericache.bench.metrics import mean, ngram_rounds, tau_hist
from vericache.engine.scheduler import ADMIT_LANE, DRAFT_LANE, VERIFY_LANE


def overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds covered by both interval lists (each list's intervals may not overlap)."""
    a, b = sorted(a), sorted(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def variant_measures(raw: dict, reference: list[list[int]], kv_per_token: int,
                     draft_weight_bytes: int | None = None,
                     draft_weight_form: str | None = None,
                     draft_head: str | None = None,
                     draft_layers: str | None = None) -> dict:
    """The variant's row of the report, from `vericache.bench.scenario.run_variant`'s record.
    `draft_weight_bytes`: the drafter's weight copy (`Runner.draft_weight_bytes`), memory a
    variant that drafts holds beside its KV (None: not known here, as the drafter service's),
    `draft_weight_form` its form (`Runner.draft_weight_form`), `draft_head` how a draft
    pass computes the LM head (`Runner.draft_head_form`) and `draft_layers` its layers'
    products (`Runner.draft_layers_form`)."""
    gens, tr, st = raw["gens"], raw["trace"], raw["tier_stats"]
    tokens = sum(len(g.output_ids) for g in gens)
    wall = tr.end - tr.start
    ttft = [tr.first_token[g.rid] - tr.start for g in gens if g.rid in tr.first_token]
    tpot = [(tr.finish[g.rid] - tr.first_token[g.rid]) / (len(g.output_ids) - 1)
            for g in gens if len(g.output_ids) > 1 and g.rid in tr.finish]
    rounds = [n for g in gens for n in g.stats.round_emitted]
    identical = [g.output_ids == ref for g, ref in zip(gens, reference)]
    sel_s = sum(g.stats.select_s for g in gens)
    k_hist: dict[int, int] = {}
    for g in gens:
        for k, n in g.stats.k_hist.items():
            k_hist[k] = k_hist.get(k, 0) + n
    round_s = sum(g.stats.draft_s + g.stats.verify_s for g in gens)
    row = {
        "variant": raw["variant"], "mode": raw["mode"], "tier": raw["tier"],
        "selection": gens[0].params.selection if raw["mode"] != "full" else None,
        # rounds by drafts verified (0: plain decode steps the cost model chose)
        "draft_len_hist": {str(k): k_hist[k] for k in sorted(k_hist)} if raw["mode"] == "vericache" else None,
        "select_s": _r(sel_s), "select_share_of_rounds": _r(_ratio(sel_s, round_s)),
        "select_delta_bytes_per_token": _r(_ratio(sum(g.stats.select_delta_bytes for g in gens),
                                                  tokens), 1),
        "schedule": raw["schedule"], "requests": len(gens), "tokens": tokens,
        "wall_s": _r(wall), "throughput_tps": _r(tokens / wall if wall > 0 else None, 3),
        "ttft_mean_s": _r(mean(ttft)), "tpot_mean_s": _r(mean(tpot)),
        "tau_mean": _r(mean(rounds)), "tau_hist": tau_hist(rounds),
        # plain steps on a verification's loaded copy that finished requests (no load each)
        "held_steps": sum(g.stats.held_steps for g in gens),
        # a model-free n-gram (prompt lookup) drafter's τ on the same outputs, same k
        "ngram_tau": _r(mean([n for g, ref in zip(gens, reference)
                              for n in ngram_rounds(g.prompt, ref, g.params.draft_len)]))
        if raw["mode"] == "vericache" else None,
        "acceptance_rate": _r(mean([g.stats.acceptance_rate for g in gens]))
        if raw["mode"] == "vericache" else None,
        "max_active": tr.max_active,
        # the most KV bytes the scheduler charged at once, per side (the budget bounds the sum)
        "kv_peak_draft_bytes": tr.peak_kv[0], "kv_peak_verify_bytes": tr.peak_kv[1],
        "kv_peak_total_bytes": tr.peak_kv_total,
        # the drafter's weight copy, outside the KV budget (0: full, or no copy), and its
        # form (`Runner.draft_weight_form`: "blocks", "bfloat16", "model"; None: not known)
        "draft_weight_bytes": draft_weight_bytes if raw["mode"] != "full" else 0,
        "draft_weight_form": draft_weight_form if raw["mode"] != "full" else None,
        # a draft pass's LM head (`Runner.draft_head_form`: "int8", "exact"; None: not known)
        "draft_head": draft_head if raw["mode"] != "full" else None,
        # its layers' products (`Runner.draft_layers_form`: "int8x2", "exact"; None: not known)
        "draft_layers": draft_layers if raw["mode"] != "full" else None,
        "draft_busy_s": _r(sum(b - a for a, b in tr.busy[DRAFT_LANE])),
        "verify_busy_s": _r(sum(b - a for a, b in tr.busy[VERIFY_LANE])),
        "admit_busy_s": _r(sum(b - a for a, b in tr.busy[ADMIT_LANE])),
        "lanes_overlap_s": _r(overlap_s(tr.busy[DRAFT_LANE], tr.busy[VERIFY_LANE])),
        # where each lane's time went: "lane:kind" -> {"s": seconds, "jobs": count}
        "busy_by_job": {f"{lane}:{kind}": {"s": _r(sec), "jobs": n}
                        for (lane, kind), (sec, n) in sorted(tr.jobs.items())},
        "identical": all(identical), "identical_requests": sum(identical),
        "ahead_drafted": tr.ahead_drafted,
        "link_bytes": raw.get("links"),
        # the cost model's start-up calibration before the timed run (None: none ran)
        "calibration": raw.get("calibration"),
        # the untimed earlier requests it served after calibrating, and the acceptance rate it
        # pooled from them (None: its timed requests were its first)
        "warm": raw.get("warm"),
        "full_kv_bytes_per_request": _r(mean([len(g.prompt) * kv_per_token for g in gens]), 0),
        "compressed_kv_bytes_per_request": _r(mean([g.stats.draft_kv_bytes for g in gens]), 0)
        if raw["mode"] != "full" else None,
        "kv_bytes_moved": None, "kv_bytes_moved_per_token": None, "prefill_offload_bytes": None,
        "transfer_s": None, "stall_s": None, "hidden_by_prefetch_s": None,
        "hidden_by_staggering_s": None, "transfer_hidden_share": None,
    }
    links = raw.get("links")
    if links is not None:  # remote-prefix: what crossed each node's link to the store
        moved = sum(links.values())
        row.update({"kv_bytes_moved": moved,
                    "kv_bytes_moved_per_token": _r(moved / tokens if tokens else None, 0),
                    "slow_link_bytes": links["far_bytes_read"] + links["far_bytes_written"]})
    if st is not None:
        prompt_bytes = sum(len(g.prompt) for g in gens) * kv_per_token
        moved = st.bytes_loaded + st.bytes_stored - prompt_bytes
        by_stagger = overlap_s(st.stalls, tr.busy[DRAFT_LANE])
        by_prefetch = max(0.0, st.transfer_s - st.stall_s)
        row.update({
            "kv_bytes_moved": moved, "kv_bytes_moved_per_token": _r(moved / tokens if tokens else None, 0),
            "prefill_offload_bytes": prompt_bytes, "loads": st.loads, "transfer_s": _r(st.transfer_s),
            "stall_s": _r(st.stall_s), "hidden_by_prefetch_s": _r(by_prefetch),
            "hidden_by_staggering_s": _r(by_stagger),
            "transfer_hidden_share": _r(_ratio(by_prefetch + by_stagger, st.transfer_s)),
        })
    return row


def summarize(rows: list[dict], schedule: str, resident: str | None = "full_resident",
              offloaded: str | None = "full_offloaded") -> dict:
    """The headline ratios; VeriCache is the `schedule` variant; `resident` and `offloaded`
    name the variants that stand for full KV kept by the verifier and full KV loaded over the
    slow link (remote-prefix: full_near and full_far); None where the run has no such
    variant (through the services, only the verifier's own tier runs), and its ratios are None."""
    by = {r["variant"]: r for r in rows}
    vc = by[f"vericache_{schedule}"]
    tps = {k: r["throughput_tps"] for k, r in by.items()}
    tps[None] = None
    none = {"ttft_mean_s": None, "kv_bytes_moved_per_token": None}
    by.setdefault(None, none)
    checked = [r for r in rows if r["mode"] != "lossy"]
    headline = f"vericache_{schedule}"
    by_selection = {
        r["selection"]: {"variant": r["variant"], "tau_mean": r["tau_mean"],
                         "throughput_tps": r["throughput_tps"], "ngram_tau": r["ngram_tau"],
                         "throughput_ratio_vs_full_resident": _r(_ratio(r["throughput_tps"], tps[resident])),
                         "throughput_ratio_vs_full_offloaded": _r(_ratio(r["throughput_tps"], tps[offloaded])),
                         "select_share_of_rounds": r["select_share_of_rounds"],
                         "select_delta_bytes_per_token": r["select_delta_bytes_per_token"]}
        for r in rows if r["variant"].partition(":")[0] == headline and not r["variant"].endswith(":fixed")}
    return {
        "by_selection": by_selection,
        "vericache_variant": vc["variant"],
        "baseline_variants": {"full_resident": resident, "full_offloaded": offloaded},
        "throughput_ratio_vs_full_resident": _r(_ratio(vc["throughput_tps"], tps[resident])),
        "throughput_ratio_vs_full_offloaded": _r(_ratio(vc["throughput_tps"], tps[offloaded])),
        "throughput_ratio_vs_lossy": _r(_ratio(vc["throughput_tps"], tps["lossy"])),
        # the same ratios under the baselines' own names (remote-prefix: full_near, full_far)
        "throughput_ratio_vs": {name: _r(_ratio(vc["throughput_tps"], tps[name]))
                                for name in (resident, offloaded) if name is not None},
        "staggered_vs_lockstep": _r(_ratio(tps["vericache_staggered"], tps["vericache_lockstep"])),
        # TTFT of loading the full KV over the slow link, over VeriCache's (higher is better)
        "ttft_ratio_vs_full": _r(_ratio(by[offloaded]["ttft_mean_s"], vc["ttft_mean_s"])),
        "tau_mean": vc["tau_mean"],
        "kv_bytes_moved_per_token_ratio_vs_full_offloaded": _r(_ratio(
            vc["kv_bytes_moved_per_token"], by[offloaded]["kv_bytes_moved_per_token"])),
        "transfer_hidden_share_staggered": by["vericache_staggered"]["transfer_hidden_share"],
        "transfer_hidden_share_lockstep": by["vericache_lockstep"]["transfer_hidden_share"],
        "identical": all(r["identical"] for r in checked),
        "not_identical": [r["variant"] for r in checked if not r["identical"]],
        "lossy_identical": by["lossy"]["identical"],
        # each schedule with the cost model's k over the same schedule with k fixed (rows
        # "<variant>:fixed", with --with-fixed-k; empty without them)
        "adaptive_vs_fixed": {v: _r(_ratio(tps[v], tps[f"{v}:fixed"]))
                              for v in ("vericache_lockstep", "vericache_staggered")
                              if f"{v}:fixed" in tps},
    }
