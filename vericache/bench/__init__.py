"""`vericache bench`: full, lossy and vericache decoding over a grid, in one process.

Modules: `prompts` (built-in long code contexts, user files), `metrics` (pure measures: n-gram
drafter τ, divergence, parse checks), `cell` (one cell's measures), `grid` (axes, plan, run),
`report` (summary, JSON, tables) and `plot` (matplotlib, lazily).
"""

from vericache.bench.grid import CellPlan, Grid, plan, run_grid
from vericache.bench.metrics import ngram_rounds, parses_code, parses_json

__all__ = ["CellPlan", "Grid", "plan", "run_grid", "ngram_rounds", "parses_code", "parses_json"]
