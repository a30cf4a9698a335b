"""--plot: τ and speed ratio against compression ratio (matplotlib, imported lazily)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from vericache.errors import InvalidArgument

MISSING = ("--plot needs matplotlib, which is not installed: "
           "pip install matplotlib (or pip install 'vericache[plot]')")


def check_available() -> None:
    """Raise InvalidArgument (before any model runs) when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise InvalidArgument(MISSING, "plot")


def series(by_config: list[dict]) -> dict[tuple[str, int], list[tuple[float, float, float]]]:
    """vericache rows grouped by (compressor, draft_len): sorted (compression, τ, speed ratio)."""
    out: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for r in by_config:
        if r["mode"] != "vericache" or r["compression"] is None:
            continue
        out.setdefault((r["compressor"], r["draft_len"]), []).append(
            (r["compression"], r["tau_mean"] or 0.0, r["speed_ratio_vs_full"] or 0.0))
    return {k: sorted(v) for k, v in sorted(out.items())}


def ngram_levels(by_config: list[dict]) -> dict[int, float]:
    """Mean n-gram drafter τ per draft length."""
    acc: dict[int, list[float]] = {}
    for r in by_config:
        if r["mode"] == "vericache" and r["ngram_tau"] is not None:
            acc.setdefault(r["draft_len"], []).append(r["ngram_tau"])
    return {k: sum(v) / len(v) for k, v in sorted(acc.items())}


def plot(doc: dict, path: Path) -> None:
    """Write the figure: left τ (n-gram drafter dashed), right tokens/s ratio to full."""
    check_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["summary"]["by_config"]
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (comp, k), pts in series(rows).items():
        xs = [p[0] for p in pts]
        ax_tau.plot(xs, [p[1] for p in pts], marker="o", label=f"{comp} k={k}")
        ax_speed.plot(xs, [p[2] for p in pts], marker="o", label=f"{comp} k={k}")
    for k, tau in ngram_levels(rows).items():
        ax_tau.axhline(tau, linestyle="--", linewidth=1, color="gray")
        ax_tau.annotate(f"n-gram k={k}", (0.01, tau), xycoords=("axes fraction", "data"),
                        fontsize=8, color="gray", va="bottom")
    ax_speed.axhline(1.0, linestyle=":", color="black", linewidth=1)
    ax_tau.set(xlabel="KV compression (full / compressed bytes)", ylabel="tokens per round (tau)",
               title="tau vs compression")
    ax_speed.set(xlabel="KV compression (full / compressed bytes)", ylabel="tokens/s ÷ full",
                 title="speed vs full")
    for ax in (ax_tau, ax_speed):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"vericache bench: {doc['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
