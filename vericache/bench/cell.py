"""One cell's measures from one generation and its prompt's `full` reference.

Speed: tokens/s over the whole generation (prefill included) and decode tokens/s (the
tokens after the first, over the time after prefill and compression), each also as a ratio
to `full` on the same prompt in the same run. Rounds: τ (tokens emitted per round), its
histogram, acceptance. Memory: the prompt's full and compressed KV bytes. Fidelity: the
first output token where the cell departs from full greedy, and `identical`. Answers: do
code and JSON parse. Time: prefill, draft and verify seconds, draft steps, verify tokens.
Selection: the policy, its seconds (and share of the rounds' time), the tokens it moved into
the drafter's set and the bytes of those moves, per output token.
For vericache cells, also the τ a model-free n-gram (prompt-lookup) drafter reaches on the
full-greedy output with the same draft length.
"""

from __future__ import annotations

from vericache.bench.metrics import (first_divergence, mean, ngram_rounds, parses_code,
                                     parses_json, tau_hist)
from vericache.bench.prompts import BenchPrompt


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _rnd(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def speeds(result) -> tuple[float | None, float | None]:
    """(tokens/s over the whole call, decode tokens/s after the first token)."""
    n, s = len(result.token_ids), result.stats
    total = n / result.seconds if result.seconds > 0 else None
    decode_time = result.seconds - s.prefill_s - s.compress_s
    decode = (n - 1) / decode_time if n > 1 and decode_time > 0 else None
    return total, decode


def answer_checks(prompt: BenchPrompt, text: str, truncated: bool) -> dict:
    """parses_code / parses_json for the kinds of answer the prompt asks for (None otherwise)."""
    return {"parses_code": parses_code(text, truncated) if prompt.expects in ("code", "any") else None,
            "parses_json": parses_json(text) if prompt.expects in ("json", "any") else None}


def measure(cell, prompt: BenchPrompt, result, reference) -> dict:
    """The cell's row of the report (a flat dict of JSON values)."""
    s = result.stats
    tps, dtps = speeds(result)
    ref_tps, ref_dtps = speeds(reference)
    compressed = s.draft_kv_bytes if cell.mode != "full" else None
    out = {
        "prompt": cell.prompt, "mode": cell.mode, "compressor": cell.compressor,
        "ratio": cell.ratio, "draft_len": cell.draft_len,
        "selection": cell.selection if cell.mode != "full" else None,
        "completion_tokens": len(result.token_ids), "finish_reason": result.finish_reason,
        "seconds": _rnd(result.seconds), "tokens_per_s": _rnd(tps, 3),
        "decode_tokens_per_s": _rnd(dtps, 3),
        "speed_ratio_vs_full": _rnd(_ratio(tps, ref_tps)),
        "decode_speed_ratio_vs_full": _rnd(_ratio(dtps, ref_dtps)),
        "rounds": s.rounds, "tau_mean": _rnd(mean(s.round_emitted)),
        "tau_hist": tau_hist(s.round_emitted),
        "acceptance_rate": _rnd(s.acceptance_rate) if cell.mode == "vericache" else None,
        "full_kv_bytes": s.full_kv_bytes, "compressed_kv_bytes": compressed,
        "compression": _rnd(_ratio(s.full_kv_bytes, compressed), 3),
        "first_divergence": first_divergence(reference.token_ids, result.token_ids),
        "identical": result.token_ids == reference.token_ids,
        **answer_checks(prompt, result.text, result.finish_reason == "length"),
        "prefill_s": _rnd(s.prefill_s), "compress_s": _rnd(s.compress_s),
        "draft_s": _rnd(s.draft_s), "verify_s": _rnd(s.verify_s),
        "draft_steps": s.draft_steps, "verify_tokens": s.verify_tokens,
        "draft_len_hist": {str(k): n for k, n in sorted(s.k_hist.items())}
        if cell.mode == "vericache" else None,
        "select_s": _rnd(s.select_s),
        # verifier time spent choosing the drafter's set, as a share of the decode rounds' time
        "select_share_of_rounds": _rnd(_ratio(s.select_s, s.draft_s + s.verify_s)),
        "select_moved_tokens": s.select_moved_tokens,
        "select_delta_bytes": s.select_delta_bytes,
        "select_delta_bytes_per_token": _rnd(_ratio(s.select_delta_bytes, len(result.token_ids)), 1),
        "ngram_tau": None, "ngram_tau_hist": None,
        "text": result.text,
    }
    if cell.mode == "vericache":
        rounds = ngram_rounds(prompt.ids, reference.token_ids, cell.draft_len)
        out["ngram_tau"], out["ngram_tau_hist"] = _rnd(mean(rounds)), tau_hist(rounds)
    return out
