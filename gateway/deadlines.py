"""Request deadlines: whose deadline a request has, and the OpenAI-shaped answer when it passes.

A request's deadline is the earlier of

- the **server's**: its tenant's ``request_timeout_s`` (tenants file), else the gateway's
  ``request_timeout_s`` when set (one deadline for every tier), else its tier's entry of
  ``tier_request_timeout_s`` (default: interactive 600 s; batch and background none);
- the **client's**: the ``x-request-timeout`` header (seconds, a positive number; the request's own
  budget, e.g. ``extra_headers={"x-request-timeout": "30"}`` with the openai SDK); for a
  non-streamed request also ``x-stainless-read-timeout``, the timeout the official SDKs send with
  every request: nothing is sent before a non-streamed body, so the SDK's read timeout bounds the
  whole wait and there is no point generating past it. For a stream it only bounds the gap between
  two chunks, which keep-alives fill (gateway/keepalive.py), so it is not a deadline there. The
  SDK gives up on its own at that timeout, so the gateway's deadline from this header runs
  ``SDK_GRACE_S`` longer: the client always sees its own timeout (``APITimeoutError``, which it may
  retry), never a 408 racing it; the generation is stopped either way (the client left, or the
  deadline passed).

A client can only shorten the server's deadline. The deadline travels to the worker as the gRPC
deadline of every call: a request still queued there when it passes is aborted at the worker (its
KV blocks freed) and settled here (lease released, unused TPM refunded).

When it passes the client gets (the body is always ``{"error": {message, type, param, code}}``;
the official SDKs retry both statuses by default):

| whose deadline | status | type | code |
|---|---|---|---|
| the server's (tier / tenant / ``request_timeout_s``) | 504 | ``server_error`` | ``timeout`` |
| the client's (``x-request-timeout``, the SDK's timeout) | 408 | ``invalid_request_error`` | ``request_timeout`` |

A stream whose response has started gets the same body as its last SSE ``data:`` event (no
``[DONE]``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Mapping

from fairshare.config import TenantConfig

from .errors import APIError, invalid_request

CLIENT_HEADER = "x-request-timeout"
SDK_HEADER = "x-stainless-read-timeout"
SDK_GRACE_S = 1.0  # seconds past the SDK's read timeout before the gateway's own deadline passes
SDK_SOURCE = "the client's timeout"


@dataclass(frozen=True)
class Deadline:
    """A request's deadline. at: ``time.monotonic()`` by which it must end (None: none). seconds: its
    length. owner: ``server`` or ``client`` (whose budget it is). source: where it came from (for the
    message: ``tier interactive``, ``tenant``, ``request_timeout_s``, a header name)."""

    at: float | None
    seconds: float | None
    owner: str = "server"
    source: str = ""

    def error(self, started: bool = True) -> APIError:
        """The answer once it has passed: 408 for the client's own deadline, 504 for the server's.
        started: whether the generation had begun (else it was still queued at the worker)."""
        what = "finish" if started else "start"
        limit = f"{self.seconds:g} s" if self.seconds is not None else "its deadline"
        if self.owner == "client":
            return APIError(408, f"The request did not {what} within its timeout of {limit} ({self.source}).",
                            "invalid_request_error", None, "request_timeout")
        return APIError(504, f"The request did not {what} within the server's deadline of {limit} "
                             f"({self.source}).", "server_error", None, "timeout")


def server_timeout_s(settings, tenant: TenantConfig) -> tuple[float | None, str]:
    """(seconds or None, source) of the server's deadline for `tenant`'s requests."""
    if tenant.request_timeout_s is not None:
        return tenant.request_timeout_s, f"tenant {tenant.id}"
    if settings.request_timeout_s is not None:
        return settings.request_timeout_s, "request_timeout_s"
    tier = tenant.tier
    return settings.tier_request_timeout_s.get(tier), f"tier {tier.value}"


def client_timeout_s(headers: Mapping[str, str], stream: bool) -> tuple[float | None, str]:
    """(seconds or None, header) of the client's own deadline. Raises APIError 400 for an
    ``x-request-timeout`` that is not a positive number (the SDK's header is trusted less: a bad
    value of it is ignored)."""
    raw = headers.get(CLIENT_HEADER)
    if raw is not None:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (value > 0 and math.isfinite(value)):
            raise invalid_request(f"Invalid header {CLIENT_HEADER}: {raw[:32]!r} is not a positive number of "
                                  "seconds.", None, "invalid_value")
        return value, CLIENT_HEADER
    if not stream:
        raw = headers.get(SDK_HEADER)
        try:
            value = float(raw) if raw is not None else math.nan
        except ValueError:
            value = math.nan
        if value > 0 and math.isfinite(value):
            return value, SDK_SOURCE
    return None, ""


def request_deadline(settings, tenant: TenantConfig, headers: Mapping[str, str], stream: bool,
                     now: float | None = None) -> Deadline:
    """The deadline of one request received `now` (``time.monotonic()``; default: now).
    Raises APIError 400 for a malformed ``x-request-timeout``."""
    now = time.monotonic() if now is None else now
    server_s, server_src = server_timeout_s(settings, tenant)
    client_s, client_src = client_timeout_s(headers, stream)
    if client_s is not None and (server_s is None or client_s < server_s):
        end_s = client_s + SDK_GRACE_S if client_src == SDK_SOURCE else client_s  # (the SDK's own timer first)
        return Deadline(now + (end_s if server_s is None else min(end_s, server_s)), client_s, "client", client_src)
    if server_s is not None:
        return Deadline(now + server_s, server_s, "server", server_src)
    return Deadline(None, None)


__all__ = ["CLIENT_HEADER", "Deadline", "SDK_GRACE_S", "SDK_HEADER", "client_timeout_s", "request_deadline", "server_timeout_s"]
