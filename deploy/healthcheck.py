#!/usr/bin/env python3
"""Container health check for FairShare images (installed as /usr/local/bin/fairshare-healthcheck).

    fairshare-healthcheck grpc HOST:PORT [SERVICE]   # grpc.health.v1 Check; SERVICE default ""
    fairshare-healthcheck http URL                   # GET; healthy on HTTP 200

Exit status 0 when healthy, 1 otherwise (one line on stderr says why), 2 on bad usage. It uses only
the standard library and, for gRPC, the grpcio + grpcio-health-checking packages that every
FairShare image already has, so the images need no curl or grpc_health_probe binary.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

TIMEOUT_S = 3.0


def check_grpc(target: str, service: str = "", timeout_s: float = TIMEOUT_S) -> tuple[bool, str]:
    """(healthy, detail) for a grpc.health.v1 Check of `service` on `target` (host:port)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as e:
        return False, f"{target} {service or '(server)'}: {e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, f"{target} {service or '(server)'}: {status}"


def check_http(url: str, timeout_s: float = TIMEOUT_S) -> tuple[bool, str]:
    """(healthy, detail) for GET `url`: healthy when it answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (URL from the image's own config)
            return resp.status == 200, f"{url}: HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"{url}: {getattr(e, 'reason', e)}"


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) >= 2 and args[0] == "grpc" and len(args) <= 3:
        ok, detail = check_grpc(args[1], args[2] if len(args) == 3 else "")
    elif len(args) == 2 and args[0] == "http":
        ok, detail = check_http(args[1])
    else:
        print("usage: fairshare-healthcheck grpc HOST:PORT [SERVICE] | http URL", file=sys.stderr)
        return 2
    if not ok:
        print(f"unhealthy: {detail}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
