"""The four services as OS processes over a Redis of their own, for chaos: kill any of them
(SIGKILL) and start it again on the same port, put a `NetProxy` on a link, count the sessions
each one holds, and stream requests that are checked against the full-greedy reference.

Used by tests/test_chaos.py and benchmarks/chaos.py (which puts tests/ on sys.path).

- `RedisServer`: `redis-server --port P --save '' --appendonly no` (optionally with
  `maxmemory` and `allkeys-lru`); never the shared 6379 one.
- `Stack`: kvstore on that Redis, verifier, drafter, gateway. With `proxies=True` the gateway
  reaches the drafter and the verifier, and they reach the kvstore, through a `NetProxy` each
  (`stack.proxies["drafter" | "verifier" | "kvstore"]`).
- `stream_chat`: one streaming request; `Outcome` classifies it against the reference ids.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import httpx

from netproxy import NetProxy
from service_process import ServiceProcess, free_port, start_service
from vericache._proto import load

ONE_THREAD = {"OMP_NUM_THREADS": "1", "LMCACHE_TRACK_USAGE": "false"}
VERIFIED_KINDS = {"prefill", "draft", "bonus", "plain"}
MODEL_SERVICES = ("verifier", "drafter")
VPB, _ = load("verifier")


class RedisServer:
    """A redis-server of our own on a free port (no persistence: a restart starts empty)."""

    def __init__(self, maxmemory_mb: int = 0, port: int | None = None):
        self.port, self.maxmemory_mb = port or free_port(), maxmemory_mb
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no"]
        if self.maxmemory_mb:
            args += ["--maxmemory", f"{self.maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=5)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def grpc_health(module: str, address: str, timeout: float = 2.0):
    stub_cls = getattr(load(module)[1], f"{module.capitalize()}Stub")
    with grpc.insecure_channel(address) as ch:
        return stub_cls(ch).Health(VPB.ServiceHealthRequest(), timeout=timeout)


def _kvstore_stats(address: str, timeout: float = 5.0) -> dict:
    pb, pb_grpc = load("kvstore")
    with grpc.insecure_channel(address) as ch:
        r = pb_grpc.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=timeout)
    return {"hits": r.hits, "misses": r.misses, "entries": r.entries, **dict(r.extra)}


def _kvstore_ready(port: int) -> bool:
    pb, pb_grpc = load("kvstore")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return pb_grpc.KVStoreStub(ch).Health(pb.HealthRequest(), timeout=2).status == \
            pb.HealthResponse.STATUS_SERVING


def _model_ready(module: str):
    return lambda port: grpc_health(module, f"127.0.0.1:{port}").ok


def _http_ready(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200


@dataclass
class Stack:
    """Redis, kvstore, verifier, drafter, gateway. `rpc_timeout_s`: the gateway's deadline on
    drafter/verifier calls; `store_timeout_s`: the services' deadline on kvstore calls."""

    max_tokens: int = 24
    redis_maxmemory_mb: int = 0
    proxies: bool = False
    rpc_timeout_s: float = 30.0
    store_timeout_s: float = 30.0
    session_ttl_s: float = 600.0
    gateway_args: list[str] = field(default_factory=list)
    procs: dict[str, ServiceProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    net: dict[str, NetProxy] = field(default_factory=dict)
    redis: RedisServer | None = None

    def start(self) -> "Stack":
        """Redis, then the four services side by side (each connects to the others lazily; the
        gateway serves once the drafter and the verifier answer), up once /ready says so."""
        self.redis = RedisServer(self.redis_maxmemory_mb)
        try:
            self.ports = {name: free_port() for name in ("kvstore", *MODEL_SERVICES)}
            if self.proxies:
                for name in ("kvstore", *MODEL_SERVICES):
                    self.net[name] = NetProxy(self.ports[name])
            with ThreadPoolExecutor(4) as pool:
                for f in [pool.submit(self._start, name, self.ports.get(name))
                          for name in ("kvstore", *MODEL_SERVICES, "gateway")]:
                    f.result()
            deadline = time.monotonic() + 300
            while not self._ready():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the gateway is not ready:\n{self.logs()}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        """/ready answers 200 (a calibrating gateway answers it only when done: a timeout is
        a no)."""
        try:
            return httpx.get(f"{self.gateway}/ready", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def _args(self, name: str) -> tuple[list[str], object, float]:
        def via(n: str) -> int:  # the port a client of service n connects to
            return self.net[n].port if n in self.net else self.ports[n]

        if name == "kvstore":
            return (["--backend", f"redis://127.0.0.1:{self.redis.port}/0?prefix=chaos:&timeout_s=5"],
                    _kvstore_ready, 60)
        if name in MODEL_SERVICES:
            return (["--kvstore", f"grpc://127.0.0.1:{via('kvstore')}?timeout_s={self.store_timeout_s}",
                     "--session-ttl-s", str(self.session_ttl_s), "--node-cache-mb", "0"],
                    _model_ready(name), 300)
        return (["--drafter", f"127.0.0.1:{via('drafter')}", "--verifier", f"127.0.0.1:{via('verifier')}",
                 "--kvstore", f"127.0.0.1:{self.ports['kvstore']}",
                 "--max-tokens", str(self.max_tokens), "--rpc-timeout-s", str(self.rpc_timeout_s),
                 "--schedule", "staggered", *self.gateway_args], _http_ready, 300)

    def _start(self, name: str, port: int | None = None) -> ServiceProcess:
        args, ready, timeout = self._args(name)
        self.procs[name] = start_service(f"services.{name}", args, ready, timeout, ONE_THREAD,
                                         port=port)
        return self.procs[name]

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.procs['gateway'].port}"

    def kill(self, name: str) -> None:
        """SIGKILL one service (or "redis")."""
        if name == "redis":
            self.redis.kill()
        else:
            self.procs[name].proc.kill()
            self.procs[name].proc.wait(10)

    def restart(self, name: str) -> None:
        """Start a killed service again on its port (Redis comes back empty)."""
        if name == "redis":
            self.redis.start()
        else:
            old = self.procs[name]
            old.log_path.unlink(missing_ok=True)
            self._start(name, port=old.port)

    def sessions(self) -> dict[str, int]:
        """What each service holds now: drafter and verifier sessions (their Health), the
        gateway's active and queued requests (/health), the kvstore's per-request scratch
        values (exact tails not yet read by an attach)."""
        out = {}
        for name in MODEL_SERVICES:
            out[name] = grpc_health(name, self.procs[name].address, 10).sessions
        h = httpx.get(f"{self.gateway}/health", timeout=10).json()
        out["gateway"] = h["active"] + h["queue_depth"]
        out["kvstore_scratch"] = int(_kvstore_stats(self.procs["kvstore"].address).get(
            "scratch_entries", 0))
        return out

    def store_stats(self) -> dict:
        return _kvstore_stats(self.procs["kvstore"].address)

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{p.log()[-3000:]}" for n, p in self.procs.items())

    def stop(self) -> None:
        for name in ("gateway", "drafter", "verifier", "kvstore"):
            p = self.procs.get(name)
            if p is not None:
                p.stop()
                p.log_path.unlink(missing_ok=True)
        for proxy in self.net.values():
            proxy.close()
        if self.redis is not None:
            self.redis.stop()


@dataclass
class Outcome:
    """One streamed request, judged against the full-greedy reference ids.

    - completed: HTTP 200, no error chunk, a finish reason, then [DONE];
    - failed_clean: an OpenAI error body (any 4xx/5xx with {"error": {...}}), or an SSE error
      chunk followed by [DONE];
    - otherwise failed_unclean (a cut connection, no [DONE], a body not in the OpenAI shape).
    `unverified`: tokens whose provenance kind is not a verified one; `wrong`: emitted tokens
    from the first that departs from the reference on."""

    started: float
    ended: float = 0.0
    status: int = 0
    ids: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    done: bool = False
    finish: str | None = None
    exception: str | None = None

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done and not self.errors and self.finish is not None

    @property
    def failed_clean(self) -> bool:
        if self.completed or self.exception:
            return False
        if self.status != 200:
            return bool(self.errors) and isinstance(self.errors[0].get("error"), dict)
        return self.done and len(self.errors) == 1 and "message" in self.errors[0]["error"]

    def unverified(self) -> int:
        return sum(k not in VERIFIED_KINDS for k in self.kinds)

    def wrong(self, ref: list[int]) -> int:
        for i, t in enumerate(self.ids):
            if i >= len(ref) or ref[i] != t:
                return len(self.ids) - i
        return 0


def stream_chat(base: str, text: str, max_tokens: int, timeout: float = 120.0,
                headers: dict | None = None, on_first=None, vericache: dict | None = None) -> Outcome:
    """Stream one greedy chat completion and record what came; `on_first()` runs once the
    first token arrived; `vericache`: the request's `vericache` options (e.g. a fixed k)."""
    out = Outcome(started=time.monotonic())
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, **({"vericache": vericache} if vericache else {})}
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=timeout,
                          headers=headers) as r:
            out.status = r.status_code
            if r.status_code != 200:
                r.read()
                try:
                    out.errors.append(r.json())
                except ValueError:
                    out.exception = f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line[6:] == "[DONE]":
                    out.done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.errors.append(chunk)
                    continue
                for tok in (chunk.get("vericache") or {}).get("tokens", ()):
                    out.ids.append(tok["id"])
                    out.kinds.append(tok["kind"])
                    if on_first is not None and len(out.ids) == 1:
                        on_first()
                for ch in chunk.get("choices") or ():
                    out.finish = ch.get("finish_reason") or out.finish
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.exception = f"{type(e).__name__}: {e}"
    finally:
        out.ended = time.monotonic()
    return out


def references(lm, texts: list[str], max_tokens: int) -> dict[str, list[int]]:
    """Full-greedy output ids of each chat prompt, in this process."""
    from vericache.engine.generation import GenParams
    from vericache.engine.local import generate
    from vericache.model.tokenize import apply_chat

    return {t: generate(lm, apply_chat(lm.tokenizer, [{"role": "user", "content": t}]),
                        GenParams(mode="full", max_tokens=max_tokens)).token_ids for t in texts}


@contextmanager
def deleting_keys(redis_client, period_s: float = 0.05, seed: int = 0):
    """While inside: every `period_s`, half the keys of the Redis behind the kvstore, picked at
    random, are deleted (keys vanish between longest_prefix and get, during an attach)."""
    stop, rng = threading.Event(), random.Random(seed)

    def evictor():
        while not stop.is_set():
            keys = list(redis_client.scan_iter(count=1000))
            if keys:
                redis_client.delete(*rng.sample(keys, max(1, len(keys) // 2)))
            time.sleep(period_s)

    t = threading.Thread(target=evictor, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def wait_drained(stack: Stack, timeout_s: float = 15.0) -> dict[str, int]:
    """The sessions each service holds, polled until all are 0 or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stack.sessions()
        if not any(s.values()) or time.monotonic() > deadline:
            return s
        time.sleep(0.25)

