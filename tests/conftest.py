"""Shared fixtures: the default model and real prompts (loaded once per session), and
helpers that start a service as a real OS process and wait until it answers."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from service_process import ServiceProcess, start_service


@pytest.fixture(scope="session")
def lm():
    """The default model (SmolLM2-135M-Instruct), fp32 on CPU: the lossless reference."""
    from vericache.model.loader import load_model

    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def prompts(lm) -> dict[str, list[int]]:
    """Real chat prompts as token ids: a short code request, a short JSON request, and a long
    (>= 2000 tokens) code context from the built-in benchmark prompts."""
    from vericache.bench.prompts import builtin_prompts
    from vericache.cli.common import BUILTIN_PROMPT, apply_chat

    tok = lm.tokenizer
    json_task = ("List three prime numbers and three even numbers as a JSON object of the form "
                 "{\"primes\": [...], \"evens\": [...]}. Answer with the JSON object only.")
    return {
        "code": apply_chat(tok, [{"role": "user", "content": BUILTIN_PROMPT}]),
        "json": apply_chat(tok, [{"role": "user", "content": json_task}]),
        "long": builtin_prompts(tok, 1, 2300)[0].ids,
    }


@pytest.fixture(scope="module")
def services() -> Iterator[Callable[..., ServiceProcess]]:
    """A factory like `service_process.start_service`; what it starts stops after the module."""
    started: list[ServiceProcess] = []

    def start(*args, **kwargs) -> ServiceProcess:
        service = start_service(*args, **kwargs)
        started.append(service)
        return service

    yield start
    for service in started:
        service.stop()
        service.log_path.unlink(missing_ok=True)
