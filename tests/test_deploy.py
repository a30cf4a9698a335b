"""The container deployment, checked offline (no Docker engine): docker-compose.yml against
the compose-spec schema and against the services' real command lines, the Dockerfile against
the project's pins, and the healthcheck CLI against a real kvstore process."""

from __future__ import annotations

import importlib.util
import logging
import re
import subprocess
import sys
import threading
import tomllib
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
import yaml

from service_process import REPO, free_port
from services.common import healthcheck
from vericache._proto import load

COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
SERVICES = ("kvstore", "verifier", "drafter", "gateway")
PORTS = {"kvstore": 50051, "verifier": 50052, "drafter": 50053, "gateway": 8000}
PEER_FLAGS = {"--kvstore", "--verifier", "--drafter"}
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def defaults(value: str) -> str:
    """A compose string with each ${VAR:-default} replaced by its default (no shell env)."""
    return _VAR.sub(lambda m: m.group(2) or "", value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def command(compose: dict, name: str) -> list[str]:
    return [defaults(arg) for arg in compose["services"][name]["command"]]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_compose_matches_the_compose_spec_schema():
    assert importlib.util.find_spec("check_jsonschema") is not None, \
        "check-jsonschema is not installed (pip install -e '.[test]')"
    r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                        "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_structure(compose):
    services = compose["services"]
    assert set(services) == {"redis", *SERVICES}
    assert services["redis"]["image"].startswith("redis:7")
    assert "redis-cli" in services["redis"]["healthcheck"]["test"]
    images = {defaults(services[name]["image"]) for name in SERVICES}
    assert len(images) == 1, f"one image for all services, got {images}"
    for name in SERVICES:
        svc, argv = services[name], command(compose, name)
        assert argv[:3] == ["python", "-m", f"services.{name}"], argv
        assert flag(argv, "--host") == "0.0.0.0" and int(flag(argv, "--port")) == PORTS[name]
        assert svc["build"] == "." and svc["restart"] == "unless-stopped"
        check = svc["healthcheck"]["test"]
        assert check[:4] == ["CMD", "python", "-m", "services.common.healthcheck"], check
        target = check[-1]
        if name == "gateway":
            assert check[-2] == "--http" and target == f"http://127.0.0.1:{PORTS[name]}/health"
        else:
            assert check[-2:] == ["--grpc", f"127.0.0.1:{PORTS[name]}"], check
        assert svc["depends_on"], f"{name} starts after its peers"
        for peer, cond in svc["depends_on"].items():
            assert cond == {"condition": "service_healthy"}, (name, peer, cond)
            assert "healthcheck" in services[peer], f"{name} waits on {peer}, which has none"
        for peer_flag in PEER_FLAGS & set(argv):  # --kvstore kvstore:50051 etc.
            peer = peer_flag.removeprefix("--")
            assert flag(argv, peer_flag) == f"{peer}:{PORTS[peer]}"
            assert peer in svc["depends_on"], f"{name} talks to {peer} but does not wait for it"
    assert [defaults(p) for p in services["gateway"]["ports"]] == ["8000:8000"]
    for name in ("verifier", "drafter", "gateway"):
        assert "model-cache:/cache" in services[name]["volumes"]
    assert "model-cache" in compose["volumes"]


def test_kvstore_command_parses(compose, monkeypatch):
    from services.kvstore.__main__ import parse_args
    from vericache.store.registry import store_class

    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    config = parse_args(command(compose, "kvstore")[3:])
    assert (config.host, config.port) == ("0.0.0.0", 50051)
    assert config.backend.startswith("lmcache://")
    cls, seen = store_class("lmcache"), {}  # the real URL parsing, without connecting
    monkeypatch.setattr(cls, "__init__", lambda self, **kw: seen.update(kw))
    cls.from_url(config.backend)
    assert seen == {"remote_url": "redis://redis:6379", "capacity_mb": 1024.0}


@pytest.mark.parametrize("name", SERVICES)
def test_command_flags_are_accepted(compose, name):
    assert importlib.util.find_spec(f"services.{name}") is not None, f"no module services.{name}"
    r = subprocess.run([sys.executable, "-m", f"services.{name}", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    accepted = set(re.findall(r"--[a-z][\w-]*", r.stdout))
    wanted = {arg for arg in command(compose, name) if arg.startswith("--")}
    missing = wanted - accepted  # peer addresses (--kvstore, --verifier, --drafter) included
    assert not missing, f"python -m services.{name} does not accept {sorted(missing)}"


def test_dockerfile_matches_the_project():
    text = DOCKERFILE.read_text()
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(d for d in deps if d.startswith("torch==")).removeprefix("torch==")
    assert f"ARG TORCH_VERSION={torch_pin}\n" in text
    assert "ARG BASE_IMAGE=python:3.11-slim\n" in text
    assert re.search(r"^USER (?!root)\w+", text, re.MULTILINE), "containers run as non-root"
    assert "load_model()" in text and "VERICACHE_CACHE_DIR=/cache" in text


# --- the healthcheck CLI ---------------------------------------------------------------

def run_healthcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.common.healthcheck", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def test_healthcheck_grpc_against_a_real_kvstore(services):
    pb, pb_grpc = load("kvstore")

    def ready(port: int) -> bool:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            r = pb_grpc.KVStoreStub(ch).Health(pb.HealthRequest(), timeout=2)
        return r.status == pb.HealthResponse.STATUS_SERVING

    kvstore = services("services.kvstore", ["--backend", "memory://", "--log-level", "WARNING"],
                       ready=ready)
    r = run_healthcheck("--grpc", kvstore.address)
    assert r.returncode == 0, r.stdout + r.stderr


def test_healthcheck_grpc_closed_port():
    r = run_healthcheck("--grpc", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert r.returncode == 1 and "no gRPC channel" in r.stderr


@pytest.mark.parametrize("answer, code", [(b"\x08\x01", 0), (b"\x08\x02", 1), (b"", 1)])
def test_healthcheck_grpc_standard_health_service(answer, code):
    """A server with grpc.health.v1 registered: SERVING passes, NOT_SERVING/UNKNOWN fail."""
    handler = grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
        "Check": grpc.unary_unary_rpc_method_handler(lambda req, ctx: answer)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert healthcheck.main(["--grpc", f"127.0.0.1:{port}", "--quiet"]) == code
    finally:
        server.stop(None)


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_healthcheck_http():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert run_healthcheck("--http", f"{base}/health").returncode == 0
        assert run_healthcheck("--http", f"{base}/other").returncode == 1
    finally:
        server.shutdown()
        server.server_close()
    assert run_healthcheck("--http", f"http://127.0.0.1:{free_port()}/health").returncode == 1
