"""OpenAI request schemas (pydantic) and builders of the response objects.

Requests are validated with these models; `gateway.errors.from_validation_error` turns a failure into
a 400 ``invalid_request_error`` whose ``param`` names the field (``messages``, ``messages.[0].role``).
Parameters the platform cannot honour are refused with a clear 400 rather than silently ignored.

The app validates bodies strictly (`validate_request`): JSON types are not coerced (``"10"`` is not
an integer, ``1`` is not a boolean) and a field these models do not declare is refused with 400
``unknown_parameter``, at the top level, in ``messages[i]``, in content parts and in
``stream_options``. Two fields are accepted and ignored on purpose: ``tenant`` and
``cache_namespace`` (`IGNORED_IDENTITY_FIELDS`): identity always comes from the API key, never from
the body, and clients written for other gateways send them. (The models themselves ignore unknown
fields, so they can also parse bodies leniently.)

Extensions beyond OpenAI: ``top_k``, ``ignore_eos``, ``stop_token_ids`` and ``cache_salt`` (splits the
tenant's own prefix-cache namespace, never reaches another tenant's).
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import APIError, invalid_request

# -- requests -------------------------------------------------------------------------------------


MAX_STOP_SEQUENCES = 4
MAX_STOP_TOKEN_IDS = 256
IGNORED_IDENTITY_FIELDS = frozenset({"tenant", "cache_namespace"})


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with ``choices: []`` and the usage."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; no obfuscation padding is sent


class TextPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` content part."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """Any non-text content part (image_url, input_audio, file): refused with a 400."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "refusal"]


ContentPart = Union[TextPart, OtherPart]


class ChatMessage(BaseModel):
    """One message of a chat conversation. ``developer`` is rendered as ``system``."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_call_id: str | None = None
    # fields of assistant messages that clients send back as they received them (not rendered)
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    annotations: list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message content as plain text (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: int | None = Field(default=None, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None  # accepted (only meaningful with store, which is refused)
    store: bool | None = None
    service_tier: str | None = None
    # extensions
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)  # <= 0: disabled
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    cache_salt: str | None = Field(default=None, max_length=512)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return v
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v is not None and any(i < 0 for i in v):
            raise ValueError("token ids must be >= 0")
        return v

    def stops(self) -> list[str]:
        """Stop strings as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def choices_n(self) -> int:
        """Number of choices per prompt (``n``, default 1)."""
        return self.n or 1

    def include_usage(self) -> bool:
        """True when a streamed response must end with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def refuse_unsupported(self) -> None:
        """Raise a 400 for parameters this platform cannot honour."""
        if self.stream_options is not None and not self.stream:
            raise invalid_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                                  "stream_options", "invalid_value")
        if self.frequency_penalty:
            raise invalid_request("frequency_penalty is not supported by this server (only 0).",
                                  "frequency_penalty", "unsupported_value")
        if self.presence_penalty:
            raise invalid_request("presence_penalty is not supported by this server (only 0).",
                                  "presence_penalty", "unsupported_value")
        if self.logit_bias:
            raise invalid_request("logit_bias is not supported by this server.", "logit_bias", "unsupported_value")
        if self.store:
            raise invalid_request("store is not supported by this server (completions are never stored).", "store",
                                  "unsupported_value")
        if self.service_tier not in (None, "auto", "default"):
            raise invalid_request("Only service_tier 'auto' or 'default' is supported by this server.",
                                  "service_tier", "unsupported_value")


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    functions: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=1024)  # a routing hint: accepted, unused
    safety_identifier: str | None = None

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` if given, else ``max_tokens`` (output tokens per choice)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def refuse_unsupported(self) -> None:  # noqa: D102
        super().refuse_unsupported()
        if self.logprobs or self.top_logprobs:
            raise invalid_request("logprobs are not supported by this server.", "logprobs", "unsupported_value")
        if self.tools:
            raise invalid_request("tools are not supported by this server.", "tools", "unsupported_value")
        if self.functions:
            raise invalid_request("functions are not supported by this server.", "functions", "unsupported_value")
        if self.tool_choice not in (None, "none", "auto"):
            raise invalid_request("tool_choice is not supported by this server.", "tool_choice", "unsupported_value")
        if self.function_call not in (None, "none", "auto"):
            raise invalid_request("function_call is not supported by this server.", "function_call",
                                  "unsupported_value")
        if self.modalities not in (None, [], ["text"]):
            raise invalid_request("Only the text modality is supported by this server.", "modalities",
                                  "unsupported_value")
        for name in ("audio", "prediction", "web_search_options", "reasoning_effort", "verbosity"):
            if getattr(self, name) is not None:
                raise invalid_request(f"{name} is not supported by this server.", name, "unsupported_value")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise invalid_request("Only response_format {\"type\": \"text\"} is supported by this server.",
                                  "response_format", "unsupported_value")
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list) and not m.content:  # OpenAI refuses it too (code empty_array)
                raise invalid_request(f"Invalid 'messages.[{i}].content': empty array. Expected an array with "
                                      "minimum length 1, but got an empty array instead.",
                                      f"messages.[{i}].content", "empty_array")
            if isinstance(m.content, list):
                for j, p in enumerate(m.content):
                    if not isinstance(p, TextPart):
                        raise invalid_request(f"Content parts of type '{p.type}' are not supported; only text.",
                                              f"messages.[{i}].content.[{j}].type", "unsupported_value")
            if m.content is None and m.role != "assistant":
                raise invalid_request(f"Invalid value for 'messages.[{i}].content': a {m.role} message needs "
                                      "content.", f"messages.[{i}].content", "invalid_value")

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them (plain-text content)."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name:
                d["name"] = m.name
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out


Prompt = Union[str, list[str], list[int], list[list[int]]]


def unknown_parameter(param: str) -> APIError:
    """400 for a field the API does not define (OpenAI's wording)."""
    return invalid_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")


def _check_fields(obj: Any, model: type[BaseModel], where: str, ignored: frozenset = frozenset()) -> None:
    if isinstance(obj, dict):
        for k in obj:
            if k not in model.model_fields and k not in ignored:
                raise unknown_parameter(f"{where}{k}" if where else str(k))


def check_known_fields(body: dict[str, Any], kind: str) -> None:
    """Raise 400 ``unknown_parameter`` for the first field the request schema does not declare (top
    level, ``stream_options``, ``messages[i]`` and its text content parts). Fields of the wrong type
    are left to validation."""
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    _check_fields(body, model, "", IGNORED_IDENTITY_FIELDS)
    _check_fields(body.get("stream_options"), StreamOptions, "stream_options.")
    messages = body.get("messages") if kind == "chat" else None
    if isinstance(messages, list):
        for i, m in enumerate(messages):
            _check_fields(m, ChatMessage, f"messages.[{i}].")
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if isinstance(part, dict) and part.get("type") == "text":
                        _check_fields(part, TextPart, f"messages.[{i}].content.[{j}].")


def integral_floats_to_int(body: Any) -> Any:
    """`body` with every float that has an integral value (``2.0``) made an int, in place: JSON has one
    number type and JSON Schema counts ``2.0`` as an integer, so strict validation must too
    (``2.5`` stays a float and is refused where an integer is expected). Iterative: any depth."""
    stack = [body]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in list(items):
            if isinstance(v, float) and v.is_integer():
                node[k] = int(v)
            elif isinstance(v, (dict, list)):
                stack.append(v)
    return body


def validate_request(body: dict[str, Any], kind: str) -> "ChatCompletionRequest | CompletionRequest":
    """The request model of `body`, validated strictly: no type coercion (``"10"`` is not an integer,
    ``1`` is not a boolean; ``10.0`` is the integer 10, as in JSON Schema), no unknown fields.
    Raises APIError 400 (unknown field) or pydantic.ValidationError."""
    check_known_fields(body, kind)
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    return model.model_validate(integral_floats_to_int(body), strict=True)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body (legacy text completions)."""

    prompt: Prompt
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list (a string, or token ids, per prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def refuse_unsupported(self) -> None:  # noqa: D102
        super().refuse_unsupported()
        if self.echo:
            raise invalid_request("echo is not supported by this server.", "echo", "unsupported_value")
        if self.suffix:
            raise invalid_request("suffix is not supported by this server.", "suffix", "unsupported_value")
        if self.best_of not in (None, 1) and self.best_of != self.choices_n():
            raise invalid_request("best_of other than n is not supported by this server.", "best_of",
                                  "unsupported_value")
        if self.logprobs:
            raise invalid_request("logprobs are not supported by this server.", "logprobs", "unsupported_value")
        for i, p in enumerate(self.prompts()):
            if isinstance(p, list) and not p:
                raise invalid_request(f"Invalid value for 'prompt.[{i}]': empty prompt.", "prompt", "invalid_value")
            if isinstance(p, list) and any(t < 0 for t in p):
                raise invalid_request("Token ids must be >= 0.", "prompt", "invalid_value")


# -- responses ------------------------------------------------------------------------------------

FINISH = {1: "stop", 2: "length", 3: "abort"}


def usage_dict(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """OpenAI ``usage`` object (tokens), with ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def chat_completion(rid: str, created: int, model: str, choices: list[tuple[str, str]], usage: dict,
                    fingerprint: str) -> dict[str, Any]:
    """A ``chat.completion`` object; `choices` are (text, finish_reason) in index order."""
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                     "logprobs": None, "finish_reason": fr} for i, (text, fr) in enumerate(choices)],
        "usage": usage, "system_fingerprint": fingerprint,
    }


def chat_chunk(rid: str, created: int, model: str, fingerprint: str, index: int | None, delta: dict | None = None,
               finish_reason: str | None = None, usage: dict | None = None, with_usage: bool = False) -> dict:
    """A ``chat.completion.chunk``. ``index=None`` makes the usage chunk (``choices: []``).

    With `with_usage` the chunk carries ``usage`` (null on content chunks), as OpenAI does when
    ``stream_options.include_usage`` is set; otherwise the key is absent.
    """
    d: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                         "system_fingerprint": fingerprint}
    if index is None:
        d["choices"] = []
    else:
        d["choices"] = [{"index": index, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}]
    if with_usage:
        d["usage"] = usage
    return d


def text_completion(rid: str, created: int, model: str, choices: list[tuple[str, str]], usage: dict,
                    fingerprint: str) -> dict[str, Any]:
    """A ``text_completion`` object; `choices` are (text, finish_reason) in index order."""
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": fr}
                    for i, (text, fr) in enumerate(choices)],
        "usage": usage, "system_fingerprint": fingerprint,
    }


def text_chunk(rid: str, created: int, model: str, fingerprint: str, index: int | None, text: str = "",
               finish_reason: str | None = None, usage: dict | None = None, with_usage: bool = False) -> dict:
    """A streamed ``text_completion`` chunk; ``index=None`` makes the usage chunk."""
    d: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                         "system_fingerprint": fingerprint}
    if index is None:
        d["choices"] = []
    else:
        d["choices"] = [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    if with_usage:
        d["usage"] = usage
    return d


def model_list(names: list[str], created: int | None = None) -> dict[str, Any]:
    """``GET /v1/models`` body."""
    created = created or int(time.time())
    return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "fairshare"}
                                       for n in names]}


__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "StreamOptions", "chat_chunk",
           "chat_completion", "model_list", "text_chunk", "text_completion", "usage_dict"]
