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

Chat requests may carry ``logprobs`` / ``top_logprobs`` (0-20), ``response_format`` (``text``,
``json_object``, ``json_schema``), ``tools`` (functions), ``tool_choice`` (``none``, ``auto``,
``required`` or a named function) and ``parallel_tool_calls``; messages may be ``tool`` results and
assistant turns with ``tool_calls``. Completions may carry ``logprobs`` (0-5). JSON Schemas (a
response format's, a function's parameters) are checked here with `jsonschema` (a 400 naming the
field); the worker compiles them for constrained decoding.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

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


NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # function and response-format names (OpenAI's rule)
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


class _Lenient(BaseModel):
    """Nested request objects: fields they do not declare are ignored (clients add vendor fields)."""

    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Lenient):
    """``function`` of a tool call: its name and its arguments (a JSON object, as text)."""

    name: str
    arguments: str


class ToolCall(_Lenient):
    """One tool call of an assistant message, as the API returned it and the client sends it back."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionDefinition(_Lenient):
    """A callable function: ``name``, ``description`` and its ``parameters`` as a JSON Schema."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    """An entry of ``tools`` (``type`` is always ``function``)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    """``tool_choice.function``: the function to call."""

    name: str


class NamedToolChoice(_Lenient):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call exactly that function."""

    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Lenient):
    """``response_format.json_schema``: a named JSON Schema the output must satisfy."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(_Lenient):
    """``response_format: {"type": "text"}`` (the default)."""

    type: Literal["text"]


class ResponseFormatJSONObject(_Lenient):
    """``response_format: {"type": "json_object"}``: any JSON object."""

    type: Literal["json_object"]


class ResponseFormatJSONSchema(_Lenient):
    """``response_format: {"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


def _format_tag(v: Any) -> str | None:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return {"text": "Text", "json_object": "JsonObject", "json_schema": "JsonSchema"}.get(kind)


# tags are capitalised so that error locations drop them (gateway/errors.py): param "response_format.type"
ResponseFormat = Annotated[Union[Annotated[ResponseFormatText, Tag("Text")],
                                 Annotated[ResponseFormatJSONObject, Tag("JsonObject")],
                                 Annotated[ResponseFormatJSONSchema, Tag("JsonSchema")]],
                           Discriminator(_format_tag, custom_error_type="invalid_value",
                                         custom_error_message="type must be 'text', 'json_object' or 'json_schema'")]


class ChatMessage(BaseModel):
    """One message of a chat conversation. ``developer`` is rendered as ``system``."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_call_id: str | None = None
    # fields of assistant messages that clients send back as they received them (not rendered)
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
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
    """Fields shared by chat and text completions. A NaN or infinite number is refused as not finite
    (JSON bodies may carry ``NaN`` / ``Infinity``), not as out of range."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: int | None = Field(default=None, ge=1)  # the upper bound is the operator's max_n (gateway/plan.py)
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
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    functions: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
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

    def top_logprobs_n(self) -> int:
        """Alternatives per position to return (0 without ``top_logprobs``)."""
        return int(self.top_logprobs or 0)

    def tool_dicts(self) -> list[dict[str, Any]]:
        """``tools`` as plain dicts (what chat templates and the tool parser read)."""
        return [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools or []]

    def calls_tools(self) -> bool:
        """True when the model may call (or must call) a tool: tools given and tool_choice not ``none``."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_function(self) -> str | None:
        """The function a named ``tool_choice`` forces, else None."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def json_format(self) -> dict[str, Any] | None:
        """The JSON Schema the answer must satisfy: ``response_format`` ``json_schema`` (its schema; none
        given: any JSON object) or ``json_object`` (``{"type": "object"}``); None for text."""
        rf = self.response_format
        if isinstance(rf, ResponseFormatJSONSchema):
            return rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {"type": "object"}
        if isinstance(rf, ResponseFormatJSONObject):
            return {"type": "object"}
        return None

    def refuse_unsupported(self) -> None:  # noqa: D102
        super().refuse_unsupported()
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise invalid_request("Invalid value for 'top_logprobs': 'logprobs' must be set to true when "
                                  "'top_logprobs' is used.", "top_logprobs", "invalid_value")
        if self.functions:
            raise invalid_request("functions are deprecated and not supported by this server; use tools.",
                                  "functions", "unsupported_value")
        self._check_tools()
        if self.function_call not in (None, "none", "auto"):
            raise invalid_request("function_call is not supported by this server.", "function_call",
                                  "unsupported_value")
        if self.modalities not in (None, [], ["text"]):
            raise invalid_request("Only the text modality is supported by this server.", "modalities",
                                  "unsupported_value")
        for name in ("audio", "prediction", "web_search_options", "reasoning_effort", "verbosity"):
            if getattr(self, name) is not None:
                raise invalid_request(f"{name} is not supported by this server.", name, "unsupported_value")
        if isinstance(self.response_format, ResponseFormatJSONSchema) and self.response_format.json_schema.schema_:
            check_json_schema(self.response_format.json_schema.schema_, "response_format.json_schema.schema",
                              strict=bool(self.response_format.json_schema.strict))
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
            if m.role == "tool" and not m.tool_call_id:
                raise invalid_request(f"Missing required parameter: 'messages.[{i}].tool_call_id'.",
                                      f"messages.[{i}].tool_call_id", "missing_required_parameter")
            if m.tool_calls and m.role != "assistant":
                raise invalid_request(f"Invalid parameter: 'messages.[{i}].tool_calls' is only allowed in "
                                      "assistant messages.", f"messages.[{i}].tool_calls", "invalid_value")

    def _check_tools(self) -> None:
        """Tools and tool_choice: unique function names, valid parameter schemas, a forcing tool_choice
        (``required``, a named function) only with tools, and naming one of them."""
        names: set[str] = set()
        for i, t in enumerate(self.tools or []):
            if t.function.name in names:
                raise invalid_request(f"Invalid 'tools': duplicate function name '{t.function.name}'.",
                                      f"tools.[{i}].function.name", "invalid_value")
            names.add(t.function.name)
            if t.function.parameters is not None:
                check_json_schema(t.function.parameters, f"tools.[{i}].function.parameters",
                                  strict=bool(t.function.strict))
        if self.tools is not None and not self.tools:
            raise invalid_request("Invalid 'tools': empty array. Expected an array with minimum length 1, but got "
                                  "an empty array instead.", "tools", "empty_array")
        # "none" / "auto" and parallel_tool_calls without tools change nothing: accepted (clients send them)
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise invalid_request("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
                                  "are specified.", "tool_choice", "invalid_value")
        forced = self.forced_function()
        if forced is not None and forced not in names:
            raise invalid_request(f"Invalid value for 'tool_choice': function '{forced}' is not one of the "
                                  "functions in 'tools'.", "tool_choice.function.name", "invalid_value")

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them (plain-text content; an assistant turn's
        ``tool_calls`` as OpenAI dicts, a tool turn's ``tool_call_id``)."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name:
                d["name"] = m.name
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            out.append(d)
        return out


Prompt = Union[str, list[str], list[int], list[list[int]]]


def check_json_schema(schema: Any, param: str, strict: bool = False) -> None:
    """Raise a 400 naming `param` unless `schema` is a JSON Schema object that the JSON Schema
    metaschema (draft 2020-12, via `jsonschema`) accepts. A schema nested too deeply for that check
    (its validator recurses several frames per level; ~100 levels of ``properties`` exhaust Python's
    stack) is refused too, rather than failing the request with a 500. strict: the client asked for
    output that satisfies the schema (``strict: true``); a keyword constrained decoding would not
    enforce (`_unenforced_keyword`) is then a 400 too, as OpenAI refuses keywords strict mode does
    not support; without it such a keyword is applied as far as the grammar can (best effort)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise invalid_request(f"Invalid schema for '{param}': a JSON Schema must be an object.", param,
                              "invalid_value")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise invalid_request(f"Invalid schema for '{param}': {e.message} (at {where}).", param,
                              "invalid_value") from None
    except RecursionError:
        raise invalid_request(f"Invalid schema for '{param}': it is nested too deeply.", param,
                              "invalid_value") from None
    ref = _remote_ref(schema)
    if ref is not None:
        raise invalid_request(f"Invalid schema for '{param}': only references within the schema ('#/...') are "
                              f"supported, got '$ref': {ref!r}.", param, "invalid_value")
    unenforced = _unenforced_keyword(schema) if strict else None
    if unenforced is not None:
        keyword, where = unenforced
        raise invalid_request(f"Invalid schema for '{param}': '{keyword}' is not supported (at {where or '(root)'}): "
                              "constrained decoding would not enforce it, so the output could violate the "
                              "schema.", param, "invalid_value")


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values there are instances, not schemas


def _remote_ref(schema: dict) -> str | None:
    """The first ``$ref`` / ``$dynamicRef`` of `schema` that points outside it (a URL or a file:
    never fetched, and the grammar compiler would silently leave it unconstrained), else None.
    Iterative: the metaschema check bounded the depth already, not the breadth."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("$ref", "$dynamicRef") and isinstance(v, str) and not v.startswith("#"):
                    return v
                if isinstance(v, (dict, list)) and k not in _DATA_KEYWORDS:
                    stack.append(v)
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return None


# Keywords the worker's grammar compiler (xgrammar, strict mode, as the worker compiles) accepts and
# then does not enforce: output that violates them passes. Measured with its matcher on SmolLM2's
# vocabulary: `null` passes {"not": {"type": "null"}}, 7 passes if/then {"maximum": 3}, 3 passes allOf
# [integer, {"minimum": 5}], {"a": 1} passes allOf of two objects requiring "a" and "b" (allOf is not
# merged), [1, 1] passes uniqueItems, [] and ["a"] pass contains {"type": "integer"}, {"a": 1} passes
# dependentRequired / dependentSchemas that require "b". (Enforced, measured the same way: minimum,
# exclusiveMaximum, multipleOf, minLength, pattern, format, const, propertyNames, maxProperties,
# unevaluatedProperties, prefixItems with items false, anyOf.)
# uniqueItems is not enforced either ([1, 1] passes) but is not refused: pydantic writes it for every
# set-typed field, and a client parsing into a set loses nothing by a duplicate.
_UNENFORCED = ("not", "if", "then", "else", "contains", "dependentRequired", "dependentSchemas")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedItems",
                  "unevaluatedProperties", "additionalItems", "not", "if", "then", "else")


def _unenforced_keyword(schema: dict) -> tuple[str, str] | None:
    """(keyword, path) of the first keyword of `schema` in `_UNENFORCED`, or of an ``allOf`` of two or
    more entries, else None. Walks schema positions only (a property named "not" is a name, not the
    keyword); iterative."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        for k in _UNENFORCED:
            if k in node:
                return k, path
        entries = node.get("allOf")
        if isinstance(entries, list) and len(entries) > 1:
            return "allOf (of two or more schemas)", path
        at = (path + "/") if path else ""
        for k in _SUBSCHEMA_MAPS:
            if isinstance(node.get(k), dict):
                stack.extend((v, f"{at}{k}/{name}") for name, v in node[k].items())
        for k in _SUBSCHEMA_LISTS:
            if isinstance(node.get(k), list):
                stack.extend((v, f"{at}{k}/{i}") for i, v in enumerate(node[k]))
        for k in _SUBSCHEMA_ONE:
            if isinstance(node.get(k), dict):
                stack.append((node[k], f"{at}{k}"))
    return None


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


def json_number(text: str) -> int | float:
    """``json.loads``' ``parse_float`` hook: a JSON number written with a fraction or exponent whose
    value is integral (``2.0``, ``1e3``) is that int, as `integral_floats_to_int` would make it, at
    no cost per item (a body of millions of numbers is not walked again in Python)."""
    value = float(text)
    return int(value) if value.is_integer() else value


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


def validate_request(body: dict[str, Any], kind: str,
                     integral_floats_done: bool = False) -> "ChatCompletionRequest | CompletionRequest":
    """The request model of `body`, validated strictly: no type coercion (``"10"`` is not an integer,
    ``1`` is not a boolean; ``10.0`` is the integer 10, as in JSON Schema), no unknown fields.
    integral_floats_done: `body` was parsed with `json_number` (no `integral_floats_to_int` walk).
    Raises APIError 400 (unknown field) or pydantic.ValidationError."""
    check_known_fields(body, kind)
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    return model.model_validate(body if integral_floats_done else integral_floats_to_int(body), strict=True)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body (legacy text completions)."""

    prompt: Prompt
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)

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


def chat_choice(index: int, content: str | None, finish_reason: str, tool_calls: list[dict] | None = None,
                logprobs: list[dict] | None = None) -> dict[str, Any]:
    """One choice of a ``chat.completion``: the assistant message (``tool_calls`` only when the model
    called tools), ``logprobs`` (``{"content": [...], "refusal": null}``, or null when not asked)."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish_reason}


def chat_completion(rid: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict,
                    fingerprint: str) -> dict[str, Any]:
    """A ``chat.completion`` object; `choices` from `chat_choice`, in index order."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage, "system_fingerprint": fingerprint}


def chat_chunk(rid: str, created: int, model: str, fingerprint: str, index: int | None, delta: dict | None = None,
               finish_reason: str | None = None, usage: dict | None = None, with_usage: bool = False,
               logprobs: list[dict] | None = None) -> dict:
    """A ``chat.completion.chunk``. ``index=None`` makes the usage chunk (``choices: []``).

    With `with_usage` the chunk carries ``usage`` (null on content chunks), as OpenAI does when
    ``stream_options.include_usage`` is set; otherwise the key is absent. `logprobs`: the chunk's
    ``logprobs.content`` items (None: ``logprobs: null``).
    """
    d: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                         "system_fingerprint": fingerprint}
    if index is None:
        d["choices"] = []
    else:
        d["choices"] = [{"index": index, "delta": delta or {},
                         "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                         "finish_reason": finish_reason}]
    if with_usage:
        d["usage"] = usage
    return d


def text_completion(rid: str, created: int, model: str, choices: list[tuple[str, str, dict | None]], usage: dict,
                    fingerprint: str) -> dict[str, Any]:
    """A ``text_completion`` object; `choices` are (text, finish_reason, logprobs object or None) in
    index order."""
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": fr}
                    for i, (text, fr, lp) in enumerate(choices)],
        "usage": usage, "system_fingerprint": fingerprint,
    }


def text_chunk(rid: str, created: int, model: str, fingerprint: str, index: int | None, text: str = "",
               finish_reason: str | None = None, usage: dict | None = None, with_usage: bool = False,
               logprobs: dict | None = None) -> dict:
    """A streamed ``text_completion`` chunk; ``index=None`` makes the usage chunk. `logprobs`: the
    chunk's logprobs object (tokens, token_logprobs, top_logprobs, text_offset) or None."""
    d: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                         "system_fingerprint": fingerprint}
    if index is None:
        d["choices"] = []
    else:
        d["choices"] = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]
    if with_usage:
        d["usage"] = usage
    return d


def model_list(names: list[str], created: int | None = None) -> dict[str, Any]:
    """``GET /v1/models`` body."""
    created = created or int(time.time())
    return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "fairshare"}
                                       for n in names]}


__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "StreamOptions", "Tool",
           "chat_choice", "chat_chunk", "chat_completion", "check_json_schema", "model_list", "text_chunk",
           "text_completion", "usage_dict"]
