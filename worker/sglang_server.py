"""`fairshare worker --engine sglang`: SGLang's engine, in process, behind FairShare's gRPC contract.

    fairshare worker --engine sglang --model PATH [--tp-size N] [--mem-fraction-static F]
                     [--policy vtc|vtc-pred|drr|fcfs|off] [--alpha 1 --beta 2] [--host --port]

The gRPC surface is the reference worker's (`proto/fairshare/v1/worker.proto`): server-streaming
`Generate` (token ids and text deltas, finish reason, usage with SGLang's cached-token count),
`Abort` (and cancelling the stream aborts), `GetModelInfo`, `GetLoad`, plus `grpc.health.v1`.
Fair scheduling happens inside SGLang's scheduler processes, through FairShare's plugin
(`worker.sglang_plugin`, entry point `sglang.srt.plugins`): this module only puts each request's
tenant where the plugin reads it, signed (see `worker.sglang_plugin.tenant`):

- `sampling_params.custom_params["fairshare_tenant"]`: HMAC-signed tenant id, weight and tier
  (the secret is created here and reaches SGLang's spawned schedulers through the environment);
- `extra_key = "fs|" + derive_namespace(...)`: the radix-cache namespace the worker derives from
  the tenant id and the client's salt (`worker.sglang_plugin.tenant.extra_key_for`; the gateway's
  `Tenant.cache_namespace` is not used); the plugin enforces it in the scheduler;
- `cache_salt`: the client's salt (splits the tenant's own namespace only).

Authentication: every ``Generate`` / ``Abort`` must carry the gateway's token (fairshare/worker_auth.py,
the same check as the reference worker's); anything else is refused with UNAUTHENTICATED before SGLang
sees it and counted in ``fairshare_worker_auth_failures_total{reason}`` (``--metrics-port``).

Scheduler failure: SGLang's scheduler processes report a crash by sending SIGQUIT to this process
(`sglang.srt.managers.scheduler.run_scheduler_process`). This worker then reports NOT_SERVING at
once (the gateway stops routing to it), ends every open stream with UNAVAILABLE (the gateway retries
those without a token yet on another worker, the others get an OpenAI error) and refuses new calls;
after ``--engine-failure-exit-s`` it hands over to SGLang's own handler, which ends the process tree,
so that its supervisor restarts it (worker/faults.py).

SGLang's rid is a fixed-length digest of FairShare's request id: SGLang aborts by rid *prefix*
(`Scheduler.abort_request` matches `rid.startswith(...)`), so rids must be prefix-free.

Text: SGLang samples and applies stop tokens/strings; the text deltas are produced here with the
model's `tokenizer.json` (the same incremental detokenizer and stop-string hold-back as the
reference engine), so a stop string is never emitted, not even partially.

Logprobs and grammars use SGLang's own machinery: `SamplingParams.logprobs` / `top_logprobs` become
`return_logprob` / `top_logprobs_num` (SGLang's logprobs are, like the reference engine's, taken
after the temperature, before top-k / top-p), read back from `meta_info["output_token_logprobs"]`
and `["output_top_logprobs"]`; `SamplingParams.grammar` becomes SGLang's constrained-decoding
sampling parameter (`json_schema`, `regex`, `ebnf` or `structural_tag`; `json_object` is the JSON
Schema ``{"type": "object"}``), compiled by SGLang's grammar backend (xgrammar by default). Before
SGLang sees it, a grammar is checked as the reference engine checks it (`GrammarCompiler.compile`,
worker/engine/grammar.py, on a thread: it must compile and admit an output, and so must each JSON
schema inside a structural tag); a refused one, or one SGLang itself cannot compile (a 400 abort),
is answered INVALID_ARGUMENT with trailing metadata ``fairshare-invalid: grammar``.

Needs a GPU node with `sglang==0.5.23` installed (extra `[sglang]`). Request translation
(`request_to_sglang`, `response_from_sglang`) imports neither sglang nor torch and is tested on CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from fairshare import worker_auth
from fairshare.tiers import DEFAULT_TIER
from fairshare.v1 import worker_pb2, worker_pb2_grpc
from fairshare.contract import FINISH_ENUMS as _FINISH
from fairshare.contract import INVALID_METADATA_KEY, grammar_of
from fairshare.contract import SERVICE_NAME
from fairshare.contract import TIER_ENUMS as _TIER_ENUMS
from fairshare.contract import TIER_NAMES as _TIER_NAMES
from worker import grpc_server
from worker.faults import FaultWindow
from worker.multiplex import GenerateManyMixin
from worker.cli import add_served_name_arguments, served_names
from worker.sglang_plugin import tenant as tenant_mod
from worker.tracing import RequestTrace

log = logging.getLogger("fairshare.worker.sglang")


class InvalidRequest(ValueError):
    """The request can never run (maps to gRPC INVALID_ARGUMENT)."""


class SchedulerFailed(RuntimeError):
    """SGLang's scheduler failed (its process reported it): the request cannot go on here."""


def sglang_rid(request_id: str) -> str:
    """SGLang request id for a FairShare request id: fixed length, hence prefix-free."""
    return "fs-" + hashlib.sha256(request_id.encode()).hexdigest()[:32]


@dataclass
class ModelFacts:
    """What the servicer needs to know about the model: limits for validation and the tokenizer
    files for `GetModelInfo` and detokenization."""

    name: str
    max_context_tokens: int
    vocab_size: int
    tokenizer_json: str = ""
    chat_template: str = ""
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token: str = ""
    eos_token: str = ""
    served_names: list[str] = field(default_factory=list)  # every name clients may use (name first)


def request_to_sglang(request: worker_pb2.GenerateRequest, facts: ModelFacts, secret: str) -> dict:
    """Keyword arguments for SGLang's `GenerateReqInput` for one FairShare request.

    Raises InvalidRequest when the request can never run (no tenant, empty or too long prompt,
    token ids outside the vocabulary, bad sampling values).
    """
    tenant = request.tenant
    if not tenant.id:
        raise InvalidRequest("tenant.id is required")
    prompt = list(request.prompt_token_ids)
    if not prompt:
        raise InvalidRequest("the prompt is empty")
    if any(t >= facts.vocab_size for t in prompt):
        raise InvalidRequest(f"prompt token ids must be in [0, {facts.vocab_size})")
    if len(prompt) >= facts.max_context_tokens:
        raise InvalidRequest(f"the prompt has {len(prompt)} tokens; this model's context is "
                             f"{facts.max_context_tokens} tokens, including at least one output token")
    weight = tenant.weight or 1.0
    if not weight > 0:
        raise InvalidRequest("tenant weight must be > 0")
    s = request.sampling
    if s.temperature < 0:
        raise InvalidRequest("temperature must be >= 0")
    if s.top_p < 0 or s.top_p > 1:
        raise InvalidRequest("top_p must be in [0, 1]")
    room = facts.max_context_tokens - len(prompt)
    request_id = request.request_id or uuid.uuid4().hex
    rid = sglang_rid(request_id)
    sampling: dict = {
        "max_new_tokens": min(s.max_tokens, room) if s.max_tokens else room,
        "temperature": float(s.temperature),
        "top_p": float(s.top_p) if 0.0 < s.top_p <= 1.0 else 1.0,
        "top_k": int(s.top_k) if s.top_k > 0 else -1,
        "ignore_eos": bool(s.ignore_eos),
        "skip_special_tokens": True,
        "custom_params": {tenant_mod.CUSTOM_PARAM_KEY: tenant_mod.sign(
            tenant.id, weight, _TIER_NAMES.get(tenant.tier, DEFAULT_TIER), secret, rid=rid)},
    }
    if s.stop:
        sampling["stop"] = list(s.stop)
    if s.stop_token_ids:
        sampling["stop_token_ids"] = [int(t) for t in s.stop_token_ids]
    if s.HasField("seed"):
        sampling["sampling_seed"] = int(s.seed)
    if s.top_logprobs and not s.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs")
    if s.top_logprobs > 20:
        raise InvalidRequest("top_logprobs must be in [0, 20]")
    if s.HasField("grammar"):
        kind = s.grammar.WhichOneof("kind")
        if kind == "json_object":
            sampling["json_schema"] = '{"type": "object"}'
        elif kind is not None:
            sampling[kind] = getattr(s.grammar, kind)  # json_schema, regex, ebnf, structural_tag
    kwargs = {
        "input_ids": prompt,
        "sampling_params": sampling,
        "rid": rid,
        "stream": True,
        "extra_key": tenant_mod.extra_key_for(tenant.id, request.cache_salt, secret),
        "cache_salt": request.cache_salt or None,
    }
    if s.logprobs:  # output positions only (logprob_start_len -1), no token text (the gateway has it)
        kwargs.update(return_logprob=True, logprob_start_len=-1, top_logprobs_num=int(s.top_logprobs))
    return kwargs


def finish_reason_of(meta_info: dict) -> tuple[int | None, str | None, int | None]:
    """(proto finish reason or None while running, abort message, abort HTTP status) from SGLang's
    `meta_info["finish_reason"]` (None, or a dict with `type` stop / length / abort)."""
    reason = meta_info.get("finish_reason")
    if reason is None:
        return None, None, None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    proto = _FINISH.get(kind, worker_pb2.FINISH_REASON_ABORT)
    if proto == worker_pb2.FINISH_REASON_ABORT and isinstance(reason, dict):
        return proto, reason.get("message"), reason.get("status_code")
    return proto, None, None


class StreamTranslator:
    """Turns SGLang's streamed outputs for one request into `GenerateResponse` messages.

    incremental: SGLang streams only the new ids in each output (`incremental_streaming_output`);
    otherwise each output holds all ids so far. tokenizer: a `tokenizers.Tokenizer` (None: no
    text). stop: the request's stop strings (text is cut before the first one and a possible
    beginning of one is held back). skip_ids: token ids never rendered (EOS, stop token ids).
    """

    def __init__(self, prompt: list[int], incremental: bool, tokenizer=None, stop: list[str] | None = None,
                 skip_ids: set[int] | None = None, arrival: float | None = None) -> None:
        from worker.engine.detokenizer import IncrementalDetokenizer

        self.incremental = incremental
        self.stop = list(stop or [])
        self.detok = IncrementalDetokenizer(tokenizer, prompt, skip_ids) if tokenizer is not None else None
        self.tokens: list[int] = []
        self.text = ""
        self.emitted_text = 0
        self.emitted_tokens = 0
        self.stopped = False
        self.arrival = time.monotonic() if arrival is None else arrival
        self.first_token_s: float | None = None
        self.sent_first = False
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []  # (token, logprob, top)
        self.emitted_logprobs = 0

    def feed(self, out: dict) -> worker_pb2.GenerateResponse | None:
        """One SGLang output → a message (None when nothing new and not finished)."""
        ids = [int(t) for t in (out.get("output_ids") or [])]
        new = ids if self.incremental else ids[len(self.tokens):]
        meta = out.get("meta_info") or {}
        proto_reason, _, _ = finish_reason_of(meta)
        self._take_logprobs(meta)
        for tok in new:
            self.tokens.append(tok)
            if self.detok is not None and not self.stopped:
                self.text += self.detok.add(tok)
                self._cut_at_stop()
        if new and self.first_token_s is None:
            self.first_token_s = time.monotonic() - self.arrival
        final = proto_reason is not None
        if final and self.detok is not None and not self.stopped:
            self.text += self.detok.flush()
            self._cut_at_stop()
        if not new and not final:
            return None
        return self._message(meta, proto_reason)

    def _take_logprobs(self, meta: dict) -> None:
        """Collect the new entries of `meta_info["output_token_logprobs"]` ((logprob, token id, text)
        per output position) and `["output_top_logprobs"]` (a list of such per position, or None):
        only the new ones in incremental streams, all so far otherwise."""
        lps = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        start = 0 if self.incremental else len(self.logprobs)
        for i in range(start, len(lps)):
            lp, tok = lps[i][0], lps[i][1]
            top = tops[i] if i < len(tops) and tops[i] else []
            self.logprobs.append((int(tok), float(lp), [(int(t[1]), float(t[0])) for t in top]))

    def _cut_at_stop(self) -> None:
        if not self.stop:
            return
        longest = max(len(s) for s in self.stop)
        start = max(0, self.emitted_text - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _message(self, meta: dict, proto_reason: int | None) -> worker_pb2.GenerateResponse:
        from worker.engine.detokenizer import stop_string_holdback

        final = proto_reason is not None
        hold = 0 if (final or self.stopped) else stop_string_holdback(self.text, self.stop)
        end = max(self.emitted_text, len(self.text) - hold)
        msg = worker_pb2.GenerateResponse(token_ids=self.tokens[self.emitted_tokens:],
                                          text_delta=self.text[self.emitted_text:end])
        self.emitted_text = end
        self.emitted_tokens = len(self.tokens)
        for tok, lp, top in self.logprobs[self.emitted_logprobs:]:
            entry = msg.logprobs.add(token_id=tok, logprob=lp)
            for alt, alt_lp in top:
                entry.top.add(token_id=alt, logprob=alt_lp)
        self.emitted_logprobs = len(self.logprobs)
        if not self.sent_first:
            queued = meta.get("queue_time")
            if isinstance(queued, (int, float)):
                msg.timings.queued_s = float(queued)
            self.sent_first = True
        if self.first_token_s is not None:
            msg.timings.first_token_s = self.first_token_s
        if final:
            msg.finish_reason = proto_reason
            msg.usage.prompt_tokens = int(meta.get("prompt_tokens") or 0)
            msg.usage.completion_tokens = int(meta.get("completion_tokens") or len(self.tokens))
            msg.usage.cached_prompt_tokens = int(meta.get("cached_tokens") or 0)
        return msg


# ---- model files ---------------------------------------------------------------------------------
def read_model_facts(model_dir: str | Path, context_len: int | None = None,
                     name: str | list[str] | None = None) -> ModelFacts:
    """Tokenizer files and limits of an HF model directory (no weights are read). name: the
    name(s) to serve under (default: the directory's name).

    Raises FileNotFoundError when config.json is missing.
    """
    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    text_cfg = cfg.get("text_config") or cfg
    tok_json = (d / "tokenizer.json").read_text() if (d / "tokenizer.json").is_file() else ""
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
    template = tok_cfg.get("chat_template") or ""
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: take the default
        template = next((t.get("template", "") for t in template if t.get("name") == "default"), "")

    def token_str(v) -> str:
        return v.get("content", "") if isinstance(v, dict) else (v or "")

    eos: list[int] = []
    for source in (cfg, text_cfg, _read_json(d / "generation_config.json")):
        v = source.get("eos_token_id")
        for t in (v if isinstance(v, list) else [v]):
            if isinstance(t, int) and t not in eos:
                eos.append(t)
    vocab = int(text_cfg.get("vocab_size") or 0)
    if tok_json and not vocab:
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_str(tok_json).get_vocab_size()
    max_ctx = int(context_len or text_cfg.get("max_position_embeddings") or 4096)
    names = list(name) if isinstance(name, (list, tuple)) else [name] if name else [d.resolve().name]
    return ModelFacts(name=names[0], served_names=names, max_context_tokens=max_ctx, vocab_size=vocab,
                      tokenizer_json=tok_json, chat_template=template, eos_token_ids=sorted(eos),
                      bos_token=token_str(tok_cfg.get("bos_token")), eos_token=token_str(tok_cfg.get("eos_token")))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# ---- the servicer --------------------------------------------------------------------------------
def _generate_req_input(**kwargs):
    from sglang.srt.managers.io_struct import GenerateReqInput

    return GenerateReqInput(**kwargs)


_FINISH_NAMES = {v: k for k, v in _FINISH.items()}


class SchedulerSnapshots:
    """The SGLang schedulers' FairShare figures in the reference engine's `snapshot()` shape, for
    `worker.metrics.EngineCollector` (the reference worker's per-tenant and per-tier series).

    Each scheduler process's plugin adds them to `Scheduler.get_internal_state`
    (`worker.sglang_plugin.hooks.after_get_internal_state`); `snapshot()` asks the tokenizer
    manager for every data-parallel rank's state on the engine's event loop (`loop`, set by `serve`)
    and merges them: tenants listed once per rank (the collector sums additive series by tenant),
    counts summed. Raises RuntimeError without a loop or when no scheduler answers with FairShare
    figures (the collector then exports nothing for that scrape); waits at most `timeout_s`."""

    ADDITIVE = ("waiting", "running", "kv_blocks_used", "kv_blocks_total", "inflight_tokens")

    def __init__(self, engine, timeout_s: float = 2.0) -> None:
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self.timeout_s = timeout_s

    def snapshot(self) -> dict:
        if self.loop is None:
            raise RuntimeError("no event loop to reach SGLang's tokenizer manager")
        future = asyncio.run_coroutine_threadsafe(self.engine.tokenizer_manager.get_internal_state(), self.loop)
        states = [s["fairshare"] for s in future.result(self.timeout_s) if isinstance(s, dict) and "fairshare" in s]
        if not states:
            raise RuntimeError("SGLang's schedulers report no FairShare state (is the plugin loaded?)")
        merged = dict(states[0], tenants=[t for s in states for t in s["tenants"]])
        for key in self.ADDITIVE:
            merged[key] = sum(s.get(key, 0) for s in states)
        merged["iterations"] = max(s.get("iterations", 0) for s in states)
        reasons: dict[str, int] = {}
        for s in states:
            for reason, n in s.get("preemptions_by_reason", {}).items():
                reasons[reason] = reasons.get(reason, 0) + n
        merged["preemptions_by_reason"] = reasons
        return merged


@dataclass(frozen=True)
class _Usage:
    cached_tokens: int


@dataclass
class _TenantStats:
    weight: float = 1.0
    tier: str = DEFAULT_TIER
    running: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finished: int = 0


class SGLangWorkerServicer(GenerateManyMixin, worker_pb2_grpc.WorkerServicer):
    """The Worker service over an in-process `sglang.Engine`.

    engine: the SGLang engine (its `tokenizer_manager` serves requests). facts: `ModelFacts`.
    secret: the tenant-token secret shared with the plugin. policy: the plugin's policy name (for
    GetLoad). request_factory: builds the request object from `request_to_sglang`'s keyword
    arguments (default SGLang's `GenerateReqInput`). Per-tenant figures in GetLoad are what this
    process sees (streams, usage); the virtual counters live in SGLang's scheduler processes.
    verifier: checks the gateway's token on Generate / Abort (`fairshare.worker_auth.Verifier`; None:
    no authentication, for tests of the translation only). metrics: a `worker.metrics.WorkerMetrics`
    (default: a fresh one exporting the schedulers' figures, `SchedulerSnapshots`, unless the
    policy is `off`). `faults` trips at the first scheduler failure
    (`scheduler_failed`); `on_failed(reason)` is called then (the server sets health NOT_SERVING).
    tracer: the OpenTelemetry tracer of the reference worker's spans (`worker.tracing.RequestTrace`:
    `worker.generate` with `worker.queue` / `worker.prefill` / `worker.decode`; default the global
    provider's). ttft_floor_s: tier -> seconds; a request's first token is held here until that long
    after its arrival at this worker (`--ttft-floor`, the reference engine's rule; errors and aborts
    are never held). The per-tenant stream series (TTFT, queue time, ITL, requests by finish reason,
    prompt and cached prompt tokens) are the reference worker's (`worker.metrics.WorkerMetrics`).
    """

    def __init__(self, engine, facts: ModelFacts, secret: str, policy: str = "vtc", request_factory=None, *,
                 verifier: worker_auth.Verifier | None = None, metrics=None, tracer=None,
                 ttft_floor_s: dict[str, float] | None = None) -> None:
        from worker.metrics import WorkerMetrics
        from worker.tracing import worker_tracer

        self.engine = engine
        self.tracer = tracer if tracer is not None else worker_tracer()
        self.ttft_floor_s = dict(ttft_floor_s or {})
        self.verifier = verifier
        self.faults = FaultWindow(limit=1)  # one scheduler failure fails this worker
        self.snapshots = SchedulerSnapshots(engine)
        if metrics is None:  # the schedulers' figures exist only with the plugin on
            metrics = WorkerMetrics(self.snapshots if policy != "off" else None, faults=self.faults)
        self.metrics = metrics
        self.on_failed = None
        self._failed = asyncio.Event()
        self.request_factory = request_factory or _generate_req_input
        self.facts = facts
        self.secret = secret
        self.policy = policy
        self.draining = False
        self.live: dict[str, str] = {}  # FairShare request id -> SGLang rid
        self.tenants: dict[str, _TenantStats] = {}
        self.tokenizer = None
        self._grammars = None  # worker/engine/grammar.GrammarCompiler, built on the first grammar (`_grammar_compiler`)
        self._grammar_lock = threading.Lock()
        if facts.tokenizer_json:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_str(facts.tokenizer_json)
        self.incremental = bool(getattr(engine.tokenizer_manager, "incremental_streaming_output", False))
        digest = hashlib.sha256((facts.tokenizer_json + "\0" + facts.chat_template).encode()).hexdigest()
        self._model_info = worker_pb2.ModelInfo(
            model_name=facts.name, served_model_names=facts.served_names or [facts.name],
            max_context_tokens=facts.max_context_tokens, tokenizer_json=facts.tokenizer_json,
            chat_template=facts.chat_template, eos_token_ids=facts.eos_token_ids, tokenizer_sha256=digest,
            bos_token=facts.bos_token, eos_token=facts.eos_token, generate_many=True)  # GenerateManyMixin

    def _grammar_compiler(self):
        """The `worker.engine.grammar.GrammarCompiler` for this model's vocabulary (built on first use,
        thread-safe; imports torch and xgrammar only then). Its compilations only decide refusals:
        SGLang compiles the grammar it decodes with itself."""
        with self._grammar_lock:
            if self._grammars is None:
                from worker.engine.grammar import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.facts.vocab_size,
                                                 sorted(self.facts.eos_token_ids), cache_mb=64)
            return self._grammars

    def _abort_sglang(self, rid: str) -> None:
        try:
            self.engine.tokenizer_manager.abort_request(rid=rid)
        except Exception:  # the engine may be shutting down
            log.exception("abort of %s failed", rid)

    def scheduler_failed(self, reason: str) -> None:
        """SGLang's scheduler failed (SIGQUIT from a child process): stop serving here. Open streams end
        with UNAVAILABLE, new calls are refused with UNAVAILABLE; `on_failed(reason)` is called. Call on
        the event loop."""
        if self.faults.failure(reason):
            log.critical("SGLang scheduler failed (%s): NOT_SERVING; failing %d open stream(s)", reason, len(self.live))
            self._failed.set()
            if self.on_failed is not None:
                self.on_failed(self.faults.reason)

    async def _until_failed(self, generator):
        """The generator's outputs, until SGLang's scheduler fails (then SchedulerFailed)."""
        it = generator.__aiter__()
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                await asyncio.wait({nxt, failed}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    await asyncio.gather(nxt, return_exceptions=True)
                    raise SchedulerFailed(self.faults.reason or "the SGLang scheduler failed")
                try:
                    yield nxt.result()
                except StopAsyncIteration:
                    return
        finally:
            failed.cancel()

    async def Generate(self, request, context):
        await worker_auth.require(self.verifier, worker_auth.generate_claims(request), context,
                                  self.metrics.observe_auth_failure)
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        if self.faults.tripped:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine has failed: {self.faults.reason}")
        tenant = request.tenant
        tier = _TIER_NAMES.get(tenant.tier, DEFAULT_TIER)
        arrival = time.monotonic()
        rt = RequestTrace(self.tracer, context.invocation_metadata(), request.request_id, tenant.id,
                          prompt_tokens=len(request.prompt_token_ids), max_tokens=request.sampling.max_tokens,
                          tier=tier)
        try:
            kwargs = request_to_sglang(request, self.facts, self.secret)
        except InvalidRequest as exc:
            self._rejected(rt, tenant.id)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request_id = request.request_id or kwargs["rid"]
        if request_id in self.live:
            self._rejected(rt, tenant.id)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"duplicate request id {request_id!r}")
        grammar = grammar_of(request.sampling)
        if grammar is not None and self.tokenizer is not None:
            # the reference engine's refusals (one home: worker/engine/grammar.GrammarCompiler): a grammar
            # xgrammar compiles but that nothing satisfies (a schema {"$ref": "#"}, a tool whose
            # parameters admit no value) is refused here, before SGLang, whose backend compiles it, starts it
            try:
                await asyncio.to_thread(self._grammar_compiler().compile, *grammar)
            except ValueError as exc:
                self._rejected(rt, tenant.id)
                context.set_trailing_metadata(((INVALID_METADATA_KEY, "grammar"),))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        rid = kwargs["rid"]
        stats = self.tenants.setdefault(tenant.id, _TenantStats())
        stats.weight, stats.tier = tenant.weight or 1.0, tier
        skip = set(self.facts.eos_token_ids) | set(request.sampling.stop_token_ids)
        translator = StreamTranslator(list(request.prompt_token_ids), self.incremental, self.tokenizer,
                                      list(request.sampling.stop), skip, arrival=arrival)
        floor = self.ttft_floor_s.get(tier, 0.0)
        self.live[request_id] = rid
        stats.running += 1
        finished = False
        outcome, usage = "cancelled", None
        last_token_at: float | None = None
        generator = self.engine.tokenizer_manager.generate_request(self.request_factory(**kwargs), None)
        try:
            async for out in self._until_failed(generator):
                msg = translator.feed(out)
                if msg is None:
                    continue
                meta = out.get("meta_info") or {}
                status = None
                if msg.finish_reason:
                    _, message, status = finish_reason_of(meta)
                    if msg.finish_reason == worker_pb2.FINISH_REASON_ABORT and status == 400:
                        finished, outcome = True, "rejected"
                        if request.sampling.HasField("grammar") and "grammar" in (message or ""):
                            # SGLang's grammar backend could not compile it ("Failed to compile ... grammar")
                            context.set_trailing_metadata(((INVALID_METADATA_KEY, "grammar"),))
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message or "invalid request")
                    if msg.finish_reason == worker_pb2.FINISH_REASON_ABORT and (status or 0) >= 500:
                        finished, outcome = True, "error"
                        await context.abort(grpc.StatusCode.INTERNAL, message or "internal error in SGLang")
                if msg.token_ids and last_token_at is None and floor > 0:
                    # TTFT floor: the tier's first token leaves no earlier than arrival + floor (the
                    # reference engine's rule, Engine._hold); the TTFT reported is the one the client sees
                    hold = translator.arrival + floor - time.monotonic()
                    if hold > 0:
                        await asyncio.sleep(hold)
                        translator.first_token_s = msg.timings.first_token_s = time.monotonic() - translator.arrival
                now = time.monotonic()
                queued_s = meta.get("queue_time")  # SGLang's scheduler queue time (engine_kwargs: enable_metrics)
                queued_s = float(queued_s) if isinstance(queued_s, (int, float)) else None
                first_token_s = translator.first_token_s if msg.token_ids and last_token_at is None else None
                # as this process sees the stream: seconds since arrival at this worker (queue time
                # from SGLang's meta_info when it reports it)
                rt.observe(queued_s if first_token_s is not None else None, first_token_s, len(msg.token_ids))
                if msg.token_ids:
                    if last_token_at is None:
                        self.metrics.observe_first_token(tenant.id, queued_s, first_token_s)
                    else:
                        self.metrics.observe_itl(tenant.id, now - last_token_at, len(msg.token_ids))
                    last_token_at = now
                if msg.finish_reason:
                    finished = True
                    outcome, usage = _FINISH_NAMES.get(msg.finish_reason, "abort"), msg.usage
                    stats.prompt_tokens += msg.usage.prompt_tokens
                    stats.cached_tokens += msg.usage.cached_prompt_tokens
                    stats.output_tokens += msg.usage.completion_tokens
                    stats.finished += 1
                yield msg
                if finished:
                    return
        except ValueError as exc:  # SGLang rejects some requests by raising in generate_request
            finished, outcome = True, "rejected"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except SchedulerFailed as exc:
            finished, outcome = True, "error"  # (nothing left to abort in SGLang)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine has failed: {exc}")
        finally:
            stats.running -= 1
            self.live.pop(request_id, None)
            if not finished:  # cancelled by the client, or the server is stopping
                self._abort_sglang(rid)
            rt.end(outcome, usage=_Usage(usage.cached_prompt_tokens) if usage is not None else None)
            self.metrics.observe_finish(tenant.id, outcome, usage.prompt_tokens if usage is not None else 0,
                                        usage.cached_prompt_tokens if usage is not None else 0)
            await generator.aclose()

    def _rejected(self, rt, tenant_id: str) -> None:
        """A call refused before SGLang saw it: its span and finish counter say `rejected`."""
        rt.end("rejected")
        self.metrics.observe_finish(tenant_id, "rejected")

    async def Abort(self, request, context):
        await worker_auth.require(self.verifier, worker_auth.abort_claims(request), context,
                                  self.metrics.observe_auth_failure)
        rid = self.live.get(request.request_id)
        if rid is not None:
            self._abort_sglang(rid)
        return worker_pb2.AbortResponse(found=rid is not None)

    async def GetModelInfo(self, request, context):
        return self._model_info

    async def GetLoad(self, request, context):
        load = worker_pb2.Load(running=len(self.live), policy=self.policy, draining=self.draining)
        for tid, s in sorted(self.tenants.items()):
            load.tenants.add(tenant_id=tid, weight=s.weight, tier=_TIER_ENUMS[s.tier], running=s.running,
                             prompt_tokens=s.prompt_tokens - s.cached_tokens, output_tokens=s.output_tokens,
                             finished=s.finished)
        return load


# ---- process entry -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fairshare worker --engine sglang",
                                description="Run a FairShare gRPC worker over SGLang (GPU).")
    p.add_argument("--engine", default="sglang")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--model", required=True, help="local HF model directory (no downloads)")
    add_served_name_arguments(p)
    p.add_argument("--policy", choices=["vtc", "vtc-pred", "drr", "fcfs", "off"], default="vtc")
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=2.0)
    p.add_argument("--cached-rate", type=float, default=0.0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-running", type=int, default=None, help="SGLang max_running_requests")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus /metrics (auth refusals, engine failure) on this port (default 0: off)")
    p.add_argument("--metrics-host", default=None, help="address of the metrics server (default: --host)")
    from worker.cli import add_kv_quota_arguments, add_reliability_arguments, add_tier_arguments

    from worker.cache.options import add_ttft_floor_argument

    add_reliability_arguments(p)
    add_kv_quota_arguments(p)
    add_tier_arguments(p)
    add_ttft_floor_argument(p)
    return p


def plugin_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """The plugin's KV quota and tier environment from the reference worker's `--kv-*` and
    `--tier-*` flags (the same parsing, `worker.cli.kv_quota_settings` / `tier_settings`). Calls
    `parser.error` on bad values, and for `--iteration-token-target`, which SGLang cannot apply
    (`update_running_batch` decodes every running request; docs/sglang-backend.md "cannot" 2)."""
    from worker.cli import kv_quota_settings, tier_settings
    from worker.sglang_plugin import plugin_env

    kv = kv_quota_settings(parser, args)
    tiers = tier_settings(parser, args)
    if tiers["iteration_token_target"] is not None:
        parser.error("--iteration-token-target: SGLang decodes every running request each step "
                     "(Scheduler.update_running_batch); not available with --engine sglang")
    return plugin_env(kv, tiers)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """`sglang.Engine` keyword arguments for the parsed flags."""
    # enable_metrics: SGLang then reports each request's scheduler queue time in meta_info
    # (ReqTimeStats.convert_to_output_meta_info), which splits the worker.queue / worker.prefill spans
    kw: dict = {"model_path": args.model, "tp_size": args.tp_size, "log_level": "error",
                "skip_tokenizer_init": False, "enable_metrics": True}
    for flag, key in (("mem_fraction_static", "mem_fraction_static"), ("max_running", "max_running_requests"),
                      ("chunked_prefill_size", "chunked_prefill_size"), ("context_length", "context_length")):
        value = getattr(args, flag)
        if value is not None:
            kw[key] = value
    return kw


def configure_plugin_env(args: argparse.Namespace, settings: dict[str, str] | None = None) -> str:
    """Export the plugin's settings (inherited by SGLang's spawned schedulers): policy, cost, and
    `settings` (`plugin_settings`: KV quotas, tiers). Returns the secret."""
    from worker.sglang_plugin import QUOTA_ENV, TIERS_ENV

    for key in (QUOTA_ENV, TIERS_ENV):
        os.environ.pop(key, None)
    os.environ.update(settings or {})
    os.environ["FAIRSHARE_SGLANG_POLICY"] = args.policy
    os.environ["FAIRSHARE_SGLANG_ALPHA"] = repr(args.alpha)
    os.environ["FAIRSHARE_SGLANG_BETA"] = repr(args.beta)
    os.environ["FAIRSHARE_SGLANG_CACHED_RATE"] = repr(args.cached_rate)
    return tenant_mod.ensure_secret()


async def serve(servicer: SGLangWorkerServicer, host: str, port: int, drain_timeout_s: float = 30.0, *,
                engine_failure_exit_s: float = 10.0) -> None:
    """Serve until SIGTERM/SIGINT, then drain and stop. SIGQUIT (a failed SGLang scheduler) fails the
    worker (`SGLangWorkerServicer.scheduler_failed`), then after `engine_failure_exit_s` seconds runs
    SGLang's own SIGQUIT handler, which ends the process tree. Raises OSError when the port is taken."""
    import signal

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    tm = servicer.engine.tokenizer_manager
    tm.auto_create_handle_loop()  # SGLang's loop task (and its SIGQUIT handler), before our signals
    server = grpc_server.new_server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = grpc_server.HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = grpc_server.bind(server, host, port)
    await server.start()
    for svc in ("", SERVICE_NAME):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    print(f"fairshare worker ready on {host}:{bound} (engine sglang, model {servicer.facts.name}, "
          f"policy {servicer.policy})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    servicer.snapshots.loop = loop
    sglang_handler = getattr(getattr(tm, "signal_handler_class", None), "running_phase_sigquit_handler", None)

    async def failed(reason: str) -> None:
        for svc in ("", SERVICE_NAME):
            await health_servicer.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
        print(f"fairshare worker: NOT_SERVING: {reason}; stopping in {engine_failure_exit_s:g} s", flush=True)
        await asyncio.sleep(max(0.5, engine_failure_exit_s))
        if sglang_handler is not None:
            sglang_handler(tm.signal_handler_class(tm))  # SGLang's clean-up: ends the process tree
        os._exit(3)

    servicer.on_failed = lambda reason: asyncio.ensure_future(failed(reason))
    loop.add_signal_handler(signal.SIGQUIT, lambda: servicer.scheduler_failed(
        "an SGLang scheduler process failed (SIGQUIT)"))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    servicer.draining = True
    for svc in ("", SERVICE_NAME):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
    deadline = loop.time() + drain_timeout_s
    while servicer.live and loop.time() < deadline:
        await asyncio.sleep(0.1)
    for rid in list(servicer.live.values()):
        servicer._abort_sglang(rid)
    servicer.end_generate_many()  # idle GenerateMany streams end now, not at the grace's end
    health_servicer.end_watches()  # so do the gateways' health watches (they saw NOT_SERVING)
    await server.stop(grace=2.0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `fairshare worker --engine sglang`; returns the exit code."""
    import sys

    parser = build_parser()
    args = parser.parse_args(argv)
    served_names(parser, args)  # usage errors before anything starts
    settings = plugin_settings(parser, args)
    from worker.cache.options import ttft_floor_settings

    floors = ttft_floor_settings(parser, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if grpc_server.port_taken(args.host, args.port):
        return 1
    if not Path(args.model, "config.json").is_file():
        print(f"fairshare worker: --engine sglang needs a local model directory, got {args.model!r}", file=sys.stderr)
        return 1
    try:
        import sglang
    except ImportError:
        print("fairshare worker: --engine sglang needs SGLang: pip install 'fairshare[sglang]' (GPU nodes)",
              file=sys.stderr)
        return 1
    try:
        from worker.cli import make_verifier

        verifier = make_verifier(args)
    except SystemExit as exc:
        return int(exc.code or 1)
    secret = configure_plugin_env(args, settings)
    engine = sglang.Engine(**engine_kwargs(args))
    try:
        context_len = getattr(engine.tokenizer_manager, "context_len", None) or args.context_length
        facts = read_model_facts(args.model, context_len, served_names(parser, args))
        servicer = SGLangWorkerServicer(engine, facts, secret, args.policy, verifier=verifier,
                                        ttft_floor_s=floors)
        if args.metrics_port:
            servicer.metrics.serve(args.metrics_host or args.host, args.metrics_port)
        # SGLang's tokenizer manager serves from the engine's own event loop: run the server there.
        loop = getattr(engine, "loop", None) or asyncio.new_event_loop()
        servicer.snapshots.loop = loop  # a scrape may come before serve() runs
        loop.run_until_complete(serve(servicer, args.host, args.port, args.drain_timeout,
                                      engine_failure_exit_s=args.engine_failure_exit_s))
    except OSError as exc:
        print(f"fairshare worker: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()
    return 0
