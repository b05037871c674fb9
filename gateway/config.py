"""Gateway settings, read from environment variables ``FAIRSHARE_*`` (pydantic-settings) and flags.

See `gateway.cli` for the flags; every field below is also ``FAIRSHARE_<FIELD>`` in the environment.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from fairshare.config import Tier, create_private_file, default_keys_path

OutagePolicy = Literal["fail_closed", "degrade"]
DEFAULT_TIER_TIMEOUTS_S: dict[Tier, float | None] = {Tier.INTERACTIVE: 600.0, Tier.BATCH: None, Tier.BACKGROUND: None}
# output tokens of a chat completion sent without max_tokens, when no default is declared for it
CHAT_DEFAULT_MAX_TOKENS = 1024
# output tokens of a text completion sent without max_tokens (OpenAI's documented default)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _model_table(v, cast):
    """Parse a per-model table: a mapping, JSON text, ``MODEL=VALUE,...`` or one value for every
    model (stored under ``*``)."""
    if isinstance(v, (int, str)) and not isinstance(v, bool):
        text = str(v).strip()
        if not text:
            return {}
        if text.startswith("{"):
            import json

            return json.loads(text)
        if "=" not in text:
            return {"*": cast(text)}
        out = {}
        for part in text.split(","):
            if part.strip():
                k, _, val = part.partition("=")
                out[k.strip()] = cast(val.strip())
        return out
    return v


class GatewaySettings(BaseSettings):
    """Everything the gateway process needs to start.

    Durations are in seconds. ``secret`` (or the contents of ``secret_file``) keys the API-key digests
    and the per-tenant cache namespaces; it must be the same on every gateway replica.
    """

    model_config = SettingsConfigDict(env_prefix="FAIRSHARE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    tenants_file: Path | None = None
    keys_file: Path | None = None
    # worker entries: host:port, dns:///name:port (every A/AAAA record), file:///path (re-read);
    # gateway/discovery.py
    workers: Annotated[list[str], NoDecode] = Field(default_factory=list)
    discovery_interval_s: float = Field(default=5.0, gt=0)  # re-resolve dns/file entries this often
    unhealthy_after: int = Field(default=3, ge=1)  # late health polls in a row before a SERVING worker leaves
    # HTTP/2 ping on each worker's connection every this many seconds; a worker that does not answer one
    # within as many seconds is gone (stopped, or its node cut off): its connection is closed, failing
    # what runs on it as a broken connection does. 0: no pings (a silent worker holds its requests
    # until their deadlines). The workers accept pings this often (worker/grpc_server.py).
    worker_keepalive_s: float = Field(default=10.0, ge=0)
    # routing (gateway/routing_policy.py): least-loaded, prefix (namespace + prompt head affinity with a
    # load bound) or fair (prefix + spill by pool-wide deficit of tenants queued at home)
    routing: Literal["least-loaded", "prefix", "fair"] = "fair"
    route_prefix_tokens: int = Field(default=32, ge=0)  # prompt tokens in the route key
    route_load_factor: float = Field(default=1.25, ge=1.0)  # bound: factor x mean load + slack
    route_slack_tokens: int = Field(default=4096, ge=0)
    route_spill_units: float = Field(default=0.0, ge=0)  # fair: counter margin (weighted units) to be first in line
    pool_board_interval_s: float = Field(default=0.1, gt=0)  # read the workers' pool board this often
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = False
    secret: SecretStr | None = None
    secret_file: Path | None = None
    tokenizer: Path | None = None
    lease_ttl_s: float = Field(default=15.0, gt=0)
    health_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=1.0, gt=0)
    max_n: int = Field(default=16, ge=1, le=128)
    max_choices: int = Field(default=64, ge=1)  # prompts x n in one request
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    body_timeout_s: float = Field(default=30.0, gt=0)  # the whole request body must arrive within this (408)
    # the request line and headers (gateway/http_guard.py): at most this many bytes (431), complete
    # within this many seconds of their first byte or of the connection (408, closed)
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    header_timeout_s: float = Field(default=10.0, gt=0)
    max_retries: int = Field(default=2, ge=0)
    log_level: str = "info"
    key_prefix: str = "fairshare"
    # tracing: none (default), console or otlp (OTEL_EXPORTER_OTLP_ENDPOINT); see fairshare/telemetry.py
    otel_exporter: Literal["none", "console", "otlp"] = "none"
    # -- OpenAI API defaults (docs/api.md) ---------------------------------------------------------
    # Output tokens of a chat completion without max_tokens, per model name ("*": every model; a
    # tenant's own default_max_tokens wins); capped by the context the prompt leaves. Env: one number,
    # "model=N,*=M" or JSON. Unset: CHAT_DEFAULT_MAX_TOKENS. /v1/completions always defaults to 16.
    default_max_tokens: Annotated[dict[str, Annotated[int, Field(gt=0)]], NoDecode] = Field(default_factory=dict)
    # Tool-call format per model name ("*": every model): hermes (default) or none (gateway/tools.py).
    tool_call_parser: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)

    # -- reliability (docs/reliability.md) ---------------------------------------------------------
    # What a tier's requests get while Redis is unreachable: "fail_closed" (503 + retry-after) or
    # "degrade" (admitted against this replica's own in-memory buckets at limit / gateway_replicas).
    # Env: JSON '{"interactive":"degrade","batch":"fail_closed"}', "tier=policy,..." or one policy for
    # every tier. Tiers not named fail closed.
    redis_outage_policy: Annotated[dict[Tier, OutagePolicy], NoDecode] = Field(default_factory=dict)
    # degrade mode divides limits by the live replica count (gateway/replicas.py), never below this floor
    gateway_replicas: int = Field(default=1, ge=1)
    replica_ttl_s: float = Field(default=10.0, gt=0)  # a replica's registration lives this long unrenewed
    redis_timeout_s: float = Field(default=2.0, gt=0)  # socket timeout of every Redis call
    # connections to Redis this replica opens at most; a call finding all of them busy waits for one
    # (up to redis_timeout_s) instead of failing: a burst is back-pressure, never an outage
    redis_max_connections: int = Field(default=256, ge=1)
    redis_probe_interval_s: float = Field(default=0.5, gt=0)  # while Redis is down: PING this often
    drain_timeout_s: float = Field(default=10.0, ge=0)  # SIGTERM: open requests may finish this long
    # Deadlines (gateway/deadlines.py): a request's deadline is its tenant's request_timeout_s (tenants
    # file), else request_timeout_s when set (one deadline for every tier), else its tier's entry of
    # tier_request_timeout_s (default: interactive 600 s; batch and background none). A client may
    # shorten it (x-request-timeout header; the SDK's timeout for non-streamed requests). Env: JSON
    # '{"interactive": 600, "batch": null}', "interactive=600,batch=none" (merged over the defaults).
    request_timeout_s: float | None = Field(default=None, gt=0)
    tier_request_timeout_s: Annotated[dict[Tier, float | None], NoDecode] = Field(
        default_factory=lambda: dict(DEFAULT_TIER_TIMEOUTS_S))
    # Streams: once admitted, the response starts within keepalive_interval_s; while the first token is
    # pending, an SSE comment ": keep-alive" goes out every keepalive_interval_s (gateway/keepalive.py).
    keepalive_interval_s: float = Field(default=15.0, gt=0)
    # Worker authentication (fairshare/worker_auth.py): every Generate/Abort is signed with the first
    # key of worker_keys ("kid:secret,...") or worker_keys_file (re-read when it changes); tokens are
    # valid for worker_token_ttl_s. worker_auth=False sends unsigned calls (only to workers started
    # with --no-worker-auth; unsafe).
    worker_keys: SecretStr | None = None
    worker_keys_file: Path | None = None
    worker_auth: bool = True
    worker_token_ttl_s: float = Field(default=60.0, gt=0, le=600)
    # /metrics: served on an admin listener (metrics_port > 0, on metrics_host), or on the public port
    # to holders of metrics_token; public_metrics=True serves it to anyone on the public port (every
    # tenant's figures: only for a public port that tenants cannot reach).
    metrics_port: int = Field(default=0, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    metrics_token: SecretStr | None = None
    metrics_token_file: Path | None = None
    public_metrics: bool = False

    @field_validator("redis_outage_policy", mode="before")
    @classmethod
    def _parse_outage_policy(cls, v):
        if isinstance(v, str):
            text = v.strip()
            if not text:
                return {}
            if text.startswith("{"):
                import json

                return json.loads(text)
            if "=" not in text and ":" not in text:  # one policy for every tier
                return {t.value: text for t in Tier}
            out = {}
            for part in text.split(","):
                if part.strip():
                    k, _, val = part.replace(":", "=").partition("=")
                    out[k.strip()] = val.strip()
            return out
        return v

    @field_validator("tier_request_timeout_s", mode="before")
    @classmethod
    def _parse_tier_timeouts(cls, v):
        if isinstance(v, str):
            text = v.strip()
            if text.startswith("{"):
                import json

                v = json.loads(text)
            else:
                v = {}
                for part in text.split(","):
                    if part.strip():
                        k, _, val = part.replace(":", "=").partition("=")
                        v[k.strip()] = val.strip()
        if isinstance(v, dict):
            out = {t.value: d for t, d in DEFAULT_TIER_TIMEOUTS_S.items()}
            for k, val in v.items():
                if isinstance(val, str) and val.strip().lower() in ("", "none", "null", "0"):
                    val = None
                if val is not None and not float(val) > 0:
                    raise ValueError(f"tier_request_timeout_s: {k}={val} is not > 0 (none: no deadline)")
                out[Tier(k).value] = None if val is None else float(val)
            return out
        return v

    def worker_signer(self):
        """The `fairshare.worker_auth.Signer` of the worker keys, or None when ``worker_auth`` is off.
        Raises RuntimeError when authentication is on and no keys are configured or readable."""
        from fairshare import worker_auth

        if not self.worker_auth:
            return None
        value = self.worker_keys.get_secret_value() if self.worker_keys is not None else None
        try:
            source = worker_auth.KeySource.from_settings(value=value, path=self.worker_keys_file, environ={})
        except worker_auth.KeysError as e:
            raise RuntimeError(str(e)) from None
        if source is None:
            raise RuntimeError("no worker-auth keys: set FAIRSHARE_WORKER_KEYS_FILE (--worker-keys-file) or "
                               "FAIRSHARE_WORKER_KEYS, the keys the workers verify with (docs/reliability.md); "
                               "--no-worker-auth sends unsigned calls (unsafe)")
        return worker_auth.Signer(source, ttl_s=self.worker_token_ttl_s)
    @field_validator("default_max_tokens", mode="before")
    @classmethod
    def _parse_default_max_tokens(cls, v):
        return _model_table(v, int)

    @field_validator("tool_call_parser", mode="before")
    @classmethod
    def _parse_tool_call_parser(cls, v):
        return _model_table(v, str)

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parsers(cls, v):
        from .tools import PARSERS

        for model, name in v.items():
            if name not in PARSERS:
                raise ValueError(f"tool_call_parser for {model!r}: unknown parser {name!r} "
                                 f"(known: {', '.join(sorted(PARSERS))})")
        return v

    def chat_default_max_tokens(self, names: list[str]) -> int:
        """The declared chat default for a model known by `names` (the requested name first), else
        ``*``'s, else CHAT_DEFAULT_MAX_TOKENS."""
        return next((self.default_max_tokens[n] for n in (*names, "*") if n in self.default_max_tokens),
                    CHAT_DEFAULT_MAX_TOKENS)

    def tool_parser_name(self, names: list[str]) -> str:
        """The tool-call parser of a model known by `names` (default ``hermes``)."""
        return next((self.tool_call_parser[n] for n in (*names, "*") if n in self.tool_call_parser), "hermes")

    @model_validator(mode="after")
    def _metrics_port_differs(self):
        if self.metrics_port and self.metrics_port == self.port and self.metrics_host == self.host:
            raise ValueError("metrics_port must differ from the API port")
        return self

    def metrics_token_value(self) -> str:
        """The metrics token (``metrics_token``, else the contents of ``metrics_token_file``), or ""."""
        if self.metrics_token is not None and self.metrics_token.get_secret_value():
            return self.metrics_token.get_secret_value()
        if self.metrics_token_file is not None:
            return Path(self.metrics_token_file).read_text(encoding="utf-8").strip()
        return ""

    def outage_policy(self, tier: Tier | str) -> str:
        """``fail_closed`` or ``degrade``: what `tier` gets while Redis is unreachable."""
        return self.redis_outage_policy.get(Tier(tier), "fail_closed")

    def routing_options(self) -> dict:
        """`gateway.routing_policy.make_routing` options from these settings."""
        return {"prefix_tokens": self.route_prefix_tokens, "load_factor": self.route_load_factor,
                "slack_tokens": self.route_slack_tokens, "spill_units": self.route_spill_units}

    @field_validator("otel_exporter", mode="before")
    @classmethod
    def _lower_exporter(cls, v):
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("workers", mode="before")
    @classmethod
    def _split_workers(cls, v):
        if isinstance(v, str):
            if v.strip().startswith("["):
                import json

                return json.loads(v)
            return [w.strip() for w in v.split(",") if w.strip()]
        return v

    @field_validator("workers", mode="after")
    @classmethod
    def _check_workers(cls, v):
        from .discovery import parse_sources

        parse_sources(v)  # ValueError names the malformed entry
        return v

    def resolved_keys_file(self) -> Path | None:
        """The keys file: ``keys_file`` if set, else the default next to ``tenants_file``."""
        if self.keys_file is not None:
            return self.keys_file
        if self.tenants_file is not None:
            return default_keys_path(self.tenants_file)
        return None

    def secret_bytes(self) -> bytes:
        """The server secret as bytes. Raises RuntimeError when neither secret nor secret_file is set."""
        if self.secret is not None and self.secret.get_secret_value():
            return self.secret.get_secret_value().encode()
        if self.secret_file is not None:
            data = Path(self.secret_file).read_text(encoding="utf-8").strip()
            if not data:
                raise RuntimeError(f"secret file {self.secret_file} is empty")
            return data.encode()
        raise RuntimeError("no server secret: set FAIRSHARE_SECRET or FAIRSHARE_SECRET_FILE (--secret-file)")


def ensure_secret_file(path: str | os.PathLike) -> bytes:
    """Return the secret stored in `path`, creating it (32 random bytes as hex, mode 0600) if absent."""
    p = Path(path)
    create_private_file(p, secrets.token_hex(32) + "\n")
    data = p.read_text(encoding="utf-8").strip()
    if not data:
        raise RuntimeError(f"secret file {p} is empty")
    return data.encode()
