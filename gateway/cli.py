"""`fairshare gateway` and `fairshare keys`: command line of the OpenAI-compatible gateway.

Gateway
-------
::

    fairshare gateway [--host 127.0.0.1] [--port 8000]
                      [--tenants FILE]                  # tenants YAML (see fairshare/config.py)
                      [--workers ENTRY[,ENTRY]]         # gRPC workers: host:port, dns:///name:port (all
                                                        # its A/AAAA records, re-resolved), file:///path
                      [--discovery-interval-s 5] [--unhealthy-after 3] [--worker-keepalive-s 10]
                      [--routing fair|prefix|least-loaded] [--route-prefix-tokens 32]
                      [--route-load-factor 1.25] [--route-slack-tokens 4096] [--route-spill-units 0]
                      [--redis-url redis://127.0.0.1:6379/0] [--redis-cluster]
                      [--secret-file FILE]              # server secret (alternative: FAIRSHARE_SECRET)
                      [--keys-file FILE]                # default: <tenants stem>.keys.yaml next to FILE
                      [--tokenizer DIR]                 # optional local tokenizer.json (+ chat template);
                                                        # default: taken from the worker (GetModelInfo)
                      [--lease-ttl-s 15] [--log-level info]
                      [--otel-exporter none|console|otlp] # traces (default none; OTLP endpoint from
                                                          # OTEL_EXPORTER_OTLP_ENDPOINT)
                      [--redis-outage-policy POLICY]    # per tier while Redis is down: fail_closed (503)
                                                        # or degrade (local buckets at limit/replicas);
                                                        # '{"interactive":"degrade"}', 'batch=degrade,...'
                                                        # or one policy for all (default fail_closed)
                      [--replicas 1]                    # floor of the live replica count that degraded
                                                        # buckets divide by (replicas register in Redis)
                      [--replica-ttl-s 10]
                      [--redis-timeout-s 2] [--drain-timeout-s 10] [--request-timeout-s S]
                      [--tier-request-timeout-s interactive=600,batch=none] [--keepalive-interval-s 15]
                      [--worker-keys-file FILE] [--worker-token-ttl-s 60] [--no-worker-auth]
                      [--max-body-bytes 8388608] [--body-timeout-s 30]
                      [--metrics-port 0] [--metrics-host 127.0.0.1]  # /metrics on an admin listener
                      [--metrics-token-file FILE] [--public-metrics]
                      [--default-max-tokens N | 'MODEL=N,*=M']  # chat output budget without max_tokens
                                                        # (default 1024; completions: 16; docs/api.md)
                      [--tool-call-parser hermes|none | 'MODEL=hermes,*=none']  # tool-call format

Every flag has an environment variable read with pydantic-settings (flags win over env):
``FAIRSHARE_HOST``, ``FAIRSHARE_PORT``, ``FAIRSHARE_TENANTS_FILE``, ``FAIRSHARE_WORKERS``
(comma-separated), ``FAIRSHARE_REDIS_URL``, ``FAIRSHARE_REDIS_CLUSTER`` (true/false),
``FAIRSHARE_SECRET`` (the secret itself),
``FAIRSHARE_SECRET_FILE``, ``FAIRSHARE_KEYS_FILE``, ``FAIRSHARE_TOKENIZER``,
``FAIRSHARE_LEASE_TTL_S``, ``FAIRSHARE_LOG_LEVEL``, ``FAIRSHARE_OTEL_EXPORTER``,
``FAIRSHARE_REDIS_OUTAGE_POLICY``, ``FAIRSHARE_GATEWAY_REPLICAS``, ``FAIRSHARE_REPLICA_TTL_S``,
``FAIRSHARE_DISCOVERY_INTERVAL_S``, ``FAIRSHARE_HEALTH_FAILURES``, ``FAIRSHARE_ROUTING``,
``FAIRSHARE_ROUTE_PREFIX_TOKENS``, ``FAIRSHARE_ROUTE_LOAD_FACTOR``, ``FAIRSHARE_ROUTE_SLACK_TOKENS``,
``FAIRSHARE_ROUTE_SPILL_UNITS``, ``FAIRSHARE_REDIS_TIMEOUT_S``,
``FAIRSHARE_DRAIN_TIMEOUT_S``, ``FAIRSHARE_REQUEST_TIMEOUT_S``, ``FAIRSHARE_MAX_BODY_BYTES``,
``FAIRSHARE_BODY_TIMEOUT_S``,
``FAIRSHARE_METRICS_PORT``, ``FAIRSHARE_METRICS_HOST``, ``FAIRSHARE_METRICS_TOKEN`` (the token itself),
``FAIRSHARE_METRICS_TOKEN_FILE``, ``FAIRSHARE_PUBLIC_METRICS``, ``FAIRSHARE_TIER_REQUEST_TIMEOUT_S``,
``FAIRSHARE_KEEPALIVE_INTERVAL_S``, ``FAIRSHARE_WORKER_KEYS`` (the keys themselves),
``FAIRSHARE_WORKER_KEYS_FILE``, ``FAIRSHARE_WORKER_AUTH``, ``FAIRSHARE_WORKER_TOKEN_TTL_S`` (see
docs/reliability.md), ``FAIRSHARE_DEFAULT_MAX_TOKENS``, ``FAIRSHARE_TOOL_CALL_PARSER`` (docs/api.md).
The gateway refuses to start without a secret, and without worker-auth keys unless
``--no-worker-auth``.

``/metrics`` (every tenant's figures) is not served to API clients on the public port: operators
scrape the admin listener (``--metrics-port``), or the public port with the metrics token
(``Authorization: Bearer TOKEN``); ``--public-metrics`` restores an open ``/metrics`` for a public
port that tenants cannot reach.

SIGTERM drains: the listener closes, ``/readyz`` answers 503, requests still arriving get 503, open
requests and streams may finish for ``--drain-timeout-s`` seconds; then the rest are stopped (a stream
gets an OpenAI error event, a plain request a 503), their leases released, and the process exits.

It listens at once; ``/readyz`` answers 200 once a worker is SERVING (and agrees on the tokenizer)
and Redis answers PING (or some tier degrades without it), 503 before and while draining;
``/healthz`` answers 200 while the process runs.

Keys
----
::

    fairshare keys create --tenant ID [--tenants FILE] [--secret-file FILE] [--keys-file FILE]
    fairshare keys import --tenant ID [--tenants FILE] [--secret-file FILE] [--keys-file FILE] < key.txt
    fairshare keys list   [--tenants FILE] [--keys-file FILE]
    fairshare keys revoke --key-id KID [--tenants FILE] [--keys-file FILE]
    fairshare keys worker --file FILE [--add | --promote KID | --remove KID]

``keys create`` prints the new key (``sk-fs-...``) once on stdout (one line, nothing else) and stores
only its HMAC-SHA256 digest under the server secret in the **keys file** (default
``<tenants file stem>.keys.yaml`` in the tenants file's directory, e.g. ``tenants.yaml`` ->
``tenants.keys.yaml``); the tenants file itself is never rewritten. When ``--secret-file`` names a
file that does not exist yet, ``keys create`` creates it (random 32 bytes, hex, mode 0600), so
``fairshare up`` can run ``keys create --secret-file S`` and then ``gateway --secret-file S``.

``keys import`` brings an existing key (e.g. from another gateway) over: it reads the key on standard
input (a prompt without echo on a terminal; never a command-line argument, which other users can
see in the process list), checks it looks like a key (one line, 16-1024 printable characters) and
stores only its digest, like ``create``. A key already stored is refused.

``keys worker`` manages the worker-auth keys file (not API keys: the key ring the gateways sign every
worker call with and the workers verify, fairshare/worker_auth.py): it creates the file with one key
when missing, and does one step of a rotation without downtime: ``--add`` (a new key, accepted
everywhere once the file has reached every host), ``--promote KID`` (the gateways sign with it),
``--remove KID`` (a minute later: its tokens have expired).

Without ``--tenants`` (and ``FAIRSHARE_TENANTS_FILE``) the commands use the state directory of
``fairshare up`` (``$FAIRSHARE_STATE_DIR``, ``./var`` in a source checkout, else
``~/.local/state/fairshare``) when it holds a ``tenants.yaml``; without ``--secret-file`` (and
``FAIRSHARE_SECRET[_FILE]``) they use the ``secret`` file next to the tenants file when there is one.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path


SWITCH_ON, SWITCH_OFF = "store_true", "store_false"  # flags without a value: set the field True / False
ROUTINGS = ("fair", "prefix", "least-loaded")
EXPORTERS = ("none", "console", "otlp")

# The flags of `fairshare gateway`: (flag, GatewaySettings field, kind, help); kind: the value's type,
# a tuple of choices, or a switch. Unset flags leave the environment's value (FAIRSHARE_*) or the default.
GATEWAY_FLAGS: tuple[tuple[str, str, object, str], ...] = (
    ("--host", "host", str, "listen address (default 127.0.0.1)"),
    ("--port", "port", int, "listen port (default 8000)"),
    ("--tenants", "tenants_file", str, "tenants YAML file"),
    ("--keys-file", "keys_file", str, "API-key digests file (default <tenants stem>.keys.yaml)"),
    ("--workers", "workers", str, "gRPC workers, comma-separated: host:port, dns:///name:port (every A/AAAA record of the name, e.g. the workers' headless Service; re-resolved) or file:///path (one host:port per line; re-read)"),
    ("--discovery-interval-s", "discovery_interval_s", float, "re-resolve dns:/file: worker entries this often (default 5 s)"),
    ("--unhealthy-after", "unhealthy_after", int, "late health polls in a row before a SERVING worker leaves routing (default 3; NOT_SERVING, draining and a refused connection take it out at once)"),
    ("--worker-keepalive-s", "worker_keepalive_s", float, "HTTP/2 ping to each worker this often; a worker that does not answer one within as long is taken as gone and its requests fail over (default 10 s; 0: no pings)"),
    ("--routing", "routing", ROUTINGS, "fair (default: prefix affinity, spilling a tenant that queues at home by pool-wide deficit), prefix (tenant namespace + prompt head affinity with a load bound) or least-loaded"),
    ("--route-prefix-tokens", "route_prefix_tokens", int, "prompt tokens in the prefix route key (default 32; 0: tenant affinity only)"),
    ("--route-load-factor", "route_load_factor", float, "a worker over factor x mean in-flight tokens + slack gets no affine request (default 1.25)"),
    ("--route-slack-tokens", "route_slack_tokens", int, "in-flight tokens a worker may hold above the bound's mean share; fair routing: how much lighter a worker with no queue must be to take a tenant queued at home (default 4096)"),
    ("--route-spill-units", "route_spill_units", float, "fair routing: a tenant queued at home spills to a worker where its pool-wide counter is below every queued rival's by more than this many weighted service units (default 0)"),
    ("--redis-url", "redis_url", str, "Redis URL (default redis://127.0.0.1:6379/0)"),
    ("--redis-cluster", "redis_cluster", SWITCH_ON, "the URL names a node of a Redis Cluster"),
    ("--secret-file", "secret_file", str, "file holding the server secret (or set FAIRSHARE_SECRET)"),
    ("--tokenizer", "tokenizer", str, "local directory with tokenizer.json and the chat template (default: taken from the workers)"),
    ("--lease-ttl-s", "lease_ttl_s", float, "in-flight lease TTL in seconds (default 15)"),
    ("--log-level", "log_level", str, "debug, info, warning, error (default info)"),
    ("--otel-exporter", "otel_exporter", EXPORTERS, "where traces go: none (default), console (stdout) or otlp (OTEL_EXPORTER_OTLP_ENDPOINT)"),
    ("--redis-outage-policy", "redis_outage_policy", str, "per tier while Redis is unreachable: fail_closed (503, default) or degrade (this replica's buckets at limit/replicas); JSON, tier=policy,... or one policy for every tier"),
    ("--replicas", "gateway_replicas", int, "floor of the gateway replica count: replicas register in Redis and degraded buckets hold limit / max(this, live replicas last seen) (default 1)"),
    ("--replica-ttl-s", "replica_ttl_s", float, "a replica's registration in Redis expires after this long without a heartbeat (default 10)"),
    ("--redis-timeout-s", "redis_timeout_s", float, "timeout of each Redis call in seconds (default 2)"),
    ("--redis-max-connections", "redis_max_connections", int, "connections to Redis at most; a call that finds them all busy waits for one, up to --redis-timeout-s (default 256)"),
    ("--drain-timeout-s", "drain_timeout_s", float, "on SIGTERM, open requests may finish for this long (default 10 s)"),
    ("--request-timeout-s", "request_timeout_s", float, "deadline of one generation in seconds: 504 / error event after it (default: none)"),
    ("--tier-request-timeout-s", "tier_request_timeout_s", str, "default deadline per tier, merged over interactive=600,batch=none,background=none (JSON or tier=seconds|none,...); --request-timeout-s replaces it for every tier"),
    ("--keepalive-interval-s", "keepalive_interval_s", float, "streams: SSE keep-alive comment this often while the first token is pending; the response headers go out at the latest this long after admission (default 15)"),
    ("--worker-keys-file", "worker_keys_file", str, "keys that sign every Generate/Abort (KID:SECRET lines, the first signs; re-read when it changes); or FAIRSHARE_WORKER_KEYS"),
    ("--no-worker-auth", "worker_auth", SWITCH_OFF, "send unsigned worker calls (only to workers started with --no-worker-auth; unsafe)"),
    ("--worker-token-ttl-s", "worker_token_ttl_s", float, "validity of each call's token in seconds (default 60)"),
    ("--max-body-bytes", "max_body_bytes", int, "larger request bodies get 413 (default 8 MiB)"),
    ("--body-timeout-s", "body_timeout_s", float, "a request body not all there within this gets 408 and the connection is closed (default 30 s)"),
    ("--max-header-bytes", "max_header_bytes", int, "a request line and headers larger than this get 431 and the connection is closed (default 64 KiB)"),
    ("--header-timeout-s", "header_timeout_s", float, "request line and headers not all there this long after their first byte (or a new connection silent that long) get 408 and the connection is closed (default 10 s)"),
    ("--metrics-port", "metrics_port", int, "serve /metrics on an admin listener on this port (default 0: none)"),
    ("--metrics-host", "metrics_host", str, "address of the admin listener (default 127.0.0.1)"),
    ("--metrics-token-file", "metrics_token_file", str, "file holding a token that may read /metrics on the public port (Authorization: Bearer)"),
    ("--public-metrics", "public_metrics", SWITCH_ON, "serve /metrics to anyone on the public port (only where tenants cannot reach it)"),
    ("--default-max-tokens", "default_max_tokens", str, "output tokens of a chat completion sent without max_tokens: N for every model, or 'MODEL=N,*=M' (default 1024; a tenant's default_max_tokens wins; completions: 16)"),
    ("--tool-call-parser", "tool_call_parser", str, "how models write tool calls: hermes (default) or none, for every model or 'MODEL=hermes,*=none'"),
)


def _settings_from_args(args: argparse.Namespace):
    from .config import GatewaySettings

    overrides = {}
    for _, dest, _, _ in GATEWAY_FLAGS:
        v = getattr(args, dest, None)
        if v is not None:
            overrides[dest] = v
    return GatewaySettings(**overrides)


def build_parser() -> argparse.ArgumentParser:
    """Parser of `fairshare gateway` (`GATEWAY_FLAGS`; flags documented in the module docstring)."""
    p = argparse.ArgumentParser(prog="fairshare gateway", description="OpenAI-compatible FairShare gateway. "
                                "Every flag can also be given as FAIRSHARE_<NAME> in the environment.")
    for flag, dest, kind, help_text in GATEWAY_FLAGS:
        opts: dict = {"dest": dest, "help": help_text}
        if kind in (SWITCH_ON, SWITCH_OFF):
            opts.update(action=kind, default=None)
        elif isinstance(kind, tuple):
            opts["choices"] = list(kind)
        elif kind is not str:
            opts["type"] = kind
        p.add_argument(flag, **opts)
    return p


def main(argv: list[str] | None = None) -> int:
    """`fairshare gateway`: serve the app with uvicorn until interrupted; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        settings = _settings_from_args(args)
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from .app import create_app

        app = create_app(settings)
    except Exception as e:  # configuration errors: one line, no traceback
        print(f"fairshare gateway: {e}", file=sys.stderr)
        return 2
    if not settings.workers:
        print("fairshare gateway: warning: no workers configured (--workers host:port)", file=sys.stderr)
    import uvicorn

    from .serve import DrainingServer

    from .http_guard import protocol_for

    access_log = settings.log_level.lower() == "debug"
    # the client's address is read only by the access log: without it, uvicorn's X-Forwarded-For
    # rewrite (a middleware layer on every request) would be work nobody reads
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                            access_log=access_log, proxy_headers=access_log,
                            timeout_graceful_shutdown=settings.drain_timeout_s + 3,
                            http=protocol_for(settings))
    install_redaction()  # after uvicorn configured its loggers
    DrainingServer(config, drain_timeout_s=settings.drain_timeout_s).run()
    return 0


_SECRETS = re.compile(r"(sk-)[A-Za-z0-9_\-]{4,}|((?i:bearer)\s+)\S+|((?:api_key|api-key|key|token)=)[^&\s\"']+")


def redact(text: str) -> str:
    """`text` with API keys (``sk-...``), bearer tokens and ``key=``/``token=`` query values masked."""
    return _SECRETS.sub(lambda m: (m.group(1) or m.group(2) or m.group(3)) + "***", text)


class RedactingFilter(logging.Filter):
    """Masks API keys in every log record (message, arguments, exception text) before it is written:
    the gateway never logs a key on purpose, and this keeps a client that puts one in a URL
    (``?api_key=...``, which uvicorn's access log would print) or in a header from leaking it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


def install_redaction() -> None:
    """Add `RedactingFilter` to every handler of the root and uvicorn loggers."""
    f = RedactingFilter()
    for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access"):
        for h in logging.getLogger(name).handlers:
            if not any(isinstance(x, RedactingFilter) for x in h.filters):
                h.addFilter(f)


def build_keys_parser() -> argparse.ArgumentParser:
    """Parser of `fairshare keys`."""
    p = argparse.ArgumentParser(prog="fairshare keys", description="Manage tenant API keys (stored as HMAC-SHA256 "
                                "digests under the server secret; the key itself is printed once).")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_text in (("create", "create a key for a tenant and print it once"),
                            ("import", "store the digest of an existing key read on standard input"),
                            ("list", "list key ids and tenants"), ("revoke", "remove a key by id")):
        s = sub.add_parser(name, help=help_text)
        s.add_argument("--tenants", dest="tenants_file", help="tenants YAML file (or FAIRSHARE_TENANTS_FILE; "
                       "default: tenants.yaml in the fairshare up state directory)")
        s.add_argument("--keys-file", dest="keys_file", help="digests file (default <tenants stem>.keys.yaml)")
        if name in ("create", "import"):
            s.add_argument("--tenant", required=True, help="tenant id")
            s.add_argument("--secret-file", dest="secret_file", help="server secret file; created when missing "
                           "(or set FAIRSHARE_SECRET; default: the secret next to the tenants file)")
        if name == "revoke":
            s.add_argument("--key-id", dest="key_id", required=True)
    w = sub.add_parser("worker", help="the worker-auth keys file: create it, or one rotation step "
                                      "(fairshare/worker_auth.py)")
    w.add_argument("--file", required=True, help="the keys file the gateways and the workers read (created with "
                                                 "one key when missing)")
    step = w.add_mutually_exclusive_group()
    step.add_argument("--add", action="store_true", help="rotation step 1: append a fresh key (accepted, not signing)")
    step.add_argument("--promote", metavar="KID", help="rotation step 2: make KID the signing key")
    step.add_argument("--remove", metavar="KID", help="rotation step 3: stop accepting KID")
    return p


def _worker_keys(args) -> int:
    from fairshare import worker_auth

    try:
        keys = worker_auth.edit_keys_file(args.file, add=args.add, promote=args.promote, remove=args.remove)
    except worker_auth.KeysError as e:
        print(f"fairshare keys worker: {e}", file=sys.stderr)
        return 1
    print(f"{args.file}: signing key {keys.ids[0]}; accepted: {', '.join(keys.ids)}", file=sys.stderr)
    return 0


def _has_secret(settings) -> bool:
    return bool(settings.secret is not None and settings.secret.get_secret_value()) or settings.secret_file is not None


def _read_key() -> str:
    """The key to import from standard input: a prompt without echo on a terminal, else the input."""
    if sys.stdin.isatty():
        import getpass

        return getpass.getpass("API key to import (not echoed): ")
    return sys.stdin.read(MAX_STDIN_KEY_BYTES)


MAX_STDIN_KEY_BYTES = 4096


def keys_main(argv: list[str] | None = None) -> int:
    """`fairshare keys create|import|list|revoke|worker`; returns the exit code."""
    from fairshare.config import load_keys, load_tenants

    from .auth import revoke_key

    args = build_keys_parser().parse_args(argv)
    if args.cmd == "worker":
        return _worker_keys(args)
    settings = _keys_settings(args)
    if settings is None:
        return 2
    keys_path = settings.resolved_keys_file()
    try:
        tenants = load_tenants(settings.tenants_file)
    except Exception as e:
        print(f"fairshare keys: cannot read {settings.tenants_file}: {e}", file=sys.stderr)
        return 2
    if args.cmd in ("create", "import"):
        return _store_key(args, settings, keys_path, tenants)
    if args.cmd == "list":
        for k in load_keys(keys_path).keys:
            print(f"{k.key_id}\t{k.tenant}\t{k.created}")
        return 0
    if args.cmd == "revoke":
        if revoke_key(keys_path, args.key_id):
            print(f"revoked {args.key_id}", file=sys.stderr)
            return 0
        print(f"fairshare keys: no key {args.key_id} in {keys_path}", file=sys.stderr)
        return 1
    return 2


def _keys_settings(args):
    """The GatewaySettings of a `fairshare keys` command: the flags, else the environment, else the
    ``fairshare up`` state directory's tenants file (and the secret beside it). None (after saying why
    on stderr) when there is no tenants file."""
    from fairshare.config import default_state_dir

    from .config import GatewaySettings

    overrides = {k: v for k, v in (("tenants_file", args.tenants_file), ("keys_file", args.keys_file),
                                   ("secret_file", getattr(args, "secret_file", None))) if v is not None}
    settings = GatewaySettings(**overrides)
    if settings.tenants_file is None:
        found = default_state_dir() / "tenants.yaml"
        if not found.is_file():
            print(f"fairshare keys: --tenants FILE is required (or FAIRSHARE_TENANTS_FILE); there is no "
                  f"{found} (the fairshare up state directory)", file=sys.stderr)
            return None
        settings = GatewaySettings(**{**overrides, "tenants_file": found})
        print(f"fairshare keys: using {found}", file=sys.stderr)
    beside = Path(settings.tenants_file).with_name("secret")  # fairshare up keeps it next to tenants.yaml
    if args.cmd in ("create", "import") and not _has_secret(settings) and beside.is_file():
        settings = GatewaySettings(**{**overrides, "tenants_file": settings.tenants_file, "secret_file": beside})
    return settings


def _store_key(args, settings, keys_path: Path, tenants) -> int:
    """`keys create` (a new key, printed once) or `keys import` (a key read on stdin): store its digest."""
    from .auth import check_imported_key, create_key, store_key
    from .config import ensure_secret_file

    if settings.secret is not None and settings.secret.get_secret_value():
        secret = settings.secret_bytes()
    elif settings.secret_file is not None:
        secret = ensure_secret_file(settings.secret_file)
    else:
        print("fairshare keys: no server secret: pass --secret-file FILE or set FAIRSHARE_SECRET", file=sys.stderr)
        return 2
    try:
        if args.cmd == "create":
            key, record = create_key(secret, args.tenant, keys_path, tenants)
        else:
            record = store_key(secret, args.tenant, check_imported_key(_read_key()), keys_path, tenants)
    except KeyError as e:
        print(f"fairshare keys: {e.args[0]} (not in {settings.tenants_file})", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"fairshare keys: {e}", file=sys.stderr)
        return 2
    if args.cmd == "create":
        print(key)
    verb = "created" if args.cmd == "create" else "imported"
    print(f"{verb} {record.key_id} for tenant {record.tenant}; digest stored in {keys_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
