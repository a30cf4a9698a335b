"""The scenario benchmarks end to end on the real model (small sizes): long-context and
remote-prefix in this process, long-context through real drafter and verifier services, and
the node-side store pieces they stand on."""

import json
import threading
import time

import pytest
from conftest import chat_ids, long_code_prompt
from test_services_e2e import _grpc_ready, _kvstore_ready

from vericache.cli import main as vericache_main
from vericache.model import kernels
from vericache.spec.costmodel import PRIOR_RATE
from vericache.store.memory import MemoryStore
from vericache.store.keys import (chunk_key, compressed_key, full_key, is_chunk_key,
                                  refresh_key)
from vericache.store.node import LinkedStore, NodeCache

SMALL = ["--concurrency", "2", "--context-tokens", "400", "--max-tokens", "12", "--compressors",
         "snapkv", "--ratios", "4", "--draft-lens", "8", "--chunk-size", "64", "--threads", "1",
         "--quiet"]


def _bench(tmp_path, *args, calibrate: bool = False) -> dict:
    """A small scenario run's JSON; the cost model starts cold unless `calibrate` (seconds per
    vericache variant)."""
    out = tmp_path / "run.json"
    flags = [] if calibrate else ["--no-calibrate"]
    assert vericache_main(["bench", *args, *SMALL, *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _check_common(doc: dict, names: set[str]) -> None:
    s = doc["summary"]
    assert {r["variant"] for r in doc["variants"]} == names
    assert s["identical"] is True and s["not_identical"] == []
    for key in ("throughput_ratio_vs_full_resident", "throughput_ratio_vs_full_offloaded",
                "staggered_vs_lockstep", "ttft_ratio_vs_full", "tau_mean"):
        assert key in s
    for r in doc["variants"]:
        assert r["tokens"] == 2 * 12 and r["throughput_tps"] > 0


@pytest.mark.slow
def test_remote_prefix_scenario(tmp_path):
    doc = _bench(tmp_path, "--scenario", "remote-prefix", "--drafter-link-gbps", "1",
                 "--link-gbps", "200", calibrate=True)
    _check_common(doc, {"full_near", "full_far", "lossy", "vericache_lockstep", "vericache_staggered"})
    by = {r["variant"]: r for r in doc["variants"]}
    # each vericache variant calibrated its cost model through its own nodes before its run;
    # the baselines have no cost model to calibrate
    for name, row in by.items():
        if name.startswith("vericache"):
            assert row["calibration"]["fitted"] and row["calibration"]["seconds"] > 0, name
        else:
            assert row["calibration"] is None, name
    assert doc["settings"]["shared_prefix_tokens"] > 300
    # the far node read the full prefix once (shared by both requests: one load per node)
    far = by["full_far"]["link_bytes"]["far_bytes_read"]
    prefix_full = doc["settings"]["shared_prefix_tokens"] // 64 * 64 * doc["settings"]["kv_bytes_per_token"]
    assert prefix_full <= far < 1.5 * prefix_full
    # VeriCache's slow link carried the compressed prefix and exact tails, less than full, and
    # where a variant drafted (the drafter loads when a request is first planned to draft)
    for v in ("vericache_lockstep", "vericache_staggered"):
        drafted = any(int(k) > 0 for k in by[v]["draft_len_hist"])
        assert by[v]["slow_link_bytes"] < far and (by[v]["slow_link_bytes"] > 0 or not drafted), by[v]
    assert by["full_near"]["slow_link_bytes"] == 0
    assert doc["summary"]["ttft_ratio_vs_full"] > 0
    s = doc["summary"]  # VeriCache against decoding next to the store, named as such
    assert set(s["throughput_ratio_vs"]) == {"full_near", "full_far"}
    assert s["throughput_ratio_vs"]["full_near"] == s["throughput_ratio_vs_full_resident"]


@pytest.mark.slow
def test_long_context_scenario_with_budget_and_roofline(tmp_path):
    """Also --warm-requests: each adaptive vericache variant serves a request about another
    document before its timed run, and reports what it pooled; --with-fixed-k: both
    schedules again with k fixed, in the same run."""
    doc = _bench(tmp_path, "--scenario", "long-context", "--kv-budget-caches", "1",
                 "--link-gbps", "8", "--selection", "question,static", "--warm-requests", "1",
                 "--with-fixed-k")
    _check_common(doc, {"full_resident", "full_offloaded", "lossy", "vericache_lockstep",
                        "vericache_staggered", "vericache_lockstep:static",
                        "vericache_lockstep:fixed", "vericache_staggered:fixed"})
    by = {r["variant"]: r for r in doc["variants"]}
    assert set(doc["summary"]["adaptive_vs_fixed"]) == {"vericache_lockstep", "vericache_staggered"}
    assert all(x > 0 for x in doc["summary"]["adaptive_vs_fixed"].values())
    for r in doc["variants"]:
        if r["variant"].endswith(":fixed"):  # k = 8 (less at the end), no cost model
            assert r["warm"] is None and r["calibration"] is None, r["variant"]
            assert max(int(k) for k in r["draft_len_hist"]) == 8, r["draft_len_hist"]
        elif r["mode"] != "vericache":
            assert r["warm"] is None, r["variant"]
        else:
            assert r["warm"]["requests"] == 1 and r["warm"]["seconds"] > 0
            # pooled from the warm request's drafts (none where its cost model kept it on
            # plain steps: the prior a fresh model starts at)
            assert 0 < r["warm"]["pooled_acceptance"] <= 1
            assert (r["warm"]["pooled_acceptance"] != PRIOR_RATE) == (r["warm"]["drafted"] > 0), r["warm"]
    assert doc["settings"]["warm_requests"] == 1
    # one row per selection policy for the headline schedule, each with τ and its costs
    sel = doc["summary"]["by_selection"]
    assert set(sel) == {"question", "static"} and sel["static"]["variant"] == "vericache_lockstep:static"
    assert by["vericache_lockstep"]["select_delta_bytes_per_token"] > 0
    assert by["vericache_lockstep:static"]["select_delta_bytes_per_token"] == 0
    assert all(sel[p]["tau_mean"] >= 1 and sel[p]["ngram_tau"] >= 1 for p in sel)
    assert by["full_resident"]["max_active"] == 1  # the budget holds one full cache
    # the budget is the total: VeriCache's drafter KV is charged to it (a second request's
    # compressed KV plus one working copy does not fit in one cache)
    budget = doc["settings"]["kv_budget_bytes"]
    assert by["full_resident"]["kv_peak_verify_bytes"] <= budget
    # the full-KV baselines never held more than the budget (one cache); a VeriCache request
    # needs its drafter's KV beside a full one, which one cache cannot hold: the first request
    # is admitted anyway (progress), one full cache past the drafter's KV at most
    for r in doc["variants"]:
        top = budget if r["mode"] == "full" else budget + r["kv_peak_draft_bytes"]
        assert 0 < r["kv_peak_total_bytes"] <= top, (r["variant"], r["kv_peak_total_bytes"])
    assert by["full_resident"]["kv_peak_draft_bytes"] == 0
    assert 0 < by["vericache_lockstep"]["kv_peak_draft_bytes"] < budget
    # the drafter's weight copy is reported beside the KV, by the variants that draft: the
    # default model's quantized blocks, which every pass shares (no bytes of the drafter's own)
    assert by["full_resident"]["draft_weight_bytes"] == 0
    assert by["full_resident"]["draft_weight_form"] is None
    assert by["lossy"]["draft_weight_bytes"] == by["vericache_lockstep"]["draft_weight_bytes"] == 0
    assert by["vericache_lockstep"]["draft_weight_form"] == "blocks"
    assert by["full_resident"]["draft_head"] is None
    assert by["vericache_lockstep"]["draft_head"] == ("int8" if kernels.linear().q8x else "exact")
    assert by["vericache_lockstep"]["draft_layers"] == ("int8x2" if kernels.linear().q8x_vnni
                                                        else "exact")
    assert by["full_resident"]["draft_layers"] is None
    assert by["vericache_lockstep"]["max_active"] == 1
    assert by["full_offloaded"]["kv_bytes_moved_per_token"] > by["vericache_lockstep"]["kv_bytes_moved_per_token"]
    # where each lane's time went, per job kind: it adds up to the lane's busy time
    jobs = by["vericache_staggered"]["busy_by_job"]
    assert {"verify:verify", "draft:draft"} <= set(jobs) and jobs["verify:verify"]["jobs"] > 0
    assert any(k.endswith(":prefill") for k in jobs), jobs
    for lane in ("draft", "verify"):
        spent = sum(v["s"] for k, v in jobs.items() if k.startswith(f"{lane}:"))
        assert spent == pytest.approx(by["vericache_staggered"][f"{lane}_busy_s"], abs=0.01)
    roof = doc["roofline"]
    assert roof["inputs"]["read_gb_s"] > 0 and roof["inputs"]["matmul_gflop_s"] > 0
    assert doc["summary"]["resident_ratio_roofline"] > 0 and doc["summary"]["resident_ratio_of_roofline"] > 0


def test_bad_scenario_flags_fail_before_the_model_loads(capsys):
    assert vericache_main(["bench", "--scenario", "remote-prefix", "--drafter-link-gbps", "0"]) == 2
    assert vericache_main(["bench", "--scenario", "long-context", "--kv-budget-mb", "10",
                           "--kv-budget-caches", "2"]) == 2
    assert vericache_main(["bench", "--scenario", "long-context", "--warm-requests", "-1"]) == 2
    assert vericache_main(["bench", "--scenario", "long-context", "--with-fixed-k",
                           "--fixed-draft-len"]) == 2
    assert vericache_main(["bench", "--scenario", "long-context", "--repeats", "0"]) == 2
    assert vericache_main(["bench", "--scenario", "long-context", "--services", "drafter=x:1"]) == 2
    err = capsys.readouterr().err
    assert "drafter-link-gbps" in err and "not both" in err and "verifier=HOST:PORT" in err
    assert "--warm-requests must be >= 0" in err and "drop --fixed-draft-len" in err
    assert "--repeats must be >= 1" in err


def test_repeated_runs_report_the_median_and_are_identical_only_if_every_run_was():
    from vericache.bench.scenario import median_run

    runs = [{"throughput_tps": t, "identical": ok, "identical_requests": n, "tau_mean": t / 2}
            for t, ok, n in ((5.0, True, 8), (7.0, True, 8), (6.0, False, 7))]
    row = median_run(runs)
    assert row["throughput_tps"] == 6.0 and row["tau_mean"] == 3.0  # the median run's row
    assert row["throughput_runs"] == [5.0, 7.0, 6.0]
    assert row["identical"] is False and row["identical_requests"] == 7
    two = median_run(runs[:2])
    assert two["throughput_tps"] == 7.0 and two["identical"] is True


@pytest.mark.slow
def test_long_context_through_the_services(tmp_path, services, lm):
    """The scenario's rounds over gRPC: a verifier with an offloaded tier, a drafter, one
    kvstore (in memory); every output identical to in-process full greedy."""
    env = {"OMP_NUM_THREADS": "1"}
    kv = services("services.kvstore", ["--backend", "memory://"], _kvstore_ready, env=env)
    common = ["--kvstore", kv.address]
    ver = services("services.verifier", [*common, "--kv-tier", "offloaded", "--tier-link-gbps", "8"],
                   _grpc_ready("verifier"), timeout_s=120, env=env)
    dra = services("services.drafter", common, _grpc_ready("drafter"), timeout_s=120, env=env)
    doc = _bench(tmp_path, "--scenario", "long-context", "--services",
                 f"drafter={dra.address},verifier={ver.address}")
    _check_common(doc, {"full_offloaded", "lossy", "vericache_lockstep", "vericache_staggered"})
    s = doc["summary"]
    assert s["throughput_ratio_vs_full_resident"] is None  # the verifier runs one tier
    assert s["throughput_ratio_vs_full_offloaded"] > 0
    # the staggered variant's idle drafter lane drafts ahead over gRPC too (DraftAhead)
    by = {r["variant"]: r for r in doc["variants"]}
    assert by["vericache_staggered"]["ahead_drafted"] > 0
    assert by["vericache_lockstep"]["ahead_drafted"] == 0

    # the drafter gets the verifier's exact KV through the store, as in-process: the same
    # rounds, not only the same tokens (without the refresh the rounds differ)
    from vericache.engine.remote import RemoteBackends
    from vericache.engine.generation import GenParams
    from vericache.engine.local import generate
    from vericache.engine.rounds import LocalBackends
    from vericache.store.grpc_store import GrpcStore
    ids = chat_ids(lm, "Write a Python function that merges two sorted lists.")
    store = GrpcStore(kv.address)
    runs, moved, backends = {}, {}, {}
    for name in ("local", "remote", "remote-no-refresh"):
        # fixed k: rounds chosen by the cost model would follow each run's timings
        params = GenParams(max_tokens=24, compressor="streamingllm", ratio=4, draft_len=8,
                           chunk_size=16, ignore_eos=True, refresh_draft=name != "remote-no-refresh",
                           namespace=name, adaptive=False)
        b = (LocalBackends(lm, MemoryStore()) if name == "local" else
             RemoteBackends(dra.address, ver.address, lm.runner.vocab_size))
        before = store.stats()
        runs[name], backends[name] = generate(lm, ids, params, b), b
        after = store.stats()
        # per-request values (the refresh among them) go to the kvstore's scratch store
        moved[name] = tuple(after[f"scratch_{k}"] - before[f"scratch_{k}"]
                            for k in ("bytes_in", "bytes_out"))
    assert runs["remote"].token_ids == runs["local"].token_ids == runs["remote-no-refresh"].token_ids
    assert runs["remote"].stats.round_emitted == runs["local"].stats.round_emitted
    # each Verify answer carries the tier's seconds back to the gateway's cost model: the
    # rounds after the first (which ran on the prefilled KV) loaded it
    assert runs["remote"].stats.rounds > 1 and backends["remote"].tier_counters()[1] > 0
    # and the refresh did travel: the verifier wrote the exact KV of the verified tokens into
    # the kvstore's scratch and the drafter read it, beyond what the request moved without it
    # (whether the rounds then differ depends on how close the drafter's own KV came)
    refreshed = runs["remote"].stats.accepted + runs["remote"].stats.rounds
    kv_bytes = refreshed * lm.runner.kv_bytes_per_token()
    assert moved["remote"][0] - moved["remote-no-refresh"][0] >= kv_bytes, moved
    assert moved["remote"][1] - moved["remote-no-refresh"][1] >= kv_bytes, moved

    # where a load costs more than the plain steps left, the service's verification holds its
    # copy (`Finish` over gRPC: here the prefilled KV its first verification ran on) and the
    # request ends on plain steps: no load at all, the same tokens
    from vericache.spec.costmodel import CostModel
    costs = CostModel()
    for _ in range(6):  # one-token passes priced at 0.02 s beside a 10 s load
        costs.observe_verify(1, len(ids), len(ids), 0.02, load_s=10.0)
    b = RemoteBackends(dra.address, ver.address, lm.runner.vocab_size)
    held = generate(lm, ids, GenParams(max_tokens=24, compressor="streamingllm", ratio=4, draft_len=8,
                                       chunk_size=16, ignore_eos=True, namespace="held",
                                       adaptive=False), b, costs)
    assert held.token_ids == runs["local"].token_ids
    assert held.stats.rounds == 1 and held.stats.held_steps == 24 - 1 - held.stats.round_emitted[0] > 0
    assert b.tier_counters()[1] == 0

    # the drafter's set moves the same way over the services (deltas through the kvstore) as
    # in-process: `verify` re-selects after every round, and the rounds match
    ids = long_code_prompt(lm, 400)
    moved = {}
    for name in ("local", "remote", "remote-static"):
        params = GenParams(max_tokens=24, compressor="snapkv", ratio=4, draft_len=8, chunk_size=64,
                           ignore_eos=True, adaptive=False, namespace=f"sel-{name}",
                           selection="static" if name == "remote-static" else "verify:every=1,tokens=8")
        b = (LocalBackends(lm, MemoryStore()) if name == "local" else
             RemoteBackends(dra.address, ver.address, lm.runner.vocab_size))
        runs[name] = generate(lm, ids, params, b)
        moved[name] = runs[name].stats.select_moves
    assert runs["remote"].token_ids == runs["local"].token_ids == runs["remote-static"].token_ids
    assert runs["remote"].stats.round_emitted == runs["local"].stats.round_emitted
    # each Verify answer carries the tier's seconds back to the gateway's cost model: the
    # rounds after the first (which ran on the prefilled KV) loaded it
    assert runs["remote"].stats.rounds > 1 and backends["remote"].tier_counters()[1] > 0
    assert moved["remote"] == moved["local"] >= 2 and moved["remote-static"] == 0


def _chunk(n: int) -> str:
    """A prefix-chunk key (what a node cache keeps), one per `n`."""
    return full_key(chunk_key("m@float32", "", [n]))


def test_node_cache_loads_a_key_once_for_concurrent_readers():
    inner = MemoryStore()
    inner.put(_chunk(1), b"x" * 200_000)
    linked = LinkedStore(inner, 0.016)  # 2 MB/s: a read takes ~0.1 s
    node = NodeCache(linked)
    got = []
    threads = [threading.Thread(target=lambda: got.append(node.get(_chunk(1)))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [b"x" * 200_000] * 4
    assert linked.bytes_read == 200_000  # one transfer for four readers
    node.put("w", b"y" * 1000)  # written through, paced
    assert inner.get("w") == b"y" * 1000 and linked.bytes_written == 1000
    assert node.get("missing") is None
    with pytest.raises(ValueError):
        LinkedStore(inner, 0)


def test_node_cache_keeps_chunks_drops_rewrites_and_asks_inner_for_presence():
    inner = MemoryStore()
    linked = LinkedStore(inner, None)
    node = NodeCache(linked, capacity_bytes=2500, keep_writes=True)
    a, b, c = _chunk(1), _chunk(2), _chunk(3)
    node.put(a, b"1" * 1000)
    assert node.get(a) == b"1" * 1000 and linked.bytes_read == 0  # its own write, local
    inner.delete(a)  # gone behind the node's back (evicted, kvstore restarted)
    assert not node.contains(a) and node.longest_prefix([a]) == 0  # presence: inner's
    node.put(b, b"2" * 1000)
    node.put(c, b"3" * 1000)  # 3000 bytes > 2500: a (least recently used) goes
    assert node.stats()["bytes_stored"] == 2000 and node.get(a) is None
    node.put(_chunk(4), b"4" * 3000)  # larger than the whole cache: written through, not kept
    assert node.stats()["bytes_stored"] == 2000 and node.get(_chunk(4)) == b"4" * 3000
    # a per-request key (a tail another node deletes, a refresh rewritten every round) is
    # never kept: neither written nor read
    node.put(refresh_key("r1"), b"5" * 100)
    assert node.get(refresh_key("r1")) == b"5" * 100
    assert node.stats()["bytes_stored"] == 2000
    inner.put(refresh_key("r1"), b"6" * 100)  # rewritten by the other node
    assert node.get(refresh_key("r1")) == b"6" * 100
    reader = NodeCache(linked, keep_writes=False)
    assert reader.get(b) == b"2" * 1000
    reader.put(b, b"7" * 1000)  # a rewrite must not leave the old copy to be served
    assert reader.get(b) == b"7" * 1000
    assert reader.delete(b) and reader.get(b) is None and not inner.contains(b)
    assert is_chunk_key(compressed_key(chunk_key("m", "", [1]), "snapkv:ratio=4"))
    assert not is_chunk_key("tail/ns/" + _chunk(1))


def test_linked_store_paces_reads():
    inner = MemoryStore()
    inner.put("k", b"z" * 250_000)
    linked = LinkedStore(inner, 0.01)  # 1.25 MB/s
    t = time.perf_counter()
    linked.get("k")
    # 250 kB at 1.25 MB/s, less the 64 KiB burst the bucket starts with: 0.148 s
    assert time.perf_counter() - t >= 0.14


def test_warm_pools_faults_in_the_slots_a_run_reaches_on_both_sides(lm):
    """Before a local variant's timed run the runner's arena pools are written as far as the
    run reaches: as many slots as the budget holds full caches, in each pool the engine makes
    caches in (`arena`: one a side with the native kernel), over a request's whole room
    (zeros, which is what a pass would make of them), and the slots are free again
    afterwards."""
    from types import SimpleNamespace

    from vericache.bench.scenario import ScenarioConfig, warm_pools
    from vericache.engine.rounds import LocalBackends, arena

    r = lm.runner
    b = LocalBackends(lm)  # sets the runner's arena slots, as every local variant's does
    try:
        prompts = [SimpleNamespace(ids=list(range(300))), SimpleNamespace(ids=list(range(250)))]
        cfg = ScenarioConfig(groups=2, max_tokens=12, draft_len=8)
        tokens = 300 + cfg.params("full").extra_capacity
        per_cache = tokens * r.kv_bytes_per_token()
        pools = {(arena(r, side, g), dtype) for g in range(2)
                 for side, dtype in (("verify", r.dtype), ("draft", r.draft_dtype))}
        assert len(pools) == 2  # the native kernel: one pool a side, whatever the group
        for key, dtype in pools:  # slot 1 of every pool written before: not zero
            held = [r.new_cache(tokens, False, key, dtype) for _ in range(2)]
            for c in held:
                c.k[:, :, :tokens].fill_(1.0)
                c.v[:, :, :tokens].fill_(1.0)
            del held, c
        warm_pools(lm, prompts, cfg, budget=per_cache)  # one full cache: one slot a pool
        for key, dtype in pools:
            pool = r._arenas[(key, False, dtype)]
            assert not pool.k[:, 0, :, :tokens].any() and not pool.v[:, 0, :, :tokens].any()
            assert bool((pool.k[:, 1, :, :tokens] == 1.0).all())  # past the budget: untouched
            assert pool.free_slots()[:2] == [0, 1]
        warm_pools(lm, prompts, cfg, budget=None)  # no budget: a slot per request
        pool = r._arenas[(arena(r, "verify", 1), False, r.dtype)]
        assert not pool.k[:, 1, :, :tokens].any()
    finally:
        b.close()
