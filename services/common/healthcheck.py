"""`python -m services.common.healthcheck`: exit 0 when a service answers, 1 when it does not.

For container healthchecks (the image has no curl or grpc_health_probe):

    --grpc HOST:PORT   waits until the channel is ready (TCP connect + HTTP/2 handshake), then
                       asks the standard health service (grpc.health.v1.Health/Check, empty
                       service name). SERVING passes, NOT_SERVING fails; a server that does not
                       register that service (UNIMPLEMENTED) passes on channel readiness alone.
    --http URL         GET URL; any 2xx passes.

The health messages are encoded by hand (field 1 of HealthCheckResponse is the status enum),
so neither grpcio-health-checking nor the core library is imported: the check stays fast.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

_CHECK = "/grpc.health.v1.Health/Check"
_SERVING = 1  # grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING


def _health_status(data: bytes) -> int:
    """The status field of a serialized HealthCheckResponse (0, UNKNOWN, when absent)."""
    if len(data) >= 2 and data[0] == 0x08:  # field 1, varint; statuses fit one byte
        return data[1]
    return 0


def check_grpc(target: str, timeout_s: float) -> tuple[bool, str]:
    import grpc

    with grpc.insecure_channel(target) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return False, f"{target}: no gRPC channel within {timeout_s:g}s"
        check = channel.unary_unary(_CHECK, request_serializer=bytes,
                                    response_deserializer=bytes)
        try:
            status = _health_status(check(b"", timeout=timeout_s))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return True, f"{target}: channel ready (no grpc.health.v1 service)"
            return False, f"{target}: health check failed: {e.code().name} {e.details()}"
    if status != _SERVING:
        return False, f"{target}: health status {status} (1 is SERVING)"
    return True, f"{target}: SERVING"


def check_http(url: str, timeout_s: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return 200 <= r.status < 300, f"{url}: HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"{url}: {getattr(e, 'reason', e)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.common.healthcheck",
                                description="Exit 0 when the service answers, 1 otherwise.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--grpc", metavar="HOST:PORT", help="a gRPC service")
    what.add_argument("--http", metavar="URL", help="an HTTP endpoint, e.g. the gateway's /health")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per step (default 3)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    a = p.parse_args(argv)
    ok, message = (check_grpc(a.grpc, a.timeout) if a.grpc else check_http(a.http, a.timeout))
    if not a.quiet:
        print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
