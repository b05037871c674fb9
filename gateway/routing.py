"""Workers: discovery, health (``grpc.health.v1``), model info and tokenizer agreement, routing, retries.

- `WorkerClient`: one gRPC channel to one worker, its health, its `ModelInfo` and its load estimate.
- `WorkerPool`: the workers `--workers` names, kept live by `gateway.discovery` (static entries,
  ``dns:///name:port``, ``file:///path``): a worker that appears is checked at once and used as soon
  as it is SERVING; one that leaves the list is *retired* (no new requests, its open streams run to
  the end, then its channel closes). Every worker is polled (health every ``health_interval_s``
  seconds, ``GetModelInfo`` once per (re)connection, ``GetLoad`` for the worker's in-flight tokens
  and drain state) and watched (the health ``Watch`` stream, so a worker that starts draining, i.e.
  reports NOT_SERVING, leaves routing at once). A SERVING worker that only answers late leaves routing
  after ``unhealthy_after`` late polls in a row (default 3: one slow answer under load is not an
  outage), at once when it answers NOT_SERVING or draining, refuses the connection, or a call to it
  fails. Workers are grouped by model (a worker answers to every name in
  ``ModelInfo.served_model_names``; the names of one model share one entry); every worker of a
  model must report the same tokenizer (sha256 of tokenizer json + chat template, or the gateway's
  own ``--tokenizer``).
  Which worker gets a request: the routing policy (`gateway.routing_policy`: least-loaded, prefix
  or fair).
- `WorkerPool.retry_after_s`: the retry hint of a 503 while no worker serves a model: how long the
  last outage of a worker of that model lasted, minus how long the current one has lasted, and never
  less than the health poll interval (the soonest the pool can see a worker come back).
- `start_generation`: opens a ``Generate`` stream on the worker the routing policy picks and reads
  until the first token; a worker that fails before that is abandoned (its call cancelled) and the
  request retried on another worker. A worker that *hands the request back* (it waited there unadmitted
  with no room: worker/scheduling/handback.py; allowed only while another worker exists, once per
  request) is neither marked failed nor counted as a retry: the request is routed to another
  worker, on the same admission lease, and the client sees nothing of it (should every other worker
  then fail before its first token, it goes back to the worker that handed it back, to wait there). Each
  attempt is a ``gateway.worker_call`` CLIENT span whose W3C trace context travels in the call's
  gRPC metadata (``traceparent``), so the worker's spans are its children.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from gateway.background import cancel_and_wait
from fairshare.telemetry import inject_metadata
from fairshare.worker_auth import generate_claims
from fairshare.contract import INVALID_METADATA_KEY, MAX_HAND_BACKS
from fairshare.v1 import worker_pb2 as pb
from fairshare.v1 import worker_pb2_grpc as pb_grpc
from fairshare.contract import TIER_NAMES

from .background import every
from .discovery import DEFAULT_INTERVAL_S, Discovery, parse_sources
from .errors import APIError, invalid_request, unavailable
from .logprobs import TokenTexts
from .routing_policy import RouteRequest, RoutingPolicy, make_routing
from .tokenization import ChatTokenizer, TokenizerFiles
from .worker_stream import GenerateStream, StreamedGenerate

log = logging.getLogger("fairshare.gateway")

WORKER_SERVICE = "fairshare.v1.Worker"
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
]

# gRPC codes that mean "this request is wrong", not "this worker is broken": never retried
_CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


def channel_options(keepalive_s: float) -> list[tuple[str, int]]:
    """A worker channel's options: message limits, no gRPC retries (the gateway retries itself) and,
    with `keepalive_s` > 0, an HTTP/2 ping every `keepalive_s` seconds, idle or not, that must be
    answered within `keepalive_s` seconds or the connection is closed (its calls and its
    GenerateMany stream fail UNAVAILABLE, as when the worker's connection breaks). A ping is
    answered by gRPC's own threads, so a worker busy in Python still answers; a stopped process or
    a node cut off from the network (whose TCP connections stay open without a word) does not.
    (gRPC 1.85 ends a ping left unanswered by ``grpc.http2.ping_timeout_ms``; ``keepalive_timeout_ms``
    alone did not, measured on a stopped server.)"""
    if keepalive_s <= 0:
        return list(_CHANNEL_OPTIONS)
    ms = max(1, round(keepalive_s * 1000))
    return [*_CHANNEL_OPTIONS, ("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms),
            ("grpc.http2.ping_timeout_ms", ms), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]


@dataclass
class ModelEntry:
    """A model served by one or more workers, with the tokenizer the gateway uses for it."""

    name: str
    max_context_tokens: int
    tokenizer: ChatTokenizer
    eos_token_ids: tuple[int, ...]
    names: list[str] = field(default_factory=list)  # every name workers serve this model under (name first)
    _texts: TokenTexts | None = field(default=None, repr=False)

    def token_texts(self) -> TokenTexts:
        """Token strings and bytes of this model's tokenizer (for logprobs), built on first use."""
        if self._texts is None:
            self._texts = TokenTexts(self.tokenizer.tokenizer)
        return self._texts

    @property
    def fingerprint(self) -> str:
        """``system_fingerprint`` reported to clients: ``fs_`` + the tokenizer hash prefix."""
        return "fs_" + self.tokenizer.sha256[:12]


@dataclass(eq=False)
class WorkerClient:
    """Connection and state of one worker (``host:port``). Token counts are prompt + max_tokens.

    slow_probes: consecutive late health polls. retired: left the worker list (discovery); gets no
    new requests and is closed once this gateway has nothing in flight on it. keepalive_s: the
    channel's ping interval and timeout in seconds (`channel_options`; 0: none).
    """

    addr: str
    keepalive_s: float = 0.0
    channel: grpc.aio.Channel | None = None
    healthy: bool = False
    agrees: bool = False
    info: pb.ModelInfo | None = None
    local_inflight: int = 0
    remote_inflight: int = 0
    local_at_poll: int = 0
    last_error: str = ""
    slow_probes: int = 0  # consecutive polls of a healthy worker that timed out
    last_model: str | None = None  # the model it served before it went down (info is cleared then)
    last_names: tuple[str, ...] = ()  # every name it served that model under
    down_since: float | None = None  # time.monotonic() when it stopped being usable; None while usable
    retired: bool = False
    worker_id: str = ""  # the worker's own identity (ModelInfo.worker_id), stable across restarts
    stub: pb_grpc.WorkerStub | None = field(default=None, repr=False)
    health: health_pb2_grpc.HealthStub | None = field(default=None, repr=False)
    generations: GenerateStream | None = field(default=None, repr=False)  # its GenerateMany stream
    watch_task: asyncio.Task | None = field(default=None, repr=False)

    def connect(self) -> None:
        """Create the channel and stubs (lazy; no I/O)."""
        if self.channel is None:
            self.channel = grpc.aio.insecure_channel(self.addr, options=channel_options(self.keepalive_s))
            self.stub = pb_grpc.WorkerStub(self.channel)
            self.health = health_pb2_grpc.HealthStub(self.channel)
            self.generations = GenerateStream(self.stub)

    @property
    def model(self) -> str | None:
        """The model this worker serves (its primary name), once known."""
        return self.info.model_name if self.info else None

    @property
    def route_id(self) -> str:
        """The identity routing hashes on: the worker's own id when it reports one (a pod keeps its
        name across restarts while its address changes), else its address."""
        return self.worker_id or self.addr

    @property
    def names(self) -> list[str]:
        """Every name this worker serves its model under (empty until known)."""
        if self.info is None:
            return []
        return list(getattr(self.info, "served_model_names", None) or ()) or [self.info.model_name]

    @property
    def usable(self) -> bool:
        """SERVING, agreeing with the gateway's tokenizer for its model, and still in the worker list."""
        return self.healthy and self.agrees and self.info is not None and not self.retired

    def load_score(self) -> int:
        """In-flight tokens: the worker's own figure at the last poll, corrected by what this gateway
        started or finished since (never below this gateway's own)."""
        return max(self.local_inflight, self.remote_inflight - self.local_at_poll + self.local_inflight)

    async def close(self) -> None:
        """Close the channel."""
        await cancel_and_wait(self.watch_task)
        self.watch_task = None
        if self.generations is not None:
            await self.generations.close()
            self.generations = None
        if self.channel is not None:
            await self.channel.close()
            self.channel = None


class WorkerPool:
    """The workers (discovered live), the models they serve and the routing choice among them.

    addrs: `--workers` entries (``host:port``, ``dns:///name:port``, ``file:///path``; see
    `gateway.discovery`). discovery_interval_s: how often dns/file entries are re-resolved.
    routing: a `gateway.routing_policy.RoutingPolicy` or its name (default least-loaded).

    A worker's health is its answer to the poll: NOT_SERVING, draining, or a refused connection
    takes it out of routing at once; a poll that only times out (a busy worker answering late) does
    so after `unhealthy_after` (>= 1) such polls in a row, so that one late answer on a loaded machine
    does not turn every request into a 503 (the unhealthy threshold of load balancers and Kubernetes
    probes). A call that fails marks its worker unhealthy at once either way (`start_generation`).
    Raises ValueError for a malformed entry or `unhealthy_after` < 1.
    """

    def __init__(self, addrs: list[str], *, health_interval_s: float = 1.0, health_timeout_s: float = 1.0,
                 local_tokenizers: dict[str, TokenizerFiles] | None = None,
                 local_tokenizer: TokenizerFiles | None = None, metrics=None,
                 discovery_interval_s: float = DEFAULT_INTERVAL_S, unhealthy_after: int = 3,
                 routing: RoutingPolicy | str = "least-loaded", keepalive_s: float = 0.0) -> None:
        if unhealthy_after < 1:
            raise ValueError("unhealthy_after must be >= 1")
        self.sources = parse_sources(addrs)
        self.discovery = Discovery(self.sources, self._set_addresses, discovery_interval_s)
        # static entries are known now (no I/O): the pool lists them before it starts
        self.keepalive_s = keepalive_s
        self.workers = [WorkerClient(s.target, keepalive_s) for s in self.sources if s.kind == "static"]
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.unhealthy_after = int(unhealthy_after)
        self.routing = make_routing(routing) if isinstance(routing, str) else routing
        self.models: dict[str, ModelEntry] = {}
        self._local = local_tokenizer
        self._local_tok: ChatTokenizer | None = ChatTokenizer(local_tokenizer) if local_tokenizer else None
        self._task: asyncio.Task | None = None
        self._discovery_task: asyncio.Task | None = None
        self._metrics = metrics
        self._first_round = asyncio.Event()
        self._adopt_lock = asyncio.Lock()
        self._closing: set[asyncio.Task] = set()
        self.recovery_s: dict[str, float] = {}  # model -> how long its last worker outage lasted (s)

    # -- membership --------------------------------------------------------------------------------
    async def _set_addresses(self, addrs: set[str]) -> None:
        """Discovery's answer: add new workers (checked at once), retire the ones that left."""
        known = {w.addr: w for w in self.workers}
        for w in self.workers:
            gone = w.addr not in addrs
            if gone and not w.retired:
                log.info("worker %s left the worker list: no new requests; %d in-flight token(s) finish there",
                         w.addr, w.local_inflight)
                w.retired = True
                self._gauge(w)
            elif not gone and w.retired:
                log.info("worker %s is back in the worker list", w.addr)
                w.retired = False
        added = [WorkerClient(a, self.keepalive_s) for a in sorted(addrs) if a not in known]
        for w in added:
            log.info("worker %s joined the worker list", w.addr)
            self.workers.append(w)
        if added and self._task is not None:
            await asyncio.gather(*(self._check(w) for w in added), return_exceptions=True)
            for w in added:
                self._start_watch(w)

    def _reap(self) -> None:
        """Close and forget retired workers with nothing of this gateway in flight."""
        for w in [w for w in self.workers if w.retired and w.local_inflight <= 0]:
            self.workers.remove(w)
            if self._metrics is not None:
                try:
                    self._metrics.worker_up.remove(w.addr)
                except KeyError:
                    pass
            task = asyncio.get_running_loop().create_task(w.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            log.info("worker %s retired and closed", w.addr)

    # -- polling ---------------------------------------------------------------------------------
    def _set_down(self, w: WorkerClient, reason: str) -> None:
        """Take `w` out of routing now (its model info is read again when it is back)."""
        if w.healthy:
            log.warning("worker %s is not serving (%s)", w.addr, reason)
        w.last_error = reason
        w.healthy = False
        w.slow_probes = 0
        w.info = None  # re-read model info after it comes back (it may have restarted)
        w.agrees = False
        self._gauge(w)

    def _failed(self, w: WorkerClient, e: grpc.aio.AioRpcError, what: str) -> None:
        """A poll that failed: a late answer (DEADLINE_EXCEEDED) of a healthy worker is tolerated
        until `unhealthy_after` in a row; anything else (refused, reset) takes it out at once."""
        reason = f"{what}{e.code().name} {e.details()}"
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and w.healthy:
            w.slow_probes += 1
            if w.slow_probes < self.unhealthy_after:
                log.info("worker %s answered its health poll late (%d in a row); still routing to it", w.addr,
                         w.slow_probes)
                return
            reason = f"{reason} ({w.slow_probes} late poll(s) in a row)"
        self._set_down(w, reason)

    async def _check(self, w: WorkerClient) -> None:
        w.connect()
        try:
            resp = await w.health.Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE),
                                        timeout=self.health_timeout_s)
        except grpc.aio.AioRpcError as e:
            self._failed(w, e, "health: ")
            return
        if resp.status != health_pb2.HealthCheckResponse.SERVING:  # draining or not ready: out at once
            self._set_down(w, "NOT_SERVING")
            return
        try:
            if w.info is None:
                info = await w.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=max(5.0, self.health_timeout_s))
                await self._adopt(w, info)
            load = await w.stub.GetLoad(pb.GetLoadRequest(), timeout=self.health_timeout_s)
        except grpc.aio.AioRpcError as e:
            self._failed(w, e, "")
            return
        w.remote_inflight = int(load.inflight_tokens)
        w.local_at_poll = w.local_inflight
        w.slow_probes = 0
        if load.draining:
            self._set_down(w, "draining")
            return
        if not w.healthy:
            log.info("worker %s is serving model %s", w.addr, w.model)
        w.healthy = True
        w.last_error = ""
        self._gauge(w)

    def _start_watch(self, w: WorkerClient) -> None:
        if w.watch_task is None:
            w.watch_task = asyncio.get_running_loop().create_task(self._watch(w), name=f"health-watch {w.addr}")

    async def _watch(self, w: WorkerClient) -> None:
        """Follow the worker's health ``Watch`` stream: NOT_SERVING takes it out of routing at once
        (a draining worker leaves before it stops); SERVING brings it back through a full check."""
        while True:
            w.connect()
            try:
                call = w.health.Watch(health_pb2.HealthCheckRequest(service=WORKER_SERVICE))
                async for resp in call:
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        if not w.healthy:
                            await self._check(w)
                    elif w.healthy:
                        self._set_down(w, "NOT_SERVING (health watch)")
            except grpc.aio.AioRpcError:
                pass  # unreachable or no Watch: the periodic checks cover it
            await asyncio.sleep(self.health_interval_s)

    def _gauge(self, w: WorkerClient) -> None:
        self._track_outage(w)
        if self._metrics is not None:
            self._metrics.worker_up.labels(w.addr).set(1 if w.usable else 0)

    def _track_outage(self, w: WorkerClient) -> None:
        """Note when `w` stops being usable and, when it is back, how long that took (per model)."""
        if w.usable:
            w.last_model, w.last_names = w.model, tuple(w.names)
            if w.down_since is not None:
                for name in w.last_names:
                    self.recovery_s[name] = time.monotonic() - w.down_since
                w.down_since = None
        elif w.down_since is None and w.last_model is not None and not w.retired:
            w.down_since = time.monotonic()

    def retry_after_s(self, model: str) -> float:
        """Seconds a client should wait before retrying while no worker serves `model` (503): the
        remainder of the expected outage (the last outage of a worker of this model), at least the
        health poll interval; the interval when no outage of the model was seen end yet."""
        downs = [w.down_since for w in self.workers if w.down_since is not None and model in w.last_names]
        expected = self.recovery_s.get(model)
        if expected is None or not downs:
            return self.health_interval_s
        return max(self.health_interval_s, expected - (time.monotonic() - min(downs)))

    async def _adopt(self, w: WorkerClient, info: pb.ModelInfo) -> None:
        """Record a worker's ModelInfo; build or check the model's tokenizer (one worker at a time)."""
        async with self._adopt_lock:
            await self._adopt_locked(w, info)
        w.worker_id = info.worker_id

    async def _adopt_locked(self, w: WorkerClient, info: pb.ModelInfo) -> None:
        files = TokenizerFiles(info.tokenizer_json, info.chat_template, info.bos_token, info.eos_token)
        w.info = info
        if info.tokenizer_sha256 and info.tokenizer_sha256 not in files.sha256_variants():
            w.agrees = False
            w.last_error = "ModelInfo.tokenizer_sha256 does not match the tokenizer and template it sent"
            log.error("worker %s: tokenizer_sha256 %s is not the sha256 of the tokenizer and template it sent (%s); "
                      "not routing to it", w.addr, info.tokenizer_sha256[:12], files.sha256[:12])
            return
        names = w.names
        entry = next((self.models[n] for n in names if n in self.models), None)
        if entry is None:
            if self._local_tok is not None:
                tok = self._local_tok
                agrees = await asyncio.to_thread(self._same_tokenizer, tok, files)
            else:
                tok = await asyncio.to_thread(ChatTokenizer, files)
                agrees = True
            if agrees:
                entry = ModelEntry(info.model_name, int(info.max_context_tokens), tok, tuple(info.eos_token_ids))
                self._register(entry, names)
            w.agrees = agrees
        else:
            w.agrees = await asyncio.to_thread(self._same_tokenizer, entry.tokenizer, files)
            if w.agrees and int(info.max_context_tokens) != entry.max_context_tokens:
                log.error("worker %s serves %s with context %d, others with %d; not routing to it", w.addr,
                          info.model_name, info.max_context_tokens, entry.max_context_tokens)
                w.agrees = False
            clash = [n for n in names if self.models.get(n, entry) is not entry]
            if w.agrees and clash:
                log.error("worker %s serves names %s that name another model here; not routing to it", w.addr, clash)
                w.agrees = False
            if w.agrees:
                self._register(entry, names)
        if not w.agrees:
            w.last_error = "tokenizer disagrees with the gateway's"
            log.error("worker %s: tokenizer/chat template of %s differ from the gateway's; not routing to it",
                      w.addr, info.model_name)

    def _register(self, entry: ModelEntry, names: list[str]) -> None:
        for n in names:
            self.models[n] = entry
            if n not in entry.names:
                entry.names.append(n)

    @staticmethod
    def _same_tokenizer(tok: ChatTokenizer, files: TokenizerFiles) -> bool:
        if tok.sha256 == files.sha256:
            return True
        if tok.files.chat_template != files.chat_template:
            return False
        try:
            return tok.normalized() == ChatTokenizer(files).normalized()
        except Exception:
            return False

    async def poll_once(self) -> None:
        """Check every worker once (concurrently); close retired workers with nothing in flight."""
        await asyncio.gather(*(self._check(w) for w in self.workers if not w.retired), return_exceptions=True)
        self._reap()
        self._first_round.set()

    async def _run(self) -> None:
        await every(lambda: self.health_interval_s, self.poll_once, "worker poll")

    async def start(self, wait_s: float = 0.0) -> None:
        """Resolve the worker list, start polling, watching and (for dns/file entries) discovery;
        wait up to `wait_s` seconds for a usable worker."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="worker-pool")
            await self.discovery.resolve_once()
            for w in self.workers:
                self._start_watch(w)
            if self.discovery.dynamic:
                self._discovery_task = asyncio.get_running_loop().create_task(self._discover(), name="worker-discovery")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not any(w.usable for w in self.workers):
            await asyncio.sleep(0.05)

    async def _discover(self) -> None:
        await asyncio.sleep(self.discovery.interval_s)
        await self.discovery.run()

    async def stop(self) -> None:
        """Stop polling, watching and discovery; close every channel."""
        await cancel_and_wait(self._discovery_task)
        await cancel_and_wait(self._task)
        self._task = self._discovery_task = None
        for w in self.workers:
            await w.close()
        await asyncio.gather(*self._closing, return_exceptions=True)

    # -- queries ---------------------------------------------------------------------------------
    def ready(self) -> bool:
        """True when at least one worker is usable."""
        return any(w.usable for w in self.workers)

    def model_names(self) -> list[str]:
        """Model names (aliases included) served by at least one usable worker, sorted."""
        return sorted({n for w in self.workers if w.usable for n in w.names if n in self.models})

    def model(self, name: str) -> ModelEntry | None:
        """The model entry, or None when no usable worker serves it."""
        if name in self.models and any(w.usable and name in w.names for w in self.workers):
            return self.models[name]
        return None

    def mark_failed(self, w: WorkerClient, reason: str) -> None:
        """Stop routing to `w` now (a call found it unreachable, or its connection broke mid-stream);
        the next successful health check (every ``health_interval_s``) brings it back."""
        if w.healthy:
            log.warning("worker %s marked unhealthy: %s", w.addr, reason)
        w.healthy = False
        w.last_error = reason
        self._gauge(w)

    def candidates(self, model: str, exclude: set[WorkerClient] | frozenset = frozenset()) -> list[WorkerClient]:
        """Usable workers of `model`, minus `exclude`."""
        return [w for w in self.workers if w.usable and model in w.names and w not in exclude]

    def pick(self, model: str, exclude: set[WorkerClient] | frozenset = frozenset(),
             request: RouteRequest | None = None) -> WorkerClient | None:
        """The worker of `model` the routing policy chooses for `request` (without a request: the
        least-loaded one, ties in turn), or None when no usable worker serves it."""
        cands = self.candidates(model, exclude)
        if not cands:
            return None
        if request is None:
            return self.routing.least_loaded(cands)
        return self.routing.choose(request, cands)


def route_request(request: pb.GenerateRequest, cost: int) -> RouteRequest:
    """What routing needs of a ``GenerateRequest``: the tenant, its cache namespace plus the client's
    cache_salt (caches never cross it), the prompt and its cost in tokens."""
    t = request.tenant
    return RouteRequest(t.id, f"{t.cache_namespace or t.id}\x00{request.cache_salt}", request.prompt_token_ids,
                        int(cost), TIER_NAMES.get(t.tier, "interactive"))


@dataclass(eq=False)
class Generation:
    """A ``Generate`` stream that has produced its first token (or finished) on one worker.

    worker: where it runs. call: its generation on the worker's GenerateMany stream
    (gateway/worker_stream.py) when the worker's ModelInfo says ``generate_many``, else the
    ``grpc.aio`` Generate call. request_id: the attempt's id.
    cost: tokens counted on the worker while it runs. pending: messages already read (they come
    first). span: the attempt's ``gateway.worker_call`` span.
    Iterate it for the remaining `GenerateResponse` messages (the ones already read come first).
    `cancel()` cancels the gRPC call (the worker aborts). `close()` releases the worker's load count
    and ends the attempt's span.
    """

    worker: WorkerClient
    call: "StreamedGenerate | grpc.aio.UnaryStreamCall"
    request_id: str
    cost: int
    pending: list[pb.GenerateResponse]
    span: trace.Span = trace.INVALID_SPAN
    closed: bool = field(default=False, init=False)

    async def messages(self) -> AsyncIterator[pb.GenerateResponse]:
        """All messages of the stream. Raises grpc.aio.AioRpcError / asyncio.CancelledError on failure."""
        while self.pending:
            yield self.pending.pop(0)
        if self.call.cancelled():
            raise asyncio.CancelledError()
        it = self.call.__aiter__()  # the call's one message iterator, resumed where start_generation left it
        while True:
            try:
                msg = await it.__anext__()
            except StopAsyncIteration:
                return
            yield msg

    def cancel(self) -> None:
        """Cancel the call (the worker aborts the request)."""
        if not self.call.done():
            self.call.cancel()

    def close(self) -> None:
        """Cancel if still running and stop counting this request's tokens on the worker (idempotent)."""
        cancelled = not self.call.done()
        self.cancel()
        if not self.closed:
            self.closed = True
            self.worker.local_inflight -= self.cost
            if self.span.is_recording():
                self.span.set_attribute("fairshare.cancelled", cancelled)
            self.span.end()

    def fail(self, code: str) -> None:
        """Mark the attempt failed (`code`: a gRPC status name or a short reason) and close it."""
        if self.span.is_recording():
            self.span.set_attribute("error.type", code)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, code))
        self.close()


def _is_progress(msg: pb.GenerateResponse) -> bool:
    return bool(msg.token_ids) or bool(msg.text_delta) or msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED


async def start_generation(pool: WorkerPool, model: str, request: pb.GenerateRequest, cost: int, *,
                           max_attempts: int = 3, metrics=None, tracer: trace.Tracer | None = None,
                           parent=None, deadline: float | None = None, signer=None) -> Generation:
    """Start `request` on the worker of `model` the pool's routing policy picks, retrying on another worker when one fails
    before its first token.

    tracer / parent: each attempt is a ``gateway.worker_call`` span of `tracer` (default: the global
    one) under the context `parent` (default: the current one); the current span (``gateway.routing``)
    gets the attempt count and the chosen worker.
    deadline: ``time.monotonic()`` by which the whole generation must end (the gRPC deadline of each
    attempt; None: none).
    signer: a `fairshare.worker_auth.Signer`; each attempt carries its token (bound to the attempt's
    request id) in the call's metadata (None: unsigned).
    Raises APIError: 400 when the worker rejects the request as invalid (code ``invalid_grammar`` for a
    grammar it cannot compile), 503 when no worker could run
    it, 504 when the deadline passed. Cancellation (asyncio) cancels the call in progress.
    """
    tracer = tracer or trace.get_tracer("fairshare.gateway")
    routing = trace.get_current_span()
    tried: set[WorkerClient] = set()
    last: str = "no worker serves this model"
    route = route_request(request, cost)
    handed: set[WorkerClient] = set()  # workers that handed it back (healthy: it may wait there after all)
    failures = attempt = 0
    while failures < max(1, max_attempts):
        w = _next_worker(pool, model, route, tried, handed)
        if w is None:
            break
        tried.add(w)
        if routing.is_recording():
            routing.set_attribute("fairshare.attempts", attempt + 1)
        # the worker may hand it back before admission only when another worker could take it
        # (worker/scheduling/handback.py; at most MAX_HAND_BACKS times)
        request.may_hand_back = route.handed_back < MAX_HAND_BACKS and bool(pool.candidates(model, tried))
        gen = _call_worker(w, request, attempt, cost, tracer, parent, deadline, signer)
        attempt += 1
        try:
            last = await _until_first_token(gen)
            if not last:
                if routing.is_recording():
                    routing.set_attribute("fairshare.worker", w.addr)
                return gen
            if last == HANDED_BACK:  # not a failure: the worker stays healthy and no retry is spent
                route = _handed_back(gen, w, route, handed, metrics)
                continue
            log.warning("%s; retrying on another worker", last)
            gen.fail("no_first_token")
        except grpc.aio.AioRpcError as e:
            gen.fail(e.code().name)
            last = _failed_before_first_token(pool, w, e, deadline)
        except BaseException:
            gen.close()
            raise
        failures += 1
        if metrics is not None:
            metrics.worker_retries.labels(w.addr).inc()
    log.warning("no worker could serve request %s (%s)", request.request_id, last)
    raise unavailable("No worker could serve the request right now; please retry.",
                      retry_after_s=pool.retry_after_s(model))


def _next_worker(pool: WorkerPool, model: str, route: RouteRequest, tried: set[WorkerClient],
                 handed: set[WorkerClient]) -> WorkerClient | None:
    """The routing policy's pick among the workers of `model` not yet `tried`; when none is left but some
    `handed` the request back (healthy, only busy), one of those, so that it waits there rather than
    fails (that worker leaves `handed`: it will not hand the request back again). None: no worker."""
    w = pool.pick(model, tried, route)
    if w is None and handed:
        w = pool.pick(model, tried - handed, route)
        handed.discard(w)
    return w


def _handed_back(gen: Generation, w: WorkerClient, route: RouteRequest, handed: set[WorkerClient],
                 metrics) -> RouteRequest:
    """Book a hand-back by `w` (worker/scheduling/handback.py): close its stream `gen` (traced, counted in
    ``fairshare_gateway_hand_backs_total``), remember `w` in `handed` and return `route` with one more
    hand-back; not a failure, so `w` stays healthy and no retry is spent."""
    if gen.span.is_recording():
        gen.span.set_attribute("fairshare.handed_back", True)
    gen.close()
    handed.add(w)
    if metrics is not None:
        metrics.hand_backs.labels(w.addr).inc()
    return replace(route, handed_back=route.handed_back + 1)


def _call_worker(w: WorkerClient, request: pb.GenerateRequest, attempt: int, cost: int, tracer: trace.Tracer,
                 parent, deadline: float | None, signer) -> Generation:
    """Open attempt number `attempt` of `request` on `w` (request id ``<id>.r<attempt>`` after the first),
    in a ``gateway.worker_call`` span, counting `cost` tokens on the worker; signed and traced."""
    req = request
    if attempt:  # a retry: a copy under its own id (the first attempt sends the request as built)
        req = pb.GenerateRequest()
        req.CopyFrom(request)
        req.request_id = f"{request.request_id}.r{attempt}"
    w.local_inflight += cost
    many = w.info is not None and w.info.generate_many  # on the worker's one GenerateMany stream (worker_stream.py)
    span = tracer.start_span("gateway.worker_call", context=parent, kind=SpanKind.CLIENT, attributes={
        "rpc.system": "grpc", "rpc.service": WORKER_SERVICE, "rpc.method": "GenerateMany" if many else "Generate",
        "server.address": w.addr, "fairshare.request_id": req.request_id, "fairshare.attempt": attempt})
    metadata = inject_metadata(trace.set_span_in_context(span))
    if signer is not None:
        metadata = [*(metadata or ()), *signer.metadata(generate_claims(req))]
    timeout = None if deadline is None else max(0.001, deadline - time.monotonic())
    if many:
        call = w.generations.generate(req, metadata=metadata or None, timeout=timeout)
    else:
        call = w.stub.Generate(req, metadata=metadata or None, timeout=timeout)
    return Generation(w, call, req.request_id, cost, [], span)


HANDED_BACK = "handed back before its first token"  # `_until_first_token`: route it to another worker


async def _until_first_token(gen: Generation) -> str:
    """Read `gen`'s stream into ``gen.pending`` until its first token (or finish): "" then;
    `HANDED_BACK` when the worker handed the request back (FINISH_REASON_HANDED_BACK, before any
    token: worker/scheduling/handback.py); else why the worker failed before it (the stream ended, or
    the worker aborted). Raises grpc.aio.AioRpcError."""
    it = gen.call.__aiter__()
    while True:
        try:
            msg = await it.__anext__()
        except StopAsyncIteration:  # stream ended without a final message: a broken worker
            return f"worker {gen.worker.addr} ended the stream without finishing"
        if msg.finish_reason == pb.FINISH_REASON_HANDED_BACK and not msg.token_ids and not msg.text_delta:
            return HANDED_BACK
        if msg.finish_reason == pb.FINISH_REASON_ABORT and not msg.token_ids and not msg.text_delta:
            return f"worker {gen.worker.addr} aborted the request before its first token"
        gen.pending.append(msg)
        if _is_progress(msg):
            return ""


def _failed_before_first_token(pool: WorkerPool, w: WorkerClient, e: grpc.aio.AioRpcError,
                               deadline: float | None) -> str:
    """What a call that failed before its first token means: raises APIError 400 (the worker found the
    request invalid) or 504 (the deadline passed); else returns why, for a retry on another worker
    (a worker UNAVAILABLE is marked failed)."""
    if e.code() in _CLIENT_CODES:
        meta = dict(e.trailing_metadata() or ())
        what = meta.get(INVALID_METADATA_KEY)
        raise invalid_request(e.details() or "invalid request", None,
                              "invalid_grammar" if what == "grammar" else "invalid_value") from None
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None:
        raise APIError(504, "The request did not start within the gateway's request timeout.",
                       "server_error", None, "timeout") from None
    last = f"worker {w.addr}: {e.code().name} {e.details()}"
    log.warning("generation failed before the first token (%s); retrying on another worker", last)
    if e.code() == grpc.StatusCode.UNAVAILABLE:
        pool.mark_failed(w, "UNAVAILABLE before the first token")
    return last

__all__ = ["APIError", "Generation", "ModelEntry", "WorkerClient", "WorkerPool", "route_request", "start_generation"]
