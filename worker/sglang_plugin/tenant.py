"""Tenant identity and cache namespace as they travel inside an SGLang request.

Imports neither sglang nor torch: `worker.sglang_server` (the producer) and the scheduler hooks (the
consumer) both use it.

Where each piece travels (SGLang 0.5.23 `GenerateReqInput` → `Req`):

- **Identity** (tenant id, weight, tier): `sampling_params["custom_params"]["fairshare_tenant"]`,
  a token `v1.<payload>.<mac>`: payload = base64url(JSON [tenant_id, weight, tier, namespace_key]),
  mac = HMAC-SHA256 over `v1.<payload>` with a server secret (`FAIRSHARE_SGLANG_SECRET`, hex),
  first 32 hex digits. `custom_params` is SGLang's own per-request dict for scheduler-side
  extensions (it carries SGLang's reasoning delimiters the same way), survives its tokenizer →
  scheduler IPC unchanged, and does not enter the radix key, so a weight or tier change does not
  invalidate a tenant's cache.
- **Cache namespace**: `extra_key = "fs|" + namespace_key`, where namespace_key = the first 32 hex
  digits of SHA-256 over the gateway's `Tenant.cache_namespace` (itself a keyed hash the gateway
  derives from the tenant). SGLang's `RadixKey(token_ids, extra_key, cache_salt)` keeps different
  extra keys in disjoint subtrees, and HiCache storage hashes are seeded by them.
- **Client salt** (`GenerateRequest.cache_salt`): SGLang's `cache_salt`. It splits the tenant's own
  namespace only; it can never name another tenant's, since the extra key differs.

Why a MAC: the plugin is loaded by *every* SGLang scheduler in an environment where FairShare is
installed, including one serving SGLang's own HTTP API, whose clients can set `extra_key`,
`cache_salt` and `custom_params` themselves. Only a request whose token verifies is attributed to
the tenant it names; any other request is accounted to `UNVERIFIED_TENANT` and its extra key is
moved under the `fsu|` prefix, so it can neither charge nor read another tenant's namespace.
The secret is created by the worker before it starts SGLang and reaches the scheduler processes
(spawned) through the environment; every tensor-parallel rank sees the same one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass

CUSTOM_PARAM_KEY = "fairshare_tenant"
SECRET_ENV = "FAIRSHARE_SGLANG_SECRET"
NAMESPACE_PREFIX = "fs|"
UNVERIFIED_PREFIX = "fsu|"
UNVERIFIED_TENANT = "_unverified"
TIERS = ("interactive", "batch", "background")
_VERSION = "v1"
_MAC_HEX = 32


@dataclass(frozen=True)
class TenantTag:
    """What the plugin knows about a request's tenant.

    tenant_id: the gateway-derived tenant. weight: VTC weight (> 0). tier: one of TIERS.
    namespace_key: 32 hex digits naming the tenant's radix-cache namespace. verified: the tag came
    from a token whose MAC checked out.
    """

    tenant_id: str
    weight: float = 1.0
    tier: str = "interactive"
    namespace_key: str = ""
    verified: bool = False

    @property
    def extra_key(self) -> str:
        """The radix-cache `extra_key` this tenant's requests must carry."""
        return NAMESPACE_PREFIX + self.namespace_key


def namespace_key(cache_namespace: str) -> str:
    """Fixed-length key for a gateway cache namespace (first 32 hex digits of its SHA-256)."""
    return hashlib.sha256(cache_namespace.encode()).hexdigest()[:_MAC_HEX]


def new_secret() -> str:
    """A fresh random secret (hex)."""
    return secrets.token_hex(32)


def ensure_secret() -> str:
    """The secret in `FAIRSHARE_SGLANG_SECRET`, creating (and exporting) one when unset, so that
    processes spawned afterwards (SGLang's schedulers) inherit it."""
    value = os.environ.get(SECRET_ENV)
    if not value:
        value = os.environ[SECRET_ENV] = new_secret()
    return value


def _mac(secret: str, message: str) -> str:
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()[:_MAC_HEX]


def sign(tenant_id: str, weight: float, tier: str, cache_namespace: str, secret: str) -> str:
    """The token for a request of `tenant_id` (see the module docstring).

    Raises ValueError for an empty tenant id, a non-positive weight or an unknown tier.
    """
    if not tenant_id:
        raise ValueError("tenant_id is required")
    if not weight > 0:
        raise ValueError(f"tenant weight must be > 0, got {weight}")
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}")
    body = json.dumps([tenant_id, float(weight), tier, namespace_key(cache_namespace)], separators=(",", ":"))
    payload = base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")
    message = f"{_VERSION}.{payload}"
    return f"{message}.{_mac(secret, message)}"


def verify(token: object, secret: str | None) -> TenantTag | None:
    """The tag a valid token carries, or None (no secret, malformed token, bad MAC, bad fields)."""
    if not secret or not isinstance(token, str):
        return None
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != _VERSION:
        return None
    message = f"{parts[0]}.{parts[1]}"
    if not hmac.compare_digest(_mac(secret, message), parts[2]):
        return None
    try:
        raw = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4))
        tenant_id, weight, tier, ns = json.loads(raw)
    except (ValueError, TypeError):
        return None
    if not (isinstance(tenant_id, str) and tenant_id and isinstance(weight, (int, float)) and weight > 0
            and tier in TIERS and isinstance(ns, str) and ns):
        return None
    return TenantTag(tenant_id, float(weight), tier, ns, verified=True)


def unverified_tag() -> TenantTag:
    """The tag every request without a valid token is accounted to."""
    return TenantTag(UNVERIFIED_TENANT, 1.0, "background", "", verified=False)


def custom_params_token(sampling_params: object) -> object:
    """The token inside an SGLang `SamplingParams` (or a plain dict of sampling params), if any."""
    params = sampling_params.get("custom_params") if isinstance(sampling_params, dict) else (
        getattr(sampling_params, "custom_params", None))
    return params.get(CUSTOM_PARAM_KEY) if isinstance(params, dict) else None
