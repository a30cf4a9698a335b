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

def check_chat_top_logprobs(lm, client, text: str, max_tokens: int) -> tuple[float, float]:
    """The official client's `logprobs=True, top_logprobs=5` in chat, streamed and not, on a
    server (`client`): the verifier's logprobs in vericache mode (drafting, k fixed) equal
    `full` mode's decode steps on the same server, token for token, within fp32 noise; the
    top 5 are sorted, led by the chosen token, and carry in-process full decoding's
    logprobs. Returns the largest differences (logprobs, top-5) between the modes."""
    from vericache.engine.generation import GenParams
    from vericache.engine.local import generate

    msgs = [{"role": "user", "content": text}]
    ref = generate(lm, chat_ids(lm, text), GenParams(mode="full", max_tokens=max_tokens, logprobs=5))
    runs = {}
    for mode in ("full", "vericache"):
        extra = {"vericache": {"mode": mode, "draft_len": 4, "adaptive": False}}
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs,
                                           max_tokens=max_tokens, logprobs=True, top_logprobs=5,
                                           extra_body=extra)
        runs[mode] = r.choices[0].logprobs.content
        chunks = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs,
                                                max_tokens=max_tokens, logprobs=True,
                                                top_logprobs=5, stream=True, extra_body=extra)
        streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                    for c in ch.choices[0].logprobs.content]
        assert [c.token for c in streamed] == [c.token for c in runs[mode]], mode
        assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, runs[mode])) < 1e-3
    full, ver = runs["full"], runs["vericache"]
    assert [c.token for c in ver] == [c.token for c in full] == \
        [lm.tokenizer.decode([t]) for t in ref.token_ids]
    diff = max(abs(a.logprob - b.logprob) for a, b in zip(ver, full))
    top_diff = max(abs(x.logprob - y.logprob) for a, b in zip(ver, full)
                   for x, y in zip(a.top_logprobs, b.top_logprobs))
    assert diff < 1e-3 and top_diff < 1e-3
    for c, r in zip(ver, ref.logprobs):
        tops = [t.logprob for t in c.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert abs(tops[0] - c.logprob) < 1e-5  # greedy: the chosen token is the top one
        assert c.top_logprobs[0].token == c.token
        # the alternatives' logprobs are in-process full decoding's (values: a near-tie may
        # swap two alternatives' order between runs)
        assert max(abs(t - v) for t, (_, v) in zip(tops, r.top)) < 1e-3
    return diff, top_diff



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
