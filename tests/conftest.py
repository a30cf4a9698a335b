"""Shared fixtures: the default model and real prompts (loaded once per session), and
helpers that start a service as a real OS process and wait until it answers."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from service_process import ServiceProcess, start_service

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
# One torch thread a process: the suite runs two workers (`-n 2`) on two cores, and every
# service it starts is a process of its own. Two threads each oversubscribe the cores: two
# concurrent 1.2k-token generations took 21 s each at two threads, 7.7 s at one. Services
# inherit this; OMP_NUM_THREADS=N in the environment overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Servers the tests start skip the start-up calibration of the cost model (seconds each):
# their cost models explore their first rounds. tests/test_calibrate.py and the services'
# end-to-end stack turn it on and check it.
os.environ.setdefault("VERICACHE_CALIBRATE", "off")


@pytest.fixture(scope="session")
def lm():
    """The default model (SmolLM2-135M-Instruct), fp32 on CPU: the lossless reference."""
    import torch

    from vericache.model.loader import load_model

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return load_model(None, dtype="float32", device="cpu")


def chat_ids(lm, text: str) -> list[int]:
    from vericache.model.tokenize import apply_chat

    return apply_chat(lm.tokenizer, [{"role": "user", "content": text}])


def rounds_by_hand(backends, g, plan: list[int], after_round=None) -> list[int]:
    """Run request `g` to its end over `backends` with round i's k = plan[i % len(plan)]
    (0: a plain step), calling `after_round(i)` after round i; releases it; its tokens."""
    from vericache.engine.rounds import run_round, start

    try:
        out = start(backends, g)
        i = 0
        while not g.finished:
            g.draftlen.choose(plan[i % len(plan)])
            out += run_round(backends, [g])[g.rid]
            i += 1
            if after_round is not None:
                after_round(i)
    finally:
        backends.release(g)
    return out


def long_code_prompt(lm, tokens: int = 2100) -> list[int]:
    """A code-continuation chat prompt of about `tokens` tokens, from the standard library."""
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    src = "".join((lib / name).read_text() for name in
                  ("json/decoder.py", "json/encoder.py", "json/scanner.py", "argparse.py"))
    ids = lm.tokenizer(src)["input_ids"][:tokens]
    code = lm.tokenizer.decode(ids)
    return chat_ids(lm, "Here is a Python module:\n```python\n" + code +
                    "\n```\nWrite a short function that uses it to pretty-print a dict.")


@pytest.fixture(scope="session")
def prompts(lm) -> dict[str, list[int]]:
    """Three real prompts: a short coding request, a JSON request, a >2k-token code context."""
    return {
        "code": chat_ids(lm, "Write a Python function that checks whether a string is a palindrome."),
        "json": chat_ids(lm, "Return a JSON object with the fields name, age and city for a "
                             "fictional person. Only output the JSON."),
        "long": long_code_prompt(lm),
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


def pytest_collection_modifyitems(config, items):
    """Modules with slow (real-model, minutes) tests first, in their own order, then the rest:
    with `-n 2 --dist loadfile` (the suite's command) the two workers then end together
    instead of one running a long module alone at the end."""
    slow = {it.module.__name__ for it in items if it.get_closest_marker("slow")}
    items.sort(key=lambda it: it.module.__name__ not in slow)
