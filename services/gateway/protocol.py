"""The OpenAI wire format: request and response models of the gateway.

Fields follow the order of the OpenAI API reference; VeriCache's own additions come last and
carry descriptions (the `vericache` request object, usage's rounds / tokens_per_round /
acceptance_rate). Unknown request fields are ignored, as OpenAI-compatible servers do.
Sampling: temperature, top_p, and vLLM's top_k, min_p, presence / frequency / repetition
penalties and logit_bias (`vericache.spec.processors`), each range-checked (a 400 names the
field); logprobs / top_logprobs are the raw model distribution's (vLLM's default), from
full-KV logits. n (up to 8) runs n requests, choice i with seed + i. response_format
(json_object, json_schema) constrains the output to a grammar (`vericache.spec.grammar`);
chat's tools and tool_choice follow `services.gateway.tools`. The OpenAI (and vLLM) fields
this gateway does not implement yet (`NOT_YET`: functions, best_of, echo, ...; tools on
completions) are accepted only at their neutral values; any other value gets a 400 naming the
field, never a 200 that silently ignored it.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from vericache.spec.grammar import GrammarSpec
from vericache.spec.logprobs import MAX_TOP_LOGPROBS
from vericache.spec.processors import LOGIT_BIAS_LIMIT, PENALTY_LIMIT, REPETITION_LIMITS


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- requests ------------------------------------------------------------------------
class TextPart(OpenAIModel):
    type: Literal["text"] = "text"
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str = Field("{}", description="the arguments, JSON text")


class ToolCallMessage(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = Field(None, description="an assistant's calls")
    tool_call_id: str | None = Field(None, description="a tool message's call")

    def text(self) -> str:
        """The content as one string (text parts are joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class JSONSchemaFormat(OpenAIModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema",
                                           description="the JSON schema; absent: any object")
    strict: bool | None = Field(None, description="accepted either way: the schema is always "
                                                  "enforced")


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def grammar(self) -> str:
        """The grammar source (`vericache.spec.grammar`) it asks for ("": none)."""
        if self.type == "text":
            return ""
        if self.type == "json_schema" and self.json_schema is not None \
                and self.json_schema.schema_ is not None:
            return GrammarSpec.json_schema(self.json_schema.schema_).source()
        return GrammarSpec("json_object").source()


class FunctionDef(OpenAIModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


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
        None, description="bitwise: the full-KV passes run in the runner's invariant pass, "
                          "so the output is full greedy decoding's bit for bit (slower); fast "
                          "(default): batched passes, identical up to near-ties (README, Exactness)")
    adaptive: bool | None = Field(None, description="false: draft draft_len tokens every round; "
                                                    "true (default): the cost model chooses k, "
                                                    "0 (a plain decode step) where drafting "
                                                    "does not pay")


MAX_CHOICES = 8  # n at most


# field -> the values that ask for nothing (what clients send when the feature is off)
NOT_YET: dict[str, tuple] = {
    "parallel_tool_calls": (True, False), "functions": ([],), "function_call": ("none",),
    "best_of": (1,), "echo": (False,), "suffix": ("",),
}
COMPLETIONS_NOT_YET: dict[str, tuple] = {"tools": ([],), "tool_choice": ("none",)}


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
    presence_penalty: float | None = Field(
        None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, allow_inf_nan=False,
        description="-2..2, subtracted from the logit of every token generated so far")
    frequency_penalty: float | None = Field(
        None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, allow_inf_nan=False,
        description="-2..2, subtracted once per occurrence in the generated tokens")
    repetition_penalty: float | None = Field(
        None, ge=REPETITION_LIMITS[0], le=REPETITION_LIMITS[1], allow_inf_nan=False,
        description="vLLM's extension, 0.001..1000 (1: off): HF's penalty over prompt and "
                    "output")
    logit_bias: dict[int, float] | None = Field(
        None, description="token id -> -100..100, added to its logit before sampling")
    top_k: int | None = Field(None, ge=-1, description="vLLM's extension: keep the k most "
                                                       "likely tokens; -1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM's extension, 0..1: drop "
                                                             "tokens under min_p x the best's "
                                                             "probability")
    response_format: ResponseFormat | None = Field(
        None, description='{"type": "json_object"} or {"type": "json_schema", "json_schema": '
                          '{"name", "schema"}}: the output follows the grammar (compact JSON)')
    # not implemented yet (see NOT_YET): only their neutral values are accepted
    parallel_tool_calls: Any = Field(None, description="accepted either way: at most one "
                                                       "call per answer")
    functions: Any = Field(None, description="not supported yet: absent or []")
    function_call: Any = Field(None, description='not supported yet: absent or "none"')
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

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v):
        for tok, b in (v or {}).items():
            if tok < 0 or not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"maps token ids >= 0 to values in [-{LOGIT_BIAS_LIMIT:g}, "
                                 f"{LOGIT_BIAS_LIMIT:g}] (got {tok}: {b})")
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
    def choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_overrides(self) -> dict:
        """The processing fields the request set, as GenParams fields."""
        out = {n: getattr(self, n) for n in ("top_p", "min_p", "presence_penalty",
                                             "frequency_penalty", "repetition_penalty",
                                             "logit_bias") if getattr(self, n) is not None}
        if self.top_k is not None:
            out["top_k"] = max(0, self.top_k)  # -1 (vLLM) and 0 are both off
        if self.response_format is not None:
            out["grammar"] = self.response_format.grammar()
        return out


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    model: str | None = None
    logprobs: bool | None = Field(False, description="return each output token's log "
                                                     "probability (of the raw model "
                                                     "distribution, from full-KV logits)")
    max_completion_tokens: int | None = None
    max_tokens: int | None = Field(None, description="deprecated by OpenAI in favour of "
                                                     "max_completion_tokens; both are accepted")
    n: int | None = Field(1, ge=1, le=MAX_CHOICES,
                          description=f"1..{MAX_CHOICES} choices; choice i samples with seed + i")
    seed: int | None = Field(None, ge=0, lt=1 << 63, description="sampling seed, 0..2^63-1")
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2,
                                      description="0..2; absent: the server's default (greedy "
                                                        "unless the server was started otherwise)")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="0..20 most likely alternatives per token; "
                                                 "needs logprobs true")
    top_p: float | None = Field(None, gt=0, le=1, description="(0, 1]: nucleus sampling")
    tools: list[Tool] | None = Field(None, description="functions the model may call "
                                                       "(services.gateway.tools)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='none, auto (the default with tools), required, or {"type": '
                          '"function", "function": {"name"}}: required and named calls are '
                          "generated under the tool's parameters schema")
    user: str | None = None
    vericache: VeriCacheOptions | None = Field(None, description="VeriCache decoding settings")

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v, info: ValidationInfo):
        tools = info.data.get("tools") or []
        if isinstance(v, NamedToolChoice) and v.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"names the function {v.function.name!r}, which is not in tools")
        if v in ("auto", "required") and not tools:
            raise ValueError(f"{v!r} needs tools")
        return v

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named (the tool_choice in effect)."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return v

    def logprobs_n(self) -> int | None:
        """None: no logprobs; n: each token's logprob and n alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

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
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="0..20: return each output token's log probability "
                                             "(raw model distribution, full-KV logits) and this "
                                             "many alternatives")
    max_tokens: int | None = None
    n: int | None = Field(1, ge=1, le=MAX_CHOICES,
                          description=f"1..{MAX_CHOICES} choices; choice i samples with seed + i")
    seed: int | None = Field(None, ge=0, lt=1 << 63, description="sampling seed, 0..2^63-1")
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2,
                                      description="0..2; absent: the server's default (greedy "
                                                        "unless the server was started otherwise)")
    top_p: float | None = Field(None, gt=0, le=1, description="(0, 1]: nucleus sampling")
    user: str | None = None
    vericache: VeriCacheOptions | None = Field(None, description="VeriCache decoding settings")
    # chat only: on completions only their neutral values are accepted
    tools: Any = Field(None, description="chat only: absent or []")
    tool_choice: Any = Field(None, description='chat only: absent or "none"')

    @field_validator(*COMPLETIONS_NOT_YET)
    @classmethod
    def _chat_only(cls, v, info: ValidationInfo):
        if not _neutral(v, COMPLETIONS_NOT_YET[info.field_name]):
            raise ValueError(f"{info.field_name} is supported on chat completions only")
        return v

    def limit(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def logprobs_n(self) -> int | None:
        return self.logprobs


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
    exact: str = Field("fast", description="how the full-KV passes ran: fast (identical up to "
                                           "near-ties) or bitwise (README, Exactness)")
    plain_rounds: int = Field(0, description="rounds the cost model made plain full-KV decode "
                                             "steps (k = 0), in vericache mode")
    draft_len_mean: float = Field(0.0, description="drafts verified per round, on average")
    held_steps: int = Field(0, description="plain full-KV decode steps that finished the request "
                                           "on the full KV its last verification loaded (an "
                                           "offloaded tier), with no load of their own")


def merge_usage(usages: list[UsageInfo]) -> UsageInfo:
    """The usage of n choices of one prompt: counts add up, the prompt counts once, ratios
    are weighted by rounds (acceptance by drafts)."""
    if len(usages) == 1:
        return usages[0]
    rounds = sum(u.rounds for u in usages)
    drafted = sum(u.draft_len_mean * u.rounds for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    prompt = usages[0].prompt_tokens
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        rounds=rounds,
        tokens_per_round=sum(u.tokens_per_round * u.rounds for u in usages) / rounds if rounds else 0.0,
        acceptance_rate=(sum(u.acceptance_rate * u.draft_len_mean * u.rounds for u in usages)
                         / drafted if drafted else 0.0),
        selection=usages[0].selection,
        selection_moves=sum(u.selection_moves for u in usages),
        selection_moved_tokens=sum(u.selection_moved_tokens for u in usages),
        exact=usages[0].exact,
        plain_rounds=sum(u.plain_rounds for u in usages),
        draft_len_mean=drafted / rounds if rounds else 0.0,
        held_steps=sum(u.held_steps for u in usages))


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ToolCallDeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallDeltaFunction


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: CompletionLogprobs | None = None
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
