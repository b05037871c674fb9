"""The FastAPI app: OpenAI-compatible endpoints over Redis admission and gRPC workers.

`create_app` builds the app and its lifespan (Redis, admission control, the worker pool, lease
renewal, the admin listener) and declares the HTTP routes:

- ``/v1/chat/completions``, ``/v1/completions``: one completion request end to end
  (gateway/completion.py: plan -> admission -> routing -> worker stream -> JSON or SSE -> settlement);
- ``/v1/models``, ``/v1/models/{model}``: the models the tenant may use;
- ``/healthz`` (the process runs), ``/readyz`` (Redis or a degrading tier, a worker serving, not
  draining; worker counts for anyone, each worker's state for operators), ``/metrics`` (operators
  only), ``/openapi.json``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from fairshare.config import TenantConfig, Tier
from fairshare.telemetry import make_tracer_provider

from . import schemas
from .admission import AdmissionControl
from .auth import TenantDirectory, bearer_key
from .background import cancel_and_wait
from .completion import serve
from .config import GatewaySettings
from .errors import APIError, install_handlers, model_not_found, unavailable
from .metrics import GatewayMetrics
from .openapi import openapi_document
from .pool_view import PoolRuntime
from .progress import OutputRates
from .redis_buckets import RedisAdmission
from .state import Gateway
from .tokenization import load_tokenizer_dir
from .tracing import gateway_tracer

log = logging.getLogger("fairshare.gateway")


@dataclass
class _Parts:
    """What `create_app` builds before the app starts (the lifespan builds the rest)."""

    settings: GatewaySettings
    directory: TenantDirectory
    metrics: GatewayMetrics
    tracer: Any
    owned_provider: Any  # the tracer provider create_app made (shut down with the app), or None
    local_tokenizer: Any
    rates: OutputRates
    signer: Any


def create_app(settings: GatewaySettings, *, directory: TenantDirectory | None = None,
               tracer_provider=None) -> GatewayApp:
    """Build the gateway app. Redis, the worker pool and lease renewal start in the app's lifespan.

    tracer_provider: where spans go (tests pass one with an in-memory exporter); default: a provider
    built from ``settings.otel_exporter`` (none: the global provider, a no-op unless configured).
    Raises RuntimeError when no server secret (or no worker-auth key, unless ``worker_auth`` is off) is
    configured, ValueError for an unknown exporter.
    """
    secret = settings.secret_bytes()
    signer = settings.worker_signer()  # RuntimeError without worker-auth keys (unless worker_auth is off)
    if directory is None:
        directory = TenantDirectory(secret, settings.tenants_file, settings.resolved_keys_file())
    owned_provider = None
    if tracer_provider is None:
        tracer_provider = owned_provider = make_tracer_provider("fairshare-gateway", settings.otel_exporter)
    parts = _Parts(settings, directory, GatewayMetrics(), gateway_tracer(tracer_provider), owned_provider,
                   load_tokenizer_dir(settings.tokenizer) if settings.tokenizer else None, OutputRates(), signer)
    # FastAPI's own OpenTelemetry instrumentation stays off: the gateway traces requests itself
    # (gateway.request is the SERVER span) and counts them in Prometheus; left on, it would check the
    # global providers on every request and, with one installed, add a second server span
    # redirect_slashes off: a path with a stray slash is answered by the OpenAI-shaped 404, not with a
    # 307 to a location built from the client's Host header
    app = GatewayApp(title="FairShare gateway", lifespan=_lifespan(parts), docs_url=None, redoc_url=None,
                     openapi_url=None, telemetry={"tracing": False, "metrics": False, "logs": False},
                     redirect_slashes=False)
    app.state.settings = settings  # (the server's protocol reads its head bounds: gateway/http_guard.py)
    install_handlers(app)
    _operator_routes(app, settings)
    _model_routes(app)
    _completion_routes(app)
    return app


class GatewayApp(FastAPI):
    """The gateway's FastAPI app, with the completion endpoints served ahead of its middleware.

    A ``POST`` to a path in `completion_paths` (``/v1/chat/completions``, ``/v1/completions``) goes
    straight to its handler: Starlette's and FastAPI's layers around a route (server-error and
    exception middleware, body-limit and telemetry middleware, the exit stack, the router's match,
    the route's request/response wrapper) each add a coroutine and a wrapped ``send`` per request,
    which on this path cost more CPU than the handler's own work on the request. The handler's
    exceptions get the app's own exception handlers (gateway/errors.py: the OpenAI error shape, a
    logged 500 for anything unexpected), found as Starlette finds them (by the exception's class,
    most specific first). Every other request (and the lifespan) goes through the whole app; the
    completion routes are declared there too (a ``GET`` to them is a 405 from the router).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.completion_paths: dict[str, Callable[[Request], Awaitable[Response]]] = {}

    async def __call__(self, scope, receive, send) -> None:
        handler = self.completion_paths.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as exc:  # noqa: BLE001 (answered by the app's handler for its class)
            response = await self._handler_for(exc)(request, exc)
        await response(scope, receive, send)

    def _handler_for(self, exc: Exception):
        """The app's exception handler for `exc`'s class or its nearest base (Exception's at worst)."""
        for cls in type(exc).__mro__:
            if cls in self.exception_handlers:
                return self.exception_handlers[cls]
        raise exc  # (unreachable: install_handlers registers one for Exception)


def _lifespan(parts: _Parts):
    """The app's lifespan: start Redis, admission control, the tenants watch, the admin listener and
    the pool; on shutdown stop and settle every open request, then all of these in reverse."""
    settings, metrics = parts.settings, parts.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        redis = _redis_client(settings)
        admission = RedisAdmission(redis, prefix=settings.key_prefix, lease_ttl_s=settings.lease_ttl_s)
        control = AdmissionControl(admission, settings.outage_policy, replicas=settings.gateway_replicas,
                                   probe_interval_s=settings.redis_probe_interval_s, metrics=metrics)
        try:
            await admission.load()
        except (RedisError, OSError) as e:
            log.error("Redis at %s is not reachable yet (%s); admission will retry per request", settings.redis_url,
                      type(e).__name__)
        control.start()
        watcher = asyncio.get_running_loop().create_task(parts.directory.watch(), name="tenants-watch")
        metrics.track(parts.directory, parts.rates)
        admin = _admin_listener(settings, metrics)
        runtime = PoolRuntime(settings, redis, control, metrics, parts.local_tokenizer)  # workers, routing, replicas
        await runtime.start()
        app.state.gw = Gateway(settings, parts.directory, redis, admission, control, runtime.pool, metrics,
                               tracer=parts.tracer, rates=parts.rates, signer=parts.signer)
        try:
            yield
        finally:
            await app.state.gw.stop_all()
            await cancel_and_wait(watcher)
            await runtime.stop()
            await control.stop()
            await redis.aclose()
            if admin is not None:
                admin.shutdown()
                admin.server_close()
            if parts.owned_provider is not None:
                parts.owned_provider.shutdown()  # flushes batched spans

    return lifespan


def _redis_client(settings: GatewaySettings) -> Redis | RedisCluster:
    """The asyncio Redis client (a cluster client with ``redis_cluster``); every call times out after
    ``redis_timeout_s`` seconds. At most ``redis_max_connections`` connections (per node for a
    cluster): a call that finds them all busy waits for one (a blocking pool, up to
    ``redis_timeout_s``) rather than failing, so a burst of one tenant's requests is back-pressure, not
    an outage that would turn every fail-closed tenant away with 503."""
    t, n = settings.redis_timeout_s, settings.redis_max_connections
    if settings.redis_cluster:
        return RedisCluster.from_url(settings.redis_url, socket_timeout=t, socket_connect_timeout=t, max_connections=n)
    pool = BlockingConnectionPool.from_url(settings.redis_url, max_connections=n, timeout=t, socket_timeout=t,
                                           socket_connect_timeout=t, health_check_interval=30)
    return Redis.from_pool(pool)  # (the client closes its pool)


def _admin_listener(settings: GatewaySettings, metrics: GatewayMetrics):
    """The ``/metrics`` admin listener on ``metrics_port`` (a WSGI server; None when the port is 0)."""
    if not settings.metrics_port:
        return None
    from prometheus_client import start_http_server

    admin, _ = start_http_server(settings.metrics_port, addr=settings.metrics_host, registry=metrics.registry)
    log.info("gateway metrics on http://%s:%d/metrics", settings.metrics_host, admin.server_port)
    return admin


def _gw(request: Request) -> Gateway:
    return request.app.state.gw


def _operator_routes(app: FastAPI, settings: GatewaySettings) -> None:
    """``/healthz``, ``/readyz``, ``/metrics``, ``/openapi.json``."""
    metrics_token = settings.metrics_token_value()
    openapi_doc = openapi_document()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    def operator(request: Request) -> bool:
        """Whether the request may read operator data on the public port: ``public_metrics`` is set or
        it carries the metrics token (``Authorization: Bearer <token>``)."""
        if settings.public_metrics:
            return True
        given = bearer_key(request.headers.get("authorization")) or ""
        return bool(metrics_token) and hmac.compare_digest(given.encode(), metrics_token.encode())

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        body = await _readiness(_gw(request), detail=operator(request))
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def prom(request: Request) -> Response:
        """Every tenant's figures: only for operators. Served here when ``public_metrics`` is set or
        to the bearer of ``metrics_token``; otherwise on the admin listener (``metrics_port``)."""
        gw = _gw(request)
        if not operator(request):
            where = (f"the admin listener (port {settings.metrics_port})" if settings.metrics_port
                     else "the admin listener (--metrics-port)")
            raise APIError(403, f"Metrics are not served to API clients on this port; operators scrape {where}"
                           " or send the metrics token.", "invalid_request_error", None, "metrics_forbidden")
        return Response(gw.metrics.render(), media_type=gw.metrics.content_type)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(openapi_doc)


async def _readiness(gw: Gateway, detail: bool = False) -> dict[str, Any]:
    """The ``/readyz`` body: ready when Redis answers (or some tier degrades without it), a worker
    serves and the gateway is not draining; an OpenAI error body added when not ready.

    Anyone may read whether it is ready and how many workers it has (``workers_total``,
    ``workers_healthy``, ``workers_usable``); `detail` (an operator: see ``operator`` in
    `_operator_routes`) adds each worker's address, id, state, model, in-flight tokens and last
    error (``workers``) and the models served (``models``): worker addresses are the cluster's
    layout, and their in-flight tokens would let any client watch the other tenants' traffic."""
    pool = gw.pool.workers
    try:
        redis_ok = bool(await gw.redis.ping())
    except (RedisError, OSError):
        redis_ok = False
    # without Redis a replica still serves when some tier degrades to local buckets
    degraded = not redis_ok and any(gw.settings.outage_policy(t) == "degrade" for t in Tier)
    ready = (redis_ok or degraded) and gw.pool.ready() and not gw.draining
    body = {"ready": ready, "redis": redis_ok, "degraded": degraded, "draining": gw.draining,
            "workers_total": len(pool), "workers_healthy": sum(w.healthy for w in pool),
            "workers_usable": sum(w.usable for w in pool)}
    if detail:
        body["workers"] = [{"addr": w.addr, "worker_id": w.worker_id or None, "healthy": w.healthy,
                            "agrees": w.agrees, "retired": w.retired, "usable": w.usable, "model": w.model,
                            "inflight_tokens": w.load_score(), "error": w.last_error or None} for w in pool]
        body["models"] = gw.pool.model_names()
    if not ready:
        why = ("draining" if gw.draining else "Redis unreachable" if not (redis_ok or degraded)
               else "no worker serving")
        body.update(unavailable("not ready: " + why).body())
    return body


async def _ratelimit_headers(gw: Gateway, tenant: TenantConfig) -> dict[str, str]:
    """Current rate-limit headers (a read-only Redis call); {} when Redis is down."""
    d = await gw.control.peek(tenant)
    return {} if d is None else d.state.headers()


def _model_routes(app: FastAPI) -> None:
    """``/v1/models`` and ``/v1/models/{model}``: the models the tenant may use (401 without a key)."""

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        gw = _gw(request)
        principal = gw.directory.authenticate(request.headers.get("authorization"))
        names = [n for n in gw.pool.model_names() if principal.tenant.may_use(n)]
        return JSONResponse(schemas.model_list(names), headers=await _ratelimit_headers(gw, principal.tenant))

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> JSONResponse:
        gw = _gw(request)
        principal = gw.directory.authenticate(request.headers.get("authorization"))
        h = await _ratelimit_headers(gw, principal.tenant)
        if not principal.tenant.may_use(model) or gw.pool.model(model) is None:
            return model_not_found(model).response(h)
        return JSONResponse(schemas.model_list([model])["data"][0], headers=h)


def _completion_routes(app: GatewayApp) -> None:
    """``/v1/chat/completions`` and ``/v1/completions`` (gateway/completion.py).

    Plain Starlette routes: the handlers take the raw request and return a response, so FastAPI's
    per-request dependency solving and exit stacks would do nothing but cost CPU on the hottest path
    (the app's exception handlers and middleware still apply; the OpenAPI document is gateway/openapi.py).
    """

    async def chat_completions(request: Request):
        return await serve(_gw(request), request, "chat")

    async def completions(request: Request):
        return await serve(_gw(request), request, "text")

    for path, handler in (("/v1/chat/completions", chat_completions), ("/v1/completions", completions)):
        app.add_route(path, handler, methods=["POST"], include_in_schema=False)
        app.completion_paths[path] = handler


__all__ = ["create_app"]
