"""Request -> generation plan: the body read and validated, the model resolved, the prompts
tokenized and the output budget fixed, before anything is admitted.

`plan_request` runs these steps in order, each raising an OpenAI-shaped `APIError` (nothing is
held yet, so an error here leaks nothing):

1. the body: JSON object of at most ``max_body_bytes`` (413), valid UTF-8 and JSON (400);
2. validation against the endpoint's schema (400 ``invalid_request_error`` naming ``param``), the
   request's deadline (``x-request-timeout`` header, 400 when malformed), the number of choices;
3. the model (404 unknown or not allowed; 503 when no worker serves it right now);
4. the `OutputPlan`: logprobs, a grammar (response_format, forced tool calls: gateway/structured.py)
   and the model's tool-call parser (gateway/tools.py);
5. tokenization (chat: the chat template with the request's tools; large inputs on a thread);
6. the token budget: ``max_tokens`` (without it the declared default: 16 for ``/v1/completions``;
   for chat the tenant's, else the model's, else 1024 tokens; never more than the context the prompt
   leaves, nor than the tenant could ever be admitted for) and the admission cost
   ``prompt + n * max_tokens`` tokens (400 ``context_length_exceeded`` / ``request_too_large``).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from fairshare.config import TenantConfig
from fairshare.v1 import worker_pb2 as pb

from . import schemas
from .config import COMPLETIONS_DEFAULT_MAX_TOKENS, GatewaySettings
from .deadlines import Deadline, request_deadline
from .errors import (APIError, body_timeout, body_too_large, client_closed, from_validation_error, invalid_request,
                     model_not_found, unavailable)
from .logprobs import TokenTexts
from .routing import ModelEntry, WorkerPool
from .structured import grammar_for
from .tokenization import PromptTooLong, TemplateError
from .tools import ToolCallParser, ToolCallStream, get_parser
from .tracing import set_error

# bodies larger than this are tokenized on a thread, so the event loop keeps streaming other requests
INLINE_TOKENIZE_BYTES = 16 * 1024

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


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
class GenerationPlan:
    """A validated request, ready for admission. Token counts in tokens.

    kind: ``chat`` or ``text``; req: the validated schema object; prompts: token ids of each prompt
    (chat: one); n: choices per prompt; max_tokens: the output budget of each choice; cost: what
    admission reserves, ``sum(prompts) + n * len(prompts) * max_tokens``; max_param: the field a
    too-large budget is blamed on.
    """

    kind: str
    req: Any
    model: str
    entry: ModelEntry
    output: OutputPlan
    deadline: Deadline
    prompts: list[list[int]]
    n: int
    max_tokens: int
    cost: int
    max_param: str

    @property
    def param(self) -> str:
        """The request field that holds the prompt."""
        return prompt_param(self.kind)

    @property
    def endpoint(self) -> str:
        """The metrics label of the endpoint (`endpoint_label`)."""
        return endpoint_label(self.kind)


def endpoint_label(kind: str) -> str:
    """The ``endpoint`` label of a request's metrics and spans: ``chat`` or ``completions``."""
    return "chat" if kind == "chat" else "completions"


def prompt_param(kind: str) -> str:
    """``messages`` (chat) or ``prompt`` (text completions)."""
    return "messages" if kind == "chat" else "prompt"


async def plan_request(gw, request: Request, kind: str, tenant: TenantConfig) -> GenerationPlan:
    """Steps 1-6 of the module docstring for one request of `tenant` (gw: a `gateway.state.Gateway`).
    Raises APIError (400/404/413/499/503)."""
    if gw.draining:
        raise unavailable("The gateway is shutting down; please retry (another replica will serve you).",
                          retry_after_s=1)
    body, size = await read_json_body(request, gw.settings.max_body_bytes, gw.settings.body_timeout_s)
    try:
        req = schemas.validate_request(body, kind, integral_floats_done=True)
    except ValidationError as e:
        raise from_validation_error(list(e.errors())) from None
    req.refuse_unsupported()
    deadline = request_deadline(gw.settings, tenant, request.headers, bool(req.stream))  # 400 for a bad header
    n = _choices(gw.settings, kind, req)
    entry = resolve_model(gw.pool, tenant, req)
    names = [req.model, *entry.names]
    output = output_plan(gw.settings, entry, names, kind, req)
    prompts = await _tokenize_traced(gw.tracer, entry, kind, req, output, size)
    max_tokens = output_budget(gw.settings, tenant, entry, names, kind, req, prompts, n)
    cost = sum(len(p) for p in prompts) + n * len(prompts) * max_tokens
    requested = req.requested_max_tokens() if kind == "chat" else req.max_tokens
    max_param = ("max_completion_tokens" if kind == "chat" and req.max_completion_tokens is not None
                 else "max_tokens")
    too_large = too_large_error(tenant, cost, max_param)
    if too_large is not None:
        # the prompts' fault when even one output token each would not fit, else the reservation's
        least = sum(len(p) for p in prompts) + n * len(prompts)
        if requested is None or too_large_error(tenant, least, max_param) is not None:
            too_large.param = prompt_param(kind)
        raise too_large
    return GenerationPlan(kind, req, req.model, entry, output, deadline, prompts, n, max_tokens, cost, max_param)


async def read_json_body(request: Request, limit: int, timeout_s: float | None = None) -> tuple[dict[str, Any], int]:
    """The request's JSON object and its size in bytes. Raises APIError 400 (not JSON / not an
    object), 413 (over `limit` bytes) or 408 (the whole body not there within `timeout_s` seconds,
    e.g. shorter than its ``content-length``: the connection is not held open for it)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)

    async def read() -> bytearray:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise body_too_large(limit)
        return raw

    try:
        if hasattr(asyncio, "timeout"):  # Python 3.11+: bounded in this task, no task of its own per request
            async with asyncio.timeout(timeout_s):
                raw = await read()
        else:
            raw = await asyncio.wait_for(read(), timeout_s)
    except ClientDisconnect:
        raise client_closed() from None
    except asyncio.TimeoutError:
        raise body_timeout(timeout_s or 0) from None
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid_request(f"The request body is not valid UTF-8 (invalid byte at offset {e.start}).", None,
                              "invalid_encoding") from None
    return _parse_json_object(text.removeprefix("\ufeff")), len(raw)


def _parse_json_object(text: str) -> dict[str, Any]:
    """`text` as a JSON object whose strings are all valid Unicode. Raises APIError 400."""
    def nested() -> APIError:  # built once the recursion has unwound, only when it is needed
        return invalid_request("The JSON body of your request is nested too deeply.", None, "invalid_json")

    try:
        body = json.loads(text, parse_float=schemas.json_number)
    except RecursionError:
        raise nested() from None
    except ValueError as e:
        if "integer string conversion" in str(e):  # valid JSON: an integer longer than Python converts
            raise invalid_request(f"A number in the request body has more than {sys.get_int_max_str_digits()} "
                                  "digits; no parameter takes one that long.", None, "invalid_value") from None
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
            raise nested() from None
    return body


def _choices(settings: GatewaySettings, kind: str, req) -> int:
    """``n``, checked against ``max_n`` and (completions) ``prompts x n <= max_choices``. Raises APIError 400."""
    n = req.choices_n()
    if n > settings.max_n:
        raise invalid_request(f"Invalid value for 'n': at most {settings.max_n} choices per request.", "n",
                              "invalid_value")
    if kind == "text" and n * len(req.prompts()) > settings.max_choices:
        raise invalid_request(f"Too many choices: prompts x n must be at most {settings.max_choices}.", "prompt",
                              "invalid_value")
    return n


def resolve_model(pool: WorkerPool, tenant: TenantConfig, req) -> ModelEntry:
    """The pool's entry of ``req.model``. Raises APIError 404 (unknown, or not allowed for `tenant`), 503
    (known but no worker serves it now), 400 (a stop token id outside the model's vocabulary)."""
    model = req.model
    entry = pool.model(model) if tenant.may_use(model) else None
    if entry is None:
        if tenant.may_use(model) and (model in pool.models or not pool.models):
            raise unavailable(f"No worker is serving model `{model}` right now.",
                              retry_after_s=pool.retry_after_s(model))
        raise model_not_found(model)
    vocab = entry.tokenizer.vocab_size()
    if req.stop_token_ids and max(req.stop_token_ids) >= vocab:
        raise invalid_request(f"Invalid token id in 'stop_token_ids': ids must be < {vocab}.",
                              "stop_token_ids", "invalid_value")
    return entry


def output_plan(settings: GatewaySettings, entry: ModelEntry, names: list[str], kind: str, req) -> OutputPlan:
    """The request's `OutputPlan`. Raises APIError 400 (a forced tool call the model's parser cannot
    express; gateway/structured.py)."""
    skip = set(entry.eos_token_ids) | set(req.stop_token_ids or ())
    if kind == "text":
        wanted = req.logprobs is not None
        return OutputPlan(logprobs=wanted, top_logprobs=int(req.logprobs or 0), skip=skip,
                          texts=entry.token_texts() if wanted else None)
    parser = get_parser(settings.tool_parser_name(names))
    grammar, grammar_param = grammar_for(req, parser)
    return OutputPlan(logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs_n() if req.logprobs else 0,
                      grammar=grammar, grammar_param=grammar_param, tool_format=parser,
                      parser=parser if req.calls_tools() else None, tools=req.tool_dicts(), skip=skip,
                      texts=entry.token_texts() if req.logprobs else None)


async def _tokenize_traced(tracer, entry: ModelEntry, kind: str, req, plan: OutputPlan,
                           size: int) -> list[list[int]]:
    """`tokenize` in a ``gateway.tokenize`` span (on a thread for a body over INLINE_TOKENIZE_BYTES).
    Raises APIError 400 (template error, bad token ids, a prompt of zero tokens)."""
    with tracer.start_as_current_span("gateway.tokenize", record_exception=False,
                                      set_status_on_exception=False) as span:
        try:
            if size > INLINE_TOKENIZE_BYTES:
                prompts = await asyncio.to_thread(tokenize, entry, kind, req, plan)
            else:
                prompts = tokenize(entry, kind, req, plan)
        except TemplateError as e:
            set_error(span, "invalid_value")
            raise invalid_request(f"Invalid 'messages': {e}", "messages", "invalid_value") from None
        except APIError as e:
            set_error(span, e.code)
            raise
        if span.is_recording():
            span.set_attributes({"fairshare.prompts": len(prompts),
                                 "fairshare.prompt_tokens": sum(len(p) for p in prompts)})
    param = prompt_param(kind)
    for p in prompts:
        if not p:
            raise invalid_request(f"Invalid '{param}': it encodes to zero tokens.", param, "invalid_value")
    return prompts


def tokenize(entry: ModelEntry, kind: str, req, plan: OutputPlan) -> list[list[int]]:
    """Token ids of each prompt (chat: one). Raises TemplateError, or APIError 400 for bad token ids
    and for a prompt sure to fill the context (``context_length_exceeded``, found from its length
    before it is encoded: a prompt of megabytes costs no seconds of CPU to refuse)."""
    tok = entry.tokenizer
    limit = entry.max_context_tokens - 1  # a prompt must leave room for one output token
    param = prompt_param(kind)
    try:
        if kind == "chat":
            return [tok.encode_chat(req.template_messages(), plan.tools or None, plan.tool_format, limit=limit)]
        prompts = []
        vocab = tok.vocab_size()
        for p in req.prompts():
            if isinstance(p, str):
                prompts.append(tok.encode_text(p, limit=limit))
            else:
                if any(t >= vocab for t in p):
                    raise invalid_request(f"Invalid token id in 'prompt': ids must be < {vocab}.", "prompt",
                                          "invalid_value")
                prompts.append(list(p))
        return prompts
    except PromptTooLong as e:
        raise context_error(entry.max_context_tokens, e.at_least, None, param, at_least=True) from None


def output_budget(settings: GatewaySettings, tenant: TenantConfig, entry: ModelEntry, names: list[str],
                  kind: str, req, prompts: list[list[int]], n: int) -> int:
    """``max_tokens`` of each choice (module docstring, step 6). Raises APIError 400
    (``context_length_exceeded``, or ``request_too_large`` when not even one output token fits)."""
    ctx = entry.max_context_tokens
    param = prompt_param(kind)
    requested = req.requested_max_tokens() if kind == "chat" else req.max_tokens
    longest = max(len(p) for p in prompts)
    if requested is not None:
        if longest + requested > ctx:
            raise context_error(ctx, longest, requested, param)
        return requested
    if longest >= ctx:
        raise context_error(ctx, longest, None, param)
    if kind == "text":  # OpenAI's documented default
        default = COMPLETIONS_DEFAULT_MAX_TOKENS
    else:  # the tenant's declared default, else the operator's for this model
        default = tenant.default_max_tokens_for(names) or settings.chat_default_max_tokens(names)
    max_tokens = min(default, ctx - longest)  # never more than the context the prompt leaves ...
    lim = tenant.limits
    caps = [c for c in (lim.tpm, lim.max_inflight_tokens) if c is not None]
    if caps:  # ... but no more than the tenant could ever be admitted for
        prompt_total = sum(len(p) for p in prompts)
        affordable = (min(caps) - prompt_total) // (n * len(prompts))
        if affordable < 1:
            raise too_large_error(tenant, prompt_total + n * len(prompts), param) or context_error(
                ctx, longest, None, param)
        max_tokens = min(max_tokens, affordable)
    return max_tokens


def context_error(ctx: int, prompt_len: int, max_tokens: int | None, param: str, at_least: bool = False) -> APIError:
    """400 ``context_length_exceeded`` in OpenAI's wording (token counts in tokens; `at_least`: the
    prompt's count is a lower bound, the prompt was refused before it was encoded)."""
    where = "messages" if param == "messages" else "prompt"
    if max_tokens is None or prompt_len >= ctx:
        count = f"at least {prompt_len}" if at_least else f"{prompt_len}"
        msg = (f"This model's maximum context length is {ctx} tokens. However, your {where} resulted in "
               f"{count} tokens. Please reduce the length of the {where}.")
    else:
        msg = (f"This model's maximum context length is {ctx} tokens. However, you requested "
               f"{prompt_len + max_tokens} tokens ({prompt_len} in the {where}, {max_tokens} in the completion). "
               f"Please reduce the length of the {where} or completion.")
    return invalid_request(msg, param, "context_length_exceeded")


def too_large_error(tenant: TenantConfig, cost: int, param: str) -> APIError | None:
    """A 400 when `cost` tokens exceed a limit's whole capacity (the request could never be admitted)."""
    lim = tenant.limits
    for name, cap in (("tokens per min (TPM)", lim.tpm), ("in-flight tokens", lim.max_inflight_tokens)):
        if cap is not None and cost > cap:
            return invalid_request(
                f"Request too large for tenant {tenant.id} on {name}: Limit {cap}, Requested {cost}. "
                f"The input or output tokens must be reduced in order to run successfully.", param, "request_too_large")
    return None


__all__ = ["GenerationPlan", "OutputPlan", "context_error", "output_budget", "output_plan", "plan_request",
           "read_json_body", "resolve_model", "tokenize", "too_large_error"]
