"""Helpers of the OpenAI-surface tests (tests/integration/test_openai_*.py): raw HTTP calls next to
the official `openai` client, SSE parsing, validation of every body and chunk against the `openai`
package's own response types, and the lease check (nothing held in Redis after a request)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai import BaseModel as OpenAIModel
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject

MODEL = "random-tiny"
HELLO = [{"role": "user", "content": "Hello, how are you?"}]


def post(gw, tenant: str, path: str, body: dict) -> httpx.Response:
    """POST `body` as `tenant` (not streamed)."""
    return httpx.post(gw.base_url + path, json=body, headers={"authorization": f"Bearer {gw.keys[tenant]}"},
                      timeout=120)


def stream_chunks(gw, tenant: str, path: str, body: dict) -> list[dict]:
    """POST a streamed request; return its SSE data objects (asserting the framing: 200, event
    stream, every line ``data: ...``, exactly one final ``data: [DONE]``)."""
    headers = {"authorization": f"Bearer {gw.keys[tenant]}"}
    with httpx.stream("POST", gw.base_url + path, json={**body, "stream": True}, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read().decode()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines[:3]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    return [strict_json(line[6:]) for line in lines[:-1]]


def _not_json(name: str):
    raise AssertionError(f"{name} is not JSON (a client's strict parser refuses it)")


def strict_json(text: str):
    """`text` parsed as strict JSON: NaN, Infinity and -Infinity (which Python's json accepts) fail."""
    return json.loads(text, parse_constant=_not_json)


def _no_extra(obj, path: str = "$") -> None:
    """No field of `obj` (an `openai` model) or of any model inside it is one the type does not
    declare (the `openai` types accept and keep unknown fields: ``model_extra``)."""
    if isinstance(obj, OpenAIModel):
        assert not obj.model_extra, f"{path}: fields the openai type does not declare: {sorted(obj.model_extra)}"
        for name in type(obj).model_fields:
            _no_extra(getattr(obj, name), f"{path}.{name}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _no_extra(v, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _no_extra(v, f"{path}.{k}")


def validate_strict(model_type: type[OpenAIModel], body: dict) -> OpenAIModel:
    """`body` validated as the `openai` type `model_type`, strictly: no type coercion (a string
    where a number belongs fails, as in the SDK's own strict mode), no field the type does not
    declare anywhere in the tree, and the model dumped back (``exclude_unset``) equals the body, so
    nothing was dropped, renamed or converted. Returns the model (AssertionError / ValidationError)."""
    obj = model_type.model_validate(body, strict=True)
    _no_extra(obj)
    assert obj.model_dump(mode="json", exclude_unset=True, by_alias=True) == body, (model_type.__name__, body)
    return obj


def chat_body(resp: httpx.Response) -> dict:
    """The JSON body of a 200 chat completion, validated strictly as an `openai` `ChatCompletion`."""
    assert resp.status_code == 200, resp.text
    body = strict_json(resp.text)
    validate_strict(ChatCompletion, body)
    return body


def completion_body(resp: httpx.Response) -> dict:
    """The JSON body of a 200 text completion, validated strictly as an `openai` `Completion`."""
    assert resp.status_code == 200, resp.text
    body = resp.json()
    validate_strict(Completion, body)
    return body


def chat_chunks(gw, tenant: str, body: dict) -> list[dict]:
    """A streamed chat completion's chunks, each validated strictly as an `openai` `ChatCompletionChunk`."""
    chunks = stream_chunks(gw, tenant, "/v1/chat/completions", body)
    for c in chunks:
        validate_strict(ChatCompletionChunk, c)
    return chunks


def validate_completion_chunk(c: dict) -> None:
    """A streamed text-completion chunk, validated strictly as an `openai` `Completion`. The type
    has no null ``finish_reason``, which every chunk but a choice's last carries (as OpenAI's own
    streams do; the SDK builds chunks without validating): such a chunk is validated with the null
    checked here and a final reason in its place."""
    choices = []
    for ch in c["choices"]:
        assert ch["finish_reason"] in (None, "stop", "length")
        choices.append({**ch, "finish_reason": ch["finish_reason"] or "stop"})
    validate_strict(Completion, {**c, "choices": choices})


def completion_chunks(gw, tenant: str, body: dict) -> list[dict]:
    """A streamed text completion's chunks, each validated by `validate_completion_chunk`."""
    chunks = stream_chunks(gw, tenant, "/v1/completions", body)
    for c in chunks:
        validate_completion_chunk(c)
    return chunks


def model_list_body(resp: httpx.Response) -> dict:
    """The JSON body of a 200 ``GET /v1/models``: ``{"object": "list", "data": [Model...]}``, each
    entry validated strictly as an `openai` `Model`."""
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"object", "data"} and body["object"] == "list", body
    for m in body["data"]:
        validate_strict(Model, m)
    return body


def streamed_chat(chunks: list[dict]) -> dict:
    """Choice 0 of a chat stream put together: content, tool calls (by index), logprobs content,
    finish reason."""
    content, calls, logprobs, finish = "", {}, [], None
    for c in chunks:
        for ch in c["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                slot = calls.setdefault(tc["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.get("id") or slot["id"]
                slot["type"] = tc.get("type") or slot["type"]
                fn = tc.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            if ch.get("logprobs"):
                logprobs += ch["logprobs"]["content"] or []
            finish = ch.get("finish_reason") or finish
    return {"content": content, "tool_calls": [calls[i] for i in sorted(calls)], "logprobs": logprobs,
            "finish_reason": finish}


def assert_openai_error(resp: httpx.Response, status: int, param=..., code=...) -> dict:
    """`resp` is an OpenAI error body with this status (and param / code when given)."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    validate_strict(ErrorObject, body["error"])
    err = body["error"]
    assert err["message"] and "Traceback" not in err["message"]
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


def assert_no_lease(gw, tenant: str) -> None:
    """No in-flight lease of `tenant` left in Redis."""
    assert gw.leases(tenant) == {}


def run_all(fn, items, workers: int = 8) -> list:
    """`fn(item)` for every item, `workers` at a time (results in order)."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))
