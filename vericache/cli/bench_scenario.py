"""`vericache bench --scenario long-context|remote-prefix`: the concurrent scenarios' command line part.

Builds the scenario's settings from the bench flags (the first of --compressors, --ratios
and --draft-lens), runs it (`vericache.bench.scenario`), prints a table, writes --json and
--plot, adds a GPU projection with --project, and exits 1 when any non-lossy output differs
from full greedy.
"""

from __future__ import annotations

import json
import sys

from vericache.bench.grid import Grid, takes_ratio
from vericache.bench.project import MACHINES, measured_round, project_run
from vericache.bench.prompts import shared_document_prompts
from vericache.bench.scenario import ScenarioConfig, parse_services, run_scenario
from vericache.errors import InvalidArgument
from vericache.model import load_model

COLUMNS = (("variant", "variant", 20), ("throughput_tps", "tok/s", 8), ("ttft_mean_s", "TTFT s", 8),
           ("tpot_mean_s", "TPOT s", 8), ("tau_mean", "tau", 6), ("max_active", "active", 7),
           ("kv_bytes_moved_per_token", "KV B/tok", 12), ("transfer_hidden_share", "hidden", 7),
           ("identical", "identical", 9))


def config(args, grid: Grid) -> ScenarioConfig:
    """The scenario's settings from the bench flags (fails before the model loads)."""
    if args.project is not None and args.project not in MACHINES:
        raise InvalidArgument(f"--project: unknown machine {args.project!r}; valid: "
                              f"{', '.join(MACHINES)}", "project")
    comp, _ = grid.configs[0]
    return ScenarioConfig(
        scenario=args.scenario, concurrency=args.concurrency, max_tokens=grid.max_tokens, compressor=comp,
        ratio=grid.ratios[0] if takes_ratio(comp) else None, draft_len=grid.draft_lens[0],
        adaptive=grid.adaptive, chunk_size=grid.chunk_size, link_gbps=args.link_gbps,
        drafter_link_gbps=args.drafter_link_gbps, kv_budget_mb=args.kv_budget_mb,
        kv_budget_caches=args.kv_budget_caches, draft_budget_mb=args.draft_kv_budget_mb,
        schedule=args.schedule, draft_ahead=args.draft_ahead, selections=grid.selections,
        calibrate=args.calibrate, warm_requests=args.warm_requests, with_fixed=args.with_fixed,
        repeats=args.repeats,
        services=parse_services(args.services) if args.services else None)


def add_roofline(doc: dict, runner, threads: int | None) -> None:
    """VeriCache's ratios as this machine's roofline projects them (vericache.bench.roofline:
    every variant at its peak rates), and the measured ratios over them, into the document.
    Not a cap: a measured ratio exceeds it where the baseline runs further below its peak."""
    from vericache.bench.roofline import measure, project_ratios

    s, st = doc["summary"], doc["settings"]
    _, tau, k, r = measured_round(doc)
    wb = runner.weight_bytes()
    model = {"params": wb // runner.embed.element_size(), "layers": runner.num_layers,
             "heads": runner.num_heads, "head_dim": runner.head_dim, "weight_bytes": wb,
             "kv_per_token": runner.kv_bytes_per_token(),
             "draft_kv_per_token": runner.draft_kv_bytes_per_token()}
    budget = st["kv_budget_bytes"]
    per_cache = (max(st["context_tokens"]) + st["max_tokens"]) * runner.kv_bytes_per_token()
    run = {"ctx": sum(st["context_tokens"]) / len(st["context_tokens"]) + st["max_tokens"] / 2,
           "batch": st["concurrency"], "budget_caches": budget / per_cache if budget else None,
           "tau": tau, "k": k, "compression": r,
           "link_gbps": st["link_gbps"]}
    roof = project_ratios(measure(threads), model, run)
    which = s["vericache_variant"].split("_")[1]
    c_res, c_off = (roof[f"ratio_vs_full_resident_{which}"], roof[f"ratio_vs_full_offloaded_{which}"])
    doc["roofline"] = roof
    s["resident_ratio_roofline"] = round(c_res, 4)
    s["resident_ratio_of_roofline"] = (round(s["throughput_ratio_vs_full_resident"] / c_res, 4)
                                  if s["throughput_ratio_vs_full_resident"] else None)
    s["offloaded_ratio_roofline"] = round(c_off, 4)
    s["offloaded_ratio_of_roofline"] = (round(s["throughput_ratio_vs_full_offloaded"] / c_off, 4)
                                   if s["throughput_ratio_vs_full_offloaded"] else None)


def describe_projection(p: dict) -> str:
    """One line for a projection (`vericache.bench.project.project_run`)."""
    if p.get("scenario") == "remote-prefix":
        return (f"projected on {p['machine']}: TTFT x{p['ttft_ratio_vs_full']:.3g} and throughput "
                f"x{p['throughput_ratio_vs_full_far']:.3g} vs full KV over the slow link, "
                f"x{p['throughput_ratio_vs_full_near']:.3g} vs full KV next to the store")
    return (f"projected on {p['machine']}: vericache {p['vericache_staggered_tps']:.4g} tok/s, "
            f"x{p['throughput_ratio_vs_full_resident']:.3g} vs full resident, "
            f"x{p['throughput_ratio_vs_full_offloaded']:.3g} vs full offloaded; "
            f"break-even tau {p['break_even_tau']:.3g}")


def render(doc: dict) -> str:
    head = " ".join(f"{title:>{w}}" for _, title, w in COLUMNS)
    lines = [head]
    for r in doc["variants"]:
        cells = []
        for key, _, w in COLUMNS:
            v = r[key]
            cells.append(f"{'-' if v is None else (f'{v:.4g}' if isinstance(v, float) else v)!s:>{w}}")
        lines.append(" ".join(cells))
    s = doc["summary"]
    lines.append(", ".join(f"{k} {s[k]}" for k in (
        "throughput_ratio_vs_full_resident", "throughput_ratio_vs_full_offloaded",
        "staggered_vs_lockstep", "ttft_ratio_vs_full", "tau_mean", "identical")))
    return "\n".join(lines)


def plot(doc: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["variants"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([r["variant"] for r in rows], [r["throughput_tps"] or 0 for r in rows])
    ax.set_ylabel("tokens/s")
    st = doc["settings"]
    ax.set_title(f"{doc['scenario']}: {st['concurrency']} requests, link {st['link_gbps']} Gbit/s")
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_scenario_cli(args, grid: Grid) -> int:
    cfg = config(args, grid)
    if args.concurrency < 1:
        raise InvalidArgument("--concurrency must be >= 1", "concurrency")
    lm = load_model(args.model, args.dtype, args.device)
    prompts = shared_document_prompts(lm.tokenizer, args.concurrency, args.context_tokens)
    # earlier traffic: questions about another document (source modules the timed one does
    # not reach at 8k tokens)
    warm = shared_document_prompts(lm.tokenizer, cfg.warm_requests, args.context_tokens,
                                   start=3) if cfg.warm_requests else []

    def step(label: str) -> None:
        if not args.quiet:
            print(f"bench: {label}", file=sys.stderr, flush=True)

    doc = run_scenario(lm, prompts, cfg, step, warm)
    doc["settings"].update({"dtype": args.dtype, "device": args.device, "threads": args.threads})
    if args.project is not None:
        doc["projection"] = project_run(doc, args.project, lm.runner.weight_bytes())
    if doc["scenario"] == "long-context" and args.services is None:
        step("roofline: this machine's read bandwidth and matmul rates")
        add_roofline(doc, lm.runner, args.threads)
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    if args.plot is not None:
        plot(doc, args.plot)
    print(render(doc))
    if "roofline" in doc:
        s = doc["summary"]
        print(f"roofline projection here: x{s['resident_ratio_roofline']:.3g} vs full resident (measured "
              f"{s['resident_ratio_of_roofline']} of it), x{s['offloaded_ratio_roofline']:.3g} vs full "
              f"offloaded (measured {s['offloaded_ratio_of_roofline']} of it)")
    if args.project is not None:
        p = doc["projection"]
        print(describe_projection(p))
    s = doc["summary"]
    if not s["identical"]:
        print("vericache: error: output differs from full greedy in: " + ", ".join(s["not_identical"]),
              file=sys.stderr)
        return 1
    return 0
