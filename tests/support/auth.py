"""Signing raw gRPC calls to a test worker as the gateway does (fairshare/worker_auth.py).

    stub.Generate(req, metadata=signed(req))      # one call, signed with the tests' worker key
    channel = signed_channel("127.0.0.1:50051")   # every Generate / Abort on it signed

The key is ``$FAIRSHARE_WORKER_KEYS`` (tests/conftest.py sets it for the whole session, so every
worker and gateway the tests start shares it).
"""

from __future__ import annotations

import os

import grpc

from fairshare import worker_auth


def signer(ttl_s: float = worker_auth.DEFAULT_TTL_S, clock=None) -> worker_auth.Signer:
    kw = {} if clock is None else {"clock": clock}
    return worker_auth.Signer(worker_auth.WorkerKeys.parse(os.environ[worker_auth.KEYS_ENV]), ttl_s, **kw)


def signed(request, extra=()) -> tuple[tuple[str, str], ...]:
    """Metadata for one call carrying `request` (a GenerateRequest or an AbortRequest)."""
    claims = (worker_auth.abort_claims(request) if not hasattr(request, "tenant")
              else worker_auth.generate_claims(request))
    return (*extra, *signer().metadata(claims))


class _Signing(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def _with_token(self, details, request):
        if details.method.endswith(("/Generate", "/Abort")):
            md = list(details.metadata or ()) + list(signed(request))
            details = details._replace(metadata=md) if hasattr(details, "_replace") else _Details(details, md)
        return details

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details, request), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details, request), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata):
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials = d.credentials
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


def signed_channel(addr: str) -> grpc.Channel:
    """An insecure channel to `addr` whose Generate and Abort calls are signed."""
    return grpc.intercept_channel(grpc.insecure_channel(addr), _Signing())


# ---- calls that are not the gateway's (the must-refuse cases of tests/reliability/test_worker_auth.py
# and tests/sglang/test_server_grpc.py) --------------------------------------------------------------
def forged_calls(make_request) -> list[tuple[str, str, object, tuple]]:
    """(case, expected refusal reason, request, metadata) for calls a worker must refuse.
    make_request(request_id, tenant_id, weight) builds a GenerateRequest."""
    import time

    good = signer()
    wrong_key = worker_auth.Signer(worker_auth.WorkerKeys.parse(
        good._keys().signing[0] + ":" + "attacker-guessed-secret"))
    other_kid = worker_auth.Signer(worker_auth.WorkerKeys.parse("not-a-key-id:" + "x" * 32))
    out = []
    r = make_request("auth-missing", "victim", 1.0)
    out.append(("no token", "missing", r, ()))
    r = make_request("auth-forged", "victim", 1.0)
    out.append(("forged token (wrong secret)", "bad_signature", r, wrong_key.metadata(worker_auth.generate_claims(r))))
    r = make_request("auth-kid", "victim", 1.0)
    out.append(("unknown key id", "unknown_key", r, other_kid.metadata(worker_auth.generate_claims(r))))
    # a real token for a modest request of one tenant, put on a request claiming more (weight, tenant)
    honest = make_request("auth-moved", "victim", 1.0)
    token = good.metadata(worker_auth.generate_claims(honest))
    moved = type(honest)()
    moved.CopyFrom(honest)  # the same request id, another tenant with a bigger weight
    moved.tenant.id, moved.tenant.weight = "attacker", 100.0
    out.append(("token moved to another identity", "bad_signature", moved, token))
    r = make_request("auth-expired", "victim", 1.0)
    stale = good.token(worker_auth.generate_claims(r), expiry=int(time.time()) - 120)
    out.append(("expired token", "expired", r, ((worker_auth.METADATA_KEY, stale),)))
    r = make_request("auth-garbled", "victim", 1.0)
    out.append(("malformed token", "malformed", r, ((worker_auth.METADATA_KEY, "fs1.nonsense"),)))
    return out
