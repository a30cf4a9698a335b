"""The OpenAI wire format: request and response models of the gateway.

Fields follow the order of the OpenAI API reference; VeriCache's own additions come last and
carry descriptions (the `vericache` request object, usage's rounds / tokens_per_round /
acceptance_rate). Unknown request fields are ignored, as OpenAI-compatible servers do. Only
the sampling OpenAI clients send by default is accepted: top_p must be 1 and n must be 1.
The OpenAI (and vLLM) fields this gateway does not implement yet (`NOT_YET`: logprobs,
response_format, tools, penalties, ...) are accepted only at their neutral values; any other
value gets a 400 naming the field, never a 200 that silently ignored it.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- requests ------------------------------------------------------------------------
class TextPart(OpenAIModel):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts are joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class VeriCacheOptions(OpenAIModel):
    """Per-request decoding settings; each one left out keeps the server's default."""

    mode: str | None = Field(None, description="full (full-KV reference), lossy (compressed KV "
                                               "only) or vericache (draft compressed, verify full)")
    compressor: str | None = Field(None, description="KV compressor for drafting, e.g. snapkv, "
                                                     "streamingllm, kivi:bits=4, snapkv-kivi")
    ratio: float | None = Field(None, description="compression ratio of token-dropping compressors")
    draft_len: int | None = Field(None, ge=1, le=256,
                                  description="largest draft length k per round (1..256)")
    selection: str | None = Field(None, description="how the drafter's kept tokens move: static, "
                                                    "question or verify (NAME:key=value,...)")
    exact: Literal["fast", "bitwise"] | None = Field(
        None, description="bitwise: the full-KV passes run row by row, so the output is full "
                          "greedy decoding's bit for bit (slower); fast (default): batched passes, "
                          "identical up to near-ties (README, Exactness)")
    adaptive: bool | None = Field(None, description="false: draft draft_len tokens every round; "
                                                    "true (default): the cost model chooses k, "
                                                    "0 (a plain decode step) where drafting "
                                                    "does not pay")


# field -> the values that ask for nothing (what clients send when the feature is off)
NOT_YET: dict[str, tuple] = {
    "logprobs": (False,), "top_logprobs": (0,), "response_format": ({"type": "text"},),
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False),
    "functions": ([],), "function_call": ("none",), "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "logit_bias": ({},),
    "top_k": (-1, 0), "min_p": (0.0,), "best_of": (1,), "echo": (False,), "suffix": ("",),
}


def _neutral(v, neutral: tuple) -> bool:
    if v is None:
        return True
    for n in neutral:
        if isinstance(n, bool) or isinstance(v, bool):  # True == 1 and False == 0: not here
            if type(v) is type(n) and v == n:
                return True
        elif isinstance(n, (int, float)) and isinstance(v, (int, float)):
            if float(v) == float(n):
                return True
        elif v == n:
            return True
    return False


class SamplingFields(OpenAIModel):
    """Fields and checks shared by both request kinds."""

    ignore_eos: bool | None = Field(None, description="vLLM's extension: decode past the end "
                                                      "of sequence up to the token limit")
    # not implemented yet (see NOT_YET): only their neutral values are accepted
    logprobs: Any = Field(None, description="not supported yet: absent or false")
    top_logprobs: Any = Field(None, description="not supported yet: absent or 0")
    response_format: Any = Field(None, description='not supported yet: absent or {"type": "text"}')
    tools: Any = Field(None, description="not supported yet: absent or []")
    tool_choice: Any = Field(None, description='not supported yet: absent or "none"')
    parallel_tool_calls: Any = Field(None, description="accepted (no tools are supported yet)")
    functions: Any = Field(None, description="not supported yet: absent or []")
    function_call: Any = Field(None, description='not supported yet: absent or "none"')
    presence_penalty: Any = Field(None, description="not supported yet: absent or 0")
    frequency_penalty: Any = Field(None, description="not supported yet: absent or 0")
    repetition_penalty: Any = Field(None, description="not supported yet: absent or 1")
    logit_bias: Any = Field(None, description="not supported yet: absent or {}")
    top_k: Any = Field(None, description="not supported yet: absent, -1 or 0")
    min_p: Any = Field(None, description="not supported yet: absent or 0")
    best_of: Any = Field(None, description="not supported yet: absent or 1")
    echo: Any = Field(None, description="not supported yet: absent or false")
    suffix: Any = Field(None, description='not supported yet: absent or ""')

    @field_validator(*NOT_YET)
    @classmethod
    def _not_yet(cls, v, info: ValidationInfo):
        if not _neutral(v, NOT_YET[info.field_name]):
            raise ValueError(f"{info.field_name} is not supported yet (only "
                             f"{' or '.join(repr(n) for n in NOT_YET[info.field_name])} is "
                             "accepted); VeriCache will not ignore it silently")
        return v

    @field_validator("n", check_fields=False)
    @classmethod
    def _one_choice(cls, v):
        if v is not None and v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("top_p", check_fields=False)
    @classmethod
    def _no_nucleus(cls, v):
        if v is not None and v != 1.0:
            raise ValueError("only top_p=1 is supported (speculative verification needs the "
                             "full distribution)")
        return v

    @field_validator("stream_options", check_fields=False)
    @classmethod
    def _stream_options_need_stream(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    model: str | None = None
    max_completion_tokens: int | None = None
    max_tokens: int | None = Field(None, description="deprecated by OpenAI in favour of "
                                                     "max_completion_tokens; both are accepted")
    n: int | None = 1
    seed: int | None = Field(None, ge=0, lt=1 << 63, description="sampling seed, 0..2^63-1")
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2,
                                      description="0..2; absent: the server's default (greedy "
                                                        "unless the server was started otherwise)")
    top_p: float | None = 1.0
    user: str | None = None
    vericache: VeriCacheOptions | None = Field(None, description="VeriCache decoding settings")

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v):
        if not v:
            raise ValueError("messages must not be empty")
        return v

    def limit(self) -> tuple[int | None, str]:
        """The requested token limit and the parameter that set it."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    n: int | None = 1
    seed: int | None = Field(None, ge=0, lt=1 << 63, description="sampling seed, 0..2^63-1")
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2,
                                      description="0..2; absent: the server's default (greedy "
                                                        "unless the server was started otherwise)")
    top_p: float | None = 1.0
    user: str | None = None
    vericache: VeriCacheOptions | None = Field(None, description="VeriCache decoding settings")

    def limit(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"


# ---- responses -----------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    rounds: int = Field(0, description="draft/verify rounds (full mode: one per decode step)")
    tokens_per_round: float = Field(0.0, description="verified tokens emitted per round (tau)")
    acceptance_rate: float = Field(0.0, description="accepted drafts / drafted tokens")
    selection: str | None = Field(None, description="the selection policy that moved the "
                                                    "drafter's kept tokens (None in full mode)")
    selection_moves: int = Field(0, description="moves of the drafter's set (deltas applied)")
    selection_moved_tokens: int = Field(0, description="tokens the verifier moved into the "
                                                       "drafter's set, over layers and KV heads")
    plain_rounds: int = Field(0, description="rounds the cost model made plain full-KV decode "
                                             "steps (k = 0), in vericache mode")
    draft_len_mean: float = Field(0.0, description="drafts verified per round, on average")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Both the whole response and each stream chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "vericache"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
