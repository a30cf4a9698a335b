"""`vericache bench`: full, lossy and vericache over prompts × compressors × ratios × draft
lengths, in one process; a table on the terminal, optionally --json and --plot.

Exits 1 when any vericache output differs from full greedy on the same prompt.
"""

from __future__ import annotations

import sys
from pathlib import Path

from vericache.bench import report
from vericache.bench.grid import Grid, plan, run_grid, split_compressors, split_numbers
from vericache.bench.prompts import builtin_prompts, file_prompts
from vericache.cli.common import add_model_args
from vericache.errors import InvalidArgument
from vericache.model import load_model


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="measure full, lossy and vericache decoding over a grid",
        description="Run full (reference), lossy (compressed KV only) and vericache (draft "
                    "compressed, verify full) in one process over prompts × compressors × ratios "
                    "× draft lengths. Reports tokens/s and its ratio to full, tokens per round "
                    "(tau) beside a model-free n-gram drafter's, acceptance, KV bytes, the lossy "
                    "output's first divergence, whether code/JSON answers parse, where the time "
                    "goes, and checks every vericache output is identical to full greedy "
                    "(exit 1 if not).")
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt-file", type=Path, action="append", default=[],
                   help="prompt text file (repeatable); encoded raw unless --chat")
    g.add_argument("--messages-file", type=Path, action="append", default=[],
                   help="JSON list of {role, content} (repeatable); the chat template is applied")
    g.add_argument("--chat", action="store_true",
                   help="wrap each --prompt-file as a user message in the chat template")
    g.add_argument("--builtin", type=int, default=None, metavar="N",
                   help="built-in long code prompts, code and JSON answers alternating "
                        "(default: 2, or 0 when prompt files are given)")
    g.add_argument("--context-tokens", type=int, default=2048, metavar="T",
                   help="about how long each built-in prompt is, in tokens (default: 2048)")
    g = p.add_argument_group("grid")
    g.add_argument("--compressors", default="snapkv,streamingllm,kivi",
                   help="comma list of compressor specs, e.g. snapkv,kivi:bits=4 "
                        "(default: snapkv,streamingllm,kivi)")
    g.add_argument("--ratios", default="4,8",
                   help="comma list of compression ratios, for compressors that take one "
                        "(default: 4,8)")
    g.add_argument("--draft-lens", default="8,32", help="comma list of largest draft lengths k "
                                                        "(default: 8,32)")
    g.add_argument("--fixed-draft-len", action="store_true", help="keep k fixed, no adaptation")
    g.add_argument("--selection", default="question",
                   help="comma list of selection policies (how the drafter's kept tokens move): "
                        "static, question, verify, each with optional NAME:key=value,... "
                        "(default: question); the first is the lossy cells' and the scenario's "
                        "headline")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens per cell (default: 128)")
    g.add_argument("--chunk-size", type=int, default=256, help="tokens per KV chunk (default: 256)")
    g = p.add_argument_group(
        "scenario", "--scenario long-context|remote-prefix runs --concurrency requests at once "
        "through the two-lane engine, VeriCache (lockstep and staggered) beside its full-KV and "
        "lossy baselines in the same run, with the first of --compressors, --ratios and "
        "--draft-lens, on built-in prompts of --context-tokens that share one code document and "
        "ask different questions (prompt files are not used). long-context: full KV resident, "
        "full KV offloaded behind --link-gbps, lossy, VeriCache verifying over the offloaded KV. "
        "remote-prefix: the shared prefix sits in a store; the decoding node reads it over "
        "--drafter-link-gbps, a verifier next to the store over --link-gbps. Every output is "
        "checked against full greedy (exit 1 if one differs); docs/performance.md has the figures")
    g.add_argument("--scenario", choices=("grid", "long-context", "remote-prefix"), default="grid",
                   help="grid: the compressor grid above (default); long-context or "
                        "remote-prefix: the concurrent scenarios")
    g.add_argument("--concurrency", type=int, default=4, metavar="N",
                   help="requests at once in the scenario, one built-in prompt each (default: 4)")
    g.add_argument("--schedule", choices=("lockstep", "staggered"), default="lockstep",
                   help="VeriCache's schedule in the headline ratios; both always run, for "
                        "staggered_vs_lockstep (default: lockstep)")
    g.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="the cost model of each adaptive VeriCache variant starts cold and "
                        "explores its first rounds (default: it first calibrates through the "
                        "variant's own backends, untimed, as `vericache serve` does at start-up)")
    g.add_argument("--warm-requests", type=int, default=0, metavar="N",
                   help="each adaptive VeriCache variant then serves N requests about another "
                        "document, untimed, and plans its timed run from the acceptance it "
                        "pooled from them, as a server that has been up does (default: 0, the "
                        "timed requests are its first and start from the prior rate)")
    g.add_argument("--with-fixed-k", dest="with_fixed", action="store_true",
                   help="also run both VeriCache schedules with k fixed at --draft-lens (rows "
                        "<variant>:fixed, summary adaptive_vs_fixed): the cost model's k "
                        "against a fixed one in the same run")
    g.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run every variant N times, interleaved (each once, then again); each "
                        "row is its median run by throughput, throughput_runs lists them all "
                        "(default: 1)")
    g.add_argument("--no-draft-ahead", dest="draft_ahead", action="store_false",
                   help="the staggered variant does not draft ahead while drafts are verified")
    g.add_argument("--link-gbps", type=float, default=None, metavar="GBIT",
                   help="the verifier's link, Gbit/s: to its offloaded full KV (long-context; "
                        "each way, full duplex; default 4, 200 = a 25 GB/s PCIe bus) or to the "
                        "store (remote-prefix; default 200); 0 = unpaced, at memory-copy speed")
    g.add_argument("--drafter-link-gbps", type=float, default=1.0, metavar="GBIT",
                   help="remote-prefix: the decoding node's (drafter's) slow link to the store, "
                        "Gbit/s (default: 1)")
    g.add_argument("--kv-budget-mb", type=float, default=None, metavar="MB",
                   help="each variant's KV memory, drafter and verifier together (the "
                        "drafter's compressed KV counts too): bounds the requests admitted and "
                        "the requests verified per offloaded pass (default: unbounded)")
    g.add_argument("--kv-budget-caches", type=float, default=None, metavar="N",
                   help="the same budget in full caches of the longest request (prompt + "
                        "output), e.g. 4")
    g.add_argument("--services", default=None, metavar="ADDRS",
                   help="run the scenario through running services, "
                        "drafter=HOST:PORT,verifier=HOST:PORT: full (on the verifier's own "
                        "--kv-tier), lossy and VeriCache; their links are the services' "
                        "--link-gbps and --tier-link-gbps flags (default: in this process)")
    g.add_argument("--draft-kv-budget-mb", type=float, default=None, metavar="MB",
                   help="the drafter's KV memory budget (default: unbounded)")
    g.add_argument("--project", default=None, metavar="MACHINE",
                   help="also project the measured tau, compression and bytes per round onto "
                        "a GPU machine with the cost model of docs/performance.md: "
                        "h200-pcie5, h100-pcie5 or gh200 (scenario runs only)")
    add_model_args(p)
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads for the run (default: torch's choice; on a shared "
                        "machine 1 gives steadier timings)")
    g = p.add_argument_group("output")
    g.add_argument("--json", type=Path, metavar="FILE", help="write every cell and a summary as JSON")
    g.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="plot tau and speed ratio against compression ratio; with --scenario, "
                        "tokens/s per variant (needs matplotlib)")
    g.add_argument("--quiet", action="store_true",
                   help="no progress bar and no tables; only the summary line")
    p.set_defaults(run=run)


def make_grid(args) -> Grid:
    return Grid(compressors=split_compressors(args.compressors),
                ratios=split_numbers(args.ratios, float, "--ratios"),
                draft_lens=split_numbers(args.draft_lens, int, "--draft-lens"),
                max_tokens=args.max_tokens, chunk_size=args.chunk_size,
                adaptive=not args.fixed_draft_len, selections=split_compressors(args.selection))


def load_prompts(args, tokenizer) -> list:
    prompts = file_prompts(tokenizer, args.prompt_file, args.messages_file, args.chat)
    n = args.builtin if args.builtin is not None else (0 if prompts else 2)
    if n < 0:
        raise InvalidArgument("--builtin must be >= 0", "builtin")
    prompts += builtin_prompts(tokenizer, n, args.context_tokens) if n else []
    if not prompts:
        raise InvalidArgument("no prompts: give --prompt-file, --messages-file or --builtin N", "builtin")
    return prompts


def run_cells(lm, prompts, grid: Grid, quiet: bool) -> list[dict]:
    """Run the grid under a tqdm progress bar on stderr (none with --quiet)."""
    from tqdm import tqdm

    from vericache.bench.grid import warm_up

    bar = tqdm(total=len(plan(prompts, grid)), desc="bench", unit="cell", file=sys.stderr,
               disable=quiet, dynamic_ncols=True)
    cells = []
    with bar:
        bar.set_postfix_str("warm-up")
        warm_up(lm, prompts[0], grid)
        for cell in run_grid(lm, prompts, grid, on_cell=lambda c: bar.set_postfix_str(c.label)):
            cells.append(cell)
            bar.update(1)
    return cells


def run(args) -> int:
    grid = make_grid(args)  # bad flags fail before the model loads
    if args.plot is not None:
        from vericache.bench.plot import check_available
        check_available()
    if args.threads is None:
        return _run(args, grid)
    if args.threads < 1:
        raise InvalidArgument("--threads must be >= 1", "threads")
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, grid)
    finally:
        torch.set_num_threads(before)


def _run(args, grid: Grid) -> int:
    if args.scenario != "grid":
        from vericache.cli.bench_scenario import run_scenario_cli
        return run_scenario_cli(args, grid)
    lm = load_model(args.model, args.dtype, args.device)
    prompts = load_prompts(args, lm.tokenizer)
    cells = run_cells(lm, prompts, grid, args.quiet)
    settings = {"compressors": grid.compressors, "ratios": grid.ratios,
                "draft_lens": grid.draft_lens, "selections": grid.selections,
                "max_tokens": grid.max_tokens,
                "chunk_size": grid.chunk_size, "adaptive": grid.adaptive, "dtype": args.dtype,
                "device": args.device, "temperature": 0.0}
    doc = report.document(lm.name, prompts, cells, settings)
    if args.json is not None:
        report.write_json(args.json, doc)
    if args.plot is not None:
        from vericache.bench.plot import plot
        plot(doc, args.plot)
    s = doc["summary"]
    if args.quiet:
        print(f"{s['cells']} cells; vericache identical to full: "
              f"{'yes' if s['all_vericache_identical'] else 'NO'}; mean tau "
              f"{report.fmt(s['vericache_tau_mean'])} (n-gram {report.fmt(s['ngram_tau_mean'])})")
    else:
        print(f"model {lm.name} ({lm.model_id}); {len(prompts)} prompts: "
              + ", ".join(f"{p.name} ({len(p.ids)} tokens)" for p in prompts))
        print(report.render(doc))
    if not s["all_vericache_identical"]:
        print("vericache: error: vericache output differs from full greedy in: "
              + ", ".join(s["not_identical"]), file=sys.stderr)
        return 1
    return 0
