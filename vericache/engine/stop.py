"""When an output ends, decided token by token so every mode ends at the same place.

`StopChecker.add(token)` is called once per verified token, in order. It returns a finish
reason ("stop" for EOS or a stop string, "length" for max_tokens) or None. EOS is not part
of the output; a stop string is cut from the text (OpenAI semantics) and the token that
completed it is the last one counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class IncrementalText:
    """Decodes a growing list of token ids and hands out only text that is final: it holds
    back an incomplete UTF-8 sequence and a suffix that could still become a stop string."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of text already handed out

    def add(self, token: int) -> str | None:
        """Append a token; returns the matched stop string when the text now contains one."""
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                return s
        return None

    def delta(self, final: bool = False) -> str:
        """Text not handed out yet that can no longer change."""
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):
                end -= 1
            for s in self.stop:
                for n in range(min(len(s) - 1, end), 0, -1):
                    if self.text[:end].endswith(s[:n]):
                        end -= n
                        break
        end = max(end, self.sent)
        out = self.text[self.sent:end]
        self.sent = end
        return out


@dataclass
class StopChecker:
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    text: IncrementalText | None = None
    ignore_eos: bool = False
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, token: int) -> str | None:
        if self.finish_reason is not None:
            raise RuntimeError("add() after the output finished")
        if token in self.eos_token_ids and not self.ignore_eos:
            self.finish_reason = "stop"
            return self.finish_reason
        self.tokens.append(token)
        if self.text is not None and self.text.add(token) is not None:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.tokens)
