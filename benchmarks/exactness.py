"""How far a verify pass is from decode steps, and what the bitwise mode costs.

For each dtype and context: decode `--rows` greedy tokens of each of `--sequences` long
prompts (code and prose alternating, about `--context-tokens` each) by single steps, in each
mode (fast: batched passes; bitwise: the runner's invariant pass), and run every window of
k+1 rows also as a verify pass, one sequence a pass (batch 1) or `batch` at once, per mode
against that mode's steps (`vericache.bench.exactness`). Reported per cell: the largest
absolute logit difference, rows whose logits or written K/V differ in any bit, the smallest
top-2 margin seen, and argmax flips. Then tokens/s of `full` and `vericache` (k fixed) in
both modes, decoding only, at each of --speed-batches requests at once (default 1).

    .venv/bin/python benchmarks/exactness.py --context-tokens 2000,8000 --rows 256 \\
        --sequences 16 --ks 4,16,32 --batches 1,16 --dtypes float32,bfloat16 --json out.json

(16 sequences x 256 rows = 4096 positions a cell; the steps run once per mode, dtype and
context, every k and batch reuses them.)
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from pathlib import Path

from vericache.bench.exactness import measure
from vericache.bench.prompts import builtin_prompts
from vericache.engine.generation import GenParams
from vericache.engine.local import generate
from vericache.model import load_model
from vericache.model.tokenize import apply_chat


def prose_prompt(tokenizer, tokens: int, start: int = 0) -> list[int]:
    """A prose prompt: docstrings of the standard library's modules, then a question."""
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    parts, n = [], 0
    for path in sorted(lib.glob("*.py"))[start:]:
        try:
            tree = ast.parse(path.read_text(errors="ignore"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    parts.append(doc)
                    n += len(tokenizer(doc)["input_ids"])
        if n >= tokens:
            break
    ids = tokenizer("\n\n".join(parts))["input_ids"][:tokens]
    return apply_chat(tokenizer, [{"role": "user", "content": tokenizer.decode(ids) +
                                   "\n\nSummarise the text above in five sentences."}])


def prompts_for(lm, batch: int, context: int) -> list[list[int]]:
    code = builtin_prompts(lm.tokenizer, (batch + 1) // 2, context)
    return [code[i // 2].ids if i % 2 == 0 else prose_prompt(lm.tokenizer, context, 40 * i)
            for i in range(batch)]


def _run_batch(lm, prompts: list[list[int]], params: GenParams) -> tuple[float, list[list[int]]]:
    """`prompts` at once through a `BatchEngine` (no cost model calibration; the modes share
    its defaults), each stream read by a thread of its own: decode seconds (from the last
    request's first token to the end) and the tokens of each."""
    from vericache.engine.batch import BatchEngine

    eng = BatchEngine(lm, max_batch=len(prompts))
    try:
        firsts, end, outs = read_streams(eng, prompts, params)
        return end - max(firsts), outs
    finally:
        eng.close()


def read_streams(eng, prompts: list[list[int]], params: GenParams):
    """`prompts` submitted at once to `eng`, each stream read by a thread of its own: each
    request's first-token time, the end time and the tokens of each (raises if one failed)."""
    import threading

    firsts, outs, errors = [0.0] * len(prompts), [[] for _ in prompts], []

    def read(i, rs):
        for ev in rs:
            if ev.error:
                errors.append(ev.error)
            if not outs[i] and ev.token_ids:
                firsts[i] = time.perf_counter()
            outs[i] += ev.token_ids

    streams = [eng.submit(p, params) for p in prompts]
    readers = [threading.Thread(target=read, args=(i, rs)) for i, rs in enumerate(streams)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    return firsts, time.perf_counter(), outs


def speed(lm, prompts: list[list[int]], tokens: int, draft_len: int) -> dict:
    """tokens/s of `full` and `vericache` (k = `draft_len` every round, so that the verify
    pass's cost shows) in each exact mode, decoding only, over `prompts` at once (one:
    `generate`, in this thread; more: one `BatchEngine`)."""
    out = {}
    for mode in ("full", "vericache"):
        for exact in ("fast", "bitwise"):
            params = GenParams(mode=mode, max_tokens=tokens, ignore_eos=True, exact=exact,
                               draft_len=draft_len, adaptive=False)
            if len(prompts) == 1:
                t = time.perf_counter()
                r = generate(lm, prompts[0], params)
                dt, toks = time.perf_counter() - t - r.stats.prefill_s, [r.token_ids]
                n, extra = tokens, {"rounds": r.stats.rounds}
            else:
                dt, toks = _run_batch(lm, prompts, params)
                n = sum(len(x) - 1 for x in toks)  # each request's first token came with prefill
                extra = {}
            out[f"{mode}_{exact}"] = {"tokens_per_s": round(n / dt, 3), "tokens": toks, **extra}
    for exact in ("fast", "bitwise"):  # each mode's guarantee: its own full decoding
        out[f"vericache_{exact}"]["identical_to_full_same_mode"] = (
            out[f"vericache_{exact}"]["tokens"] == out[f"full_{exact}"]["tokens"])
    ref = out["full_fast"]["tokens"]
    for v in out.values():
        v["identical_to_full_fast"] = v.pop("tokens") == ref
    for mode in ("full", "vericache"):
        out[f"{mode}_bitwise_vs_fast"] = round(out[f"{mode}_bitwise"]["tokens_per_s"]
                                               / out[f"{mode}_fast"]["tokens_per_s"], 3)
    return out


def table(rows: list[dict]) -> str:
    """The distance rows as markdown: dtype x context x k x batch, fast and bitwise side by
    side (max |logit diff|, rows differing in logits and in K/V out of those compared, the
    smallest top-2 margin, argmax flips)."""
    cells = {(r["dtype"], r["context"], r["k"], r["batch"], r["mode"]): r
             for r in rows if "mode" in r}
    out = ["| dtype | context | k | batch | rows | fast: max diff | logits / K/V rows differing "
           "| smallest margin | flips | bitwise: max diff | rows differing | flips |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted({c[:4] for c in cells}):
        f, b = cells.get((*key, "fast")), cells.get((*key, "bitwise"))
        if f is None or b is None:
            continue
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {f['rows']} "
                   f"| {f['max_abs_logit']:.3g} | {f['logit_rows_differing']} / "
                   f"{f['kv_rows_differing']} | {f['min_top2_margin']:.3g} | {f['argmax_flips']} "
                   f"| {b['max_abs_logit']:.3g} "
                   f"| {max(b['logit_rows_differing'], b['kv_rows_differing'])} "
                   f"| {b['argmax_flips']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context-tokens", default="2000", help="comma-separated (default 2000)")
    ap.add_argument("--rows", type=int, default=64,
                    help="greedy tokens per sequence (default 64; 0: speed runs only)")
    ap.add_argument("--sequences", type=int, default=16,
                    help="prompts per context, code and prose alternating (default 16)")
    ap.add_argument("--ks", default="4,16,32")
    ap.add_argument("--batches", default="1,16",
                    help="sequences per verify pass, comma-separated (default 1,16)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--speed-tokens", type=int, default=32,
                    help="tokens per speed run (0: no speed runs; default 32)")
    ap.add_argument("--speed-batches", default="1",
                    help="requests at once in the speed runs, comma-separated (default 1)")
    ap.add_argument("--speed-draft-len", type=int, default=8,
                    help="vericache's k, fixed, in the speed runs (default 8)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--table", type=Path, nargs="+", default=None,
                    help="print the distance rows of these --json files as a markdown table; "
                         "no runs")
    a = ap.parse_args(argv)
    if a.table:
        print(table([r for f in a.table for r in json.loads(f.read_text())["rows"]]))
        return 0
    rows = []
    for dtype in a.dtypes.split(","):
        lm = load_model(None, dtype, "cpu")
        for ctx in (int(c) for c in a.context_tokens.split(",")):
            def cell(mode, k, batch, d, seconds, dtype=dtype, ctx=ctx):
                row = {"dtype": dtype, "context": ctx, "mode": mode, "k": k, "batch": batch,
                       **d.as_dict(), "seconds": round(seconds, 1)}
                print(json.dumps(row), flush=True)
                rows.append(row)

            if a.rows:
                measure(lm.runner, prompts_for(lm, a.sequences, ctx), a.rows,
                        [int(x) for x in a.ks.split(",")], [int(b) for b in a.batches.split(",")],
                        on_cell=cell)
            for batch in (int(b) for b in a.speed_batches.split(",")) if a.speed_tokens else ():
                row = {"dtype": dtype, "context": ctx, f"speed_batch_{batch}":
                       speed(lm, prompts_for(lm, batch, ctx), a.speed_tokens, a.speed_draft_len)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "rows": rows},
                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
