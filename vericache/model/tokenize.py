"""Prompts to token ids, beside the model: the chat template and plain text, the same way for
every entry point (CLI, gateway, benchmarks)."""

from __future__ import annotations

from vericache.errors import InvalidArgument


def template_takes_tools(tokenizer) -> bool:
    """Whether the model's chat template renders a `tools` argument (SmolLM2's does not)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def apply_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """A chat's token ids under the model's chat template, ready for the assistant's turn;
    `tools` go to a template that takes them (`template_takes_tools`)."""
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages) or not messages:
        raise InvalidArgument("messages must be a non-empty list of {role, content} strings", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("this model has no chat template; send a plain prompt", "messages")
    extra = {"tools": tools} if tools and template_takes_tools(tokenizer) else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False, **extra)
    return list(ids)


def encode_text(tokenizer, text: str) -> list[int]:
    """A plain prompt's token ids (with the tokenizer's special tokens, e.g. BOS)."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
