"""Hostile input against the real gateway (real worker, real Redis).

- schemathesis generates requests for the three ``/v1`` endpoints from the gateway's own OpenAPI
  document (``/openapi.json``), valid ones and invalid ones (negative mode: wrong types, values out of
  range, missing fields, extra fields): never a 5xx, every error in OpenAI's shape, every invalid
  request refused with a 4xx.
- Explicit cases: a body over the configured size (413, with and without ``content-length``),
  invalid UTF-8, lone surrogates, absurd nesting, negative/absurd/mistyped ``max_tokens``, huge ``n``,
  too many stop strings, unknown fields (top level, in a message, in ``stream_options``), wrong types,
  out-of-range extension values: each a clear 400 naming the parameter; a body shorter than its
  ``content-length`` (408, the connection closed, not held open).
"""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.reliability.conftest import (HELLO, MODEL, InProcessGateway, assert_error_object, assert_error_response,
                                        lease_state)

MAX_BODY = 64 * 1024
HONOURED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
            "stream", "seed", "stop", "top_k", "ignore_eos", "user", "cache_salt", "metadata", "stop_token_ids"}


@pytest.fixture(scope="module")
def gw(two_workers, redis_url, tmp_path_factory):
    two_workers.ensure_alive()
    # a small in-flight budget keeps every generation short (valid requests are generated too)
    g = InProcessGateway(tmp_path_factory.mktemp("gw"), [{"id": "hx", "limits": {"max_inflight_tokens": 64}}],
                         two_workers.addrs, redis_url, max_body_bytes=MAX_BODY).wait_ready()
    yield g
    g.stop()


def post(gw, body=None, content: bytes | None = None, path="/v1/chat/completions", **headers) -> httpx.Response:
    h = {"authorization": f"Bearer {gw.keys['hx']}", "content-type": "application/json", **headers}
    if content is None:
        content = json.dumps(body).encode()
    return httpx.post(gw.base_url + path, content=content, headers=h, timeout=60)


def check_answer(resp, negative: bool) -> None:
    """No 5xx; errors OpenAI-shaped; invalid requests refused."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        assert_error_object(resp.json())
    elif negative:
        raise AssertionError(f"invalid request accepted: {resp.status_code} {resp.text[:300]}")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path,method", [("/v1/chat/completions", "POST"), ("/v1/completions", "POST"),
                                         ("/v1/models", "GET")])
def test_schemathesis_no_5xx_and_openai_errors(gw, path, method, mode):
    doc = httpx.get(gw.base_url + "/openapi.json").json()
    if mode == GenerationMode.POSITIVE:  # as a client of this deployment: its model, the parameters it honours
        comps = doc["components"]["schemas"]
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            props = comps[name]["properties"]
            props["model"] = {"const": MODEL}
            for k in list(props):
                if k not in HONOURED:
                    del props[k]
            props["stop"] = {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4}
        comps["ChatMessage"]["properties"] = {"role": {"enum": ["system", "user", "assistant"]},
                                              "content": {"type": "string"}}
        comps["ChatMessage"]["required"] = ["role", "content"]
    schema = schemathesis.openapi.from_dict(doc)
    if method == "POST":  # exercise the body; GET /v1/models has no other input than its key
        schema.config.generation.update(with_security_parameters=False)
    op = schema[path][method]
    headers = {"authorization": f"Bearer {gw.keys['hx']}"}
    examples = {"GET": 10, "POST": 50 if mode == GenerationMode.NEGATIVE else 30}[method]
    seen = {"n": 0, "statuses": {}}

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        resp = case.call(base_url=gw.base_url, headers=headers, timeout=60)
        seen["n"] += 1
        seen["statuses"][resp.status_code] = seen["statuses"].get(resp.status_code, 0) + 1
        if resp.status_code >= 400 and "error" in (resp.json() or {}):
            c = resp.json()["error"]["code"]
            seen.setdefault("codes", {})[c] = seen.setdefault("codes", {}).get(c, 0) + 1
        negative = mode == GenerationMode.NEGATIVE and method == "POST" and not _accepts_anyway(case.body)
        check_answer(resp, negative)

    run()
    print(f"\nschemathesis {method} {path} {mode.value}: {seen['n']} requests, statuses {seen['statuses']}, "
          f"error codes {seen.get('codes')}")
    gw.settled()
    assert lease_state(_redis(gw), gw.prefix, "hx") == (set(), set())


def _accepts_anyway(body) -> bool:
    """Negative cases the gateway may legitimately accept: not an object body is refused anyway, so
    only bodies whose only 'invalid' part is a field accepted on purpose (tenant, cache_namespace)."""
    return isinstance(body, dict) and bool({"tenant", "cache_namespace"} & set(body))


def _redis(gw):
    import redis

    return redis.Redis.from_url(gw.redis_url)


# -- explicit cases ----------------------------------------------------------------------------------------

def test_body_over_the_configured_size_is_413(gw):
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}
    r = post(gw, big)
    assert assert_error_response(r, 413)["code"] == "request_too_large"
    # without content-length (chunked): still 413, detected while reading

    def chunks():
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]

    r = httpx.post(gw.base_url + "/v1/chat/completions", content=chunks(), timeout=60,
                   headers={"authorization": f"Bearer {gw.keys['hx']}", "content-type": "application/json"})
    assert assert_error_response(r, 413)["code"] == "request_too_large"


@pytest.mark.parametrize("raw,code", [
    (b'{"model": "random-tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "invalid_encoding"),
    (b'{"model": "random-tiny", "messages": [{"role": "user", "content": "\xc3("}]}', "invalid_encoding"),
    (b'{"model": "random-tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_encoding"),
    (b'{"model": "random-tiny", "messages": [{"role": "user", "content": "a\\udc00b"}]}', "invalid_encoding"),
    (b'{"model": "random-tiny", "x": ' + b"[" * 20000 + b"]" * 20000 + b"}", "invalid_json"),
    (b'{"model": "random-tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None),
    (b'{"model": "random-tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', None),
    # valid JSON with an integer longer than Python converts (4,300 digits): a value error, not "not JSON"
    (b'{"model": "random-tiny", "max_tokens": ' + b"9" * 5000 + b"}", "invalid_value"),
    (b"\xef\xbb\xbf[1]", "invalid_json"),
])
def test_malformed_bodies_are_clear_400s(gw, raw, code):
    err = assert_error_response(post(gw, content=raw), 400)
    if code is not None:
        assert err["code"] == code, err


def _nested_schema(depth: int) -> dict:
    """An object schema `depth` levels deep ({"properties": {"a": {... {"type": "integer"}}}})."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("extra,param,code", [
    ({"max_tokens": -1}, "max_tokens", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": 10**30}, "messages", "context_length_exceeded"),
    ({"max_tokens": "10"}, "max_tokens", "invalid_value"),
    ({"max_tokens": 10.5}, "max_tokens", "invalid_value"),
    ({"max_tokens": 1e300}, "messages", "context_length_exceeded"),
    ({"max_tokens": True}, "max_tokens", "invalid_value"),
    ({"max_completion_tokens": -5}, "max_completion_tokens", "invalid_value"),
    ({"n": 10**9}, "n", "invalid_value"),
    ({"n": 17}, "n", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"stop": 5}, "stop", "invalid_value"),
    ({"foo": 1}, "foo", "unknown_parameter"),
    ({"messages": [{"role": "user", "content": "hi", "bar": 2}]}, "messages.[0].bar", "unknown_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "baz": 1}]}]},
     "messages.[0].content.[0].baz", "unknown_parameter"),
    ({"stream": True, "stream_options": {"include_usage": True, "qux": 1}}, "stream_options.qux",
     "unknown_parameter"),
    ({"messages": {"role": "user", "content": "hi"}}, "messages", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_value"),
    ({"stream": "yes"}, "stream", "invalid_value"),
    ({"stream": 1}, "stream", "invalid_value"),
    ({"seed": 1.5}, "seed", "invalid_value"),
    ({"seed": 2**64}, "seed", "invalid_value"),
    ({"top_k": 2**40}, "top_k", "invalid_value"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids", "invalid_value"),
    ({"stop_token_ids": list(range(300))}, "stop_token_ids", "invalid_value"),
    ({"model": ["random-tiny"]}, "model", "invalid_value"),
    ({"user": {"id": 1}}, "user", "invalid_value"),
    ({"store": True}, "store", "unsupported_value"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "unsupported_value"),
    # JSON Schemas too deep for the metaschema check's recursion (it was a 500, RecursionError)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": _nested_schema(300)}}},
     "response_format.json_schema.schema", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _nested_schema(300)}}]},
     "tools.[0].function.parameters", "invalid_value"),
])
def test_hostile_fields_are_clear_400s(gw, extra, param, code):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, **extra}
    err = assert_error_response(post(gw, body), 400)
    assert (err["param"], err["code"]) == (param, code), err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("field", ["temperature", "top_p", "frequency_penalty", "presence_penalty"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_number_is_named_as_such_not_as_out_of_range(gw, field, literal):
    content = ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "%s": %s}'
               % (MODEL, field, literal)).encode()
    err = assert_error_response(post(gw, content=content), 400)
    assert (err["param"], err["code"]) == (field, "invalid_value") and "finite number" in err["message"], err


def test_every_n_over_the_bound_gets_the_same_message(gw):
    """n is bounded once, by the operator's max_n (16 by default), whatever the size of n."""
    messages = set()
    for n in (17, 128, 129, 10**6):
        err = assert_error_response(post(gw, {"model": MODEL, "messages": HELLO, "max_tokens": 2, "n": n}), 400)
        assert (err["param"], err["code"]) == ("n", "invalid_value"), err
        messages.add(err["message"])
    assert messages == {"Invalid value for 'n': at most 16 choices per request."}


@pytest.mark.parametrize("sent", [b'{"model": "', b""])
def test_a_body_shorter_than_its_content_length_is_a_408_and_the_connection_closes(two_workers, redis_url, tmp_path,
                                                                                    sent):
    """A client that declares more body than it sends (a slow or broken client, or slowloris) gets a
    408 once the body timeout passes, and the gateway closes the connection instead of holding it."""
    g = InProcessGateway(tmp_path, [{"id": "hx"}], two_workers.addrs, redis_url, body_timeout_s=0.5).wait_ready()
    try:
        url = urlsplit(g.base_url)
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {url.netloc}\r\nauthorization: Bearer {g.keys['hx']}"
                f"\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n").encode()
        with socket.create_connection((url.hostname, url.port), timeout=120) as conn:  # a hang's ceiling
            conn.sendall(head + sent)
            answer = b""
            while chunk := conn.recv(65536):  # ends only when the gateway closes the connection
                answer += chunk
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 408"), answer[:300]
        err = assert_error_object(json.loads(rest.partition(b"\r\n\r\n")[2]))
        assert (err["code"], err["type"]) == ("request_timeout", "invalid_request_error"), err
        assert lease_state(g.redis_client(), g.prefix, "hx") == (set(), set())  # nothing was admitted
    finally:
        g.stop()


def test_text_completion_hostile_fields(gw):
    for extra, param, code in [({"prompt": [[1, 2], [-3]]}, "prompt", "invalid_value"),
                               ({"prompt": [10**12]}, "prompt", "invalid_value"),
                               ({"prompt": "hi", "echo": "yes"}, "echo", "invalid_value"),
                               ({"prompt": "hi", "messages": HELLO}, "messages", "unknown_parameter"),
                               ({"prompt": "hi", "n": 4, "best_of": 2}, "best_of", "unsupported_value")]:
        err = assert_error_response(post(gw, {"model": MODEL, "max_tokens": 2, **extra}, path="/v1/completions"), 400)
        assert (err["param"], err["code"]) == (param, code), (extra, err)


def test_edge_values_that_are_valid_are_served(gw):
    # a seed at the int64 edge with n=2 (seed + 1 wraps; never a protobuf overflow)
    r = post(gw, {"model": MODEL, "messages": HELLO, "max_tokens": 2, "n": 2, "seed": 2**63 - 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    # JSON has one number type: 2.0 is the integer 2 (as JSON Schema says)
    r = post(gw, {"model": MODEL, "messages": HELLO, "max_tokens": 2.0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text
    # identity fields are accepted and ignored (the key decides the tenant)
    r = post(gw, {"model": MODEL, "messages": HELLO, "max_tokens": 2, "tenant": "someone-else",
                  "cache_namespace": "x"})
    assert r.status_code == 200
    # OpenAI fields that change nothing here are accepted
    r = post(gw, {"model": MODEL, "messages": HELLO, "max_tokens": 2, "metadata": {"a": "b"}, "store": False,
                  "service_tier": "auto", "parallel_tool_calls": True, "prompt_cache_key": "k",
                  "stream_options": None})
    assert r.status_code == 200, r.text
    gw.settled()
    assert lease_state(_redis(gw), gw.prefix, "hx") == (set(), set())


@given(st.binary(max_size=300))
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def _fuzz_raw(gw, data):
    check_answer(post(gw, content=data), negative=False)


def test_random_bytes_never_5xx(gw):
    _fuzz_raw(gw)
