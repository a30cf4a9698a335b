"""Batch-1 `full` decode tokens/s of the runner against llama.cpp on the same F32 GGUF, the
same prompt tokens and the same threads, in one run.

Needs llama-cpp-python (an optional benchmark dependency: `pip install llama-cpp-python`,
which builds llama.cpp from source) and an F32 GGUF of the default model, written from the
runner's own fp32 folder by llama.cpp's converter (in the llama-cpp-python sdist, with its
gguf-py), so both read the same weights:

    python vendor/llama.cpp/convert_hf_to_gguf.py ~/.cache/vericache/models/<id> \\
        --outtype f32 --outfile smollm2-f32.gguf
    .venv/bin/python benchmarks/llama_cpp_compare.py --gguf smollm2-f32.gguf --json out.json

Per context (`--contexts`, built-in prompts cut to that many tokens): the runner decodes
`--tokens` greedy tokens through `vericache.engine.local.stream` (decode time: from its first
token to its last), then llama.cpp evaluates the same prompt and decodes as many tokens one
`eval` at a time, greedy over its logits (decode time alike); the order alternates with
`--repeats`. Reports tok/s, the ratio, and the position of the first token where the two
greedy outputs part (float32 both; a different summation order may flip a near-tie).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vericache.bench.prompts import builtin_prompts
from vericache.engine.generation import GenParams
from vericache.engine.local import stream
from vericache.model import load_model


def runner_decode(lm, ids: list[int], tokens: int) -> tuple[float, list[int]]:
    params = GenParams(mode="full", max_tokens=tokens, ignore_eos=True)
    out, first = [], None
    for ev in stream(lm, ids, params):
        if first is None:
            first = time.perf_counter()
        out += ev.token_ids
    return (len(out) - 1) / (time.perf_counter() - first), out


def llama_decode(llm, ids: list[int], tokens: int) -> tuple[float, list[int]]:
    import numpy as np

    llm.reset()
    llm.eval(ids)
    out = [int(np.argmax(llm.scores[llm.n_tokens - 1]))]
    t = time.perf_counter()
    while len(out) < tokens:
        llm.eval([out[-1]])
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    return (len(out) - 1) / (time.perf_counter() - t), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="an F32 GGUF of the default model")
    ap.add_argument("--contexts", default="1000,7000")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit("llama-cpp-python is not installed (pip install llama-cpp-python)")
    torch.set_num_threads(a.threads)
    lm = load_model()
    contexts = [int(c) for c in a.contexts.split(",")]
    llm = Llama(model_path=a.gguf, n_ctx=max(contexts) + a.tokens + 8, n_threads=a.threads,
                n_threads_batch=a.threads, n_batch=512, logits_all=True, verbose=False)
    rows = []
    for ctx in contexts:
        ids = builtin_prompts(lm.tokenizer, 1, ctx + 64)[0].ids[:ctx]
        for rep in range(a.repeats):
            order = ("runner", "llama.cpp") if rep % 2 == 0 else ("llama.cpp", "runner")
            got = {}
            for who in order:
                got[who] = (runner_decode(lm, ids, a.tokens) if who == "runner"
                            else llama_decode(llm, ids, a.tokens))
            (rt, ro), (lt, lo) = got["runner"], got["llama.cpp"]
            part = next((i for i, (x, y) in enumerate(zip(ro, lo)) if x != y), None)
            row = {"context": ctx, "repeat": rep, "threads": a.threads, "tokens": a.tokens,
                   "runner_tok_s": round(rt, 2), "llama_cpp_tok_s": round(lt, 2),
                   "runner_share": round(rt / lt, 3), "outputs_part_at": part}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"gguf": a.gguf, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
