"""Structured outputs (``response_format``) through the official `openai` client, against the real
gateway, a real worker (random tiny model: only constrained decoding makes its output valid) and Redis.

- 100 strict ``json_schema`` requests with a nested schema (objects, arrays, enums, required fields,
  bounded strings and numbers, so every path of the grammar ends), half streamed: every answer ends
  with ``finish_reason: "stop"``, parses and validates with `jsonschema`.
- ``json_object``: a JSON object.
- bad schemas: one the metaschema rejects (400 from the gateway, before admission) and one only the
  worker's grammar compiler rejects (400 from the worker, after admission): OpenAI-shaped, no lease left.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.integration.openai_helpers import (HELLO, MODEL, assert_no_lease, assert_openai_error, chat_body,
                                              chat_chunks, post, run_all, streamed_chat)

TENANTS = [{"id": "so-main", "limits": {"rpm": 100000, "tpm": 100_000_000}}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "scores": {"type": "array", "minItems": 1, "maxItems": 2,
                   "items": {"type": "object",
                             "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "number", "minimum": 0,
                                                                             "maximum": 9}},
                             "required": ["k", "v"], "additionalProperties": False}},
    },
    "required": ["name", "age", "role", "active", "tags", "address", "scores"],
    "additionalProperties": False,
}
# the longest answer the grammar allows to a random model is ~140 tokens (measured over 300 samples)
MAX_TOKENS = 400
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def gw(gateway_factory):
    return gateway_factory(TENANTS)


def _one(gw, i: int) -> tuple[str, str]:
    messages = [{"role": "user", "content": f"Describe person number {i} as JSON."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": i,
            "response_format": FORMAT}
    if i % 2:
        out = streamed_chat(chat_chunks(gw, "so-main", body))
        return out["content"], out["finish_reason"]
    choice = chat_body(post(gw, "so-main", "/v1/chat/completions", body))["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def test_100_strict_json_schema_answers_parse_and_validate(gw):
    results = run_all(lambda i: _one(gw, i), range(100))
    failures = []
    for i, (text, finish) in enumerate(results):
        try:
            assert finish == "stop", f"finish_reason {finish}"
            jsonschema.validate(json.loads(text), PERSON)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append((i, str(e)[:200], text[:300]))
    assert not failures, failures
    assert len({t for t, _ in results}) > 90  # seeded samples differ: the grammar constrains, it does not fix
    assert_no_lease(gw, "so-main")


def test_openai_client_json_schema_and_json_object(gw):
    client = gw.client("so-main")
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=MAX_TOKENS, seed=7,
                                       response_format=FORMAT)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=64, seed=3,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":  # a random model may run out of tokens inside an object
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "zero"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {"type": "object"}}},
     "response_format.json_schema.name"),
    ({"type": "xml"}, "response_format"),
    # valid for the metaschema, but its $ref points nowhere: only the worker's compiler finds out
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}}}, "response_format"),
    # compiles, but nothing satisfies it (no first token): it used to fail the whole batch it ran in
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}, "response_format"),
    # strict, with a keyword the grammar would not enforce (null would pass it)
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {"not": {"type": "null"}}}},
     "response_format.json_schema.schema"),
])
def test_invalid_response_format_is_a_400_and_leaves_no_lease(gw, fmt, param):
    r = post(gw, "so-main", "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 8,
                                                   "response_format": fmt})
    err = assert_openai_error(r, 400, param)
    assert err["type"] == "invalid_request_error"
    assert_no_lease(gw, "so-main")
    with pytest.raises(openai.BadRequestError):
        gw.client("so-main").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, response_format=fmt)
