"""Request validation -> OpenAI errors, SSE framing, response builders and the routing choice."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gateway.errors import APIError, from_validation_error
from gateway.routing import WorkerClient, WorkerPool
from gateway.schemas import (ChatCompletionRequest, CompletionRequest, check_json_schema, chat_chunk, usage_dict,
                             validate_request)
from gateway.sse import DONE, event


def err_of(model, body) -> APIError:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return from_validation_error(list(e.value.errors()))


M = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,param,code", [
    ({"model": "m", "messages": []}, "messages", "invalid_value"),
    ({"model": "m"}, "messages", "missing_required_parameter"),
    ({"model": "m", "messages": [{"role": "bot", "content": "x"}]}, "messages.[0].role", "invalid_value"),
    ({"model": "m", "messages": [{"content": "x"}]}, "messages.[0].role", "missing_required_parameter"),
    ({"model": "m", "messages": M + [{"role": "user", "content": {"a": 1}}]}, "messages.[1].content",
     "invalid_value"),
    ({"model": "m", "messages": M, "temperature": 2.5}, "temperature", "invalid_value"),
    ({"model": "m", "messages": M, "max_completion_tokens": -1}, "max_completion_tokens", "invalid_value"),
    ({"model": "m", "messages": M, "stop": [""]}, "stop", "invalid_value"),
    ({"model": "m", "messages": M, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage",
     "invalid_value"),
    ({"model": 5, "messages": M}, "model", "invalid_value"),
])
def test_chat_validation_errors_name_the_param(body, param, code):
    e = err_of(ChatCompletionRequest, body)
    assert e.status == 400 and e.type == "invalid_request_error" and e.param == param and e.code == code
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("stop,words", [(["a", "b", "c", "d", "e"], "at most 4 stop sequences"),
                                        ([""], "stop sequences must not be empty")])
def test_a_validators_message_is_given_in_its_own_words(stop, words):
    """Our validators' ValueErrors reach the client as written, without pydantic's "Value error, " prefix."""
    e = err_of(ChatCompletionRequest, {"model": "m", "messages": M, "stop": stop})
    assert e.message == f"Invalid value for 'stop': {words}", e.message


def test_completion_prompt_forms():
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x"}).prompts() == ["x"]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompts() == [[1, 2]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    assert err_of(CompletionRequest, {"model": "m", "prompt": []}).param == "prompt"


@pytest.mark.parametrize("extra,param", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"functions": [{"name": "f"}]}, "functions"),  # deprecated form of tools
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.[0].content.[0].type"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_unsupported_parameters_are_refused_not_ignored(extra, param):
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": M, **extra})
    with pytest.raises(APIError) as e:
        req.refuse_unsupported()
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("role", ["user", "system", "assistant"])
def test_empty_content_array_is_refused(role):
    """`"content": []` is a 400 `empty_array` (as OpenAI answers), not a prompt with an empty turn."""
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": M + [{"role": role, "content": []}]})
    with pytest.raises(APIError) as e:
        req.refuse_unsupported()
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages.[1].content", "empty_array")


def test_accepted_parameters():
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]},
                                   {"role": "user", "content": "q"}],
        "max_tokens": 9, "max_completion_tokens": 3, "stop": "x", "n": 2, "seed": 1, "presence_penalty": 0,
        "stream": True, "stream_options": {"include_usage": True}, "cache_salt": "s", "unknown_vendor_field": 1})
    req.refuse_unsupported()
    assert req.requested_max_tokens() == 3 and req.stops() == ["x"] and req.include_usage()
    assert req.template_messages()[0] == {"role": "system", "content": "ab"}


def test_sse_framing():
    assert event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert DONE == b"data: [DONE]\n\n"
    c = chat_chunk("id", 1, "m", "fp", 0, {"content": "x"}, None, None, with_usage=True)
    assert "usage" in c and c["usage"] is None
    assert "usage" not in chat_chunk("id", 1, "m", "fp", 0, {"content": "x"})
    u = chat_chunk("id", 1, "m", "fp", None, usage=usage_dict(3, 4, 1), with_usage=True)
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 7
    assert u["usage"]["prompt_tokens_details"]["cached_tokens"] == 1
    json.dumps(u)


def test_pick_least_inflight_tokens():
    pool = WorkerPool([])
    ws = []
    for i, (local, remote, at_poll) in enumerate([(100, 100, 100), (0, 500, 0), (50, 60, 50)]):
        w = WorkerClient(f"w{i}", healthy=True, agrees=True, local_inflight=local, remote_inflight=remote,
                         local_at_poll=at_poll)
        w.info = type("I", (), {"model_name": "m"})()
        ws.append(w)
    pool.workers = ws
    pool.models = {"m": object()}
    # scores: w0 100; w1 500 (another gateway's load seen at the last poll); w2 60
    assert pool.pick("m") is ws[2]
    assert pool.pick("m", {ws[2]}) is ws[0]
    ws[2].healthy = False
    assert pool.pick("m") is ws[0]
    ws[0].agrees = False
    assert pool.pick("m") is ws[1]
    assert pool.pick("other") is None
    # ties: round robin
    for w in ws:
        w.healthy, w.agrees, w.local_inflight, w.remote_inflight, w.local_at_poll = True, True, 0, 0, 0
    assert {pool.pick("m") for _ in range(6)} == set(ws)


def test_integral_json_floats_are_ints_from_the_parser():
    """`json_number` (the gateway's parse_float hook) does at parse time what `integral_floats_to_int`
    does by walking the body: 2.0 and 1e3 are ints, 2.5 stays a float; validation agrees either way."""
    from gateway.schemas import json_number, validate_request

    raw = '{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e1, "n": 2.0, "top_p": 0.5}'
    parsed = json.loads(raw, parse_float=json_number)
    assert (parsed["max_tokens"], parsed["n"], parsed["top_p"]) == (10, 2, 0.5)
    assert type(parsed["max_tokens"]) is int and type(parsed["top_p"]) is float
    fast = validate_request(parsed, "chat", integral_floats_done=True)
    walked = validate_request(json.loads(raw), "chat")
    assert fast == walked and fast.max_tokens == 10
    with pytest.raises(ValidationError):
        validate_request(json.loads(raw.replace("1e1", "10.5"), parse_float=json_number), "chat", integral_floats_done=True)


@pytest.mark.parametrize("schema", [
    {"$ref": "http://169.254.169.254/latest"},
    {"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}},
    {"type": "array", "prefixItems": [{"type": "string"}, {"$dynamicRef": "other.json#/x"}]},
])
def test_a_reference_outside_the_schema_is_a_400_not_an_unconstrained_answer(schema):
    """A `$ref` to a URL or file is never fetched, and the grammar compiler left it unconstrained (an
    answer of any shape with status 200): it is refused, naming the parameter."""
    with pytest.raises(APIError) as e:
        check_json_schema(schema, "response_format.json_schema.schema")
    assert e.value.status == 400 and e.value.param == "response_format.json_schema.schema"
    assert "only references within the schema" in e.value.message


def test_local_references_and_ref_shaped_data_are_accepted():
    check_json_schema({"$defs": {"a": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/a"},
                       "$ref": {"type": "string"}}, "enum": [{"$ref": "http://example.com/data"}]}, "p")


@pytest.mark.parametrize("schema,keyword,where", [
    ({"not": {"type": "null"}}, "'not'", "(root)"),
    ({"type": "object", "properties": {"x": {"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 3}}}},
     "'if'", "properties/x"),
    ({"type": "array", "items": {"else": {}}}, "'else'", "items"),
    ({"$defs": {"a": {"then": {"type": "string"}}}, "$ref": "#/$defs/a"}, "'then'", "$defs/a"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "'allOf", "(root)"),
    ({"allOf": [{"type": "object", "required": ["a"]}, {"type": "object", "required": ["b"]}]}, "'allOf", "(root)"),
    ({"anyOf": [{"type": "string"}, {"type": "array", "contains": {"const": 1}}]}, "'contains'", "anyOf/1"),
    ({"type": "array", "contains": {"type": "integer"}}, "'contains'", "(root)"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired'", "(root)"),
])
def test_strict_refuses_a_keyword_constrained_decoding_would_not_enforce(schema, keyword, where):
    """xgrammar compiles these and then lets through output that violates them (measured: `null` under
    {"not": {"type": "null"}}, 3 under allOf [integer, minimum 5], 7 under if/then maximum 3, [] under
    contains): with strict: true they are refused, naming the keyword and where it stands,
    as OpenAI refuses what strict mode does not support; without strict they are best effort."""
    with pytest.raises(APIError) as e:
        check_json_schema(schema, "tools.[0].function.parameters", strict=True)
    assert e.value.status == 400 and e.value.param == "tools.[0].function.parameters"
    assert keyword in e.value.message and f"(at {where})" in e.value.message
    check_json_schema(schema, "tools.[0].function.parameters")  # not strict: accepted


def test_enforced_look_alikes_are_accepted_in_strict_mode():
    """A property named "not", data that looks like the keyword, a one-entry allOf and uniqueItems (not
    enforced, but what pydantic writes for a set, which loses nothing by a duplicate) are accepted."""
    check_json_schema({"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "string"}},
                       "enum": [{"not": 1}], "examples": [{"if": 2}]}, "p", strict=True)
    check_json_schema({"allOf": [{"type": "integer"}]}, "p", strict=True)
    check_json_schema({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "p", strict=True)


def test_the_strict_flag_of_the_request_reaches_the_check():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "null"}}}}
    validate_request(dict(base, response_format=fmt), "chat").refuse_unsupported()  # strict unset: best effort
    fmt["json_schema"]["strict"] = True
    with pytest.raises(APIError) as e:
        validate_request(dict(base, response_format=fmt), "chat").refuse_unsupported()
    assert e.value.param == "response_format.json_schema.schema"
    tool = {"type": "function", "function": {"name": "f", "strict": True,
                                             "parameters": {"type": "object", "properties": {"a": {"not": {}}}}}}
    with pytest.raises(APIError) as e:
        validate_request(dict(base, tools=[tool]), "chat").refuse_unsupported()
    assert e.value.param == "tools.[0].function.parameters"
