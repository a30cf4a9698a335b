"""Serving: an OpenAI request becomes prompt ids + GenParams, runs on the engine, and comes
back as one response or an SSE stream. Core errors become HTTP errors here, in one place
(`error_response`).

Streams: `data: {json}\\n\\n` per chunk; a failure after the stream started becomes an error
chunk; `data: [DONE]` always ends it. A client that goes away cancels its request. A chunk
that carries output tokens also carries VeriCache's extension `"vericache": {"tokens":
[{"id", "kind", "text"}, ...]}` (kind: how the token came, `TOKEN_KINDS` in
vericache/engine/generation.py; text: the token decoded alone, which may differ from the
chunk's content where a character spans tokens or a stop string was cut). OpenAI clients
ignore the extra field.

Tools (`services.gateway.tools`): with tool_choice other than none, an answer that holds a
call comes back as `message.tool_calls` with finish_reason "tool_calls". Streamed, a required
or named call goes out as OpenAI sends one: a delta with `tool_calls[0]` carrying id, type and
name, then the arguments piece by piece as the tokens come. With "auto" (which may answer
text) the stream holds a choice's text back until it ends, then sends the call (a delta with
id, type and name, then one with the arguments) or the text as one content delta.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                       ChatCompletionChunk, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob,
                                       CompletionChoice, CompletionLogprobs, CompletionRequest,
                                       CompletionResponse, Delta, ErrorInfo, ModelCard,
                                       ModelList, ToolCallDelta, ToolCallDeltaFunction,
                                       ToolCallFunction, ToolCallOut, TopLogprob, UsageInfo,
                                       merge_usage)
from services.gateway.ready import RETRY_AFTER_S as READY_RETRY_AFTER_S
from services.gateway.ready import NotReady, Readiness
from services.gateway.tools import (CallStream, call_grammar, parse_calls, render,
                                    text_besides_calls)
from vericache.model.tokenize import apply_chat, encode_text, template_takes_tools
from vericache.engine.api import Engine
from vericache.engine.generation import GenParams
from vericache.errors import (ContextTooLong, InvalidArgument, NotFound, ResourceExhausted,
                              Unavailable, VeriCacheError)

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1


class ModelNotFound(NotFound):
    """The request names a model this gateway does not serve."""


class GenerationFailed(VeriCacheError):
    """The engine ended a request with an error after it was accepted."""


def error_response(exc: BaseException) -> JSONResponse:
    """The HTTP answer (OpenAI error shape) for an exception; the one place errors are mapped."""
    param, code, headers = getattr(exc, "param", None), None, {}
    if isinstance(exc, ModelNotFound):
        status, kind, param, code = 404, "invalid_request_error", "model", "model_not_found"
    elif isinstance(exc, InvalidArgument):
        status, kind = 400, "invalid_request_error"
        code = "context_length_exceeded" if isinstance(exc, ContextTooLong) else None
    elif isinstance(exc, NotFound):
        status, kind, code = 404, "invalid_request_error", "not_found"
    elif isinstance(exc, ResourceExhausted):
        status, kind, code = 429, "rate_limit_error", "rate_limit_exceeded"
        headers["Retry-After"] = str(RETRY_AFTER_S)
    elif isinstance(exc, NotReady):
        status, kind, code = 503, "server_error", "service_unavailable"
        headers["Retry-After"] = str(READY_RETRY_AFTER_S)
    elif isinstance(exc, Unavailable):
        status, kind, code = 503, "server_error", "service_unavailable"
    else:
        if not isinstance(exc, VeriCacheError):
            log.error("request failed unexpectedly", exc_info=exc)
        status, kind = 500, "server_error"
    return error_json(status, str(exc) or type(exc).__name__, kind, param, code, headers)


def error_json(status: int, message: str, kind: str = "invalid_request_error",
               param: str | None = None, code: str | None = None,
               headers: dict | None = None) -> JSONResponse:
    body = {"error": ErrorInfo(message=message, type=kind, param=param, code=code).model_dump()}
    return JSONResponse(body, status_code=status, headers=headers)


def chunks(c: dict | list[dict] | None) -> list[dict]:
    """A chunk callback's answer as a list (it may hold one back, or send several)."""
    return [] if c is None else c if isinstance(c, list) else [c]


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class OpenAIServing:
    """Chat and text completions over one engine, with the server's default GenParams.
    `metrics`: where each request's latencies go; `readiness`: requests are refused
    (NotReady, a 503) while it says a backend does not answer."""

    def __init__(self, engine: Engine, model_name: str | None = None,
                 defaults: GenParams | None = None, metrics: GatewayMetrics | None = None,
                 readiness: Readiness | None = None):
        self.engine = engine
        self.model_name = model_name or engine.model_name
        self.defaults = defaults or GenParams()
        self.metrics, self.readiness = metrics, readiness

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name)])

    # ---- request -> (prompt ids, GenParams) ------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFound(f"The model `{name}` does not exist; this server serves "
                                f"`{self.model_name}`")

    def _chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.engine.tokenizer
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []] \
            if req.tool_mode != "none" else None
        messages = render([{"role": m.role, "content": m.text(),
                            "tool_calls": [c.model_dump() for c in m.tool_calls or []]}
                           for m in req.messages], tools, template_takes_tools(tok))
        return apply_chat(tok, messages, tools)

    @staticmethod
    def _tools(req) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in getattr(req, "tools", None) or []]

    def _answer(self, req, text: str, finish: str | None) -> tuple[AssistantMessage, str | None]:
        """A chat choice's message and finish reason: its tool call, when tools are on and
        the answer holds one (see services.gateway.tools), else its text."""
        calls = parse_calls(text, self._tools(req)) if req.tool_mode != "none" else []
        if not calls or finish == "length":
            return AssistantMessage(content=text), finish
        return AssistantMessage(content=text_besides_calls(text), tool_calls=[ToolCallOut(
            id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
            for c in calls]), "tool_calls"

    def _completion_ids(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise InvalidArgument("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return encode_text(self.engine.tokenizer, prompt)
        vocab = len(self.engine.tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidArgument(f"prompt token ids must lie in [0, {vocab})", "prompt")
        return list(prompt)

    def _params(self, req: ChatCompletionRequest | CompletionRequest, n_prompt: int,
                prompt_param: str) -> GenParams:
        """Server defaults, overridden by the request's own fields and its `vericache` object."""
        room = self.engine.max_context - n_prompt - 1
        if n_prompt and room < 1:
            raise ContextTooLong(f"the prompt ({n_prompt} tokens) does not fit the model's "
                                 f"{self.engine.max_context}-token context", prompt_param)
        limit, name = req.limit()
        if limit is None:
            limit = max(1, min(self.defaults.max_tokens, room))
        elif limit < 1:
            raise InvalidArgument(f"{name} must be >= 1 (got {limit})", name)
        over = {"max_tokens": limit, "stop": req.stop_list()}
        if req.temperature is not None:
            over["temperature"] = req.temperature
        if req.seed is not None:
            over["seed"] = req.seed
        if req.ignore_eos is not None:
            over["ignore_eos"] = req.ignore_eos
        over.update(req.sampling_overrides())
        mode = getattr(req, "tool_mode", "none")
        if mode in ("required", "named"):
            if over.get("grammar"):
                raise InvalidArgument("response_format and a required tool call each fix the "
                                      "output's grammar; send one", "tool_choice")
            over["grammar"] = call_grammar(self._tools(req), req.tool_choice.function.name
                                           if mode == "named" else None)
        over["logprobs"] = req.logprobs_n()
        if req.vericache is not None:
            over.update(req.vericache.model_dump(exclude_none=True))
        return dataclasses.replace(self.defaults, **over)

    async def _submit(self, req, request: Request, to_ids: Callable,
                      prompt_param: str) -> tuple[list, float]:
        """Queue the request's n choices under the caller's tenant namespace (set by the
        access middleware; a request object without one keeps the server default); choice i
        samples with seed + i. Returns their streams (if one is refused, none runs) and the
        arrival time (time.perf_counter())."""
        arrival = time.perf_counter()
        if self.readiness is not None:
            self.readiness.require()
        self._check_model(req.model)
        ids = await run_in_threadpool(to_ids, req)
        params = self._params(req, len(ids), prompt_param)
        namespace = getattr(request.state, "namespace", None)
        if namespace:
            params = dataclasses.replace(params, namespace=namespace)
        n = req.choices
        streams = []
        try:
            for i in range(n):
                p = params if n == 1 else dataclasses.replace(params, seed=(params.seed or 0) + i)
                streams.append(await run_in_threadpool(self.engine.submit, ids, p))
        except BaseException:
            for st in streams:
                st.cancel()
            raise
        return streams, arrival

    # ---- running ---------------------------------------------------------------------
    async def _events(self, stream, arrival: float) -> AsyncIterator:
        """The request's events; raises GenerationFailed on an error event; cancels the
        request if the consumer stops early (client gone, server shutting down). A request
        that finishes has its latencies observed (`GatewayMetrics.observe_request`)."""
        done, first, last, tokens = False, None, None, 0
        try:
            async for ev in stream.astream():
                if ev.error:
                    done = True
                    log.warning("%s failed: %s", stream.request_id, ev.error)
                    raise GenerationFailed(f"generation failed: {ev.error}")
                if ev.token_ids:
                    last = time.perf_counter()
                    first, tokens = first or last, tokens + len(ev.token_ids)
                done = ev.finish_reason is not None
                if done and self.metrics is not None:
                    self.metrics.observe_request(
                        None if first is None else first - arrival, tokens,
                        (last or 0.0) - (first or 0.0), stream.gen.stats.prefill_s)
                yield ev
        finally:
            if not done:
                stream.cancel()

    # ---- logprobs in the OpenAI shapes ------------------------------------------------
    def _token_text(self, token: int) -> str:
        return self.engine.tokenizer.decode([token])

    def _top(self, token: int, logprob: float) -> TopLogprob:
        text = self._token_text(token)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    def chat_logprobs(self, lps) -> ChatLogprobs:
        """Chat's `logprobs`: {content: [{token, logprob, bytes, top_logprobs}]}."""
        return ChatLogprobs(content=[ChatTokenLogprob(
            **self._top(lp.token, lp.logprob).model_dump(),
            top_logprobs=[self._top(t, v) for t, v in lp.top]) for lp in lps])

    def completion_logprobs(self, lps, offset: int = 0) -> CompletionLogprobs:
        """Completions' `logprobs` (the legacy shape); `offset`: characters of the completion
        before these tokens. As in vLLM, each top_logprobs entry holds the chosen token too."""
        out = CompletionLogprobs()
        for lp in lps:
            text = self._token_text(lp.token)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.text_offset.append(offset)
            out.top_logprobs.append({**{self._token_text(t): v for t, v in lp.top},
                                     text: lp.logprob})
            offset += len(text)
        return out

    def _tokens(self, ev) -> list[dict]:
        """The extension's per-token provenance of an event: id, kind, text."""
        tok = self.engine.tokenizer
        kinds = ev.kinds or [None] * len(ev.token_ids)
        return [{"id": t, "kind": k, "text": tok.decode([t], skip_special_tokens=True)}
                for t, k in zip(ev.token_ids, kinds)]

    async def _collect(self, streams: list, arrival: float,
                       request: Request) -> tuple[list[tuple], UsageInfo]:
        """Run the choices to their end (cancelling them if the client disconnects or one
        fails): (text, finish reason, logprobs or None) per choice, and the usage."""
        async def watch():
            while not await request.is_disconnected():
                await asyncio.sleep(0.5)
            for st in streams:
                st.cancel()

        async def one(stream):
            text, finish, usage, lps = [], None, None, None
            async with contextlib.aclosing(self._events(stream, arrival)) as events:
                async for ev in events:
                    text.append(ev.text)
                    finish, usage = ev.finish_reason, ev.usage
                    if ev.logprobs is not None:
                        lps = (lps or []) + ev.logprobs
            return "".join(text), finish, lps, UsageInfo(**(usage or {}))

        watcher = asyncio.create_task(watch())
        tasks = [asyncio.ensure_future(one(st)) for st in streams]
        try:
            out = await asyncio.gather(*tasks)
        finally:
            watcher.cancel()
            for t in tasks:  # a failed choice stops the others (their streams are cancelled)
                t.cancel()
        return [o[:3] for o in out], merge_usage([o[3] for o in out])

    async def _merged(self, streams: list, arrival: float) -> AsyncIterator[tuple[int, object]]:
        """(choice index, event) of every choice as they come; an error in one raises here
        and stops the others."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, stream):
            try:
                async with contextlib.aclosing(self._events(stream, arrival)) as events:
                    async for ev in events:
                        await queue.put((i, ev, None))
                await queue.put((i, None, None))
            except Exception as e:  # noqa: BLE001 -- re-raised by the consumer
                await queue.put((i, None, e))

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
        try:
            left = len(tasks)
            while left:
                i, ev, err = await queue.get()
                if err is not None:
                    raise err
                if ev is None:
                    left -= 1
                else:
                    yield i, ev
        finally:
            for t in tasks:
                t.cancel()

    async def _sse(self, streams: list, arrival: float, first: list[dict],
                   chunk: Callable[[int, str, str | None, list | None], dict],
                   usage_chunk: Callable[[UsageInfo], dict] | None) -> AsyncIterator[str]:
        try:
            for c in first:
                yield sse(c)
            usages: dict[int, UsageInfo] = {}
            async with contextlib.aclosing(self._merged(streams, arrival)) as events:
                async for i, ev in events:
                    if ev.text or ev.token_ids or ev.logprobs:  # logprobs go out with their token
                        # none: held back (a chat stream with tools); several: a call's deltas
                        for n, c in enumerate(chunks(chunk(i, ev.text, None, ev.logprobs))):
                            yield sse({**c, "vericache": {"tokens": self._tokens(ev)}} if n == 0 else c)
                    if ev.finish_reason:
                        for c in chunks(chunk(i, "", ev.finish_reason, None)):
                            yield sse(c)
                        usages[i] = UsageInfo(**(ev.usage or {}))
            if usage_chunk is not None:
                yield sse(usage_chunk(merge_usage([usages[i] for i in sorted(usages)])))
        except Exception as e:  # noqa: BLE001 -- reported to the client as an error chunk
            yield sse(json.loads(error_response(e).body))
        yield sse("[DONE]")

    @staticmethod
    def _streaming(body: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- endpoints -------------------------------------------------------------------
    def _head(self, prefix: str) -> dict:
        """id, created and model: the same in every chunk of one response."""
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.model_name}

    async def chat(self, req: ChatCompletionRequest, request: Request):
        streams, arrival = await self._submit(req, request, self._chat_ids, "messages")
        head = self._head("chatcmpl")
        if not req.stream:
            outs, usage = await self._collect(streams, arrival, request)
            return ChatCompletionResponse(**head, usage=usage, choices=[
                ChatChoice(index=i, **dict(zip(("message", "finish_reason"),
                                               self._answer(req, text, finish))),
                           logprobs=None if lps is None else self.chat_logprobs(lps))
                for i, (text, finish, lps) in enumerate(outs)])
        extra = {"usage": None} if req.include_usage else {}
        held: dict[int, tuple[list[str], list]] = {}  # with tools: per choice, text and logprobs
        forced: dict[int, CallStream] = {}  # required or named: per choice, its call so far

        def call_delta(i: int, c: CallStream, kind: str, piece: str, lps: list | None) -> dict:
            first = kind == "name"
            return plain_chunk(i, "", None, lps, Delta(tool_calls=[ToolCallDelta(
                index=0, id=c.id if first else None, type="function" if first else None,
                function=ToolCallDeltaFunction(name=piece if first else None,
                                               arguments="" if first else piece))]))

        def tool_chunk(i: int, text: str, finish: str | None, lps: list | None = None):
            """With tools: a forced call streams as it comes (`CallStream`); otherwise hold
            the choice's text back and, at its end, send its call or its text."""
            got = held.setdefault(i, ([], []))
            got[0].append(text)
            got[1].extend(lps or [])
            if req.tool_mode in ("required", "named"):
                c = forced.setdefault(i, CallStream())

                def lps_so_far() -> list | None:
                    """The logprobs not sent yet (they go with the next delta)."""
                    out, got[1][:] = (list(got[1]) if req.logprobs and got[1] else None), []
                    return out

                out = [call_delta(i, c, kind, piece, lps_so_far()) for kind, piece in c.feed(text)]
                if c.name is not None:
                    if finish is not None:
                        out.append(plain_chunk(i, "", finish if finish == "length" else "tool_calls",
                                               lps_so_far()))
                    return out or None
            if finish is None:
                return None
            message, finish = self._answer(req, "".join(got[0]), finish)
            lps = got[1] if req.logprobs else None
            if message.tool_calls is None:
                return [plain_chunk(i, message.content, None, lps), plain_chunk(i, "", finish)]
            out = []
            for n, c in enumerate(message.tool_calls):
                out.append(plain_chunk(i, "", None, lps if n == 0 else None, Delta(tool_calls=[
                    ToolCallDelta(index=n, id=c.id, type="function",
                                  function=ToolCallDeltaFunction(name=c.function.name,
                                                                 arguments=""))])))
                out.append(plain_chunk(i, "", None, None, Delta(tool_calls=[ToolCallDelta(
                    index=n, function=ToolCallDeltaFunction(arguments=c.function.arguments))])))
            return out + [plain_chunk(i, "", finish)]

        def plain_chunk(i: int, text: str, finish: str | None, lps: list | None = None,
                        delta: Delta | None = None) -> dict:
            c = ChatCompletionChunk(**head, choices=[ChatChunkChoice(
                index=i, delta=delta or Delta(content=text if text or not finish else None),
                logprobs=None if lps is None else self.chat_logprobs(lps), finish_reason=finish)])
            d = c.model_dump(exclude={"usage"}, exclude_none=True)
            d["choices"][0].setdefault("finish_reason", None)
            d["choices"][0].setdefault("logprobs", None)
            return {**d, **extra}

        chunk = tool_chunk if req.tool_mode != "none" else plain_chunk

        def usage_chunk(u: UsageInfo) -> dict:
            return ChatCompletionChunk(**head, choices=[], usage=u).model_dump()

        first = [plain_chunk(i, "", None, None, Delta(role="assistant", content=""))
                 for i in range(len(streams))]
        return self._streaming(self._sse(streams, arrival, first, chunk,
                                         usage_chunk if req.include_usage else None))

    async def completion(self, req: CompletionRequest, request: Request):
        streams, arrival = await self._submit(req, request, self._completion_ids, "prompt")
        head = self._head("cmpl")
        if not req.stream:
            outs, usage = await self._collect(streams, arrival, request)
            return CompletionResponse(**head, usage=usage, choices=[
                CompletionChoice(text=text, index=i, finish_reason=finish,
                                 logprobs=None if lps is None else self.completion_logprobs(lps))
                for i, (text, finish, lps) in enumerate(outs)])
        extra = {"usage": None} if req.include_usage else {}
        offsets = [0] * len(streams)  # per choice: characters of the tokens whose logprobs went out

        def chunk(i: int, text: str, finish: str | None, lps: list | None = None) -> dict:
            logprobs = None
            if lps is not None:
                logprobs = self.completion_logprobs(lps, offsets[i])
                offsets[i] += sum(len(t) for t in logprobs.tokens)
            c = CompletionResponse(**head, choices=[CompletionChoice(
                text=text, index=i, logprobs=logprobs, finish_reason=finish)])
            return {**c.model_dump(exclude={"usage"}), **extra}

        def usage_chunk(u: UsageInfo) -> dict:
            return CompletionResponse(**head, choices=[], usage=u).model_dump()

        return self._streaming(self._sse(streams, arrival, [], chunk,
                                         usage_chunk if req.include_usage else None))
