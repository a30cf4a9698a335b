"""The HTTP API under schemathesis, at the issue's size: at least 1000 generated cases against a
running `vericache serve` (API key on), each answer checked to be a non-5xx, the server alive
at the end. tests/test_fuzz.py runs the same generation with fewer cases for the suite's time.

    PYTHONPATH=. .venv/bin/python benchmarks/fuzz_http.py --examples 250 \
        --json benchmarks/results/2026-12-01e/fuzz_http.json

Cases: `--examples` per operation and generation mode (positive, negative; GET operations
without parameters only generate a handful), derandomized; generated token limits above 4
are lowered to 4, as in the test (what is fuzzed is the API, not the decoding).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from service_process import start_serve  # noqa: E402

KEY = "fuzz-key"
TOKEN_LIMIT = 4


def _bounded(case) -> None:
    if isinstance(case.body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            v = case.body.get(name)
            if isinstance(v, int) and not isinstance(v, bool) and v > TOKEN_LIMIT:
                case.body[name] = TOKEN_LIMIT


def run(base: str, examples: int) -> dict:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    cases, statuses, failures = Counter(), Counter(), []
    for mode in ("positive", "negative"):
        for result in schema.get_all_operations():
            op = result.ok()
            if mode == "negative" and op.method.upper() == "GET":
                continue
            label = f"{op.method.upper()} {op.path} ({mode})"

            @given(case=op.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            def one(case):
                _bounded(case)
                cases[label] += 1
                response = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
                statuses[response.status_code] += 1
                try:
                    case.validate_response(response, checks=[not_a_server_error])
                except Exception as e:  # noqa: BLE001 -- counted and reported, the run goes on
                    failures.append({"operation": label, "status": response.status_code,
                                     "error": str(e)[:300]})

            one()
            print(f"{label}: {cases[label]} cases", flush=True)
    return {"cases": dict(cases), "total_cases": sum(cases.values()),
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "server_errors": sum(v for k, v in statuses.items() if k >= 500),
            "failures": failures[:20]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=250, help="cases per operation and mode")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    t0 = time.monotonic()
    server = start_serve(["--max-tokens", str(TOKEN_LIMIT), "--max-waiting", "8",
                          "--max-body-bytes", "262144"],
                         env={"OMP_NUM_THREADS": "1", "VERICACHE_API_KEY": KEY})
    try:
        out = run(f"http://{server.address}", a.examples)
        import httpx

        alive = httpx.post(f"http://{server.address}/v1/completions", timeout=120,
                           headers={"Authorization": f"Bearer {KEY}"},
                           json={"prompt": "def add(a, b):", "max_tokens": 2}).status_code == 200
        out["alive_afterwards"] = alive and server.proc.poll() is None
        out["tracebacks_in_log"] = server.log().count("Traceback")
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)
    out["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps({k: v for k, v in out.items() if k != "failures"}, indent=1))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    ok = (out["total_cases"] >= 1000 and not out["server_errors"] and not out["failures"]
          and out["alive_afterwards"] and not out["tracebacks_in_log"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
