"""Tenant identity and cache namespace as they travel inside an SGLang request.

Imports neither sglang nor torch: `worker.sglang_server` (the producer) and the scheduler hooks (the
consumer) both use it.

Where each piece travels (SGLang 0.5.23 `GenerateReqInput` → `Req`):

- **Identity** (tenant id, weight, tier): `sampling_params["custom_params"]["fairshare_tenant"]`,
  a token `v3.<payload>.<mac>`: payload = base64url(JSON [tenant_id, weight, tier, rid, expiry]),
  mac = HMAC-SHA256 over `v3.<payload>` with a server secret (`FAIRSHARE_SGLANG_SECRET`, hex), first
  32 hex digits. The token is bound to the SGLang request id (`rid`) and expires (`expiry`, Unix
  seconds: `INTERNAL_TTL_S` after signing); the plugin accepts it only on the request with that rid,
  before its expiry, and once: a second request object carrying the same rid within the validity
  is a replay, accounted as unverified (`FairShareState.tag_of`). So a token captured from one
  request (e.g. by a client of SGLang's own HTTP API that can set `custom_params`) can neither be
  moved to another request nor sent again. `custom_params` is SGLang's own per-request dict for scheduler-side extensions (it
  carries SGLang's reasoning delimiters the same way), survives its tokenizer → scheduler IPC
  unchanged, and does not enter the radix key, so a weight or tier change does not invalidate a
  tenant's cache.
- **Cache namespace**: `extra_key = "fs|" + derive_namespace(cache_secret, tenant_id, cache_salt)`
  (`worker.cache.namespace`, the reference worker's derivation), computed on the worker from the
  verified tenant id and the request's `cache_salt`, never taken from the gateway or the client.
  SGLang's `RadixKey(token_ids, extra_key, cache_salt)` keeps different extra keys in disjoint
  subtrees of its radix tree, at every tier it has: device KV, HiCache host copies (attached to the
  same tree nodes) and HiCache storage, whose page hashes are seeded by the extra key and salt
  (`sglang.srt.mem_cache.utils.storage_namespace_seed`). The cache secret is
  `FAIRSHARE_CACHE_SECRET` when set (set the same value on every worker sharing a HiCache storage
  backend to let a tenant's storage pages be reused across them), else a key derived from the
  token secret; either way every scheduler process and tensor-parallel rank computes the same
  namespaces, as SGLang's rank-consensus checks on its cache require.
- **Client salt** (`GenerateRequest.cache_salt`): folded into the namespace (and passed on as
  SGLang's `cache_salt` as well). It splits the tenant's own namespace only; it can never name
  another tenant's, since the tenant id is part of the hashed input.

Why a MAC: the plugin is loaded by *every* SGLang scheduler in an environment where FairShare is
installed, including one serving SGLang's own HTTP API, whose clients can set `extra_key`,
`cache_salt` and `custom_params` themselves. Only a request whose token verifies is attributed to
the tenant it names; any other request is accounted to `UNVERIFIED_TENANT` and its extra key is
moved under the `fsu|` prefix, so it can neither charge nor read another tenant's namespace.
The secret is created by the worker before it starts SGLang and reaches the scheduler processes
(spawned) through the environment; every tensor-parallel rank sees the same one.

Imports `worker.cache.namespace` (pure Python) for the namespace derivation.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from functools import lru_cache

from fairshare.tiers import TIERS
from worker.cache.namespace import SECRET_ENV as CACHE_SECRET_ENV
from worker.cache.namespace import derive_namespace

CUSTOM_PARAM_KEY = "fairshare_tenant"
SECRET_ENV = "FAIRSHARE_SGLANG_SECRET"
NAMESPACE_PREFIX = "fs|"
UNVERIFIED_PREFIX = "fsu|"
UNVERIFIED_TENANT = "_unverified"
_VERSION = "v3"
INTERNAL_TTL_S = 300.0  # seconds; it only has to cover the hop from the servicer to the scheduler
_MAC_HEX = 32
_CACHE_KEY_LABEL = b"fairshare sglang cache-namespace secret v1"


@dataclass(frozen=True)
class TenantTag:
    """What the plugin knows about a request's tenant.

    tenant_id: the gateway-derived tenant. weight: VTC weight (> 0). tier: one of TIERS.
    verified: the tag came from a token whose MAC checked out.
    """

    tenant_id: str
    weight: float = 1.0
    tier: str = "interactive"
    verified: bool = False


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


@lru_cache(maxsize=8)
def _cache_secret(token_secret: str, configured: str) -> bytes:
    if configured:
        raw = configured.encode("utf-8")
        if len(raw) < 16:
            raise ValueError(f"{CACHE_SECRET_ENV} must be at least 16 bytes long")
        return raw
    return hmac.new(token_secret.encode(), _CACHE_KEY_LABEL, hashlib.sha256).digest()


def cache_secret(token_secret: str, environ=None) -> bytes:
    """The secret radix-cache namespaces are derived under (bytes, 32 or more).

    `FAIRSHARE_CACHE_SECRET` (UTF-8) when set in `environ` (default `os.environ`), else
    HMAC-SHA256(token_secret, a fixed label): deterministic in every process that shares the token
    secret (all SGLang schedulers and tensor-parallel ranks), and independent of the tenant-token
    MACs. Raises ValueError for an empty token secret without `FAIRSHARE_CACHE_SECRET`, or a
    `FAIRSHARE_CACHE_SECRET` shorter than 16 bytes.
    """
    env = os.environ if environ is None else environ
    configured = env.get(CACHE_SECRET_ENV, "")
    if not configured and not token_secret:
        raise ValueError("no secret to derive cache namespaces from")
    return _cache_secret(token_secret or "", configured)


def extra_key_for(tenant_id: str, cache_salt: str | None, token_secret: str, environ=None) -> str:
    """The SGLang `extra_key` of a request of `tenant_id` with the client's `cache_salt`:
    `"fs|" + derive_namespace(cache_secret(token_secret), tenant_id, cache_salt or "")`
    (3 + 65 characters). Raises ValueError for an empty tenant id or no secret."""
    return NAMESPACE_PREFIX + derive_namespace(cache_secret(token_secret, environ), tenant_id, cache_salt or "")


def _mac(secret: str, message: str) -> str:
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()[:_MAC_HEX]


def sign(tenant_id: str, weight: float, tier: str, secret: str, *, rid: str, ttl_s: float = INTERNAL_TTL_S,
         now: float | None = None) -> str:
    """The token for SGLang request `rid` of `tenant_id`, valid `ttl_s` seconds from `now` (Unix
    time; default the current time). See the module docstring.

    Raises ValueError for an empty tenant id or rid, a non-positive weight or an unknown tier.
    """
    if not rid:
        raise ValueError("rid is required")
    if not tenant_id:
        raise ValueError("tenant_id is required")
    if not weight > 0:
        raise ValueError(f"tenant weight must be > 0, got {weight}")
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}")
    expiry = int((time.time() if now is None else now) + ttl_s)
    body = json.dumps([tenant_id, float(weight), tier, rid, expiry], separators=(",", ":"))
    payload = base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")
    message = f"{_VERSION}.{payload}"
    return f"{message}.{_mac(secret, message)}"


def verify(token: object, secret: str | None, *, rid: str, now: float | None = None) -> tuple[TenantTag, int] | None:
    """(the tag, the expiry in Unix seconds) of a valid token for request `rid`, or None (no secret,
    malformed token, bad MAC, bad fields, another request's token, expired at `now`: Unix time,
    default the current time). Replay (the same rid twice) is the caller's to refuse."""
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
        tenant_id, weight, tier, bound_rid, expiry = json.loads(raw)
    except (ValueError, TypeError):
        return None
    if not (isinstance(tenant_id, str) and tenant_id and isinstance(weight, (int, float)) and weight > 0
            and tier in TIERS and isinstance(expiry, int)):
        return None
    if bound_rid != rid or (time.time() if now is None else now) > expiry:
        return None
    return TenantTag(tenant_id, float(weight), tier, verified=True), expiry


def unverified_tag() -> TenantTag:
    """The tag every request without a valid token is accounted to."""
    return TenantTag(UNVERIFIED_TENANT, 1.0, "background", verified=False)


def custom_params_token(sampling_params: object) -> object:
    """The token inside an SGLang `SamplingParams` (or a plain dict of sampling params), if any."""
    params = sampling_params.get("custom_params") if isinstance(sampling_params, dict) else (
        getattr(sampling_params, "custom_params", None))
    return params.get(CUSTOM_PARAM_KEY) if isinstance(params, dict) else None
