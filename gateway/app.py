"""The FastAPI app: OpenAI-compatible endpoints over Redis admission and gRPC workers.

Request path (``/v1/chat/completions`` and ``/v1/completions``):

1. authenticate the API key -> tenant (401 otherwise);
2. validate the body (400 ``invalid_request_error`` naming ``param``), resolve the model (404);
3. render the chat template (with the request's tools) and tokenize; check the context (400
   ``context_length_exceeded``); without ``max_tokens`` the output budget is the declared default
   (16 for ``/v1/completions``; for chat the tenant's, else the model's, else 1024 tokens; never more
   than the context the prompt leaves);
4. admit in one Redis call: RPM, TPM (reserving ``prompt + n * max_tokens``), in-flight tokens and
   concurrent requests (429 with ``retry-after`` otherwise);
5. start the generation(s) on the least-loaded worker, retrying on another worker until the first
   token, and only then answer: a JSON body or an SSE stream, ``x-ratelimit-*`` headers on both;
6. settle exactly once on success, error or client disconnect: cancel the gRPC streams (the worker
   aborts), refund ``reserved - (prompt + completion actually used)`` TPM tokens, release the lease.

What the output must follow and what comes back with it is the request's `OutputPlan`: logprobs
(gateway/logprobs.py), a grammar (response_format, forced tool calls: gateway/structured.py) and the
model's tool-call parser (gateway/tools.py), which turns tool-call text into ``tool_calls``.

Each request is one ``gateway.request`` trace (gateway/tracing.py) with spans for auth, tokenize,
admission, routing, each worker call (whose context the worker continues) and streaming.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from gateway.background import cancel_and_wait
from fairshare.config import TenantConfig, Tier
from fairshare.telemetry import make_tracer_provider
from fairshare.contract import TIER_ENUMS
from fairshare.v1 import worker_pb2 as pb

from . import schemas
from .admission import Admission, Decision, Lease
from .auth import Principal, TenantDirectory, bearer_key
from . import keepalive
from .config import COMPLETIONS_DEFAULT_MAX_TOKENS, GatewaySettings
from .deadlines import Deadline, request_deadline
from .errors import (APIError, from_validation_error, install_handlers, invalid_request, model_not_found, retry_headers,
                     unavailable)
from .logprobs import CompletionLogprobs, TokenTexts, chat_content
from .metrics import UNKNOWN_TENANT, GatewayMetrics
from .openapi import openapi_document
from .outage import AdmissionControl, RedisUnavailable
from .pool_view import PoolRuntime
from .progress import OutputRates
from .routing import Generation, ModelEntry, WorkerPool, start_generation
from .sse import DONE, SSEResponse, event
from .structured import grammar_for
from .tokenization import TemplateError, load_tokenizer_dir
from .tools import ToolCallParser, ToolCallStream, get_parser
from .tracing import end_request_span, gateway_tracer, set_error
from .watch import RequestWatch

log = logging.getLogger("fairshare.gateway")



@dataclass
class Gateway:
    """Everything the request handlers share (one per app)."""

    settings: GatewaySettings
    directory: TenantDirectory
    redis: Redis | RedisCluster
    admission: Admission
    control: AdmissionControl
    pool: WorkerPool
    metrics: GatewayMetrics
    live: set["Session"] = field(default_factory=set)
    tracer: trace.Tracer = field(default_factory=gateway_tracer)
    rates: OutputRates = field(default_factory=OutputRates)  # measured output rate per model (retry hints)
    draining: bool = False  # SIGTERM received: new requests get 503, open ones finish until the deadline
    signer: Any = None  # fairshare.worker_auth.Signer of every worker call (None: unsigned, --no-worker-auth)
    _drain_task: asyncio.Task | None = None

    def begin_drain(self, deadline_s: float) -> None:
        """Stop admitting; after `deadline_s` seconds stop every request still open (streams get an
        error event, others a 503). Call on the event loop."""
        if self.draining:
            return
        self.draining = True
        log.warning("draining: %d request(s) open; they may finish for %.1f s", len(self.live), deadline_s)

        async def deadline() -> None:
            await asyncio.sleep(deadline_s)
            if self.live:
                log.warning("drain deadline reached: stopping %d open request(s)", len(self.live))
            for s in list(self.live):
                s.stop("The gateway is shutting down; the request was stopped before it finished. Please retry.")

        self._drain_task = asyncio.ensure_future(deadline())


# -- one request's generation and settlement --------------------------------------------------------

@dataclass
class OutputPlan:
    """What a request's output must follow and what is returned with it.

    logprobs / top_logprobs: per-token log probabilities (chat ``top_logprobs``; completions
    ``logprobs: N`` asks for N alternatives). grammar / grammar_param: the worker-side constraint and
    the request field it comes from (for a 400 when the worker cannot compile it). tool_format: the
    model's tool-call parser (renders tools into prompts whose template cannot); parser: the same when
    it also reads the output (tools given and tool_choice not none; None: plain content); tools: the
    request's tools as dicts. skip: token ids that end generation and never appear in text (left out
    of logprobs). texts: the model's token strings (for logprobs).
    """

    logprobs: bool = False
    top_logprobs: int = 0
    grammar: pb.Grammar | None = None
    grammar_param: str | None = None
    tool_format: ToolCallParser | None = None
    parser: ToolCallParser | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    skip: set[int] = field(default_factory=set)
    texts: TokenTexts | None = None

    def tool_stream(self) -> ToolCallStream | None:
        """A fresh tool-call reader for one choice (None when tool calls are not parsed)."""
        return None if self.parser is None else self.parser.stream(self.tools)


@dataclass
class Job:
    """One choice: a prompt (group) sampled once. Token counts in tokens."""

    index: int
    group: int
    prompt_ids: list[int]
    max_tokens: int
    seed: int | None
    gen: Generation | None = None
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    usage: pb.Usage | None = None
    error: grpc.aio.AioRpcError | None = None  # how its stream failed, if it did
    first_at: float | None = None  # perf_counter() of its first and latest output tokens (gateway/progress.py)
    last_at: float | None = None
    first_tokens: int = 0  # tokens in the message that carried the first ones
    logprobs: list = field(default_factory=list)  # pb.TokenLogprob entries received so far
    tools: ToolCallStream | None = None           # tool-call reader of this choice (streams)
    calls_sent: int = 0                           # tool calls streamed so far
    completion_logprobs: CompletionLogprobs | None = None  # text completions: offsets across chunks


class Session:
    """An admitted request: its jobs, generations, lease and the settlement that ends it (once)."""

    def __init__(self, gw: Gateway, principal: Principal, entry: ModelEntry, model: str, jobs: list[Job],
                 lease: Lease, decision: Decision, rid: str, endpoint: str, t0: float,
                 plan: OutputPlan | None = None, deadline: Deadline | None = None) -> None:
        self.gw = gw
        self.plan = plan or OutputPlan()
        self.principal = principal
        self.entry = entry
        self.model = model
        self.jobs = jobs
        self.lease = lease
        self.decision = decision
        self.rid = rid
        self.endpoint = endpoint
        self.t0 = t0
        self.finished = False
        self.client_gone = False
        self.stop_reason: str | None = None  # set by stop(): the server ends the request (drain deadline)
        self.deadline_info = deadline or Deadline(None, None)  # whose deadline, when (gateway/deadlines.py)
        self.deadline: float | None = self.deadline_info.at  # time.monotonic(); the gRPC deadline of each call
        self._watch: RequestWatch | None = None  # the request's one task: disconnect watch, then settlement
        self._starting: asyncio.Task | None = None  # the handler, while it waits for the first tokens
        # a stream's start, in a task of its own once it outlasts the keep-alive grace (its body then
        # sends keep-alive comments until the first token; gateway/keepalive.py)
        self.start_task: asyncio.Future | None = None
        self.first_token_at: float | None = None
        self.trace_ctx = otel_context.get_current()  # the request span's context: parent of worker calls
        self.stream_span: trace.Span = trace.INVALID_SPAN  # first token -> settlement
        self.request_span: trace.Span | None = None  # set for SSE responses, which end it when they settle

    @property
    def tenant(self) -> TenantConfig:
        return self.principal.tenant

    def headers(self) -> dict[str, str]:
        """Rate-limit headers from the admission decision, plus the request id."""
        h = self.decision.state.headers()
        h["x-request-id"] = self.rid
        return h

    def record(self, job: Job, msg: pb.GenerateResponse) -> str:
        """Account one worker message to `job`; returns its text delta."""
        if self.first_token_at is None and (msg.token_ids or msg.text_delta):
            self.first_token_at = time.perf_counter()
            self.gw.metrics.ttft.labels(self.tenant.id, self.model).observe(self.first_token_at - self.t0)
        if msg.token_ids:
            job.last_at = time.perf_counter()
            if job.first_at is None:
                job.first_at, job.first_tokens = job.last_at, len(msg.token_ids)
        job.completion_tokens += len(msg.token_ids)
        if msg.text_delta:
            job.text.append(msg.text_delta)
        if msg.logprobs:
            job.logprobs.extend(msg.logprobs)
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            job.finish_reason = schemas.FINISH.get(msg.finish_reason, "stop")
            if msg.HasField("usage"):
                job.usage = msg.usage
                job.completion_tokens = int(msg.usage.completion_tokens)
        return msg.text_delta

    def usage(self) -> tuple[int, int, int]:
        """(prompt, completion, cached) tokens: the workers' figures, counted once per prompt."""
        prompt = cached = 0
        seen: set[int] = set()
        for j in self.jobs:
            if j.group in seen or j.gen is None:
                continue
            seen.add(j.group)
            src = next((k.usage for k in self.jobs if k.group == j.group and k.usage is not None), None)
            if src is not None:
                prompt += int(src.prompt_tokens)
                cached += int(src.cached_prompt_tokens)
            else:
                prompt += len(j.prompt_ids)
        completion = sum(j.completion_tokens for j in self.jobs)
        return prompt, completion, cached

    def usage_dict(self) -> dict[str, Any]:
        p, c, k = self.usage()
        return schemas.usage_dict(p, c, k)

    def watch(self, request: Request) -> None:
        """Start the request's one task: it watches the client's connection until the request ends,
        then settles it (gateway/watch.py). Call once, after admission."""
        self._watch = RequestWatch(request.receive, self.on_client_gone, self._do_settle)

    async def until_started(self, coro):
        """Await `coro` (the wait for the first tokens, in the caller's task) and return its result; a
        disconnect or `stop()` meanwhile interrupts it (cancelling the gRPC calls it has open, and a
        stream's start task): APIError 499 or 503."""
        task = asyncio.current_task()
        self._starting = task
        try:
            return await coro
        except asyncio.CancelledError:
            if not (self.client_gone or self.stop_reason is not None):
                raise  # cancelled from elsewhere
            if hasattr(task, "uncancel"):  # Python >= 3.11 counts cancellations
                task.uncancel()
            if self.client_gone:
                raise APIError(499, "Client closed the request.", "invalid_request_error", None,
                               "client_closed_request") from None
            raise unavailable(self.stop_reason or "The request was stopped.", retry_after_s=1) from None
        finally:
            self._starting = None

    def _interrupt(self) -> None:
        """Cancel every gRPC stream (the workers abort) and a wait for the first tokens."""
        for j in self.jobs:
            if j.gen is not None:
                j.gen.cancel()
        if self._starting is not None:
            self._starting.cancel()
        if self.start_task is not None:
            self.start_task.cancel()

    def on_client_gone(self) -> None:
        """The client disconnected: cancel every gRPC stream (the workers abort)."""
        if self.finished or self.client_gone:
            return
        self.client_gone = True
        self.gw.metrics.disconnects.labels(self.tenant.id).inc()
        self._interrupt()

    def stop(self, reason: str) -> None:
        """End the request from the server side (the gateway is shutting down): cancel its gRPC streams;
        the client gets an OpenAI error (an SSE ``data:`` error event, or a 503 body)."""
        if self.finished or self.client_gone or self.stop_reason is not None:
            return
        self.stop_reason = reason
        self._interrupt()

    async def settle(self) -> None:
        """Cancel what still runs, refund unused TPM and release the lease; idempotent, and completes
        even when the caller is cancelled."""
        if self._watch is None:  # never watched (settled right after admission): settle in a task all the same
            self._watch = RequestWatch(None, self.on_client_gone, self._do_settle)
        await self._watch.close()

    async def _do_settle(self) -> None:
        for j in self.jobs:
            if j.gen is not None:
                j.gen.close()
        self.gw.live.discard(self)
        self.gw.rates.observe_jobs(self.model, self.jobs)
        p, c, k = self.usage()
        used = p + c
        m = self.gw.metrics
        m.inflight.labels(self.tenant.id).dec()
        m.inflight_tokens.labels(self.tenant.id).dec(self.lease.tokens)
        self._end_spans(p, c, k)
        m.tokens.labels(self.tenant.id, self.model, "prompt").inc(p)
        m.tokens.labels(self.tenant.id, self.model, "completion").inc(c)
        m.tokens.labels(self.tenant.id, self.model, "cached").inc(k)
        try:  # never raises for Redis failures: an unreachable Redis is settled with when it returns
            await self.gw.control.settle(self.lease, used)
        except Exception:
            log.exception("settlement of %s failed; the lease expires in %.0f s", self.rid,
                          self.gw.control.lease_ttl_s)

    def _end_spans(self, prompt: int, completion: int, cached: int) -> None:
        span = self.stream_span
        if span.is_recording():
            span.set_attributes({
                "fairshare.prompt_tokens": prompt, "fairshare.completion_tokens": completion,
                "fairshare.cached_prompt_tokens": cached, "fairshare.client_gone": self.client_gone,
                "fairshare.finish_reasons": [j.finish_reason or "none" for j in self.jobs]})
            if not self.finished and not self.client_gone:
                set_error(span, "incomplete")
        span.end()
        if self.request_span is not None:
            rs, self.request_span = self.request_span, None
            if self.client_gone and rs.is_recording():
                rs.set_attribute("fairshare.client_gone", True)
            end_request_span(rs, 200)


# -- helpers --------------------------------------------------------------------------------------

async def _json_body(request: Request, limit: int) -> tuple[dict[str, Any], int]:
    """The request's JSON object and its size in bytes. Raises APIError 400 (not JSON / not an
    object) or 413 (over `limit` bytes)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"Request body too large: at most {limit} bytes.", "invalid_request_error", None,
                       "request_too_large")
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise APIError(413, f"Request body too large: at most {limit} bytes.", "invalid_request_error", None,
                               "request_too_large")
    except ClientDisconnect:
        raise APIError(499, "Client closed the request.", "invalid_request_error", None,
                       "client_closed_request") from None
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid_request(f"The request body is not valid UTF-8 (invalid byte at offset {e.start}).", None,
                              "invalid_encoding") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        body = json.loads(text)
    except RecursionError:
        raise invalid_request("The JSON body of your request is nested too deeply.", None, "invalid_json") from None
    except ValueError:
        raise invalid_request("We could not parse the JSON body of your request. (HINT: This likely means you "
                              "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)",
                              None, "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.", None, "invalid_json")
    if _SURROGATE_ESCAPE.search(text):  # "\ud800" parses to a lone surrogate, which is not text
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise invalid_request("The request body contains an invalid Unicode escape (a lone surrogate).", None,
                                  "invalid_encoding") from None
        except RecursionError:
            raise invalid_request("The JSON body of your request is nested too deeply.", None,
                                  "invalid_json") from None
    return body, len(raw)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _context_error(ctx: int, prompt_len: int, max_tokens: int | None, param: str) -> APIError:
    where = "messages" if param == "messages" else "prompt"
    if max_tokens is None or prompt_len >= ctx:
        msg = (f"This model's maximum context length is {ctx} tokens. However, your {where} resulted in "
               f"{prompt_len} tokens. Please reduce the length of the {where}.")
    else:
        msg = (f"This model's maximum context length is {ctx} tokens. However, you requested "
               f"{prompt_len + max_tokens} tokens ({prompt_len} in the {where}, {max_tokens} in the completion). "
               f"Please reduce the length of the {where} or completion.")
    return invalid_request(msg, param, "context_length_exceeded")


def _rate_limit_error(tenant: TenantConfig, model: str, d: Decision, cost: int) -> APIError:
    st = d.state
    lim = tenant.limits
    wait = _human(d.retry_after_s)
    if d.reason == "requests":
        typ = "requests"
        msg = (f"Rate limit reached for {model} for tenant {tenant.id} on requests per min (RPM): Limit {st.rpm_limit}, "
               f"Used {st.rpm_limit - max(0, st.rpm_remaining or 0)}, Requested 1. Please try again in {wait}.")
    elif d.reason == "tokens":
        typ = "tokens"
        msg = (f"Rate limit reached for {model} for tenant {tenant.id} on tokens per min (TPM): Limit {st.tpm_limit}, "
               f"Used {st.tpm_limit - max(0, st.tpm_remaining or 0)}, Requested {cost}. Please try again in {wait}.")
    elif d.reason == "inflight_tokens":
        typ = "tokens"
        msg = (f"Rate limit reached for {model} for tenant {tenant.id} on in-flight tokens: Limit "
               f"{lim.max_inflight_tokens}, In flight {d.inflight_tokens}, Requested {cost}. "
               f"Please try again in {wait}.")
    else:
        typ = "requests"
        msg = (f"Rate limit reached for {model} for tenant {tenant.id} on concurrent requests: Limit "
               f"{lim.max_concurrent_requests}, Running {d.concurrent}. Please try again in {wait}.")
    headers = st.headers()
    headers.update(retry_headers(d.retry_after_s))
    return APIError(429, msg, typ, None, "rate_limit_exceeded", headers)


def _human(seconds: float) -> str:
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def _too_large(tenant: TenantConfig, cost: int, param: str) -> APIError | None:
    """A 400 when `cost` tokens exceed a limit's whole capacity (the request could never be admitted)."""
    lim = tenant.limits
    for name, cap in (("tokens per min (TPM)", lim.tpm), ("in-flight tokens", lim.max_inflight_tokens)):
        if cap is not None and cost > cap:
            return invalid_request(
                f"Request too large for tenant {tenant.id} on {name}: Limit {cap}, Requested {cost}. "
                f"The input or output tokens must be reduced in order to run successfully.", param, "request_too_large")
    return None


# -- the app ----------------------------------------------------------------------------------------

def create_app(settings: GatewaySettings, *, directory: TenantDirectory | None = None,
               tracer_provider=None) -> FastAPI:
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
    metrics = GatewayMetrics()
    owned_provider = None
    if tracer_provider is None:
        tracer_provider = owned_provider = make_tracer_provider("fairshare-gateway", settings.otel_exporter)
    tracer = gateway_tracer(tracer_provider)
    local_tok = load_tokenizer_dir(settings.tokenizer) if settings.tokenizer else None
    rates = OutputRates()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        t = settings.redis_timeout_s
        if settings.redis_cluster:
            redis = RedisCluster.from_url(settings.redis_url, socket_timeout=t, socket_connect_timeout=t)
        else:
            redis = Redis.from_url(settings.redis_url, socket_timeout=t, socket_connect_timeout=t,
                                   health_check_interval=30)
        admission = Admission(redis, prefix=settings.key_prefix, lease_ttl_s=settings.lease_ttl_s)
        control = AdmissionControl(admission, settings.outage_policy, replicas=settings.gateway_replicas,
                                   probe_interval_s=settings.redis_probe_interval_s, metrics=metrics)
        try:
            await admission.load()
        except (RedisError, OSError) as e:
            log.error("Redis at %s is not reachable yet (%s); admission will retry per request", settings.redis_url,
                      type(e).__name__)
        control.start()
        watcher = asyncio.get_running_loop().create_task(directory.watch(), name="tenants-watch")
        metrics.track(directory, rates)
        admin = None
        if settings.metrics_port:
            from prometheus_client import start_http_server

            admin, _ = start_http_server(settings.metrics_port, addr=settings.metrics_host, registry=metrics.registry)
            log.info("gateway metrics on http://%s:%d/metrics", settings.metrics_host, admin.server_port)
        runtime = PoolRuntime(settings, redis, control, metrics, local_tok)  # workers, routing, replicas
        await runtime.start()
        pool = runtime.pool
        app.state.gw = Gateway(settings, directory, redis, admission, control, pool, metrics, tracer=tracer, rates=rates,
                               signer=signer)
        try:
            yield
        finally:
            gw = app.state.gw
            for s in list(gw.live):
                s.stop("The gateway is shutting down; the request was stopped before it finished. Please retry.")
                await s.settle()
            if gw._drain_task is not None:
                gw._drain_task.cancel()
            await cancel_and_wait(watcher)
            await runtime.stop()
            await control.stop()
            await redis.aclose()
            if admin is not None:
                admin.shutdown()
                admin.server_close()
            if owned_provider is not None:
                owned_provider.shutdown()  # flushes batched spans

    # FastAPI's own OpenTelemetry instrumentation stays off: the gateway traces requests itself
    # (gateway.request is the SERVER span) and counts them in Prometheus; left on, it would check the
    # global providers on every request and, with one installed, add a second server span
    app = FastAPI(title="FairShare gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    install_handlers(app)
    metrics_token = settings.metrics_token_value()
    openapi_doc = openapi_document()

    def gw_of(request: Request) -> Gateway:
        return request.app.state.gw

    async def headers_for(gw: Gateway, tenant: TenantConfig) -> dict[str, str]:
        """Current rate-limit headers (a read-only Redis call); {} when Redis is down."""
        d = await gw.control.peek(tenant)
        return {} if d is None else d.state.headers()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        gw = gw_of(request)
        workers = [{"addr": w.addr, "worker_id": w.worker_id or None, "healthy": w.healthy, "agrees": w.agrees,
                    "retired": w.retired, "usable": w.usable, "model": w.model, "inflight_tokens": w.load_score(),
                    "error": w.last_error or None} for w in gw.pool.workers]
        try:
            redis_ok = bool(await gw.redis.ping())
        except (RedisError, OSError):
            redis_ok = False
        # without Redis a replica still serves when some tier degrades to local buckets
        degraded = not redis_ok and any(gw.settings.outage_policy(t) == "degrade" for t in Tier)
        ready = (redis_ok or degraded) and gw.pool.ready() and not gw.draining
        body = {"ready": ready, "redis": redis_ok, "degraded": degraded, "draining": gw.draining,
                "workers": workers, "models": gw.pool.model_names()}
        if not ready:
            why = ("draining" if gw.draining else "Redis unreachable" if not (redis_ok or degraded)
                   else "no worker serving")
            body.update(unavailable("not ready: " + why).body())
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prom(request: Request) -> Response:
        """Every tenant's figures: only for operators. Served here when ``public_metrics`` is set or
        to the bearer of ``metrics_token``; otherwise on the admin listener (``metrics_port``)."""
        gw = gw_of(request)
        if not settings.public_metrics:
            given = bearer_key(request.headers.get("authorization")) or ""
            if not (metrics_token and hmac.compare_digest(given.encode(), metrics_token.encode())):
                where = (f"the admin listener (port {settings.metrics_port})" if settings.metrics_port
                         else "the admin listener (--metrics-port)")
                raise APIError(403, f"Metrics are not served to API clients on this port; operators scrape {where}"
                               " or send the metrics token.", "invalid_request_error", None, "metrics_forbidden")
        return Response(gw.metrics.render(), media_type=gw.metrics.content_type)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(openapi_doc)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        gw = gw_of(request)
        principal = gw.directory.authenticate(request.headers.get("authorization"))
        names = [n for n in gw.pool.model_names() if principal.tenant.may_use(n)]
        return JSONResponse(schemas.model_list(names), headers=await headers_for(gw, principal.tenant))

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> JSONResponse:
        gw = gw_of(request)
        principal = gw.directory.authenticate(request.headers.get("authorization"))
        h = await headers_for(gw, principal.tenant)
        if not principal.tenant.may_use(model) or gw.pool.model(model) is None:
            return model_not_found(model).response(h)
        return JSONResponse(schemas.model_list([model])["data"][0], headers=h)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(gw_of(request), request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(gw_of(request), request, "text")

    return app


async def _serve(gw: Gateway, request: Request, kind: str):
    """Handle one completion request end to end (see the module docstring)."""
    t0 = time.perf_counter()
    endpoint = "chat" if kind == "chat" else "completions"
    m = gw.metrics
    span = gw.tracer.start_span("gateway.request", kind=SpanKind.SERVER, attributes={
        "http.request.method": request.method, "http.route": request.url.path, "fairshare.endpoint": endpoint})
    # the request span parents the others; an untraced one (tracing off) is not worth attaching
    token = otel_context.attach(trace.set_span_in_context(span)) if span.get_span_context().is_valid else None
    ended = False
    try:
        try:
            with gw.tracer.start_as_current_span("gateway.auth", record_exception=False,
                                                 set_status_on_exception=False) as auth_span:
                try:
                    principal = gw.directory.authenticate(request.headers.get("authorization"))
                except APIError as e:
                    set_error(auth_span, e.code)
                    raise
        except APIError as e:  # the tenant is unknown: label "unknown"; the key (or part of it) is never recorded
            m.requests.labels(UNKNOWN_TENANT, endpoint, str(e.status)).inc()
            end_request_span(span, e.status, e.code)
            ended = True
            raise
        tenant = principal.tenant
        span.set_attribute("fairshare.tenant", tenant.id)
        try:
            resp = await _admit_and_start(gw, request, kind, principal, t0)
        except APIError as e:
            if e.status not in (429, 503) and not any(k.startswith("x-ratelimit") for k in e.headers):
                d = await gw.control.peek(tenant)
                if d is not None:
                    e.headers = {**d.state.headers(), **e.headers}
            m.requests.labels(tenant.id, endpoint, str(e.status)).inc()
            end_request_span(span, e.status, e.code)
            ended = True
            raise
        session, body_or_stream = resp
        span.set_attribute("fairshare.request_id", session.rid)
        if isinstance(body_or_stream, dict):  # non-streamed: already settled
            m.requests.labels(tenant.id, endpoint, "200").inc()
            m.latency.labels(tenant.id, endpoint).observe(time.perf_counter() - t0)
            end_request_span(span, 200)
            ended = True
            return JSONResponse(body_or_stream, headers=session.headers())
        m.requests.labels(tenant.id, endpoint, "200").inc()
        span.set_attribute("fairshare.stream", True)
        session.request_span = span  # ended when the stream settles
        ended = True
        return SSEResponse(body_or_stream, on_disconnect=session.on_client_gone, on_close=session.settle,
                           headers=session.headers())
    except BaseException as e:
        if not ended:  # an unexpected error (or cancellation): the handlers answer 500
            end_request_span(span, 500, "cancelled" if isinstance(e, asyncio.CancelledError) else type(e).__name__)
        raise
    finally:
        if token is not None:
            otel_context.detach(token)


async def _admit_and_start(gw: Gateway, request: Request, kind: str, principal: Principal, t0: float):
    """Validate, tokenize, admit and start. Returns (session, dict body | event iterator)."""
    tenant = principal.tenant
    if gw.draining:
        raise unavailable("The gateway is shutting down; please retry (another replica will serve you).",
                          retry_after_s=1)
    body, size = await _json_body(request, gw.settings.max_body_bytes)
    try:
        req = schemas.validate_request(body, kind)
    except ValidationError as e:
        raise from_validation_error(list(e.errors())) from None
    req.refuse_unsupported()
    deadline = request_deadline(gw.settings, tenant, request.headers, bool(req.stream))  # 400 for a bad header
    n = req.choices_n()
    if n > gw.settings.max_n:
        raise invalid_request(f"Invalid value for 'n': at most {gw.settings.max_n} choices per request.", "n",
                              "invalid_value")
    if kind == "text" and n * len(req.prompts()) > gw.settings.max_choices:
        raise invalid_request(f"Too many choices: prompts x n must be at most {gw.settings.max_choices}.", "prompt",
                              "invalid_value")
    model = req.model
    entry = gw.pool.model(model) if tenant.may_use(model) else None
    if entry is None:
        if tenant.may_use(model) and (model in gw.pool.models or not gw.pool.models):
            raise unavailable(f"No worker is serving model `{model}` right now.",
                              retry_after_s=gw.pool.retry_after_s(model))
        raise model_not_found(model)

    if req.stop_token_ids and max(req.stop_token_ids) >= entry.tokenizer.vocab_size():
        raise invalid_request(f"Invalid token id in 'stop_token_ids': ids must be < {entry.tokenizer.vocab_size()}.",
                              "stop_token_ids", "invalid_value")
    names = [model, *entry.names]
    plan = _output_plan(gw, entry, names, kind, req)

    # tokenize (large inputs on a thread, so the event loop keeps streaming other requests)
    param = "messages" if kind == "chat" else "prompt"
    with gw.tracer.start_as_current_span("gateway.tokenize", record_exception=False,
                                         set_status_on_exception=False) as tok_span:
        try:
            if size > _INLINE_TOKENIZE_BYTES:
                prompts = await asyncio.to_thread(_tokenize, entry, kind, req, plan)
            else:
                prompts = _tokenize(entry, kind, req, plan)
        except TemplateError as e:
            set_error(tok_span, "invalid_value")
            raise invalid_request(f"Invalid 'messages': {e}", "messages", "invalid_value") from None
        except APIError as e:
            set_error(tok_span, e.code)
            raise
        if tok_span.is_recording():
            tok_span.set_attributes({"fairshare.prompts": len(prompts),
                                     "fairshare.prompt_tokens": sum(len(p) for p in prompts)})
    for p in prompts:
        if not p:
            raise invalid_request(f"Invalid '{param}': it encodes to zero tokens.", param, "invalid_value")

    # output budget per choice
    ctx = entry.max_context_tokens
    requested = req.requested_max_tokens() if kind == "chat" else req.max_tokens
    max_param = ("max_completion_tokens" if kind == "chat" and req.max_completion_tokens is not None
                 else "max_tokens")
    longest = max(len(p) for p in prompts)
    prompt_total = sum(len(p) for p in prompts)
    if requested is None:
        if longest >= ctx:
            raise _context_error(ctx, longest, None, param)
        if kind == "text":  # OpenAI's documented default
            default = COMPLETIONS_DEFAULT_MAX_TOKENS
        else:  # the tenant's declared default, else the operator's for this model
            default = tenant.default_max_tokens_for(names) or gw.settings.chat_default_max_tokens(names)
        max_tokens = min(default, ctx - longest)  # never more than the context the prompt leaves ...
        lim = tenant.limits
        caps = [c for c in (lim.tpm, lim.max_inflight_tokens) if c is not None]
        if caps:  # ... but no more than the tenant could ever be admitted for
            affordable = (min(caps) - prompt_total) // (n * len(prompts))
            if affordable < 1:
                raise _too_large(tenant, prompt_total + n * len(prompts), param) or _context_error(
                    ctx, longest, None, param)
            max_tokens = min(max_tokens, affordable)
    else:
        max_tokens = requested
        if longest + max_tokens > ctx:
            raise _context_error(ctx, longest, max_tokens, param)
    cost = prompt_total + n * len(prompts) * max_tokens
    too_large = _too_large(tenant, cost, max_param if requested is not None else param)
    if too_large is not None:
        raise too_large

    # admission: one Redis round trip
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    m = gw.metrics
    with gw.tracer.start_as_current_span("gateway.admission", record_exception=False, set_status_on_exception=False,
                                         attributes={"fairshare.cost_tokens": cost}) as adm_span:
        ta = time.perf_counter()
        try:
            decision = await gw.control.admit(tenant, cost, lease_id=rid,
                                              expected_s=gw.rates.seconds_for(model, max_tokens))
        except RedisUnavailable as e:  # Redis is down and this tier fails closed
            m.admission_latency.labels(tenant.id, "error").observe(time.perf_counter() - ta)
            set_error(adm_span, "redis_unavailable")
            raise unavailable(f"The rate limiter is unavailable (Redis {e.cause}); please retry.",
                              retry_after_s=e.retry_after_s) from None
        m.admission_latency.labels(tenant.id, "admitted" if decision.admitted else "rejected").observe(
            time.perf_counter() - ta)
        if adm_span.is_recording():
            adm_span.set_attributes({"fairshare.admitted": decision.admitted, "fairshare.reason": decision.reason})
    if not decision.admitted:
        m.rejections.labels(tenant.id, decision.reason).inc()
        if decision.reason in ("tokens_never_fit", "inflight_never_fit"):
            err = _too_large(tenant, cost, param) or invalid_request("Request too large.", param, "request_too_large")
            err.headers.update(decision.state.headers())
            raise err
        m.rate_limited.labels(tenant.id, decision.reason).inc()
        raise _rate_limit_error(tenant, model, decision, cost)
    lease = decision.lease
    assert lease is not None
    m.inflight.labels(tenant.id).inc()
    m.inflight_tokens.labels(tenant.id).inc(lease.tokens)

    jobs: list[Job] = []
    for g, p in enumerate(prompts):
        for i in range(n):
            seed = None if req.seed is None else (req.seed + i + 2**63) % 2**64 - 2**63  # stays an int64
            jobs.append(Job(index=g * n + i, group=g, prompt_ids=p, max_tokens=max_tokens, seed=seed))
    session = Session(gw, principal, entry, model, jobs, lease, decision, rid, "chat" if kind == "chat" else "text", t0,
                      plan, deadline=deadline)
    lease.remaining_s = lambda: gw.rates.remaining_s(model, jobs)  # refreshed in Redis at each renewal
    gw.live.add(session)
    session.watch(request)

    # until the first token (which may wait in the worker's queue), still watching the client: the
    # request's watch interrupts the wait (499; 503 on stop). A non-streamed request waits in this task.
    # A stream waits here at most the keep-alive grace: its start runs in a task of its own, so that the
    # response can begin and keep the connection alive while it runs on (gateway/keepalive.py); errors
    # within the grace still get their own status. The routing span ends with the start.
    route_span = gw.tracer.start_span("gateway.routing", attributes={"fairshare.model": model,
                                                                     "fairshare.choices": len(jobs)})
    try:
        if req.stream:
            token = otel_context.attach(trace.set_span_in_context(route_span))  # current in the start task
            try:
                start = session.start_task = asyncio.ensure_future(_start_all(gw, session, req))
            finally:
                otel_context.detach(token)
            start.add_done_callback(lambda task: _end_routing_span(route_span, task))
            if not await session.until_started(keepalive.started_within(start, gw.settings.keepalive_interval_s)):
                if route_span.is_recording():
                    route_span.set_attribute("fairshare.keepalive", True)
        else:
            try:
                with trace.use_span(route_span, end_on_exit=False, record_exception=False,
                                    set_status_on_exception=False):
                    await session.until_started(_start_all(gw, session, req))
            except BaseException as e:
                set_error(route_span, e.code if isinstance(e, APIError) else
                          "cancelled" if isinstance(e, asyncio.CancelledError) else type(e).__name__)
                raise
            finally:
                route_span.end()
    except BaseException:
        if session.start_task is not None:
            await cancel_and_wait(session.start_task)
        await session.settle()
        raise
    session.stream_span = gw.tracer.start_span("gateway.streaming", context=session.trace_ctx,
                                               attributes={"fairshare.stream": bool(req.stream)})
    if req.stream:
        stream = _chat_stream(session, req) if kind == "chat" else _text_stream(session, req)
        return session, stream
    try:
        body = await _collect(session, kind)
    finally:
        await session.settle()
    return session, body


def _end_routing_span(span: trace.Span, task: asyncio.Future) -> None:
    """End the ``gateway.routing`` span when its start task ends (error type when it failed)."""
    if task.cancelled():
        set_error(span, "cancelled")
    elif task.exception() is not None:
        e = task.exception()
        set_error(span, e.code if isinstance(e, APIError) else type(e).__name__)
    span.end()


_INLINE_TOKENIZE_BYTES = 16 * 1024


def _output_plan(gw: Gateway, entry: ModelEntry, names: list[str], kind: str, req) -> OutputPlan:
    """The request's `OutputPlan`. Raises APIError 400 (a forced tool call the model's parser cannot
    express; gateway/structured.py)."""
    skip = set(entry.eos_token_ids) | set(req.stop_token_ids or ())
    if kind == "text":
        wanted = req.logprobs is not None
        return OutputPlan(logprobs=wanted, top_logprobs=int(req.logprobs or 0), skip=skip,
                          texts=entry.token_texts() if wanted else None)
    parser = get_parser(gw.settings.tool_parser_name(names))
    grammar, grammar_param = grammar_for(req, parser)
    return OutputPlan(logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs_n() if req.logprobs else 0,
                      grammar=grammar, grammar_param=grammar_param, tool_format=parser,
                      parser=parser if req.calls_tools() else None, tools=req.tool_dicts(), skip=skip,
                      texts=entry.token_texts() if req.logprobs else None)


def _tokenize(entry: ModelEntry, kind: str, req, plan: OutputPlan) -> list[list[int]]:
    """Token ids of each prompt (chat: one). Raises TemplateError, or APIError 400 for bad token ids."""
    tok = entry.tokenizer
    if kind == "chat":
        return [tok.encode_chat(req.template_messages(), plan.tools or None, plan.tool_format)]
    prompts = []
    vocab = tok.vocab_size()
    for p in req.prompts():
        if isinstance(p, str):
            prompts.append(tok.encode_text(p))
        else:
            if any(t >= vocab for t in p):
                raise invalid_request(f"Invalid token id in 'prompt': ids must be < {vocab}.", "prompt",
                                      "invalid_value")
            prompts.append(list(p))
    return prompts


def _generate_request(session: Session, job: Job, req) -> pb.GenerateRequest:
    t = session.tenant
    plan = session.plan
    sp = pb.SamplingParams(
        max_tokens=job.max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=int(req.top_k or 0),
        stop=req.stops(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        logprobs=plan.logprobs,
        top_logprobs=plan.top_logprobs,
    )
    if plan.grammar is not None:
        sp.grammar.CopyFrom(plan.grammar)
    if job.seed is not None:
        sp.seed = job.seed
    rid = session.rid if len(session.jobs) == 1 else f"{session.rid}.{job.index}"
    return pb.GenerateRequest(
        request_id=rid,
        tenant=pb.Tenant(id=t.id, weight=t.weight, tier=TIER_ENUMS[t.tier]),
        prompt_token_ids=job.prompt_ids, sampling=sp, cache_salt=req.cache_salt or "")


async def _start_all(gw: Gateway, session: Session, req) -> None:
    """Start every job's generation (each retried on other workers until its first token)."""
    attempts = gw.settings.max_retries + 1

    async def start(job: Job) -> None:
        try:
            job.gen = await start_generation(gw.pool, session.model, _generate_request(session, job, req),
                                             len(job.prompt_ids) + job.max_tokens, max_attempts=attempts,
                                             metrics=gw.metrics, tracer=gw.tracer, parent=session.trace_ctx,
                                             deadline=session.deadline, signer=gw.signer)
        except APIError as e:
            if e.status == 504 and e.code == "timeout":  # the deadline passed while it was queued
                raise session.deadline_info.error(started=False) from None
            if e.code == "invalid_grammar":  # the worker could not compile it: name the field
                e.param, e.code = session.plan.grammar_param, "invalid_value"
            raise

    if len(session.jobs) == 1:
        await start(session.jobs[0])
        return
    tasks = [asyncio.ensure_future(start(j)) for j in session.jobs]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _merged(session: Session) -> AsyncIterator[tuple[Job, pb.GenerateResponse]]:
    """Messages of every job as they come. Raises the first stream error."""
    jobs = session.jobs
    if len(jobs) == 1:
        job = jobs[0]
        try:
            async for msg in job.gen.messages():
                yield job, msg
        except grpc.aio.AioRpcError as e:
            job.error = e
            raise
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for msg in job.gen.messages():
                await queue.put((job, msg, None))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            if isinstance(e, grpc.aio.AioRpcError):
                job.error = e
            await queue.put((job, None, e))
            return
        await queue.put((job, None, None))

    tasks = [asyncio.ensure_future(pump(j)) for j in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            job, msg, err = await queue.get()
            if err is not None:
                raise err
            if msg is None:
                remaining -= 1
                continue
            yield job, msg
    finally:
        for t in tasks:
            t.cancel()


# gRPC codes of a stream that mean the worker (or the connection to it) is gone, not the request
_WORKER_LOST = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN}


def _stream_failure(session: Session, err: BaseException) -> APIError:
    """The client's error for a generation that failed after its first token (the details, which name
    workers, go to the log only). A worker whose connection broke is marked unhealthy at once, so the
    next requests go to the others."""
    if session.stop_reason is not None:
        return unavailable(session.stop_reason, retry_after_s=1)
    for j in session.jobs:
        e = j.error
        if e is not None and j.gen is not None:
            log.warning("request %s: worker %s failed during generation: %s %s", session.rid, j.gen.worker.addr,
                        e.code().name, e.details())
            if e.code() in _WORKER_LOST:
                session.gw.pool.mark_failed(j.gen.worker, f"{e.code().name} during generation")
    retry_s = session.gw.pool.retry_after_s(session.model)  # another worker may take it (retry hints)
    if isinstance(err, grpc.aio.AioRpcError):
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return session.deadline_info.error(started=True)
        return unavailable(f"The worker failed during generation ({err.code().name}); please retry.",
                           retry_after_s=retry_s)
    return unavailable(f"The worker failed during generation ({type(err).__name__}); please retry.",
                       retry_after_s=retry_s)


def _check_finished(session: Session) -> None:
    retry_s = session.gw.pool.retry_after_s(session.model)
    for j in session.jobs:
        if j.finish_reason is None:
            raise unavailable("The worker ended the stream without finishing the request.", retry_after_s=retry_s)
        if j.finish_reason == "abort":
            raise unavailable("The worker aborted the request.", retry_after_s=retry_s)


async def _collect(session: Session, kind: str) -> dict[str, Any]:
    """Run a non-streamed request to the end (a disconnect or `Session.stop` cancels its gRPC calls:
    APIError 499 / 503)."""
    try:
        async with aclosing(_merged(session)) as messages:
            async for job, msg in messages:
                session.record(job, msg)
    except grpc.aio.AioRpcError as e:
        raise _stream_failure(session, e) from None
    except asyncio.CancelledError:  # our own cancellation, or a call cancelled by a disconnect or stop()
        if session.client_gone:
            raise APIError(499, "Client closed the request.", "invalid_request_error", None,
                           "client_closed_request") from None
        if session.stop_reason is not None:
            raise _stream_failure(session, asyncio.CancelledError()) from None
        raise
    _check_finished(session)
    session.finished = True
    created = int(time.time())
    plan = session.plan
    if kind == "chat":
        choices = [_chat_choice(plan, j) for j in session.jobs]
        return schemas.chat_completion(session.rid, created, session.model, choices, session.usage_dict(),
                                       session.entry.fingerprint)
    texts = [("".join(j.text), j.finish_reason or "stop",
              CompletionLogprobs(plan.texts).add(j.logprobs, plan.skip) if plan.logprobs else None)
             for j in session.jobs]
    return schemas.text_completion(session.rid, created, session.model, texts, session.usage_dict(),
                                   session.entry.fingerprint)


def _finish_reason(job: Job, made_calls: bool) -> str:
    """OpenAI's finish reason: ``tool_calls`` when the choice ended normally after calling tools."""
    reason = job.finish_reason or "stop"
    return "tool_calls" if made_calls and reason == "stop" else reason


def _chat_choice(plan: OutputPlan, job: Job) -> dict[str, Any]:
    """A non-streamed chat choice: the text read by the tool-call parser (the same reader the
    stream uses), its logprobs."""
    text = "".join(job.text)
    calls: list[dict[str, Any]] = []
    reader = plan.tool_stream()
    if reader is not None:
        content, calls = reader.feed(text)
        rest, more = reader.finish()
        text, calls = content + rest, calls + more
    logprobs = chat_content(plan.texts, job.logprobs, plan.skip) if plan.logprobs else None
    return schemas.chat_choice(job.index, None if calls and not text else text, _finish_reason(job, bool(calls)),
                               calls or None, logprobs)


def _chat_stream(session: Session, req: schemas.ChatCompletionRequest) -> AsyncIterator[bytes]:
    created = int(time.time())
    fp = session.entry.fingerprint
    with_usage = req.include_usage()
    plan = session.plan
    for j in session.jobs:
        j.tools = plan.tool_stream()

    def chunk(index, delta=None, finish=None, logprobs=None):
        return event(schemas.chat_chunk(session.rid, created, session.model, fp, index, delta, finish, None,
                                        with_usage, logprobs))

    def body(job: Job, msg) -> list[bytes]:
        out = []
        text = session.record(job, msg)
        calls: list[dict[str, Any]] = []
        if job.tools is not None:
            text, calls = job.tools.feed(text)
            if job.finish_reason is not None:
                rest, more = job.tools.finish()
                text, calls = text + rest, calls + more
        logprobs = chat_content(plan.texts, msg.logprobs, plan.skip) if plan.logprobs else None
        if text or logprobs:
            out.append(chunk(job.index, {"content": text}, logprobs=logprobs))
        for call in calls:
            out.append(chunk(job.index, {"tool_calls": [{"index": job.calls_sent, **call}]}))
            job.calls_sent += 1
        if job.finish_reason not in (None, "abort"):  # an abort is answered with an error event (_stream)
            out.append(chunk(job.index, {}, _finish_reason(job, job.calls_sent > 0)))
        return out

    return _stream(session, [chunk(j.index, {"role": "assistant", "content": ""}) for j in session.jobs], body,
                   lambda: event(schemas.chat_chunk(session.rid, created, session.model, fp, None,
                                                    usage=session.usage_dict(), with_usage=True))
                   if with_usage else None)


def _text_stream(session: Session, req: schemas.CompletionRequest) -> AsyncIterator[bytes]:
    created = int(time.time())
    fp = session.entry.fingerprint
    with_usage = req.include_usage()

    plan = session.plan
    for j in session.jobs:
        j.completion_logprobs = CompletionLogprobs(plan.texts) if plan.logprobs else None

    def chunk(index, text="", finish=None, logprobs=None):
        return event(schemas.text_chunk(session.rid, created, session.model, fp, index, text, finish, None,
                                        with_usage, logprobs))

    def body(job: Job, msg) -> list[bytes]:
        out = []
        text = session.record(job, msg)
        logprobs = None
        if job.completion_logprobs is not None:
            logprobs = job.completion_logprobs.add(msg.logprobs, plan.skip)
            if not logprobs["tokens"]:
                logprobs = None
        if text or logprobs:
            out.append(chunk(job.index, text, logprobs=logprobs))
        if job.finish_reason not in (None, "abort"):  # an abort is answered with an error event (_stream)
            out.append(chunk(job.index, "", job.finish_reason))
        return out

    return _stream(session, [], body,
                   lambda: event(schemas.text_chunk(session.rid, created, session.model, fp, None,
                                                    usage=session.usage_dict(), with_usage=True))
                   if with_usage else None)


async def _stream(session: Session, opening: list[bytes], body, usage_event) -> AsyncIterator[bytes]:
    """The SSE body: keep-alive comments until the first token (when the response began before it),
    opening chunks, content chunks, (usage chunk), ``[DONE]``; settles in every case. `body(job, msg)`
    gives the chunks of one worker message (all its tokens), written at once."""
    try:
        start = session.start_task
        if start is not None and not start.done():  # answered before the first token: keep the line alive
            async for b in keepalive.comments(start, session.gw.settings.keepalive_interval_s):
                yield b
        if start is not None:
            try:
                start.result()
            except APIError as e:
                yield event(e.body())
                return
            except asyncio.CancelledError:
                if session.stop_reason is not None and not session.client_gone:
                    yield event(unavailable(session.stop_reason, retry_after_s=1).body())
                return
        if opening:
            yield b"".join(opening)
        try:
            async with aclosing(_merged(session)) as messages:
                async for job, msg in messages:
                    chunks = body(job, msg)
                    if chunks:
                        yield b"".join(chunks)
            _check_finished(session)
        except APIError as e:
            if not session.client_gone:
                yield event(e.body())
            return
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            if session.client_gone:
                return
            if isinstance(e, asyncio.CancelledError) and session.stop_reason is None and not any(
                    j.gen is not None and j.gen.call.cancelled() for j in session.jobs):
                raise  # we are being cancelled ourselves
            yield event(_stream_failure(session, e).body())
            return
        session.finished = True
        await session.settle()  # before [DONE]: a client that saw [DONE] sees its lease released
        u = usage_event()
        yield DONE if u is None else u + DONE
    finally:
        await session.settle()
        session.gw.metrics.latency.labels(session.tenant.id, session.endpoint).observe(
            time.perf_counter() - session.t0)
