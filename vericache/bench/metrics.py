"""Pure measures over token lists and answer text: n-gram drafter τ, divergence, parse checks.

Nothing here touches a model; every function takes plain lists and strings, so each one is
unit-tested on hand-made cases.
"""

from __future__ import annotations

import ast
import codeop
import json
import re
import warnings
from collections import Counter
from collections.abc import Sequence

_FENCE_PY = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_FENCE_ANY = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def ngram_lookup(seq: Sequence[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """A prompt-lookup drafter's proposal: up to `k` tokens that followed the most recent
    earlier occurrence of the last n tokens of `seq`, trying n = max_n down to min_n.

    Returns [] when no suffix n-gram occurs earlier (or k < 1).
    """
    if k < 1:
        return []
    L = len(seq)
    for n in range(max_n, min_n - 1, -1):
        if n > L - 1:
            continue
        tail = tuple(seq[L - n:])
        # occurrences that end before the last token, so at least one token follows them
        for j in range(L - n - 1, -1, -1):
            if tuple(seq[j:j + n]) == tail:
                return list(seq[j + n:j + n + k])
    return []


def ngram_rounds(prompt: Sequence[int], output: Sequence[int], k: int,
                 max_n: int = 3, min_n: int = 1) -> list[int]:
    """Tokens emitted per round by a model-free n-gram drafter verifying against `output`.

    The simulation mirrors a vericache round on the same greedy output: the first output
    token comes from the prefill (no round); each round proposes up to k tokens (at most the
    remaining tokens minus one, so the verifier's bonus token exists), the verifier accepts
    the longest matching prefix and adds one token of its own: a round emits accepted + 1.
    """
    out = list(output)
    seq = list(prompt) + out[:1]
    i, rounds = min(1, len(out)), []
    while i < len(out):
        room = min(k, len(out) - i - 1)
        proposal = ngram_lookup(seq, room, max_n, min_n) if room > 0 else []
        a = 0
        while a < len(proposal) and proposal[a] == out[i + a]:
            a += 1
        rounds.append(a + 1)
        seq.extend(out[i:i + a + 1])
        i += a + 1
    return rounds


def mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def tau_hist(round_emitted: Sequence[int]) -> dict[str, int]:
    """Histogram of tokens per round: {"1": count, "2": count, ...} (string keys, for JSON)."""
    return {str(t): c for t, c in sorted(Counter(round_emitted).items())}


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first output token where `other` differs from `reference`; None when
    they are equal. When one is a strict prefix of the other, the shorter one's length."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    if len(reference) == len(other):
        return None
    return min(len(reference), len(other))


def extract_code(text: str) -> str:
    """The first ```python fenced block (an unclosed fence runs to the end), else the first
    fenced block of any language, else the whole text."""
    for pat in (_FENCE_PY, _FENCE_ANY):
        m = pat.search(text)
        if m:
            return m.group(1)
    return text


def parses_code(text: str, truncated: bool = False) -> bool:
    """Whether the answer's code parses with ast.parse. Empty code does not count.

    An answer cut by the token limit (`truncated`) whose code runs to the end of the text is
    judged as a prefix: its last, partial line is dropped, and code that is incomplete but
    has no syntax error so far (per `codeop`, as the interactive prompt judges input) counts.
    """
    code = extract_code(text)
    cut = truncated and text.endswith(code)
    if cut and not code.endswith("\n"):
        code = code[:code.rfind("\n") + 1]
    if not code.strip():
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarnings of odd escapes are not errors
        try:
            ast.parse(code)
            return True
        except (SyntaxError, ValueError):
            if not cut:
                return False
        try:
            codeop.compile_command(code, "<answer>", "exec")  # None: incomplete so far
        except (SyntaxError, ValueError, OverflowError):
            return False
    return True


def extract_json(text: str) -> object | None:
    """The first {...} object in the text, decoded; None if there is none that decodes."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        obj, _ = json.JSONDecoder().raw_decode(text, start)
        return obj
    except json.JSONDecodeError:
        pass
    end = text.rfind("}")
    if end > start:
        try:
            return json.loads(text[start:end + 1])
        except json.JSONDecodeError:
            return None
    return None


def parses_json(text: str) -> bool:
    """Whether the answer holds a {...} block that json.loads accepts."""
    return isinstance(extract_json(text), dict)
