"""Tenant configuration shared by both tiers: the tenants YAML file and the API-keys file.

Tenants file (YAML, e.g. ``tenants.yaml``)::

    tenants:
      - id: acme                  # [A-Za-z0-9._-], 1..64 chars; used in Redis keys and metrics
        weight: 2.0               # > 0; the worker's VTC divides charged service by it
        tier: interactive         # interactive | batch | background
        limits:                   # every limit is optional; absent or null = unlimited
          rpm: 600                # requests per minute (token bucket, continuous refill)
          tpm: 200000             # tokens per minute (bucket; reserves prompt + max_tokens)
          max_inflight_tokens: 32768      # sum of prompt + max_tokens over running requests
          max_concurrent_requests: 16
        models: ["*"]             # model names it may use, or "*" (default: all); alias allowed_models
        request_timeout_s: 120    # optional: this tenant's deadline per request (default: its tier's)
        default_max_tokens: 512   # optional: output tokens of a chat completion without max_tokens
                                  # (or per model: {SmolLM2-135M-Instruct: 256, "*": 512})
        api_key_digests: []       # optional inline HMAC-SHA256 digests (hex); usually in the keys file
      - id: nightly
        weight: 0.5
        tier: background
        limits: {tpm: 50000}

A mapping form (``tenants: {acme: {weight: 2}}``) is accepted too.

Keys file (YAML, default ``<tenants stem>.keys.yaml`` next to the tenants file), written by
``fairshare keys create``; it holds digests only, never a key::

    keys:
      - key_id: key_3f9a1c2b7d4e
        tenant: acme
        digest: 5b1d...       # hex HMAC-SHA256(secret, "api-key:" + key)
        created: "2026-11-29T22:00:00+00:00"
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fairshare.tiers import Tier  # noqa: F401 (re-exported: the tenant schema's tier type)

TENANT_ID_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"


class TenantLimits(BaseModel):
    """Per-tenant admission limits enforced by the gateway. ``None`` means unlimited.

    - ``rpm``: requests per minute (token bucket of capacity ``rpm``, refilled at ``rpm/60`` per second).
    - ``tpm``: tokens per minute (capacity ``tpm`` tokens, refilled at ``tpm/60`` tokens per second);
      a request reserves ``prompt + max_tokens`` (summed over choices) and is refunded what it did not use.
    - ``max_inflight_tokens``: tokens (prompt + max_tokens) reserved by requests still running.
    - ``max_concurrent_requests``: requests still running.
    """

    model_config = ConfigDict(extra="forbid")

    rpm: int | None = Field(default=None, gt=0)
    tpm: int | None = Field(default=None, gt=0)
    max_inflight_tokens: int | None = Field(default=None, gt=0)
    max_concurrent_requests: int | None = Field(default=None, gt=0)


class TenantConfig(BaseModel):
    """One tenant: identity, share (weight, tier), limits, the models it may use (``models``, also
    spelled ``allowed_models``) and, optionally, its own default output budget for chat completions
    sent without ``max_tokens`` (tokens; one number, or per model name with ``*`` for the rest)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    id: str = Field(pattern=TENANT_ID_PATTERN)
    weight: float = Field(default=1.0, gt=0)
    tier: Tier = Tier.INTERACTIVE
    limits: TenantLimits = Field(default_factory=TenantLimits)
    allowed_models: list[str] = Field(default_factory=lambda: ["*"], alias="models")
    # the deadline of each of its requests, seconds (None: its tier's default; gateway/deadlines.py)
    request_timeout_s: float | None = Field(default=None, gt=0)
    default_max_tokens: int | dict[str, int] | None = None
    api_key_digests: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _one_models_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "models" in data and "allowed_models" in data:
            raise ValueError("give either models or allowed_models (the same list), not both")
        return data

    @field_validator("default_max_tokens")
    @classmethod
    def _positive_defaults(cls, v):
        values = [v] if isinstance(v, int) else list((v or {}).values())
        if any(isinstance(x, bool) or x <= 0 for x in values):
            raise ValueError("default_max_tokens must be > 0")
        return v

    def default_max_tokens_for(self, names: list[str]) -> int | None:
        """This tenant's chat default for a model known by `names` (requested name first), or None."""
        v = self.default_max_tokens
        if v is None or isinstance(v, int):
            return v
        return next((v[n] for n in (*names, "*") if n in v), None)

    @field_validator("api_key_digests")
    @classmethod
    def _hex_digests(cls, v: list[str]) -> list[str]:
        out = []
        for d in v:
            d = d.strip().lower()
            if len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
                raise ValueError("api_key_digests must be 64-character hex HMAC-SHA256 digests")
            out.append(d)
        return out

    def may_use(self, model: str) -> bool:
        """True when this tenant may call `model`."""
        return "*" in self.allowed_models or model in self.allowed_models


class TenantsFile(BaseModel):
    """The tenants YAML file: a list (or mapping by id) of tenants with unique ids."""

    model_config = ConfigDict(extra="forbid")

    tenants: list[TenantConfig] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _mapping_form(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("tenants"), dict):
            data = dict(data)
            data["tenants"] = [{"id": k, **(v or {})} for k, v in data["tenants"].items()]
        return data

    @model_validator(mode="after")
    def _unique_ids(self) -> "TenantsFile":
        seen: set[str] = set()
        for t in self.tenants:
            if t.id in seen:
                raise ValueError(f"duplicate tenant id {t.id!r}")
            seen.add(t.id)
        return self

    def by_id(self) -> dict[str, TenantConfig]:
        """Tenants keyed by id."""
        return {t.id: t for t in self.tenants}


class KeyRecord(BaseModel):
    """One API key as stored: its id, tenant and HMAC-SHA256 digest (never the key)."""

    model_config = ConfigDict(extra="forbid")

    key_id: str
    tenant: str = Field(pattern=TENANT_ID_PATTERN)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    created: str = ""


class KeysFile(BaseModel):
    """The keys YAML file written by `fairshare keys create`."""

    model_config = ConfigDict(extra="forbid")

    keys: list[KeyRecord] = Field(default_factory=list)


# Markers that begin the gateway's log line about a reload of the tenants/keys files (gateway/auth.py);
# `fairshare up` forwards such lines to its terminal as one-line notices (fairshare/cli/supervisor.py).
CONFIG_RELOADED = "config reloaded:"
CONFIG_REJECTED = "config rejected:"


def default_state_dir() -> Path:
    """Where `fairshare up` keeps its state (tenants.yaml, tenants.keys.yaml, secret, logs):
    ``$FAIRSHARE_STATE_DIR``; else ``./var`` in a source checkout; else ``~/.local/state/fairshare``
    (``$XDG_STATE_HOME/fairshare``)."""
    env = os.environ.get("FAIRSHARE_STATE_DIR")
    if env:
        return Path(env).expanduser()
    cwd = Path.cwd()
    if (cwd / "pyproject.toml").is_file() and (cwd / "fairshare").is_dir():
        return cwd / "var"
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
    return base / "fairshare"


def load_tenants(path: str | os.PathLike) -> TenantsFile:
    """Read and validate a tenants YAML file.

    A file with no document (empty, blank or comments only: what a reader sees while an editor or a
    truncating write is half done) or without a ``tenants:`` key is refused, never read as zero
    tenants: that would lock every tenant out. ``tenants: []`` says "no tenants" on purpose.

    Raises FileNotFoundError, yaml.YAMLError, ValueError (no document / no ``tenants:`` key) or
    pydantic.ValidationError (a ValueError too).
    """
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if data is None:
        raise ValueError(f"tenants file {path} is empty (no YAML document); expected `tenants:`")
    if not isinstance(data, dict) or "tenants" not in data:
        raise ValueError(f"tenants file {path} has no `tenants:` key")
    return TenantsFile.model_validate(data)


def default_keys_path(tenants_path: str | os.PathLike) -> Path:
    """Default keys file for a tenants file: ``<dir>/<stem>.keys.yaml`` (tenants.yaml -> tenants.keys.yaml)."""
    p = Path(tenants_path)
    return p.with_name(p.stem + ".keys.yaml")


def load_keys(path: str | os.PathLike) -> KeysFile:
    """Read a keys file; a missing file is an empty one. Raises on malformed content."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        return KeysFile()
    return KeysFile.model_validate(data)


def create_private_file(path: str | os.PathLike, text: str) -> bool:
    """Create `path` (and its directory) holding `text`, mode 0600, unless it exists; never overwrites
    (another process creating it meanwhile wins). Returns whether this call created it."""
    p = Path(path)
    if p.exists():
        return False
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def save_keys(path: str | os.PathLike, keys: KeysFile) -> None:
    """Write a keys file atomically (temp file + rename), mode 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yaml.safe_dump(keys.model_dump(mode="json"), f, sort_keys=False)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
