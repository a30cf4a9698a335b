"""The benchmark grid: parse the axes, plan the cells, run them in one process.

Per prompt: `full` once (the speed baseline and the reference tokens), `lossy` once per
compressor × ratio (with the first selection policy), `vericache` once per compressor × ratio
× draft length × selection policy. Compressors
without a ratio parameter (kivi: bits via "kivi:bits=4") or whose spec sets one run once,
with ratio None.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from vericache.bench.cell import measure
from vericache.bench.prompts import BenchPrompt
from vericache.compress.registry import compressor_class, make_compressor
from vericache.engine import local
from vericache.engine.generation import GenParams
from vericache.errors import InvalidArgument
from vericache.select import make_selection


@dataclass(frozen=True)
class CellPlan:
    """One generation of the grid."""

    prompt: str
    mode: str
    compressor: str | None = None
    ratio: float | None = None
    draft_len: int | None = None
    selection: str | None = None

    @property
    def label(self) -> str:
        parts = [self.prompt, self.mode]
        if self.compressor:
            parts.append(self.compressor + (f"@{self.ratio:g}" if self.ratio else ""))
        if self.draft_len:
            parts.append(f"k={self.draft_len}")
        if self.selection and self.mode == "vericache":
            parts.append(f"sel={self.selection}")
        return " ".join(parts)


@dataclass
class Grid:
    """The axes of a run and the decoding settings every cell shares."""

    compressors: list[str]
    ratios: list[float]
    draft_lens: list[int]
    max_tokens: int = 128
    chunk_size: int = 256
    adaptive: bool = True
    selections: list[str] = field(default_factory=lambda: ["question"])
    configs: list[tuple[str, float | None]] = field(init=False)

    def __post_init__(self):
        if not self.selections:
            raise InvalidArgument("--selection is empty", "selection")
        for s in self.selections:
            make_selection(s)
        if not self.compressors:
            raise InvalidArgument("--compressors is empty", "compressors")
        if not self.draft_lens or min(self.draft_lens) < 1:
            raise InvalidArgument("--draft-lens needs integers >= 1", "draft_lens")
        if self.max_tokens < 2:
            raise InvalidArgument("--max-tokens must be >= 2", "max_tokens")
        self.configs = []
        for c in self.compressors:
            for r in (self.ratios if takes_ratio(c) else [None]):
                make_compressor(c, r)  # bad names and parameters fail before the model loads
                self.configs.append((c, r))

    def params(self, mode: str, compressor: str | None = None, ratio: float | None = None,
               draft_len: int | None = None, max_tokens: int | None = None,
               selection: str | None = None) -> GenParams:
        return GenParams(max_tokens=max_tokens or self.max_tokens, temperature=0.0, mode=mode,
                         compressor=compressor or "snapkv", ratio=ratio,
                         draft_len=draft_len or 1, adaptive=self.adaptive,
                         chunk_size=self.chunk_size, selection=selection or self.selections[0])


def split_compressors(text: str) -> list[str]:
    """Split "snapkv,kivi:bits=4,group=32,streamingllm" into compressor specs: a piece with
    "=" but no ":" continues the previous spec's parameters."""
    out: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if "=" in piece and ":" not in piece and out and ":" in out[-1]:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def split_numbers(text: str, kind: type, flag: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgument(f"{flag}: expected a comma list of numbers, got {text!r}", flag) from None


def takes_ratio(spec: str) -> bool:
    """Whether the ratio axis applies: the class has a ratio parameter the spec does not set."""
    name, _, rest = spec.partition(":")
    if any(kv.partition("=")[0].strip() == "ratio" for kv in rest.split(",")):
        return False
    return "ratio" in inspect.signature(compressor_class(name).__init__).parameters


def plan(prompts: list[BenchPrompt], grid: Grid) -> list[CellPlan]:
    """Every cell of the run, prompt by prompt, `full` first."""
    cells = []
    for p in prompts:
        cells.append(CellPlan(p.name, "full"))
        for c, r in grid.configs:
            cells.append(CellPlan(p.name, "lossy", c, r, selection=grid.selections[0]))
            cells.extend(CellPlan(p.name, "vericache", c, r, k, s)
                         for k in grid.draft_lens for s in grid.selections)
    return cells


def warm_up(lm, prompt: BenchPrompt, grid: Grid) -> None:
    """A few short generations so the first timed cell does not pay one-time start costs."""
    ids = prompt.ids[:min(len(prompt.ids), grid.chunk_size + 32)]
    local.generate(lm, ids, grid.params("full", max_tokens=4))
    c, r = grid.configs[0]
    local.generate(lm, ids, grid.params("vericache", c, r, 4, max_tokens=6))


def run_grid(lm, prompts: list[BenchPrompt], grid: Grid,
             on_cell: Callable[[CellPlan], None] | None = None) -> Iterator[dict]:
    """Run every cell; yields each cell's measures (see `vericache.bench.cell.measure`).
    `on_cell` is called before each cell starts (for progress display)."""
    by_name = {p.name: p for p in prompts}
    reference = None
    for cell in plan(prompts, grid):
        if on_cell is not None:
            on_cell(cell)
        prompt = by_name[cell.prompt]
        params = grid.params(cell.mode, cell.compressor, cell.ratio, cell.draft_len,
                             selection=cell.selection)
        result = local.generate(lm, prompt.ids, params)
        if cell.mode == "full":
            reference = result
        yield measure(cell, prompt, result, reference)
