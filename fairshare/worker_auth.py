"""Worker authentication: the gateway signs every Generate/Abort call; workers accept nothing else.

Both tiers import this module (no torch): the gateway signs (`Signer`), the reference worker
(worker/server.py) and the SGLang worker (worker/sglang_server.py) verify (`Verifier`).

**The token** travels in the call's gRPC metadata under ``fairshare-auth`` (`METADATA_KEY`)::

    fs1.<key id>.<expiry>.<mac>

- ``expiry``: Unix time (whole seconds) after which the token is refused; the gateway signs each
  call just before it makes it, valid for ``ttl_s`` seconds (default 60): long enough for a call to
  reach the worker across clock skew, short enough that a captured token is soon worthless.
- ``mac``: base64url (unpadded) of HMAC-SHA256(key, message) over the call's identity (`Claims`):
  the method (``Generate`` or ``Abort``), key id, expiry, request id, tenant id, tier, weight and
  the client's namespace salt (``cache_salt``), one per line. A token therefore names one request
  of one tenant with one share: changing any of them in the request (another tenant, a bigger
  weight, a higher tier, someone else's cache namespace) breaks the MAC.

**Replay**: a token is single-use. The worker remembers each (method, request id) it accepted until
the token's expiry and refuses the same pair again, so a captured call cannot be sent twice, and a
token cannot outlive the memory (expiries more than ``max_ttl_s`` ahead are refused).

**Keys** (`WorkerKeys`): ``kid:secret`` entries (comma- or newline-separated; ``#`` comments), from
``FAIRSHARE_WORKER_KEYS`` or a file (``FAIRSHARE_WORKER_KEYS_FILE`` / ``--worker-keys-file``, e.g. a
mounted Kubernetes Secret). The first entry signs; every entry is accepted. A file is re-read when it
changes (checked at most once a second), so keys rotate without downtime: (1) append the new key on
every worker and gateway (both accepted), (2) move it first (gateways sign with it), (3) once the old
tokens have expired (``ttl_s``), remove the old key (`edit_keys_file`, ``fairshare keys worker``).
Secrets must be at least 16 bytes.

**Refusals** are gRPC ``UNAUTHENTICATED`` with one of `REASONS` (missing, malformed, unknown_key,
bad_signature, expired, replayed), counted per reason by the `Verifier` (each worker exports the
counts as ``fairshare_worker_auth_failures_total{reason}``). ``GetLoad``, ``GetModelInfo`` and
``grpc.health.v1`` are not authenticated: they carry no tenant data beyond load figures and are for
the gateway's polls and the metrics network (docs/reliability.md).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import heapq
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

METADATA_KEY = "fairshare-auth"
KEYS_ENV = "FAIRSHARE_WORKER_KEYS"
KEYS_FILE_ENV = "FAIRSHARE_WORKER_KEYS_FILE"
VERSION = "fs1"
DEFAULT_TTL_S = 60.0
MAX_TTL_S = 600.0
MIN_SECRET_BYTES = 16
REASONS = ("missing", "malformed", "unknown_key", "bad_signature", "expired", "replayed")
_KID = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


class AuthError(Exception):
    """A call that is not the gateway's. `reason`: one of `REASONS`; the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class KeysError(ValueError):
    """A keys value or file that cannot be used (raised at start-up, never per call)."""


# ---- keys -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerKeys:
    """The key ring: (kid, secret bytes) pairs, the first one signing. Parse with `parse`."""

    entries: tuple[tuple[str, bytes], ...]

    @classmethod
    def parse(cls, text: str, where: str = "worker keys") -> "WorkerKeys":
        """Parse ``kid:secret`` entries (comma- or newline-separated, ``#`` comments, blank lines
        ignored; ``kid=secret`` also accepted). Raises KeysError for no entry, a bad or duplicate key id
        or a secret under 16 bytes."""
        entries: list[tuple[str, bytes]] = []
        items = [part for line in text.splitlines() for part in line.split("#", 1)[0].split(",")]
        for raw in items:
            item = raw.strip()
            if not item:
                continue
            m = re.match(r"^([^:=\s]+)\s*[:=]\s*(\S+)$", item)
            if m is None:
                raise KeysError(f"{where}: {item[:12]!r}... is not KID:SECRET")
            kid, secret = m.group(1), m.group(2).encode("utf-8")
            if not _KID.match(kid):
                raise KeysError(f"{where}: key id {kid!r} must be 1-32 of [A-Za-z0-9_-]")
            if len(secret) < MIN_SECRET_BYTES:
                raise KeysError(f"{where}: the secret of key {kid!r} is shorter than {MIN_SECRET_BYTES} bytes")
            if any(k == kid for k, _ in entries):
                raise KeysError(f"{where}: key id {kid!r} given twice")
            entries.append((kid, secret))
        if not entries:
            raise KeysError(f"{where}: no key (expected KID:SECRET entries)")
        return cls(tuple(entries))

    @property
    def signing(self) -> tuple[str, bytes]:
        """(kid, secret) that signs."""
        return self.entries[0]

    def get(self, kid: str) -> bytes | None:
        return next((s for k, s in self.entries if k == kid), None)

    @property
    def ids(self) -> list[str]:
        return [k for k, _ in self.entries]


def new_key_text(kid: str | None = None) -> str:
    """A fresh ``kid:secret`` line (secret: 32 random bytes, hex)."""
    import secrets

    return f"{kid or 'k' + time.strftime('%Y%m%d')}:{secrets.token_hex(32)}\n"


def ensure_keys_file(path: str | os.PathLike) -> Path:
    """Create `path` with one fresh key (mode 0600) unless it exists; returns the path."""
    from fairshare.config import create_private_file

    p = Path(path)
    create_private_file(p, "# FairShare worker-auth keys (fairshare/worker_auth.py): KID:SECRET; the first signs\n"
                        + new_key_text())
    return p


def edit_keys_file(path: str | os.PathLike, *, add: bool = False, promote: str | None = None,
                   remove: str | None = None) -> WorkerKeys:
    """One rotation step on a keys file (created with one key when missing), written atomically, mode
    0600: `add` appends a fresh key (accepted, not signing yet); `promote` moves key id `promote`
    first (it signs); `remove` drops key id `remove` (refused from then on). Returns the new ring.
    Raises KeysError for an unknown key id or removing the last key."""
    import tempfile

    p = ensure_keys_file(path)
    keys = WorkerKeys.parse(p.read_text(encoding="utf-8"), str(p))
    entries = list(keys.entries)
    if add:
        kid = "k" + time.strftime("%Y%m%d%H%M%S")
        while any(k == kid for k, _ in entries):
            kid += "b"
        entries.append(WorkerKeys.parse(new_key_text(kid)).entries[0])
    for wanted in (promote, remove):
        if wanted is not None and not any(k == wanted for k, _ in entries):
            raise KeysError(f"{p}: no key {wanted!r} (keys: {', '.join(k for k, _ in entries)})")
    if promote is not None:
        entries.sort(key=lambda e: e[0] != promote)
    if remove is not None:
        if len(entries) == 1:
            raise KeysError(f"{p}: {remove!r} is the only key; add another first")
        entries = [e for e in entries if e[0] != remove]
    text = "# FairShare worker-auth keys (fairshare/worker_auth.py): KID:SECRET; the first signs\n" + "".join(
        f"{k}:{v.decode()}\n" for k, v in entries)
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", dir=p.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, p)
    return WorkerKeys(tuple(entries))


class KeySource:
    """Where the keys come from: a literal value, or a file re-read when it changes.

    value: ``kid:secret`` text (e.g. ``$FAIRSHARE_WORKER_KEYS``). path: a keys file. One of them.
    `keys()` returns the current `WorkerKeys`; a file edited into something unreadable keeps the
    previous keys (and `last_error` says why). Raises KeysError at construction when the initial
    keys cannot be read.
    """

    def __init__(self, value: str | None = None, path: str | os.PathLike | None = None,
                 recheck_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if (value is None) == (path is None):
            raise KeysError("give worker keys either as a value or as a file")
        self.path = Path(path) if path is not None else None
        self.recheck_s = recheck_s
        self.clock = clock
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._checked = clock()
        if self.path is not None:
            self._stamp = self._file_stamp()
            self._keys = WorkerKeys.parse(self._read(), str(self.path))
        else:
            self._stamp = None
            self._keys = WorkerKeys.parse(value or "", KEYS_ENV)

    @classmethod
    def from_settings(cls, value: str | None = None, path: str | os.PathLike | None = None,
                      environ=None) -> "KeySource | None":
        """The source named by a flag value / file, else by ``FAIRSHARE_WORKER_KEYS_FILE`` or
        ``FAIRSHARE_WORKER_KEYS`` in `environ` (default os.environ); None when nothing is set."""
        env = os.environ if environ is None else environ
        if path:
            return cls(path=path)
        if value:
            return cls(value=value)
        if env.get(KEYS_FILE_ENV):
            return cls(path=env[KEYS_FILE_ENV])
        if env.get(KEYS_ENV):
            return cls(value=env[KEYS_ENV])
        return None

    def _read(self) -> str:
        try:
            return self.path.read_text(encoding="utf-8")
        except OSError as e:
            raise KeysError(f"cannot read worker keys file {self.path}: {e.strerror or e}") from None

    def _file_stamp(self):
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def keys(self) -> WorkerKeys:
        """The current key ring (re-reading a changed file at most every `recheck_s` seconds)."""
        if self.path is None:
            return self._keys
        now = self.clock()
        if now - self._checked < self.recheck_s:
            return self._keys
        with self._lock:
            self._checked = now
            stamp = self._file_stamp()
            if stamp is not None and stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._keys = WorkerKeys.parse(self._read(), str(self.path))
                    self.last_error = None
                except KeysError as e:  # keep serving with the previous keys
                    self.last_error = str(e)
        return self._keys


# ---- claims and tokens ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Claims:
    """The identity a token is bound to. method: ``Generate`` or ``Abort``. tier: the wire enum value
    (`fairshare.v1.Tier`); weight: the request's weight exactly as sent; salt: its ``cache_salt``."""

    method: str
    request_id: str
    tenant: str = ""
    tier: int = 0
    weight: float = 0.0
    salt: str = ""

    def message(self, kid: str, expiry: int) -> bytes:
        return "\n".join((VERSION, self.method, kid, str(expiry), self.request_id, self.tenant, str(int(self.tier)),
                          repr(float(self.weight)), self.salt)).encode("utf-8")


def generate_claims(request) -> Claims:
    """The claims of a `fairshare.v1.GenerateRequest` (duck-typed: request_id, tenant, cache_salt)."""
    t = request.tenant
    return Claims("Generate", request.request_id, t.id, int(t.tier), float(t.weight), request.cache_salt)


def abort_claims(request) -> Claims:
    """The claims of a `fairshare.v1.AbortRequest`: only its request id."""
    return Claims("Abort", request.request_id)


def _mac(secret: bytes, message: bytes) -> str:
    # hmac.digest: the one-shot C path (no HMAC object per call); the same bytes as hmac.new(...).digest()
    return base64.urlsafe_b64encode(hmac.digest(secret, message, "sha256")).decode().rstrip("=")


class Signer:
    """Signs calls with the signing key of `source` (`KeySource` or `WorkerKeys`).

    ttl_s: how long a token stays valid (seconds, default 60). clock: Unix time (default time.time).
    """

    def __init__(self, source: "KeySource | WorkerKeys", ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"worker token TTL must be in (0, {MAX_TTL_S:g}] s, got {ttl_s}")
        self.source = source
        self.ttl_s = ttl_s
        self.clock = clock

    def _keys(self) -> WorkerKeys:
        return self.source.keys() if isinstance(self.source, KeySource) else self.source

    def token(self, claims: Claims, expiry: int | None = None) -> str:
        """The token for `claims`, valid until `expiry` (Unix seconds; default now + ttl_s)."""
        kid, secret = self._keys().signing
        exp = int(self.clock() + self.ttl_s) if expiry is None else int(expiry)
        return f"{VERSION}.{kid}.{exp}.{_mac(secret, claims.message(kid, exp))}"

    def metadata(self, claims: Claims) -> tuple[tuple[str, str], ...]:
        """gRPC metadata carrying the token for `claims`."""
        return ((METADATA_KEY, self.token(claims)),)


def token_of(metadata: Iterable | None) -> str | None:
    """The token in a call's invocation metadata (pairs or objects with key/value), or None."""
    for item in metadata or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == METADATA_KEY:
            return value.decode("ascii", "replace") if isinstance(value, bytes) else value
    return None


class Verifier:
    """Checks tokens against the keys of `source` and remembers accepted (method, request id) pairs
    until their expiry (replay protection). Thread-safe.

    max_ttl_s: tokens expiring further ahead than this (plus `skew_s`) are refused as malformed.
    skew_s: seconds of clock skew tolerated past a token's expiry. clock: Unix time.
    `failures`: refusals counted per reason (`REASONS`).
    """

    def __init__(self, source: "KeySource | WorkerKeys", max_ttl_s: float = MAX_TTL_S, skew_s: float = 5.0,
                 clock: Callable[[], float] = time.time, max_remembered: int = 2_000_000) -> None:
        self.source = source
        self.max_ttl_s = max_ttl_s
        self.skew_s = skew_s
        self.clock = clock
        self.max_remembered = max_remembered
        self.failures: dict[str, int] = {r: 0 for r in REASONS}
        self.accepted = 0
        self._used: dict[tuple[str, str], int] = {}
        self._expiries: list[tuple[int, str, str]] = []  # heap of (expiry, method, request id)
        self._lock = threading.Lock()

    def _keys(self) -> WorkerKeys:
        return self.source.keys() if isinstance(self.source, KeySource) else self.source

    def _refuse(self, reason: str, message: str) -> AuthError:
        with self._lock:
            self.failures[reason] += 1
        return AuthError(reason, message)

    def check(self, token: str | None, claims: Claims) -> None:
        """Accept the call or raise AuthError (missing, malformed, unknown_key, bad_signature, expired,
        replayed). An accepted (method, request id) is refused from then until its token's expiry."""
        if not token:
            raise self._refuse("missing", f"{claims.method} needs the gateway's token (metadata {METADATA_KEY!r})")
        parts = token.split(".")
        if len(parts) != 4 or parts[0] != VERSION or not parts[2].isdigit() or not claims.request_id:
            raise self._refuse("malformed", "malformed worker token (or no request id)")
        _, kid, exp_text, mac = parts
        secret = self._keys().get(kid)
        if secret is None:
            raise self._refuse("unknown_key", f"unknown worker key id {kid[:32]!r}")
        expiry = int(exp_text)
        if not hmac.compare_digest(_mac(secret, claims.message(kid, expiry)), mac):
            raise self._refuse("bad_signature", "the worker token does not match this request")
        now = self.clock()
        if now > expiry + self.skew_s:
            raise self._refuse("expired", f"the worker token expired {now - expiry:.0f} s ago")
        if expiry > now + self.max_ttl_s + self.skew_s:
            raise self._refuse("malformed", f"the worker token expires more than {self.max_ttl_s:g} s ahead")
        key = (claims.method, claims.request_id)
        with self._lock:
            self._forget(now)
            if key in self._used:
                self.failures["replayed"] += 1
                raise AuthError("replayed", f"this {claims.method} token was already used (request id "
                                            f"{claims.request_id[:64]!r})")
            if len(self._used) >= self.max_remembered:
                self.failures["replayed"] += 1  # fail closed rather than forget a token still valid
                raise AuthError("replayed", "too many live tokens to remember; retry shortly")
            self._used[key] = expiry
            heapq.heappush(self._expiries, (expiry, *key))
            self.accepted += 1

    def _forget(self, now: float) -> None:
        limit = now - self.skew_s
        while self._expiries and self._expiries[0][0] < limit:
            expiry, method, rid = heapq.heappop(self._expiries)
            if self._used.get((method, rid)) == expiry:
                del self._used[(method, rid)]

    @property
    def remembered(self) -> int:
        """(method, request id) pairs remembered now."""
        return len(self._used)


async def require(verifier: Verifier | None, claims: Claims, context, on_refused=None) -> None:
    """In a grpc.aio handler: return if the call's token verifies (or `verifier` is None: auth off),
    else abort the call with UNAUTHENTICATED. on_refused(reason) is called before aborting."""
    if verifier is None:
        return
    try:
        verifier.check(token_of(context.invocation_metadata()), claims)
    except AuthError as e:
        if on_refused is not None:
            on_refused(e.reason)
        import grpc

        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))


__all__ = ["AuthError", "Claims", "KeySource", "KeysError", "METADATA_KEY", "REASONS", "Signer", "Verifier",
           "WorkerKeys", "abort_claims", "edit_keys_file", "ensure_keys_file", "generate_claims", "new_key_text",
           "require", "token_of"]
