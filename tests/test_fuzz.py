"""Bad input: schemathesis generates requests from the running gateway's own OpenAPI schema
(/openapi.json of `vericache serve`, API key on) — valid and invalid bodies, odd types,
boundary values — and every answer must be a non-5xx; the server must be alive afterwards.

The run is bounded: MAX_EXAMPLES cases per operation and generation mode (positive and
negative), derandomized; the server starts with --max-tokens 4 and every generated max_tokens /
max_completion_tokens above 4 is lowered to 4 (the decoding itself is not what is fuzzed here,
and a generated max_tokens of 10^9 would decode the whole context on a 2-core CPU).
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis  # a required test dependency: missing fails the module, never skips it
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from service_process import start_serve

MAX_EXAMPLES = int(os.environ.get("VERICACHE_FUZZ_EXAMPLES", 30))  # benchmarks/fuzz_http.py: >= 1000
KEY = "fuzz-key"
TOKEN_LIMIT = 4
CASES: dict[str, int] = {}
STATUSES: dict[int, int] = {}


@pytest.fixture(scope="module")
def server():
    service = start_serve(["--max-tokens", str(TOKEN_LIMIT), "--max-waiting", "8",
                           "--max-body-bytes", "262144"],
                          env={"OMP_NUM_THREADS": "1", "VERICACHE_API_KEY": KEY})
    yield service
    service.stop()
    service.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"http://{server.address}/openapi.json")


def _bounded(case) -> None:
    """Lower generated token limits to TOKEN_LIMIT (anything else is sent as generated)."""
    if isinstance(case.body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            v = case.body.get(name)
            if isinstance(v, int) and not isinstance(v, bool) and v > TOKEN_LIMIT:
                case.body[name] = TOKEN_LIMIT


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_server_errors(api_schema, mode):
    """Each operation of the schema, MAX_EXAMPLES generated cases (schemathesis's pytest
    plugin does not load under pytest 9, so hypothesis drives its strategies directly)."""
    for result in api_schema.get_all_operations():
        op = result.ok()
        if mode == "negative" and op.method.upper() == "GET":
            continue  # no parameters, no body: nothing to make invalid
        label = f"{op.method.upper()} {op.path} ({mode})"

        @given(case=op.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        def run(case):
            _bounded(case)
            CASES[label] = CASES.get(label, 0) + 1
            response = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
            STATUSES[response.status_code] = STATUSES.get(response.status_code, 0) + 1
            case.validate_response(response, checks=[not_a_server_error])

        run()


def test_server_alive_afterwards(server):
    assert server.proc.poll() is None
    r = httpx.get(f"http://{server.address}/health", timeout=5)
    assert r.status_code == 200 and r.json()["active"] == 0
    r = httpx.post(f"http://{server.address}/v1/completions", timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "def add(a, b):", "max_tokens": 2})
    assert r.status_code == 200, r.text
    print(f"\nfuzz cases per operation: {CASES} (total {sum(CASES.values())}); "
          f"statuses: {dict(sorted(STATUSES.items()))}")
    assert "Traceback" not in server.log(), server.log()[-4000:]
