"""Project a saved scenario run (`vericache bench --scenario ... --json FILE`) onto GPU
machines with the cost model of docs/performance.md, from the τ, drafts per round and
compression measured in that run.

    python benchmarks/project_json.py run.json --machines h200-pcie5,gh200
    python benchmarks/project_json.py run.json --roofline   # also this machine's cap, measured now

`--gpu-times FILE` (long-context runs): pass times measured on a device by
`benchmarks/gpu_timing.py` replace the bandwidth model's (peak x 0.8), one projection per
measured point (`vericache.bench.project.project_measured`).

`--roofline` (long-context runs) measures this machine's read bandwidth and matmul rates now
and adds the cap on VeriCache's ratios that they allow (vericache.bench.roofline); run it on
the machine, and with the threads, of the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vericache.bench.project import MACHINES, project_run
from vericache.cli.bench_scenario import describe_projection


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", type=Path, help="a scenario run's --json file")
    p.add_argument("--machines", default=",".join(MACHINES),
                   help=f"comma list of machines (default: {','.join(MACHINES)})")
    p.add_argument("--weight-bytes", type=float, default=538060032,
                   help="the model's weight bytes (default: SmolLM2-135M in fp32, 538060032)")
    p.add_argument("--roofline", action="store_true",
                   help="also measure this machine's roofline and the cap it puts on the run's ratios")
    p.add_argument("--threads", type=int, default=None, help="torch threads for --roofline")
    p.add_argument("--gpu-times", type=Path,
                   help="a benchmarks/gpu_timing.py --json file: project with its measured times")
    p.add_argument("--out", type=Path, help="write the projections as JSON")
    a = p.parse_args(argv)
    doc = json.loads(a.json.read_text())
    out = {}
    for name in filter(None, a.machines.split(",")):
        if name not in MACHINES:
            print(f"project_json: unknown machine {name!r}; valid: {', '.join(MACHINES)}",
                  file=sys.stderr)
            return 2
        out[name] = project_run(doc, name, a.weight_bytes)
        print(describe_projection(out[name]))
    if a.gpu_times is not None:
        from vericache.bench.project import project_measured

        out["measured"] = project_measured(doc, json.loads(a.gpu_times.read_text()))
        for q in out["measured"]:
            print(f"measured on {q['device']} ({q['shape']}), batch {q['batch']} x "
                  f"{q['context']}: vericache {q['vericache_staggered_tps']:.4g} tok/s, "
                  f"x{q['throughput_ratio_vs_full_resident']:.3g} vs full resident, "
                  f"x{q['throughput_ratio_vs_full_offloaded']:.3g} vs full offloaded; "
                  f"break-even tau {q['break_even_tau']:.3g}")
    if a.roofline:
        from vericache.cli.bench_scenario import add_roofline
        from vericache.model import load_model

        add_roofline(doc, load_model(None, "float32", "cpu").runner, a.threads)
        s = doc["summary"]
        out["roofline"] = doc["roofline"]
        print(f"roofline projection here: x{s['resident_ratio_roofline']:.3g} vs full resident (measured "
              f"{s['resident_ratio_of_roofline']} of it), x{s['offloaded_ratio_roofline']:.3g} vs full "
              f"offloaded (measured {s['offloaded_ratio_of_roofline']} of it)")
    if a.out is not None:
        a.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
