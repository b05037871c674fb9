"""Helpers of the OpenAI-surface tests (tests/integration/test_openai_*.py): raw HTTP calls next to
the official `openai` client, SSE parsing, validation of every body and chunk against the `openai`
package's own response types, and the lease check (nothing held in Redis after a request)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

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
    return [json.loads(line[6:]) for line in lines[:-1]]


def chat_body(resp: httpx.Response) -> dict:
    """The JSON body of a 200 chat completion, validated as an `openai` `ChatCompletion`."""
    assert resp.status_code == 200, resp.text
    body = resp.json()
    ChatCompletion.model_validate(body)
    return body


def completion_body(resp: httpx.Response) -> dict:
    """The JSON body of a 200 text completion, validated as an `openai` `Completion`."""
    assert resp.status_code == 200, resp.text
    body = resp.json()
    Completion.model_validate(body)
    return body


def chat_chunks(gw, tenant: str, body: dict) -> list[dict]:
    """A streamed chat completion's chunks, each validated as an `openai` `ChatCompletionChunk`."""
    chunks = stream_chunks(gw, tenant, "/v1/chat/completions", body)
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    return chunks


def completion_chunks(gw, tenant: str, body: dict) -> list[dict]:
    """A streamed text completion's chunks, each validated as an `openai` `Completion`. The type
    has no null ``finish_reason``, which every chunk but a choice's last carries (as OpenAI's own
    streams do; the SDK builds chunks without validating): such a chunk is validated with the null
    checked here and a final reason in its place."""
    chunks = stream_chunks(gw, tenant, "/v1/completions", body)
    for c in chunks:
        choices = []
        for ch in c["choices"]:
            assert ch["finish_reason"] in (None, "stop", "length")
            choices.append({**ch, "finish_reason": ch["finish_reason"] or "stop"})
        Completion.model_validate({**c, "choices": choices})
    return chunks


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
