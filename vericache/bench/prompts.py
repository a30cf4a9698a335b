"""Benchmark prompts: the user's files and message lists, or built-in long code contexts.

A built-in prompt wraps source text of installed Python modules (the standard library's, so
the text is the same on every machine with the same Python) in a chat message, cut by tokens
to about the requested context length. Two variants alternate: one asks for code, one for a
JSON object, so the answer's syntax can be checked (`ast.parse`, `json.loads`).
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from vericache.model.tokenize import apply_chat, encode_text
from vericache.errors import InvalidArgument

# modules whose source makes the context; missing ones are skipped
SOURCE_MODULES = ("json.decoder", "json.encoder", "argparse", "textwrap", "shlex", "fnmatch",
                  "configparser", "string", "heapq", "bisect", "functools", "csv", "difflib")

CODE_TASK = ("Write one new Python function that uses the code above (for example a small helper "
             "built on its classes or functions), with a docstring. Answer with a single "
             "```python code block and no explanation.")
JSON_TASK = ("List the names of the functions and classes defined in the code above as a JSON "
             "object of the form {\"functions\": [...], \"classes\": [...]}. Answer with the "
             "JSON object only.")
VARIANTS = (("code", CODE_TASK), ("json", JSON_TASK))


@dataclass
class BenchPrompt:
    """One prompt of a run: its token ids and the kind of answer it asks for."""

    name: str
    ids: list[int]
    expects: str = "any"  # "code", "json" or "any" (both checks are reported)
    source: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "prompt_tokens": len(self.ids), "expects": self.expects,
                "source": self.source}


def module_sources(start: int = 0) -> list[tuple[str, str]]:
    """(label, text) of every present module in SOURCE_MODULES, rotated to begin at `start`."""
    found = []
    for name in SOURCE_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        found.append((name, Path(spec.origin).read_text(encoding="utf-8")))
    if not found:
        raise InvalidArgument("no Python source found for the built-in prompts", "builtin")
    s = start % len(found)
    return found[s:] + found[:s]


def _message(source: str, task: str) -> list[dict]:
    return [{"role": "user", "content": f"```python\n{source}```\n\n{task}"}]


def code_context(tokenizer, sources: list[tuple[str, str]], budget: int) -> tuple[str, str]:
    """Concatenated sources cut to about `budget` tokens at a line end; returns (text, labels)."""
    parts, labels, chars = [], [], 0
    for label, text in sources:
        parts.append(f"# ---- module {label} ----\n{text}\n")
        labels.append(label)
        chars += len(parts[-1])
        if chars > budget * 8:  # plenty: source code runs 3-4 characters a token
            break
    ids = encode_text(tokenizer, "".join(parts))
    special = len(encode_text(tokenizer, ""))
    text = tokenizer.decode(ids[special:special + max(0, budget)], skip_special_tokens=True)
    if len(ids) - special > budget and "\n" in text:
        text = text[:text.rfind("\n") + 1]
    used = [lb for lb in labels if f"module {lb} ----" in text]
    return text, "+".join(used)


def builtin_prompts(tokenizer, n: int, context_tokens: int) -> list[BenchPrompt]:
    """`n` built-in prompts of about `context_tokens` tokens each, code and JSON alternating."""
    if context_tokens < 64:
        raise InvalidArgument(f"--context-tokens must be >= 64 (got {context_tokens})", "context_tokens")
    out = []
    for i in range(n):
        kind, task = VARIANTS[i % len(VARIANTS)]
        overhead = len(apply_chat(tokenizer, _message("", task)))
        text, labels = code_context(tokenizer, module_sources(3 * (i // len(VARIANTS))),
                                    context_tokens - overhead)
        ids = apply_chat(tokenizer, _message(text, task))
        out.append(BenchPrompt(f"builtin-{kind}-{i}", ids, kind, labels))
    return out


SHARED_TASK = ("Write a short Python example that calls `{name}` from the code above, with a "
               "comment saying what it returns. Answer with a single ```python code block.")


def shared_document_prompts(tokenizer, n: int, context_tokens: int, start: int = 0) -> list[BenchPrompt]:
    """`n` prompts of about `context_tokens` tokens that share one code document and differ
    in their question (each about another function defined in it): the shape of many users
    asking about one long context. The shared part is a common token prefix, so a prefix
    cache computes (or loads) it once. `start`: the document begins at that source module
    (another start, another document)."""
    if context_tokens < 256:
        raise InvalidArgument(f"--context-tokens must be >= 256 (got {context_tokens})", "context_tokens")
    overhead = len(apply_chat(tokenizer, _message("", SHARED_TASK.format(name="x" * 24))))
    text, labels = code_context(tokenizer, module_sources(start), context_tokens - overhead)
    # its functions, or where a short document reaches none, its classes
    names = list(dict.fromkeys(re.findall(r"^\s*def (\w+)\(", text, re.M)
                               or re.findall(r"^\s*class (\w+)\b", text, re.M)))
    if not names:
        raise InvalidArgument("the shared document defines no functions or classes", "context_tokens")
    out = []
    for i in range(n):
        name = names[(i * 7) % len(names)] if len(names) < n else names[i * len(names) // n]
        ids = apply_chat(tokenizer, _message(text, SHARED_TASK.format(name=name)))
        out.append(BenchPrompt(f"shared{start or ''}-{i}-{name}", ids, "code", labels))
    return out


def file_prompts(tokenizer, prompt_files: list[Path], messages_files: list[Path],
                 chat: bool = False) -> list[BenchPrompt]:
    """Prompts from text files (raw, or as one user message with `chat`) and from JSON
    files holding an OpenAI-style list of {role, content} (the chat template is applied)."""
    out = []
    for path in prompt_files:
        text = _read(path)
        ids = apply_chat(tokenizer, [{"role": "user", "content": text}]) if chat \
            else encode_text(tokenizer, text)
        out.append(BenchPrompt(path.stem, ids, "any", str(path)))
    for path in messages_files:
        try:
            messages = json.loads(_read(path))
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"{path}: not JSON: {e}", "messages_file") from e
        out.append(BenchPrompt(path.stem, apply_chat(tokenizer, messages), "any", str(path)))
    _unique_names(out)
    return out


def _read(path: Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidArgument(f"cannot read {path}: {e}", "prompt_file") from e


def _unique_names(prompts: list[BenchPrompt]) -> None:
    """Suffix repeated names (two files called prompt.txt in different folders) with #2, #3."""
    seen: dict[str, int] = {}
    for p in prompts:
        seen[p.name] = seen.get(p.name, 0) + 1
        if seen[p.name] > 1:
            p.name = f"{p.name}#{seen[p.name]}"
