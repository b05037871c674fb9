"""The worker's gRPC server (grpc.aio): `fairshare.v1.Worker` plus `grpc.health.v1`.

Each `Generate` call registers its request with the engine and relays the engine's outputs
(delivered on the engine thread) through an asyncio queue. Outputs are coalesced: whatever the
engine produced for the request since the stream last sent (one iteration's tokens, or those of
consecutive iterations when the engine ran ahead of the connection) goes out as one message, with
one logprob entry per token, never one message per token when tokens are ready together; a pause
between iterations (a preemption) starts a new message, so `Timings.iteration` (the message's
latest iteration) and the token count place every token. When the client cancels the stream
(gateway disconnect, deadline), the handler is cancelled and the request is aborted, which frees
its KV blocks. SIGTERM drains: health goes NOT_SERVING (and ``GetLoad.draining``), new requests get
UNAVAILABLE (the gateway retries them on another worker), in-flight ones may finish until the drain
deadline (``--drain-timeout``), then the rest are aborted (their streams end with finish reason
ABORT, which the gateway turns into an OpenAI error) and the process exits; a second SIGTERM/SIGINT
cuts the drain short.

Prefix-cache namespaces are derived here, on the worker, from the tenant id the gateway
authenticated and the client's optional ``cache_salt`` (keyed hash under ``FAIRSHARE_CACHE_SECRET``
or a per-process random secret; worker/cache/namespace.py, docs/cache-isolation.md); the gateway's
``Tenant.cache_namespace`` is not used for the reference engine's cache.

Authentication (fairshare/worker_auth.py, docs/reliability.md): every ``Generate`` and ``Abort``
must carry the gateway's token in its metadata, bound to the request's id, tenant, tier, weight
and cache salt, unexpired and not used before; any other call is refused with UNAUTHENTICATED
before the engine sees it, and counted (``fairshare_worker_auth_failures_total{reason}``).
``GetLoad``, ``GetModelInfo`` and health stay open (load figures and the tokenizer only).

Engine faults (worker/faults.py): a step that raises fails the requests of its batch, whose calls
end with INTERNAL (the gateway answers 503 or an SSE error event, or retries one that had no token
yet on another worker); repeated faults fail the engine: health goes NOT_SERVING, every live call
ends with UNAVAILABLE, new ones get UNAVAILABLE, and after ``engine_failure_exit_s`` the process
exits with status 3 so that its supervisor restarts it.

Deadlines: the gateway's gRPC deadline travels with each call; when it passes, grpc cancels the
handler, which aborts the request (queued or running) and frees its KV blocks.

A request's grammar (structured outputs, forced tool calls) is compiled here, on a thread, before
the request reaches the engine (worker/engine/grammar.py; compiled grammars are cached); one that does
not compile is refused with INVALID_ARGUMENT and trailing metadata ``fairshare-invalid: grammar``, so
the gateway answers a 400 naming the request field. Logprobs travel as one ``TokenLogprob`` per token.
Every name in ``served_model_names`` (``--served-model-name``) is reported by ``GetModelInfo``.

No request field triggers anything but generation: the tests' fault injection and engine hold live
in a test-only launcher (tests/support/worker_main.py) that plugs in through `serve(configure=...)`.

Observability (docs/observability.md): each call is a ``worker.generate`` span continuing the trace
context the gateway put in the gRPC metadata, with queue / prefill / decode children
(worker/tracing.py); TTFT, ITL and queue-time histograms and finish counters are observed here as
outputs stream, and the engine's per-tenant load is read at scrape time (worker/metrics.py),
served on ``--metrics-port``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fairshare import worker_auth
from fairshare.tiers import DEFAULT_TIER
from fairshare.v1 import worker_pb2, worker_pb2_grpc
from fairshare.contract import FINISH_ENUMS, INVALID_METADATA_KEY, SERVICE_NAME, TIER_ENUMS, grammar_of
from fairshare.contract import TIER_NAMES as _TIER_NAMES
from worker.engine.engine import Engine, EngineFailed, RequestOutput, RequestTimings
from worker.faults import EXIT_ENGINE_FAILED
from worker import grpc_server
from worker.engine.sequence import FinishReason, SamplingParams
from worker.metrics import WorkerMetrics
from worker.multiplex import GenerateManyMixin
from worker.tracing import RequestTrace, worker_tracer

log = logging.getLogger("fairshare.worker")

_FINISH = {r: FINISH_ENUMS[r.value] for r in FinishReason}
_FINISH_NAMES = {r: r.value for r in FinishReason}


def sampling_from_proto(p: worker_pb2.SamplingParams, grammar=None) -> SamplingParams:
    """Map the wire SamplingParams to the engine's (max_tokens 0 → rest of the context).
    grammar: the compiled grammar of `p.grammar` (the caller compiles it, off the engine loop)."""
    return SamplingParams(
        max_tokens=p.max_tokens or None,
        temperature=p.temperature,
        top_p=p.top_p if 0.0 < p.top_p <= 1.0 else 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        grammar=grammar,
    )


_TIMING_FIELDS = tuple(f.name for f in dataclasses.fields(RequestTimings))  # each a field of the proto's Timings too


def _to_proto(outs: list[RequestOutput]) -> worker_pb2.GenerateResponse:
    """One message for the engine outputs of one request that are ready together (in order): their
    tokens, text and logprobs concatenated, each timing from the first output that has it, the
    iteration of the last one (the latest step the message carries), the last one's finish and usage."""
    msg = worker_pb2.GenerateResponse()
    first = {}  # timing field -> value, from the first output that has it
    for out in outs:
        msg.token_ids.extend(out.token_ids)
        for tok, lp, top in out.logprobs:
            entry = msg.logprobs.add(token_id=tok, logprob=lp)
            for alt, alt_lp in top:
                entry.top.add(token_id=alt, logprob=alt_lp)
        for name in _TIMING_FIELDS:
            value = getattr(out.timings, name)
            if value is not None and name not in first:
                first[name] = value
                setattr(msg.timings, name, value)
        msg.timings.iteration = out.iteration
        if out.finish_reason is not None:
            msg.finish_reason = _FINISH[out.finish_reason]
            msg.usage.prompt_tokens = out.prompt_tokens
            msg.usage.completion_tokens = out.completion_tokens
            msg.usage.cached_prompt_tokens = out.cached_tokens
    msg.text_delta = "".join(out.text_delta for out in outs)
    return msg


class WorkerServicer(GenerateManyMixin, worker_pb2_grpc.WorkerServicer):
    """Implements the Worker service on top of an `Engine` (whose loop thread is started here).

    metrics: where TTFT / ITL / finish figures go (default: a fresh `WorkerMetrics` over `engine`).
    tracer_provider: where spans go (default: the global provider, a no-op unless configured).
    verifier: checks the gateway's token on Generate / Abort (`fairshare.worker_auth.Verifier`);
    None: no authentication (only for in-process embedding and experiments; `fairshare worker`
    always has one).
    """

    def __init__(self, engine: Engine, model_name: str | list[str], *, metrics: WorkerMetrics | None = None,
                 tracer_provider=None, verifier: worker_auth.Verifier | None = None, worker_id: str = "",
                 pool=None) -> None:
        names = [model_name] if isinstance(model_name, str) else list(dict.fromkeys(model_name))
        if not names or not all(names):
            raise ValueError("a worker needs at least one non-empty model name")
        self.engine = engine
        self.verifier = verifier
        self.model_name = names[0]
        self.served_model_names = names
        self.worker_id = worker_id
        self.pool = pool  # a worker.pool_service.PoolService, or None (per-worker counters)
        self.draining = False
        self.refused_while_draining = 0
        self.live: set[str] = set()
        self.metrics = metrics if metrics is not None else WorkerMetrics(engine)
        self.metrics.draining = lambda: self.draining
        self.tracer = worker_tracer(tracer_provider)
        m = engine.model
        digest = hashlib.sha256((m.tokenizer_json + "\0" + (m.chat_template or "")).encode()).hexdigest()
        self._model_info = worker_pb2.ModelInfo(
            model_name=names[0], served_model_names=names, max_context_tokens=engine.max_model_len,
            tokenizer_json=m.tokenizer_json, chat_template=m.chat_template or "", eos_token_ids=sorted(m.eos_token_ids), tokenizer_sha256=digest,
            bos_token=m.bos_token or "", eos_token=m.eos_token or "", worker_id=worker_id,
            generate_many=True,  # GenerateManyMixin
        )

    async def _authenticate(self, claims: worker_auth.Claims, context) -> None:
        await worker_auth.require(self.verifier, claims, context, self.metrics.observe_auth_failure)

    async def Generate(self, request, context):
        await self._authenticate(worker_auth.generate_claims(request), context)
        if self.draining:
            self.refused_while_draining += 1
            log.info("refused request %s: draining (the gateway retries it on another worker)", request.request_id)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        if self.engine.failed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine has failed: {self.engine.failed}")
        request_id = request.request_id or uuid.uuid4().hex
        tenant = request.tenant
        if not tenant.id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tenant.id is required")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[RequestOutput, float, int]] = asyncio.Queue()
        tier = _TIER_NAMES.get(tenant.tier, DEFAULT_TIER)

        def on_output(out: RequestOutput) -> None:  # engine thread: stamp it here, before the hand-over
            loop.call_soon_threadsafe(queue.put_nowait, (out, time.perf_counter(), time.time_ns()))

        rt = RequestTrace(self.tracer, context.invocation_metadata(), request_id, tenant.id,
                          prompt_tokens=len(request.prompt_token_ids), max_tokens=request.sampling.max_tokens,
                          tier=tier)
        compiled = None
        grammar = grammar_of(request.sampling)
        if grammar is not None:  # compiled on a thread (the first one builds the vocabulary tables)
            try:
                compiled = await asyncio.to_thread(self.engine.compile_grammar, *grammar)
            except ValueError as exc:
                rt.end("rejected")
                self.metrics.observe_finish(tenant.id, "rejected")
                context.set_trailing_metadata(((INVALID_METADATA_KEY, "grammar"),))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            self.engine.add_request(
                request_id, tenant.id, list(request.prompt_token_ids), sampling_from_proto(request.sampling, compiled),
                on_output, weight=tenant.weight or 1.0, tier=tier,
                cache_salt=request.cache_salt,  # the engine derives the namespace (worker/cache/namespace.py)
                may_hand_back=request.may_hand_back,  # worker/scheduling/handback.py
            )
        except EngineFailed as exc:
            rt.end("rejected")
            self.metrics.observe_finish(tenant.id, "rejected")
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ValueError as exc:
            rt.end("rejected")
            self.metrics.observe_finish(tenant.id, "rejected")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.live.add(request_id)
        finished = False
        outcome = "cancelled"
        end_ns = None
        last_token_at: float | None = None
        final: RequestOutput | None = None
        after_pause = None  # an output taken from the queue that starts the next message
        try:
            while not finished:
                # coalesce: the outputs already queued (the engine ran ahead of this stream) go in one
                # message, up to a pause (a preemption, a wait): a client still sees the pause
                ready = [after_pause if after_pause is not None else await queue.get()]
                after_pause = None
                while not queue.empty():
                    item = queue.get_nowait()
                    if item[0].iteration > ready[-1][0].iteration + 1:
                        after_pause = item
                        break
                    ready.append(item)
                outs: list[RequestOutput] = []
                for out, at, at_ns in ready:
                    rt.observe(out.timings.queued_s, out.timings.first_token_s, len(out.token_ids))
                    if out.token_ids:
                        if last_token_at is None:
                            self.metrics.observe_first_token(tenant.id, out.timings.queued_s,
                                                             out.timings.first_token_s or 0.0)
                        else:
                            self.metrics.observe_itl(tenant.id, at - last_token_at, len(out.token_ids))
                        last_token_at = at
                    if out.error:
                        finished = True
                        outcome, end_ns, final = "error", at_ns, out
                        # a failed engine is a worker to route around (UNAVAILABLE); one faulty batch is not
                        code = grpc.StatusCode.UNAVAILABLE if self.engine.failed else grpc.StatusCode.INTERNAL
                        await context.abort(code, out.error)
                    outs.append(out)
                    if out.finish_reason is not None:
                        finished = True
                        outcome, end_ns, final = _FINISH_NAMES[out.finish_reason], at_ns, out
                        break
                yield _to_proto(outs)
        finally:
            self.live.discard(request_id)
            if not finished:  # cancelled by the client (or the server shutting down)
                self.engine.abort(request_id)
            rt.end(outcome, end_ns, final)
            ran = final is not None and final.finish_reason is not FinishReason.HANDED_BACK  # handed back: it runs elsewhere
            self.metrics.observe_finish(tenant.id, outcome, final.prompt_tokens if ran else 0,
                                        final.cached_tokens if ran else 0)

    async def Abort(self, request, context):
        await self._authenticate(worker_auth.abort_claims(request), context)
        return worker_pb2.AbortResponse(found=self.engine.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        return self._model_info

    async def GetLoad(self, request, context):
        snap = self.engine.snapshot()
        load = worker_pb2.Load(
            waiting=snap["waiting"], running=snap["running"], kv_blocks_used=snap["kv_blocks_used"],
            kv_blocks_total=snap["kv_blocks_total"], kv_block_size=snap["kv_block_size"], policy=snap["policy"],
            iterations=snap["iterations"], draining=self.draining, inflight_tokens=snap["inflight_tokens"],
            kv_quota_enabled=snap["kv_quota"], reclaim_preemptions=snap["reclaim_preemptions"],
            tier_scheduling=snap.get("tier_scheduling", False),
            tier_preemptions=snap.get("preemptions_by_reason", {}).get("tier", 0),
            returning_preemptions=snap.get("returning_preemptions", 0),
            iteration_token_target=snap.get("iteration_token_target", 0),
            worker_id=self.worker_id, pool_counters=self.pool is not None, pool_workers=snap.get("pool_workers", 0),
            pool_board_age_s=self.pool.board_age_s() if self.pool is not None else 0.0,
        )
        for tier, t in snap.get("tiers", {}).items():
            load.tiers.add(tier=TIER_ENUMS.get(tier, 0), charged_service=t["service"], service_share=t["service_share"],
                           min_share=t["min_share"], deficit=t["deficit"], backlogged=t["backlogged"],
                           blocked_iterations=t["blocked_iterations"], waiting=t["waiting"], running=t["running"],
                           preemptions=t["preemptions"])
        for t in snap["tenants"]:
            load.tenants.add(
                tenant_id=t["tenant_id"], weight=t["weight"], tier=TIER_ENUMS.get(t["tier"], 0),
                virtual_counter=t["virtual_counter"], charged_service=t["charged_service"],
                prompt_tokens=t["prompt_tokens"], output_tokens=t["output_tokens"], waiting=t["waiting"],
                running=t["running"], kv_blocks=t["kv_blocks"], finished=t["finished"],
                preemptions=t["preemptions"], quota_waits=t.get("quota_waits", 0),
                # KV quotas: 0 / false when the worker runs without them (Load.kv_quota_enabled)
                kv_soft_quota_blocks=t.get("kv_soft_quota_blocks", 0), kv_hard_cap_blocks=t.get("kv_hard_cap_blocks", 0),
                kv_over_quota=t.get("kv_over_quota", False), backlogged=t.get("backlogged", False),
                pool_service=t.get("pool_service", 0.0),
            )
        _fill_cache_load(load, snap)
        return load


def _fill_cache_load(load: worker_pb2.Load, snap: dict) -> None:
    """The radix prefix cache's fields of GetLoad (pool-wide and per tenant), from the snapshot."""
    load.cache_blocks = snap.get("cache_blocks", 0)
    load.cache_public_blocks = snap.get("cache_public_blocks", 0)
    load.cache_hit_tokens = snap.get("cache_hit_tokens", 0)
    load.cache_lookup_tokens = snap.get("cache_lookup_tokens", 0)
    by_id = {t["tenant_id"]: t for t in snap["tenants"]}
    for tl in load.tenants:
        t = by_id.get(tl.tenant_id, {})
        tl.cache_blocks = t.get("cache_blocks", 0)
        tl.cached_prompt_tokens = t.get("cached_prompt_tokens", 0)


async def serve(engine: Engine, model_name: str | list[str], host: str, port: int, drain_timeout_s: float = 30.0,
                ready_message: bool = True, *, metrics_port: int = 0, metrics_host: str | None = None,
                metrics_max_tenants: int = 64, tracer_provider=None, worker_id: str = "", pool=None,
                configure=None, verifier: worker_auth.Verifier | None = None,
                engine_failure_exit_s: float = 10.0) -> int:
    """Serve until SIGTERM/SIGINT, then drain (up to `drain_timeout_s` seconds) and stop. Returns the
    exit status: 0, or `EXIT_ENGINE_FAILED` (3) when the engine failed (worker/faults.py).

    verifier: checks the gateway's tokens (see `WorkerServicer`). engine_failure_exit_s: once the
    engine has failed (health NOT_SERVING), stop after this many seconds so that the supervisor
    restarts the process (0: stay up, NOT_SERVING, until signalled).

    metrics_port: serve Prometheus ``/metrics`` over HTTP on metrics_host (default `host`):metrics_port
    (0: no metrics server). metrics_max_tenants: distinct tenant labels before ``other``.
    tracer_provider: where spans go (default: the global provider); shut down (flushed) at the end.
    worker_id: this worker's identity (ModelInfo / Load). pool: a `worker.pool_service.PoolService`
    (started with the engine, stopped after the drain), or None.
    configure: extension point for a program embedding the worker, ``configure(server, engine,
    servicer)``, called once before the Worker service is registered and the engine and server start:
    it may add services to the ``grpc.aio`` server and wrap the servicer's or the engine's methods
    (the test launcher tests/support/worker_main.py adds its test-control service there). `fairshare
    worker` passes none; nothing a request carries reaches it.
    Raises OSError when a port cannot be bound.
    """
    import signal

    server = grpc_server.new_server()
    servicer = WorkerServicer(engine, model_name, metrics=WorkerMetrics(engine, max_tenants=metrics_max_tenants),
                              tracer_provider=tracer_provider, verifier=verifier, worker_id=worker_id, pool=pool)
    if configure is not None:
        configure(server, engine, servicer)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = grpc_server.HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = grpc_server.bind(server, host, port)
    if metrics_port:
        bound_metrics = servicer.metrics.serve(metrics_host or host, metrics_port)
        log.info("worker metrics on http://%s:%d/metrics", metrics_host or host, bound_metrics)
    stop = asyncio.Event()
    hurry = asyncio.Event()  # a second signal: stop draining now
    loop = asyncio.get_running_loop()
    failed_task: list[asyncio.Task] = []

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    async def engine_failed(reason: str) -> None:
        for svc in ("", SERVICE_NAME):
            await health_servicer.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
        print(f"fairshare worker: NOT_SERVING: {reason}" + (f"; exiting in {engine_failure_exit_s:g} s so that the "
              "supervisor restarts it" if engine_failure_exit_s > 0 else ""), flush=True)
        if engine_failure_exit_s > 0:
            await asyncio.sleep(engine_failure_exit_s)
            hurry.set()
            stop.set()

    engine.on_failed = lambda reason: loop.call_soon_threadsafe(
        lambda: failed_task.append(asyncio.ensure_future(engine_failed(reason))))
    engine.start()
    if pool is not None:
        pool.start()
    await server.start()
    for svc in ("", SERVICE_NAME):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    if engine.failed and not failed_task:  # (failed before the loop could hear it)
        failed_task.append(asyncio.ensure_future(engine_failed(engine.failed)))
    if ready_message:
        print(f"fairshare worker ready on {host}:{bound} (model {', '.join(servicer.served_model_names)}, "
              f"policy {engine.policy.name}, "
              f"{engine.block_manager.num_blocks} KV blocks of {engine.block_manager.block_size} tokens)", flush=True)
        cache = ("off" if engine.cache is None else "on, one global namespace (UNSAFE)"
                 if not engine.config.cache_isolation else "on, namespaced per tenant")
        print(f"cost function: {engine.cost.describe()}; prefix cache {cache}", flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    servicer.draining = True
    for svc in ("", SERVICE_NAME):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("draining: %d request(s) in flight may finish for %.1f s", len(servicer.live), drain_timeout_s)
    deadline = loop.time() + drain_timeout_s
    while servicer.live and loop.time() < deadline and not hurry.is_set():
        await asyncio.sleep(0.05)
    if servicer.live:
        log.warning("drain %s: aborting %d request(s) still in flight", "cut short" if hurry.is_set()
                    else "deadline reached", len(servicer.live))
    engine.shutdown()  # aborts what is left: each stream ends with finish_reason ABORT
    if pool is not None:
        pool.stop()
    servicer.end_generate_many()  # idle GenerateMany streams end now, not at the grace's end
    health_servicer.end_watches()  # so do the gateways' health watches (they saw NOT_SERVING)
    await server.stop(grace=2.0)
    log.info("stopped (refused %d request(s) while draining)", servicer.refused_while_draining)
    servicer.metrics.stop()
    if tracer_provider is not None:
        tracer_provider.shutdown()  # flushes batched spans
    return EXIT_ENGINE_FAILED if engine.failed else 0
