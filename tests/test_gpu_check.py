"""The GPU check's CPU dry run (`DEVICE=cpu benchmarks/gpu_check.sh`): a toy random-weight
Llama on CPU, timed at each batch and context, and projected with the τ of this repository's
latest long-context run; its identity check (vericache = full for every compressor, both
`exact` modes); and the measured projection's limits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "benchmarks/results/2026-12-02/thirteenth/long_context_8x4k.json"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, DEVICE="cpu", PYTHON=sys.executable, RUN_JSON=str(RUN))
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return (json.loads((out / "gpu_times.json").read_text()),
            json.loads((out / "projection.json").read_text()),
            json.loads((out / "gpu_identity.json").read_text()))


def test_times_cover_the_grid_with_the_models_sizes(dry_run):
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_timing import SHAPES

    times, _, _ = dry_run
    assert [(p["batch"], p["context"]) for p in times["points"]] == [
        (2, 256), (2, 1024), (4, 256), (4, 1024)]
    cfg = LlamaConfig(**SHAPES["tiny"], tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg)
    assert times["weight_bytes"] == sum(p.numel() * 4 for p in hf.parameters())
    kvt = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert times["kv_bytes_per_token"] == kvt
    for p in times["points"]:
        assert p["full_kv_bytes_per_request"] == p["context"] * kvt
        assert min(p["full_step_s"], p["verify_pass_s"], p["draft_step_s"]) > 0
    assert times["h2d_gb_s"] > 0
    assert times["overlap"] is None  # no copy engine on CPU


def test_projection_uses_the_measured_times(dry_run):
    times, proj, _ = dry_run
    run = json.loads(RUN.read_text())
    vc = [r for r in run["variants"] if r["variant"] == run["summary"]["vericache_variant"]][0]
    assert len(proj["measured"]) == len(times["points"])
    for q, p in zip(proj["measured"], times["points"]):
        assert (q["batch"], q["context"]) == (p["batch"], p["context"])
        assert q["inputs"]["tau"] == vc["tau_mean"]
        assert q["inputs"]["t_verify_s"] == p["verify_pass_s"]
        # staggering never loses to lockstep: max(a + b, c) <= a + max(b, c)
        assert q["vericache_staggered_tps"] >= q["vericache_lockstep_tps"]
        assert q["throughput_ratio_vs_full_resident"] * q["full_resident_tps"] == pytest.approx(
            q["vericache_staggered_tps"])


def test_identity_covers_every_compressor_in_both_modes(dry_run):
    from vericache.compress.registry import compressor_names

    rows = dry_run[2]["rows"]
    cases = {r["case"] for r in rows if r["case"].startswith("vericache=")}
    want = {(c, e) for c in compressor_names() for e in ("fast", "bitwise")}
    assert {(c.split("=", 1)[1].split(":")[0].rsplit("/", 1)[0], c.rsplit("/", 1)[1])
            for c in cases} == want
    assert all(r["identical"] and "error" not in r for r in rows), rows


def test_measured_projection_limits():
    """A link too fast to matter leaves the passes: full offloaded = full resident, VeriCache
    = B τ / (k t_draft + t_verify); a slow one leaves the link: B τ / t_load."""
    from vericache.bench.project import measured_round, project_measured

    run = json.loads(RUN.read_text())
    _, tau, k, _ = measured_round(run)
    point = {"batch": 4, "context": 100, "ratio": 4.0, "full_step_s": 0.5, "verify_pass_s": 0.8,
             "draft_step_s": 0.1, "full_kv_bytes_per_request": 1000}
    gpu = {"device": "x", "shape": "y", "weight_bytes": 1000, "memory_bytes": None,
           "points": [point]}
    fast = project_measured(run, dict(gpu, h2d_gb_s=1e9))[0]
    assert fast["full_offloaded_tps"] == pytest.approx(fast["full_resident_tps"]) == pytest.approx(8)
    assert fast["vericache_staggered_tps"] == pytest.approx(4 * tau / (k * 0.1 + 0.8))
    slow = project_measured(run, dict(gpu, h2d_gb_s=4000 / 100 / 1e9))[0]  # t_load = 100 s
    assert slow["vericache_staggered_tps"] == pytest.approx(4 * tau / 100)
    # at the break-even τ the link's ceiling is the resident rate
    assert slow["break_even_tau"] * 4 / 100 == pytest.approx(slow["full_resident_tps"])
    # memory for two full caches: the resident baseline runs 2 requests, its step scaled by
    # the bytes it reads, (W + 2F) / (W + 4F)
    two = project_measured(run, dict(gpu, h2d_gb_s=1e9, memory_bytes=3000))[0]
    assert two["full_resident_batch"] == 2
    assert two["full_resident_tps"] == pytest.approx(2 / (0.5 * 3000 / 5000))
