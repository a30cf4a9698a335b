"""The run's report: summary, JSON document and the terminal tables."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path

from vericache.bench.metrics import mean

CONFIG_KEYS = ("mode", "compressor", "ratio", "draft_len", "selection")
_AVERAGED = ("tokens_per_s", "decode_tokens_per_s", "speed_ratio_vs_full",
             "decode_speed_ratio_vs_full", "tau_mean", "ngram_tau", "acceptance_rate",
             "compression", "first_divergence", "select_share_of_rounds",
             "select_delta_bytes_per_token")


def machine() -> dict:
    import torch
    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


def _avg(values: Sequence) -> float | None:
    xs = [v for v in values if v is not None]
    m = mean(xs)
    return None if m is None else round(m, 4)


def _rate(values: Sequence) -> float | None:
    xs = [v for v in values if v is not None]
    return round(sum(map(bool, xs)) / len(xs), 4) if xs else None


def by_config(cells: list[dict]) -> list[dict]:
    """Cells averaged over prompts, one row per (mode, compressor, ratio, draft_len, selection)."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault(tuple(c[k] for k in CONFIG_KEYS), []).append(c)
    rows = []
    for key, cs in groups.items():
        row = dict(zip(CONFIG_KEYS, key), prompts=len(cs))
        row.update({k: _avg([c[k] for c in cs]) for k in _AVERAGED})
        row["identical_all"] = all(c["identical"] for c in cs)
        row["parses_code_rate"] = _rate([c["parses_code"] for c in cs])
        row["parses_json_rate"] = _rate([c["parses_json"] for c in cs])
        rows.append(row)
    return rows


def label(c: dict) -> str:
    parts = [c["prompt"], c["mode"]] if "prompt" in c else [c["mode"]]
    if c["compressor"]:
        parts.append(c["compressor"] + (f"@{c['ratio']:g}" if c["ratio"] else ""))
    if c["draft_len"]:
        parts.append(f"k={c['draft_len']}")
    if c.get("selection") and c["mode"] == "vericache":
        parts.append(f"sel={c['selection']}")
    return " ".join(parts)


def summarize(cells: list[dict]) -> dict:
    vc = [c for c in cells if c["mode"] == "vericache"]
    configs = by_config(cells)
    best = max((r for r in configs if r["mode"] == "vericache" and r["speed_ratio_vs_full"]),
               key=lambda r: r["speed_ratio_vs_full"], default=None)
    return {"cells": len(cells), "vericache_cells": len(vc),
            "all_vericache_identical": all(c["identical"] for c in vc),
            "not_identical": [label(c) for c in vc if not c["identical"]],
            "vericache_tau_mean": _avg([c["tau_mean"] for c in vc]),
            "ngram_tau_mean": _avg([c["ngram_tau"] for c in vc]),
            "best_vericache": None if best is None else {
                k: best[k] for k in (*CONFIG_KEYS, "speed_ratio_vs_full",
                                     "decode_speed_ratio_vs_full", "tau_mean")},
            "by_config": configs}


def document(model: str, prompts: list, cells: list[dict], settings: dict) -> dict:
    """The --json document."""
    return {"model": model, "machine": machine(), "settings": settings,
            "prompts": [p.to_json() for p in prompts], "cells": cells,
            "summary": summarize(cells)}


def write_json(path: Path, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


# ---- terminal tables -----------------------------------------------------------------

def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _num(v) -> str:
    return "-" if v is None else f"{v:g}"


def _kv(c: dict) -> str:
    full = c["full_kv_bytes"] / 2**20
    if c["compressed_kv_bytes"] is None:
        return f"{full:.1f}"
    return f"{full:.1f}>{c['compressed_kv_bytes'] / 2**20:.1f} ({c['compression']:.1f}x)"


def _parse(c: dict) -> str:
    marks = [f"{name}:{fmt(c[key])}" for name, key in (("py", "parses_code"), ("json", "parses_json"))
             if c[key] is not None]
    return " ".join(marks) or "-"


MAIN_COLUMNS = [
    ("prompt", lambda c: c["prompt"]), ("mode", lambda c: c["mode"]),
    ("compressor", lambda c: c["compressor"] or "-"), ("ratio", lambda c: _num(c["ratio"])),
    ("k", lambda c: fmt(c["draft_len"])),
    ("sel", lambda c: c["selection"] if c.get("selection") and c["mode"] == "vericache" else "-"),
    ("tok/s", lambda c: fmt(c["tokens_per_s"], 1)),
    ("dec tok/s", lambda c: fmt(c["decode_tokens_per_s"], 1)),
    ("x full", lambda c: fmt(c["speed_ratio_vs_full"])), ("tau", lambda c: fmt(c["tau_mean"])),
    ("ngram tau", lambda c: fmt(c["ngram_tau"])), ("accept", lambda c: fmt(c["acceptance_rate"])),
    ("KV MiB", _kv), ("1st div", lambda c: fmt(c["first_divergence"])), ("parses", _parse),
    ("identical", lambda c: fmt(c["identical"])),
]
TIME_COLUMNS = [
    ("prompt", lambda c: c["prompt"]), ("mode", lambda c: c["mode"]),
    ("compressor", lambda c: c["compressor"] or "-"), ("ratio", lambda c: _num(c["ratio"])),
    ("k", lambda c: fmt(c["draft_len"])), ("tokens", lambda c: fmt(c["completion_tokens"])),
    ("total s", lambda c: fmt(c["seconds"])), ("prefill s", lambda c: fmt(c["prefill_s"])),
    ("compress s", lambda c: fmt(c["compress_s"], 3)), ("draft s", lambda c: fmt(c["draft_s"])),
    ("verify s", lambda c: fmt(c["verify_s"])), ("draft steps", lambda c: fmt(c["draft_steps"])),
    ("verify tokens", lambda c: fmt(c["verify_tokens"])), ("rounds", lambda c: fmt(c["rounds"])),
]


def table(cells: list[dict], columns=MAIN_COLUMNS) -> str:
    """Cells as an aligned text table (numbers right-aligned)."""
    head = [name for name, _ in columns]
    rows = [[f(c) for _, f in columns] for c in cells]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    left = {"prompt", "mode", "compressor"}

    def line(vals):
        return "  ".join(v.ljust(w) if h in left else v.rjust(w)
                         for h, v, w in zip(head, vals, widths)).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


def render(doc: dict) -> str:
    """Both tables and the summary lines, for the terminal."""
    s, cells = doc["summary"], doc["cells"]
    out = [table(cells), "", "where the time goes:", table(cells, TIME_COLUMNS), ""]
    out.append(f"vericache identical to full greedy: "
               f"{'all ' + str(s['vericache_cells']) if s['all_vericache_identical'] else 'NO'}"
               + ("" if s["all_vericache_identical"] else f" (differs: {', '.join(s['not_identical'])})"))
    if s["vericache_tau_mean"] is not None:
        out.append(f"mean tau: vericache {s['vericache_tau_mean']:.2f}, n-gram drafter on the same "
                   f"outputs {fmt(s['ngram_tau_mean'])}")
    if s["best_vericache"]:
        b = s["best_vericache"]
        out.append(f"fastest vericache: {label(b)}: {fmt(b['speed_ratio_vs_full'])}x full "
                   f"(decode {fmt(b['decode_speed_ratio_vs_full'])}x), tau {fmt(b['tau_mean'])}")
    return "\n".join(out)
