"""Start a service as a real OS process (`python -m module --host 127.0.0.1 --port P ...`) and
wait until its Health answers; stop it with SIGTERM. Used by the service tests (and by the
`services` fixture in conftest.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServiceProcess:
    """A service started with `python -m module`, listening on 127.0.0.1:port."""

    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, wait for a graceful exit (SIGKILL after `timeout_s`); the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_service(module: str, args: list[str], ready: Callable[[int], bool],
                  timeout_s: float = 60.0, env: dict[str, str] | None = None,
                  port: int | None = None, subcommand: tuple[str, ...] = ()) -> ServiceProcess:
    """Run `python -m module [subcommand] --port P *args` and wait until `ready(P)` (its Health)
    answers. P is a free port unless `port` names one (a restart on the same port)."""
    port = port or free_port()
    log_fd, log_name = tempfile.mkstemp(prefix=f"{module.replace('.', '-')}-", suffix=".log")
    proc = subprocess.Popen([sys.executable, "-m", module, *subcommand, "--host", "127.0.0.1", "--port",
                             str(port), *args], cwd=REPO, stdout=log_fd, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    os.close(log_fd)
    service = ServiceProcess(proc, port, Path(log_name))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{module} exited with {proc.returncode}:\n{service.log()}")
        try:
            if ready(port):
                return service
        except Exception:  # noqa: BLE001 -- not up yet
            pass
        time.sleep(0.2)
    service.stop()
    raise TimeoutError(f"{module} did not answer within {timeout_s}s:\n{service.log()}")


def http_ready(port: int) -> bool:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200


def start_serve(args: list[str], env: dict[str, str] | None = None,
                timeout_s: float = 180.0) -> ServiceProcess:
    """`vericache serve` (the embedded gateway) on a free port, up once /health answers."""
    return start_service("vericache", args, http_ready, timeout_s, env, subcommand=("serve",))
