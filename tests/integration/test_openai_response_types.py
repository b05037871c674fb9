"""Every body and stream chunk the gateway produces, validated against the `openai` package's own
response types (`ChatCompletion`, `ChatCompletionChunk`, `Completion`, `Model`, `ErrorObject`),
strictly (`tests.integration.openai_helpers.validate_strict`: no coercion, no undeclared field
anywhere in the tree, the model dumped back equals the body), on the real gateway and worker
(random-tiny).

The matrix: non-streamed, streamed, streamed with ``stream_options.include_usage``, ``n > 1``,
logprobs, tool calls, ``response_format`` json_schema, ``stop``, ``max_tokens`` reached
(``finish_reason: "length"``), prompt batches; ``/v1/models`` and ``/v1/models/{id}``; the error
bodies of 400, 401, 404, 429 and 503, and the error event that ends a stream a worker aborted
mid-generation (before the fix it was preceded by a chunk with ``finish_reason: "abort"``, which no
`openai` type admits).

Beyond the types, the shape rules the SDK relies on when it assembles a stream: every chunk of one
response has the same ``id``, ``created``, ``model`` and ``system_fingerprint``; the usage chunk
(include_usage) is the last, has ``choices: []`` and the usage of the whole response; each choice
ends with exactly one chunk carrying its ``finish_reason``.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject

from fairshare.v1 import worker_pb2 as pb

from tests.integration.openai_helpers import (HELLO, MODEL, assert_openai_error, chat_body, chat_chunks,
                                              completion_body, completion_chunks, model_list_body, post,
                                              validate_completion_chunk, validate_strict)
from tests.integration.test_gateway_routing import ProxyWorker
from tests.integration.test_openai_tools import WEATHER

TENANTS = [{"id": "rt-main", "limits": {"rpm": 100000, "tpm": 100_000_000}},
           {"id": "rt-tight", "limits": {"rpm": 1, "tpm": 100_000_000}}]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["city", "n"], "additionalProperties": False}}}

CHAT_CASES = {
    "plain": {},
    "length": {"max_tokens": 3, "ignore_eos": True},
    "stop": {"stop": ["e", "a", "o"], "max_tokens": 30, "temperature": 1.0, "seed": 3},
    "n3": {"n": 3, "temperature": 1.0, "seed": 5},
    "logprobs": {"logprobs": True, "top_logprobs": 3, "ignore_eos": True},
    "tools": {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
              "max_tokens": 200, "temperature": 1.0, "seed": 1},
    "json_schema": {"response_format": SCHEMA, "max_tokens": 60, "temperature": 1.0, "seed": 2},
}
TEXT_CASES = {
    "plain": {},
    "length": {"max_tokens": 3, "ignore_eos": True},
    "stop": {"stop": ["e", "a"], "max_tokens": 30, "temperature": 1.0, "seed": 3},
    "n2": {"n": 2, "temperature": 1.0, "seed": 5},
    "logprobs": {"logprobs": 2, "ignore_eos": True},
    "batch": {"prompt": ["Once upon a time", "Hello there"], "max_tokens": 4},
}


@pytest.fixture(scope="module")
def gw(gateway_factory):
    return gateway_factory(TENANTS)


def _chat(extra: dict) -> dict:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 8, **extra}


def _text(extra: dict) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, **extra}


def _check_stream_shape(chunks: list[dict], choices: int, with_usage: bool) -> dict | None:
    """Shared fields equal across chunks; one finish chunk per choice; the usage chunk last (with
    usage) or absent everywhere (without). Returns the final usage (or None)."""
    head = chunks[0]
    for c in chunks:
        assert (c["id"], c["created"], c["model"], c["system_fingerprint"]) == (
            head["id"], head["created"], head["model"], head["system_fingerprint"]), c
        assert ("usage" in c) == with_usage, c
    finishes = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"] is not None]
    assert sorted(finishes) == list(range(choices)), finishes
    if not with_usage:
        return None
    *content, last = chunks
    assert last["choices"] == [] and last["usage"] is not None
    assert all(c["usage"] is None and c["choices"] for c in content)
    u = last["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    return u


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_chat_bodies_and_chunks_are_openai_types(gw, case):
    body = _chat(CHAT_CASES[case])
    full = validate_strict(ChatCompletion, chat_body(post(gw, "rt-main", CHAT, body)))
    n = body.get("n", 1)
    assert [c.index for c in full.choices] == list(range(n))
    if case == "length":
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 3
    if case == "tools":
        assert full.choices[0].finish_reason == "tool_calls" and full.choices[0].message.tool_calls
    if case == "logprobs":
        assert full.choices[0].logprobs.content
    for with_usage in (False, True):
        streamed = {**body, "stream_options": {"include_usage": True}} if with_usage else body
        chunks = chat_chunks(gw, "rt-main", streamed)
        u = _check_stream_shape(chunks, n, with_usage)
        if u is not None and case in ("length", "logprobs"):  # ignore_eos: the same token count
            assert u["completion_tokens"] == full.usage.completion_tokens
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize("case", sorted(TEXT_CASES))
def test_completion_bodies_and_chunks_are_openai_types(gw, case):
    body = _text(TEXT_CASES[case])
    full = validate_strict(Completion, completion_body(post(gw, "rt-main", TEXT, body)))
    n = body.get("n", 1) * (len(body["prompt"]) if isinstance(body["prompt"], list) else 1)
    assert [c.index for c in full.choices] == list(range(n))
    if case == "length":
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 3
    if case == "logprobs":
        lp = full.choices[0].logprobs
        assert lp.tokens and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    for with_usage in (False, True):
        streamed = {**body, "stream_options": {"include_usage": True}} if with_usage else body
        chunks = completion_chunks(gw, "rt-main", streamed)
        u = _check_stream_shape(chunks, n, with_usage)
        if u is not None and case in ("length", "logprobs"):
            assert u["completion_tokens"] == full.usage.completion_tokens


def test_model_list_and_model_are_openai_types(gw):
    auth = {"authorization": f"Bearer {gw.keys['rt-main']}"}
    listed = model_list_body(httpx.get(gw.base_url + "/v1/models", headers=auth, timeout=30))
    assert MODEL in [m["id"] for m in listed["data"]]
    r = httpx.get(gw.base_url + f"/v1/models/{MODEL}", headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    assert validate_strict(Model, r.json()).id == MODEL


@pytest.mark.parametrize("name", ["missing_key", "bad_key", "unknown_model", "bad_json", "wrong_type",
                                  "unknown_field", "unknown_route", "rate_limited", "model_404"])
def test_error_bodies_are_openai_error_objects(gw, name):
    key = gw.keys["rt-main"]
    auth = {"authorization": f"Bearer {key}"}
    url = gw.base_url
    if name == "missing_key":
        assert_openai_error(httpx.post(url + CHAT, json=_chat({}), timeout=30), 401, code="missing_api_key")
    elif name == "bad_key":
        assert_openai_error(httpx.post(url + CHAT, json=_chat({}), headers={"authorization": "Bearer sk-nope-1234"},
                                       timeout=30), 401, code="invalid_api_key")
    elif name == "unknown_model":
        assert_openai_error(post(gw, "rt-main", CHAT, {**_chat({}), "model": "no-such-model"}), 404,
                            code="model_not_found")
    elif name == "bad_json":
        assert_openai_error(httpx.post(url + CHAT, content=b"{not json", headers={**auth, "content-type":
                                                                                  "application/json"}, timeout=30),
                            400)
    elif name == "wrong_type":
        assert_openai_error(post(gw, "rt-main", TEXT, _text({"max_tokens": "8"})), 400, param="max_tokens")
    elif name == "unknown_field":
        assert_openai_error(post(gw, "rt-main", CHAT, _chat({"no_such_field": 1})), 400)
    elif name == "unknown_route":
        assert_openai_error(httpx.get(url + "/v1/nope", headers=auth, timeout=30), 404)
    elif name == "model_404":
        assert_openai_error(httpx.get(url + "/v1/models/no-such-model", headers=auth, timeout=30), 404,
                            code="model_not_found")
    else:  # the first request takes the only token of a 1 rpm bucket; the second is a 429
        assert post(gw, "rt-tight", TEXT, _text({"max_tokens": 1})).status_code == 200
        assert_openai_error(post(gw, "rt-tight", TEXT, _text({"max_tokens": 1})), 429)


class AbortAfterFirstMessage(ProxyWorker):
    """Forwards to the real worker, but ends every Generate stream with FINISH_REASON_ABORT right
    after the worker's first message that carries tokens, forwarded as unfinished even when the worker
    had sent every token in it (a worker giving up mid-generation, on any machine)."""

    def Generate(self, request, context):
        self.requests.append(request)
        call = self.forward(request, context)
        for msg in call:
            if msg.token_ids:  # the worker may send every token and its finish in one (coalesced) message:
                part = pb.GenerateResponse()  # forward its tokens as unfinished, then give up
                part.CopyFrom(msg)
                part.ClearField("finish_reason")
                part.ClearField("usage")
                yield part
                call.cancel()
                yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_ABORT,
                                          usage=pb.Usage(prompt_tokens=len(request.prompt_token_ids),
                                                         completion_tokens=len(msg.token_ids)))
                return
            yield msg


def _raw_events(gw, tenant: str, path: str, body: dict) -> list:
    """Every SSE data item of a streamed request, ``[DONE]`` as the string, the rest parsed."""
    headers = {"authorization": f"Bearer {gw.keys[tenant]}"}
    with httpx.stream("POST", gw.base_url + path, json={**body, "stream": True}, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read().decode()
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines[:3]
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_worker_abort_mid_stream_is_an_error_event_never_an_abort_finish_reason(gateway_factory, worker_addr, path):
    proxy = AbortAfterFirstMessage(worker_addr)
    try:
        gw = gateway_factory([{"id": "rt-abort", "limits": {"tpm": 1_000_000}}], workers=[proxy.addr],
                             health_interval_s=30.0)
        body = _chat({"max_tokens": 20, "ignore_eos": True}) if path == CHAT else _text({"max_tokens": 20,
                                                                                         "ignore_eos": True})
        events = _raw_events(gw, "rt-abort", path, body)
        *chunks, last = events
        assert "[DONE]" not in events
        assert set(last) == {"error"}
        validate_strict(ErrorObject, last["error"])
        assert last["error"]["type"] == "server_error"
        assert chunks, "no chunk came before the abort"
        for c in chunks:  # every chunk before the error is a valid chunk: no finish_reason "abort"
            if path == CHAT:
                validate_strict(ChatCompletionChunk, c)
            else:
                validate_completion_chunk(c)
            assert all(ch["finish_reason"] is None for ch in c["choices"]), c
        assert_openai_error(post(gw, "rt-abort", path, body), 503)  # not streamed: the same error as a body
        assert gw.leases("rt-abort") == {}
    finally:
        proxy.stop()
