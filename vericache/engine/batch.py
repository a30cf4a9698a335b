"""The embedded engine: many requests on one local runner, batched per forward pass.

A background thread runs rounds over every active request: admitted requests are prefilled
between rounds; then all drafts of the round step together (one pass per draft step over
every request still drafting), then one verify pass for all of them. Requests join and leave
between rounds (continuous batching). Callers submit from any thread and read events from a
thread-safe queue, or asynchronously with `astream`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from vericache.engine.api import Engine
from vericache.engine.generation import Generation, GenParams
from vericache.engine.local import GenEvent
from vericache.errors import ResourceExhausted, VeriCacheError
from vericache.model.loader import LoadedModel

log = logging.getLogger(__name__)


@dataclass
class EngineEvent(GenEvent):
    usage: dict | None = None  # on the last event
    error: str | None = None  # set when the request failed; no more events follow


class RequestStream:
    """Events of one request, in order. The last has finish_reason or error set."""

    def __init__(self, gen: Generation, request_id: str):
        self.gen, self.request_id = gen, request_id
        self.events: queue.Queue[EngineEvent] = queue.Queue()
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __iter__(self) -> Iterator[EngineEvent]:
        while True:
            ev = self.events.get()
            yield ev
            if ev.finish_reason or ev.error:
                return

    async def astream(self) -> AsyncIterator[EngineEvent]:
        while True:
            ev = await asyncio.to_thread(self.events.get)
            yield ev
            if ev.finish_reason or ev.error:
                return


class BatchEngine(Engine):
    def __init__(self, lm: LoadedModel, max_batch: int = 16, max_waiting: int = 64):
        self.lm = lm
        self.model_name, self.tokenizer, self.max_context = lm.name, lm.tokenizer, lm.max_context
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self._waiting: queue.Queue[RequestStream] = queue.Queue()
        self._active: list[RequestStream] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._ids = 0
        self.counters = {"requests": 0, "finished": 0, "errors": 0, "tokens": 0, "rounds": 0,
                         "draft_s": 0.0, "verify_s": 0.0, "prefill_s": 0.0}
        self.tau_hist: dict[int, int] = {}
        self._thread = threading.Thread(target=self._loop, name="vericache-engine", daemon=True)
        self._thread.start()

    # ---- API ---------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: GenParams) -> RequestStream:
        """Validate and queue a request (raises InvalidArgument / ContextTooLong / ResourceExhausted)."""
        gen = Generation(self.lm, prompt_ids, params)
        if self._waiting.qsize() >= self.max_waiting:
            raise ResourceExhausted(f"{self.max_waiting} requests are already waiting")
        with self._lock:
            self._ids += 1
            rs = RequestStream(gen, f"req-{self._ids}")
            self.counters["requests"] += 1
        self._waiting.put(rs)
        self._wake.set()
        return rs

    @property
    def queue_depth(self) -> int:
        return self._waiting.qsize()

    @property
    def active(self) -> int:
        return len(self._active)

    def metrics(self) -> dict:
        return {"counters": dict(self.counters), "tau_hist": dict(self.tau_hist)}

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- the loop ------------------------------------------------------------------
    def _finish(self, rs: RequestStream, error: str | None = None) -> None:
        g = rs.gen
        usage = g.usage()
        if error:
            self.counters["errors"] += 1
            rs.events.put(EngineEvent([], "", None, usage, error))
        self.counters["finished"] += 1
        self.counters["rounds"] += g.stats.rounds
        for n in g.stats.round_emitted:
            self.tau_hist[n] = self.tau_hist.get(n, 0) + 1

    def _emit(self, rs: RequestStream, toks: list[int]) -> None:
        g = rs.gen
        self.counters["tokens"] += len(toks)
        done = g.finished
        rs.events.put(EngineEvent(toks, g.text.delta(done), g.stop.finish_reason,
                                  g.usage() if done else None))

    def _admit(self) -> None:
        while len(self._active) < self.max_batch:
            try:
                rs = self._waiting.get_nowait()
            except queue.Empty:
                return
            if rs.cancelled:
                continue
            try:
                t = time.perf_counter()
                toks = rs.gen.start()
                self.counters["prefill_s"] += time.perf_counter() - t
            except VeriCacheError as e:
                self._finish(rs, str(e))
                continue
            self._emit(rs, toks)
            if rs.gen.finished:
                self._finish(rs)
            else:
                self._active.append(rs)

    def _round(self) -> None:
        runner = self.lm.runner
        batch = [rs for rs in self._active if not rs.cancelled]
        for rs in batch:
            rs.gen.begin_round()
        t0 = time.perf_counter()
        out = {id(rs): [] for rs in batch}
        drafting = [rs for rs in batch]
        while drafting:
            items = [(rs, rs.gen.next_draft_item()) for rs in drafting]
            drafting = [rs for rs, it in items if it is not None]
            if not drafting:
                break
            logits = runner.forward([it for _, it in items if it is not None])
            for rs, lg in zip(drafting, logits):
                out[id(rs)] += rs.gen.apply_draft(lg)
        t1 = time.perf_counter()
        verifying = [rs for rs in batch if rs.gen.params.mode != "lossy"]
        if verifying:
            logits = runner.forward([rs.gen.verify_item() for rs in verifying])
            for rs, lg in zip(verifying, logits):
                out[id(rs)] += rs.gen.apply_verify(lg)
        t2 = time.perf_counter()
        self.counters["draft_s"] += t1 - t0
        self.counters["verify_s"] += t2 - t1
        for rs in batch:
            self._emit(rs, out[id(rs)])
        still = []
        for rs in self._active:
            if rs.gen.finished or rs.cancelled:
                self._finish(rs, "cancelled" if rs.cancelled and not rs.gen.finished else None)
            else:
                still.append(rs)
        self._active = still

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._admit()
                if not self._active:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._round()
            except Exception as e:  # a bug must not leave clients waiting forever
                log.exception("engine round failed")
                for rs in self._active:
                    self._finish(rs, f"internal error: {e}")
                self._active = []
