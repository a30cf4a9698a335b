"""Tools (OpenAI function calling) for models whose chat template may not know them: the
prompt that lists them, the grammar of a forced call, and the calls parsed out of the output.

The format is Hermes / Qwen 2.5's. A chat template that takes `tools` gets them as they are
(`apply_chat_template(..., tools=...)`); one that ignores them (SmolLM2's) gets them rendered
into the system prompt (`SYSTEM`), and the model is asked to answer a call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. Earlier assistant calls are
rendered the same way, and `tool` messages as `<tool_response>...</tool_response>`.

tool_choice:
- "none": the tools are left out of the prompt; the answer is text.
- "auto" (the default with tools): no grammar; a `<tool_call>` block (or an answer that is
  just such a JSON object) naming a tool is parsed as a call, anything else is text.
- "required", or {"type": "function", "function": {"name": ...}}: the output is generated
  under `call_grammar`: the wrapper around a JSON object whose name is one of the tools (that
  one) and whose arguments follow that tool's `parameters` schema, so it always parses.
One call per answer: the grammar holds one, and parallel_tool_calls is accepted either way.

Streamed, a required or named call goes out as it is generated (`CallStream`): a delta with
the call's id and name once the name is complete, then the arguments' JSON text piece by
piece, as OpenAI streams them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from vericache.errors import InvalidArgument
from vericache.spec.grammar import GrammarSpec, parse

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
SYSTEM = ("You are a function calling AI model. You may call one of the functions below to "
          "answer the user.\n<tools>\n{tools}\n</tools>\nTo call a function, answer with its "
          "name and arguments as a JSON object inside <tool_call></tool_call> tags:\n"
          "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
          "</tool_call>")
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
# a forced call's text up to its arguments (the grammar writes name, then arguments)
_HEAD = re.compile(r'\s*<tool_call>\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:')


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or call_id()


class CallStream:
    """A forced call (tool_choice required or named, generated under `call_grammar`) read as
    its text arrives: `feed(text)` returns what became known, ("name", name) once, when the
    name is complete, then ("arguments", piece) for each new piece of the arguments' JSON
    text, up to the brace that closes them (`done`). Text that does not start like a call
    yields nothing (`name` stays None: the caller sends the answer whole at its end)."""

    def __init__(self):
        self.text, self.name, self.id = "", None, call_id()
        self.pos = 0  # the next character to scan, once the name is known
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False
        self.sent = False  # any of the arguments' text

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.text += text
        out = []
        if self.name is None:
            m = _HEAD.match(self.text)
            if m is None:
                return out
            self.name, self.pos = json.loads(m.group(1)), m.end()
            out.append(("name", self.name))
        begin = self.pos
        while not self.done and self.pos < len(self.text):
            ch = self.text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.done = self.depth == 0
        piece = self.text[begin:self.pos]
        if not self.sent:
            piece = piece.lstrip()  # the whitespace after "arguments":
        if piece:
            self.sent = True
            out.append(("arguments", piece))
        return out


def functions(tools: list[dict]) -> dict[str, dict]:
    """name -> function definition ({name, description, parameters}) of the request's tools."""
    return {t["function"]["name"]: t["function"] for t in tools}


def system_prompt(tools: list[dict]) -> str:
    return SYSTEM.format(tools="\n".join(json.dumps(t["function"]) for t in tools))


def render(messages: list[dict], tools: list[dict] | None, template_takes_tools: bool) -> list[dict]:
    """Messages ({role, content, tool_calls?}) as plain {role, content} for a chat template;
    with tools and a template that ignores them, the tools go into the system prompt."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        for c in m.get("tool_calls") or []:
            args = c["function"]["arguments"] or "{}"
            content += (OPEN + f'{{"name": {json.dumps(c["function"]["name"])}, '
                        f'"arguments": {args}}}' + CLOSE)
        if m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools and not template_takes_tools:
        head = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + head}
        else:
            out.insert(0, {"role": "system", "content": head})
    return out


def call_grammar(tools: list[dict], name: str | None = None) -> str:
    """The grammar source of one call (`OPEN` JSON `CLOSE`) to `name` or to any of `tools`."""
    fns = functions(tools)
    chosen = [fns[name]] if name is not None else list(fns.values())
    options = [{"type": "object",
                "properties": {"name": {"const": f["name"]},
                               "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
               for f in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    source = GrammarSpec.json_schema(schema, OPEN, CLOSE).source()
    try:
        parse(source)
    except InvalidArgument as e:
        raise InvalidArgument(f"a tool's parameters: {e}", "tools") from None
    return source


def text_besides_calls(text: str) -> str | None:
    """The text of an answer with calls outside its `<tool_call>` blocks (None when there is
    none, or when the whole answer was one call's JSON object)."""
    rest = _BLOCK.sub("", text).strip()
    return rest if rest and rest != text.strip() else None


def parse_calls(text: str, tools: list[dict]) -> list[ToolCall]:
    """The calls in an answer: each `<tool_call>` block, or the whole answer when it is one
    JSON object, that names one of `tools` with object arguments; [] when there is none."""
    names = functions(tools)
    blocks = _BLOCK.findall(text) or [text.strip()]
    calls = []
    for b in blocks:
        try:
            d = json.loads(b)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("name") in names and isinstance(d.get("arguments", {}), dict):
            calls.append(ToolCall(d["name"], json.dumps(d.get("arguments", {}))))
    return calls
