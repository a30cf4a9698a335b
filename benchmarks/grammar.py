"""Structured output under speculation: what the grammar costs and what it does to τ.

Two parts, on the default model (SmolLM2-135M-Instruct) and its tokenizer:

1. engines: xgrammar and llguidance side by side (why `vericache.spec.grammar` uses
   xgrammar): the tokenizer tables' build time, the compile time of a JSON schema and of
   "any JSON object" (the median of 5, caches off), and the mask time per token, replaying a
   valid document token by token (mean and p99 over the tokens).
2. decoding: the same prompts in `vericache` mode (k fixed) without and with a JSON-schema
   grammar, one request at a time: τ, acceptance, and the grammar's time (masks on the drafter
   and the verifier, advances, rollbacks: `Grammars.seconds`) per output token and as a share
   of the rounds' time (draft + verify). The constrained output is checked against constrained
   `full` decoding (token for token) and against the schema.

    PYTHONPATH=. .venv/bin/python benchmarks/grammar.py --prompts 4 --max-tokens 96 \\
        --draft-len 8 --threads 1 --json benchmarks/results/2026-12-01e/grammar.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
DOCUMENT = {"name": "Alice Smith", "age": 31, "city": "Paris",
            "hobbies": ["chess", "climbing", "baking bread"]}
ASKS = ["Describe a fictional person as a JSON object with name, age, city and hobbies.",
        "Give me a JSON profile of a retired teacher: name, age, city, hobbies.",
        "Invent a character for a novel and return it as JSON (name, age, city, hobbies).",
        "Return a JSON record for a young software engineer with her hobbies.",
        "Make up a JSON object for a chef living in Lyon.",
        "Create a JSON profile of a musician from Vienna."]


def _median_s(fn, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _p99(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(round(0.99 * len(xs))) - 1)]


def engines(lm) -> dict:
    """Build, compile and mask times of both engines on the model's tokenizer."""
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt
    import xgrammar as xgr

    tok, vocab = lm.tokenizer, lm.vocab_size
    out = {}
    # xgrammar: the separators the engine uses (", " and ": ")
    text = json.dumps(DOCUMENT)
    ids = tok(text)["input_ids"]
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab,
                                              stop_token_ids=list(lm.eos_token_ids))
    build = time.perf_counter() - t
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    compile_schema = _median_s(lambda: comp.compile_json_schema(json.dumps(SCHEMA),
                                                                any_whitespace=False))
    compile_object = _median_s(lambda: comp.compile_json_schema('{"type": "object"}',
                                                                any_whitespace=False))
    g = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    m = xgr.GrammarMatcher(g)
    bm = xgr.allocate_token_bitmask(1, vocab)
    masks = []
    for i in ids:
        t = time.perf_counter()
        m.fill_next_token_bitmask(bm)
        masks.append(time.perf_counter() - t)
        assert m.accept_token(i)
    out["xgrammar"] = {"build_ms": build * 1e3, "compile_schema_ms": compile_schema * 1e3,
                       "compile_object_ms": compile_object * 1e3, "tokens": len(ids),
                       "mask_us_mean": statistics.mean(masks) * 1e6,
                       "mask_us_p99": _p99(masks) * 1e6}
    # llguidance: compact JSON (its default separators without flexible whitespace)
    ids = tok(json.dumps(DOCUMENT, separators=(",", ":")))["input_ids"]
    t = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=lm.eos_token_ids[0])
    build = time.perf_counter() - t
    def llg(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        return llguidance.LLMatcher(ltok, grammar)

    times = {"schema": _median_s(lambda: llg(SCHEMA)),
             "object": _median_s(lambda: llg({"type": "object"}))}
    lm_matcher = llg(SCHEMA)
    bm = lgt.allocate_token_bitmask(1, vocab)
    masks = []
    for i in ids:
        t = time.perf_counter()
        lgt.fill_next_token_bitmask(lm_matcher, bm, 0)
        masks.append(time.perf_counter() - t)
        assert lm_matcher.consume_token(i), lm_matcher.get_error()
    out["llguidance"] = {"build_ms": build * 1e3, "compile_schema_ms": times["schema"] * 1e3,
                         "compile_object_ms": times["object"] * 1e3, "tokens": len(ids),
                         "mask_us_mean": statistics.mean(masks) * 1e6,
                         "mask_us_p99": _p99(masks) * 1e6}
    return out


def decoding(lm, n_prompts: int, max_tokens: int, draft_len: int, compressor: str,
             ratio: float | None, chunk_size: int) -> dict:
    import jsonschema

    from vericache.engine.generation import GenParams
    from vericache.engine.local import generate
    from vericache.engine.rounds import LocalBackends
    from vericache.model.tokenize import apply_chat
    from vericache.spec.grammar import GrammarSpec

    source = GrammarSpec.json_schema(SCHEMA).source()
    backends = LocalBackends(lm)
    g = backends.grammars
    g.compile(source)  # the tokenizer's tables (once a process) are not a request's cost
    rows = []
    for ask in ASKS[:n_prompts]:
        ids = apply_chat(lm.tokenizer, [{"role": "user", "content": ask}])
        row = {"prompt": ask, "prompt_tokens": len(ids)}
        for label, grammar in (("plain", ""), ("grammar", source)):
            p = GenParams(max_tokens=max_tokens, mode="vericache", compressor=compressor,
                          ratio=ratio, chunk_size=chunk_size, draft_len=draft_len,
                          adaptive=False, grammar=grammar)
            s0, c0, m0 = g.seconds, g.compile_s, g.masks
            r = generate(lm, ids, p, backends)
            rounds_s = r.stats.draft_s + r.stats.verify_s
            row[label] = {"tokens": len(r.token_ids), "tau": r.usage["tokens_per_round"],
                          "acceptance": r.usage["acceptance_rate"], "rounds_s": rounds_s,
                          "grammar_s": g.seconds - s0, "masks": g.masks - m0,
                          "compile_ms": (g.compile_s - c0) * 1e3, "finish": r.finish_reason}
            if grammar:
                full = generate(lm, ids, GenParams(max_tokens=max_tokens, mode="full",
                                                   grammar=grammar), backends)
                row[label]["equals_full"] = full.token_ids == r.token_ids
                value = json.loads(r.text) if r.finish_reason == "stop" else None
                if value is not None:
                    jsonschema.validate(value, SCHEMA)
                row[label]["valid"] = value is not None
                row[label]["text"] = r.text
        rows.append(row)
    backends.close()
    return {"compressor": compressor, "ratio": ratio, "chunk_size": chunk_size,
            "draft_len": draft_len, "max_tokens": max_tokens, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help=f"1..{len(ASKS)}")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=8)
    ap.add_argument("--compressor", default="streamingllm")
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--chunk-size", type=int, default=16,
                    help="small, so that the short prompts are compressed at all")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()

    import torch

    from vericache.model import load_model

    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load_model()
    eng = engines(lm)
    print("engine      build ms  compile schema ms  compile object ms  mask us mean  p99")
    for name, e in eng.items():
        print(f"{name:<11} {e['build_ms']:8.0f}  {e['compile_schema_ms']:17.1f}  "
              f"{e['compile_object_ms']:17.1f}  {e['mask_us_mean']:12.1f}  {e['mask_us_p99']:.0f}")
    dec = decoding(lm, a.prompts, a.max_tokens, a.draft_len, a.compressor, a.ratio,
                   a.chunk_size)
    print(f"\n{dec['compressor']} at {dec['ratio']:g}x over {dec['chunk_size']}-token chunks, "
          f"k = {dec['draft_len']} fixed, up to {dec['max_tokens']} tokens")
    print("prompt  tau plain  tau grammar  acc plain  acc grammar  mask ms/token  mask share "
          "of rounds  compile ms  = full  valid")
    tot = {"plain_tok": 0, "plain_rounds": 0.0, "g_tok": 0, "g_rounds_s": 0.0, "g_s": 0.0}
    for i, row in enumerate(dec["rows"]):
        pl, gr = row["plain"], row["grammar"]
        per_tok = gr["grammar_s"] / max(1, gr["tokens"]) * 1e3
        share = gr["grammar_s"] / gr["rounds_s"] if gr["rounds_s"] else 0.0
        gr["mask_ms_per_token"], gr["mask_share"] = per_tok, share
        print(f"{i:>6}  {pl['tau']:9.2f}  {gr['tau']:11.2f}  {pl['acceptance']:9.3f}  "
              f"{gr['acceptance']:11.3f}  {per_tok:13.3f}  {share:21.4f}  {gr['compile_ms']:10.1f}"
              f"  {str(gr['equals_full']):>6}  {gr['valid']}")
        tot["g_tok"] += gr["tokens"]
        tot["g_rounds_s"] += gr["rounds_s"]
        tot["g_s"] += gr["grammar_s"]
    taus = {k: statistics.mean(r[k]["tau"] for r in dec["rows"]) for k in ("plain", "grammar")}
    dec["summary"] = {"tau_plain": taus["plain"], "tau_grammar": taus["grammar"],
                      "mask_ms_per_token": tot["g_s"] / max(1, tot["g_tok"]) * 1e3,
                      "mask_share_of_rounds": tot["g_s"] / tot["g_rounds_s"],
                      "all_equal_full": all(r["grammar"]["equals_full"] for r in dec["rows"]),
                      "all_valid": all(r["grammar"]["valid"] for r in dec["rows"])}
    s = dec["summary"]
    print(f"\nmean tau: {s['tau_plain']:.2f} plain, {s['tau_grammar']:.2f} with the grammar; "
          f"grammar {s['mask_ms_per_token']:.3f} ms an output token, "
          f"{100 * s['mask_share_of_rounds']:.2f}% of the rounds' time; "
          f"all = constrained full: {s['all_equal_full']}, all valid: {s['all_valid']}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"engines": eng, "decoding": dec,
                                            "torch_threads": torch.get_num_threads()}, indent=1))
    return 0 if s["all_equal_full"] else 1


if __name__ == "__main__":
    sys.exit(main())
