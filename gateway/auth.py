"""API keys and tenant identity.

- Keys look like ``sk-fs-<43 url-safe chars>`` (256 random bits). They are stored only as
  ``HMAC-SHA256(secret, "api-key:" + key)`` (hex), in the keys file or inline in the tenants file.
- The worker's prefix-cache namespace of a tenant is ``HMAC-SHA256(secret, "cache-ns:" + tenant_id)``:
  derived here from the authenticated tenant, never from client input.
- `TenantDirectory` maps a presented key to its tenant, re-reading the tenants and keys files when
  they change on disk (checked at most once per `reload_interval_s` seconds).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml

from fairshare.config import (CONFIG_REJECTED, CONFIG_RELOADED, KeyRecord, KeysFile, TenantConfig, TenantsFile,
                              load_keys, load_tenants, save_keys)

from .errors import APIError, invalid_api_key, missing_api_key

log = logging.getLogger("fairshare.gateway")

KEY_PREFIX = "sk-fs-"


def key_digest(secret: bytes, key: str) -> str:
    """Hex HMAC-SHA256 digest under the server secret of an API key (type prefix ``api-key:``)."""
    return hmac.new(secret, b"api-key:" + key.encode("utf-8"), hashlib.sha256).hexdigest()


def new_key() -> str:
    """A fresh random API key (``sk-fs-`` + 256 bits, url-safe base64)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def create_key(secret: bytes, tenant_id: str, keys_path: str | os.PathLike,
               tenants: TenantsFile | None = None) -> tuple[str, KeyRecord]:
    """Create a key for `tenant_id`, append its digest to the keys file and return (key, record).

    The key itself is returned once and never stored. Raises KeyError when `tenants` is given and has
    no such tenant. Concurrent callers are serialised with an exclusive lock file next to the keys file.
    """
    key = new_key()
    return key, store_key(secret, tenant_id, key, keys_path, tenants)


MIN_IMPORTED_KEY_CHARS = 16
MAX_IMPORTED_KEY_CHARS = 1024


def check_imported_key(key: str) -> str:
    """`key` as it will be stored (surrounding whitespace removed). Raises ValueError unless it is
    one line of 16-1024 printable ASCII characters without spaces (what API keys look like; shorter
    ones are too easy to guess)."""
    key = key.strip()
    if not key:
        raise ValueError("no key given (pipe it on standard input)")
    if any(c.isspace() for c in key) or not key.isascii() or not key.isprintable():
        raise ValueError("a key is one line of printable ASCII without spaces")
    if not MIN_IMPORTED_KEY_CHARS <= len(key) <= MAX_IMPORTED_KEY_CHARS:
        raise ValueError(f"a key has {MIN_IMPORTED_KEY_CHARS}-{MAX_IMPORTED_KEY_CHARS} characters "
                         f"(this one has {len(key)})")
    return key


def store_key(secret: bytes, tenant_id: str, key: str, keys_path: str | os.PathLike,
              tenants: TenantsFile | None = None) -> KeyRecord:
    """Store the digest of `key` for `tenant_id` in the keys file and return its record; the key
    itself is never written. Used for new keys and for existing ones brought from another gateway.

    Raises KeyError when `tenants` is given and has no such tenant, ValueError when the same key is
    already stored (for any tenant). Serialised with an exclusive lock file next to the keys file.
    """
    if tenants is not None and tenant_id not in tenants.by_id():
        raise KeyError(f"unknown tenant {tenant_id!r}")
    digest = key_digest(secret, key)
    if tenants is not None and any(digest in t.api_key_digests for t in tenants.tenants):
        raise ValueError("this key is already in the tenants file")
    record = KeyRecord(key_id="key_" + secrets.token_hex(6), tenant=tenant_id, digest=digest,
                       created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    keys_path = Path(keys_path)
    keys_path.parent.mkdir(parents=True, exist_ok=True)
    with open(keys_path.with_name(keys_path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        keys = load_keys(keys_path)
        same = next((k for k in keys.keys if hmac.compare_digest(k.digest, digest)), None)
        if same is not None:
            raise ValueError(f"this key is already stored ({same.key_id}, tenant {same.tenant})")
        keys.keys.append(record)
        save_keys(keys_path, keys)
    return record


def revoke_key(keys_path: str | os.PathLike, key_id: str) -> bool:
    """Remove the key with `key_id` from the keys file; True when one was removed."""
    keys_path = Path(keys_path)
    with open(keys_path.with_name(keys_path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        keys = load_keys(keys_path)
        kept = [k for k in keys.keys if k.key_id != key_id]
        if len(kept) == len(keys.keys):
            return False
        save_keys(keys_path, KeysFile(keys=kept))
    return True


def bearer_key(authorization: str | None) -> str | None:
    """The key in an ``Authorization: Bearer KEY`` header, or None when absent/empty."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    value = value.strip()
    return value or None


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: the tenant the key belongs to. (Prefix-cache namespaces are derived
    by the workers from the tenant id, worker/cache/namespace.py, never by the gateway.)"""

    tenant: TenantConfig


class TenantDirectory:
    """Tenants and key digests, reloaded from disk when the files change.

    `authenticate(authorization_header)` returns a `Principal` or raises `APIError` (401).
    """

    def __init__(self, secret: bytes, tenants_file: str | os.PathLike | None = None,
                 keys_file: str | os.PathLike | None = None, tenants: TenantsFile | None = None,
                 keys: KeysFile | None = None, reload_interval_s: float = 1.0) -> None:
        self._secret = secret
        self._tenants_file = Path(tenants_file) if tenants_file else None
        self._keys_file = Path(keys_file) if keys_file else None
        self._reload_interval_s = reload_interval_s
        self._lock = threading.Lock()
        self._checked_at = 0.0
        self._stamp: tuple = ()
        self._bad_stamp: tuple | None = None  # files as they were when a reload last failed
        self._tenants: dict[str, TenantConfig] = {}
        self._by_digest: dict[str, str] = {}
        if tenants is not None or keys is not None:
            self._install(tenants or TenantsFile(), keys or KeysFile())
        else:
            self.reload()

    # -- loading ---------------------------------------------------------------------------------
    def _file_stamp(self) -> tuple:
        out = []
        for p in (self._tenants_file, self._keys_file):
            try:
                st = p.stat() if p else None
                out.append((st.st_mtime_ns, st.st_size) if st else None)
            except FileNotFoundError:
                out.append(None)
        return tuple(out)

    def _install(self, tenants: TenantsFile, keys: KeysFile) -> None:
        by_id = tenants.by_id()
        by_digest: dict[str, str] = {}
        for t in tenants.tenants:
            for d in t.api_key_digests:
                by_digest[d] = t.id
        for k in keys.keys:
            if k.tenant not in by_id:
                log.warning("key %s names unknown tenant %s; ignored", k.key_id, k.tenant)
                continue
            by_digest[k.digest] = k.tenant
        with self._lock:
            self._tenants = by_id
            self._by_digest = by_digest

    def reload(self) -> None:
        """Re-read the tenants and keys files now. Raises on a malformed file."""
        stamp = self._file_stamp()
        tenants = load_tenants(self._tenants_file) if self._tenants_file else TenantsFile()
        keys = load_keys(self._keys_file) if self._keys_file else KeysFile()
        self._install(tenants, keys)
        self._stamp = stamp
        self._checked_at = time.monotonic()

    def maybe_reload(self) -> None:
        """Reload when a file changed, at most once per reload interval; keeps the old data on errors.
        A malformed file (OSError, ValueError incl. pydantic's ValidationError, yaml.YAMLError) is
        logged as one line, once: it is not read again until the files change."""
        if self._tenants_file is None and self._keys_file is None:
            return
        now = time.monotonic()
        if now - self._checked_at < self._reload_interval_s:
            return
        self._checked_at = now
        stamp = self._file_stamp()
        if stamp in (self._stamp, self._bad_stamp):  # unchanged, or the same broken files as last time
            return
        try:
            self.reload()
            self._bad_stamp = None
            log.info("%s %d tenant(s) from %s", CONFIG_RELOADED, len(self._tenants), self._tenants_file)
        except (OSError, ValueError, yaml.YAMLError) as exc:  # an operator's mistake: one line, once per edit
            self._bad_stamp = stamp
            text = " ".join(str(exc).split())
            log.error("%s could not reload tenants/keys (%s: %s); keeping the previous configuration",
                      CONFIG_REJECTED, type(exc).__name__, text[:500])
        except Exception:  # keep serving with the previous configuration
            self._bad_stamp = stamp
            log.exception("%s could not reload tenants/keys; keeping the previous configuration", CONFIG_REJECTED)

    async def watch(self, interval_s: float | None = None) -> None:
        """Check the files every `interval_s` seconds (default: the reload interval) until cancelled,
        so an edit is applied, or refused with its one log line, without waiting for a request."""
        while True:
            await asyncio.sleep(interval_s or self._reload_interval_s)
            self.maybe_reload()

    # -- queries ---------------------------------------------------------------------------------
    def tenants(self) -> dict[str, TenantConfig]:
        """Current tenants by id."""
        return dict(self._tenants)

    def tenant(self, tenant_id: str) -> TenantConfig | None:
        """The tenant with this id, or None."""
        return self._tenants.get(tenant_id)

    def principal_for(self, tenant_id: str) -> Principal:
        """The principal of a known tenant (raises KeyError otherwise)."""
        return Principal(self._tenants[tenant_id])

    def authenticate(self, authorization: str | None) -> Principal:
        """Map an ``Authorization`` header to its tenant. Raises APIError 401 when missing or unknown."""
        self.maybe_reload()
        key = bearer_key(authorization)
        if key is None:
            raise missing_api_key()
        digest = key_digest(self._secret, key)
        tenant_id = self._by_digest.get(digest)
        if tenant_id is None or tenant_id not in self._tenants:
            raise invalid_api_key(key)
        return self.principal_for(tenant_id)


__all__ = ["APIError", "Principal", "TenantDirectory", "bearer_key", "check_imported_key",
           "create_key", "key_digest", "new_key", "revoke_key", "store_key"]
