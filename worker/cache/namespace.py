"""Radix-cache namespaces, derived on the worker from the tenant (docs/cache-isolation.md).

A request's prefix-cache namespace is a keyed hash under a worker secret:

    derive_namespace(secret, tenant_id, salt) = "t" + hex HMAC-SHA256(secret, enc("cache-ns", tenant_id, salt))

where `enc` is a typed, length-prefixed encoding: each field is its UTF-8 bytes preceded by their
length as 4 big-endian bytes, and the first field names the kind of key. So two different
(kind, tenant_id, salt) triples never encode to the same bytes (no "a"+"bc" = "ab"+"c" collision,
no salt that imitates another tenant id), and no other keyed hash this code base makes under the
same secret (API-key digests, etc.) can land in this namespace space. The client's `cache_salt`
only enters as the last field next to the tenant id the gateway authenticated, so a salt can split
a tenant's own namespace but never name another tenant's: without the secret nobody can compute
anyone's namespace, and even with it the tenant id is part of the hashed input.

Secret: `FAIRSHARE_CACHE_SECRET` (`load_secret`), else 32 random bytes per process (namespaces then
change when the worker restarts, which only empties its cache, which a restart does anyway).

Reserved, non-derivable names: `PUBLIC_NAMESPACE` (operator-listed public prefixes, shared by all
tenants) and `GLOBAL_NAMESPACE` (the unsafe experiment-only mode without isolation). Derived names
always start with "t" followed by 64 hex digits, so they can never equal either.

Imports neither torch nor grpc.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

PUBLIC_NAMESPACE = "public"
GLOBAL_NAMESPACE = "global"
SECRET_ENV = "FAIRSHARE_CACHE_SECRET"
_KIND = "cache-ns"


def encode_fields(*fields: str) -> bytes:
    """Length-prefixed encoding of strings: for each, 4-byte big-endian length then UTF-8 bytes.
    Injective: different field tuples give different bytes."""
    out = bytearray()
    for f in fields:
        b = f.encode("utf-8")
        out += len(b).to_bytes(4, "big") + b
    return bytes(out)


def derive_namespace(secret: bytes, tenant_id: str, salt: str = "") -> str:
    """The radix-cache namespace of `tenant_id` (optionally split by the client's `salt`).

    secret: the worker's cache secret (>= 16 bytes). Returns "t" + 64 hex digits.
    Raises ValueError for a short secret or an empty tenant id.
    """
    if len(secret) < 16:
        raise ValueError("the cache secret must be at least 16 bytes")
    if not tenant_id:
        raise ValueError("tenant_id is required to derive a cache namespace")
    mac = hmac.new(secret, encode_fields(_KIND, tenant_id, salt), hashlib.sha256)
    return "t" + mac.hexdigest()


def load_secret(environ: dict[str, str] | None = None) -> bytes:
    """The cache secret: `FAIRSHARE_CACHE_SECRET` (UTF-8 bytes, at least 16) when set, else 32
    random bytes (a per-process secret). Raises ValueError when the variable is set but too short."""
    env = os.environ if environ is None else environ
    value = env.get(SECRET_ENV, "")
    if value:
        raw = value.encode("utf-8")
        if len(raw) < 16:
            raise ValueError(f"{SECRET_ENV} must be at least 16 bytes long")
        return raw
    return secrets.token_bytes(32)


__all__ = ["GLOBAL_NAMESPACE", "PUBLIC_NAMESPACE", "SECRET_ENV", "derive_namespace", "encode_fields", "load_secret"]
