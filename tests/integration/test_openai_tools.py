"""Tool calling through the official `openai` client against the real gateway and worker (random
tiny model: forced calls are well-formed only because constrained decoding makes them so).

- ``tool_choice`` naming a function and ``"required"``, streamed and not: 100% well-formed
  ``tool_calls`` (id, type, a declared name) whose arguments parse and validate against the
  function's parameters; ``finish_reason: "tool_calls"``; with ``parallel_tool_calls: false``
  exactly one call.
- the conversation sent back with the assistant's ``tool_calls`` and a ``tool`` result is accepted.
- ``auto`` with a model that writes no call: plain content; tools are in the prompt (the SmolLM2
  template has no ``tools`` variable: the fallback system section).
- bad input: unknown function in tool_choice, tool_choice without tools, a tool result without
  ``tool_call_id``, an invalid parameters schema: OpenAI-shaped 400, no lease left.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.integration.openai_helpers import (HELLO, MODEL, assert_no_lease, assert_openai_error, chat_body,
                                              chat_chunks, post, run_all, streamed_chat)

TENANTS = [{"id": "tools-main", "limits": {"rpm": 100000, "tpm": 100_000_000}}]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16},
                                  "unit": {"enum": ["celsius", "fahrenheit"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "unit", "days"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object",
                   "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 20},
                                  "filters": {"type": "array", "items": {"enum": ["news", "images"]},
                                              "maxItems": 2}},
                   "required": ["query", "filters"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def gw(gateway_factory):
    return gateway_factory(TENANTS)


def _call(gw, i: int, tool_choice, parallel: bool | None, max_tokens: int) -> tuple[list[dict], str]:
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": max_tokens,
            "temperature": 1.0, "seed": i}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    if i % 2:
        out = streamed_chat(chat_chunks(gw, "tools-main", body))
        return out["tool_calls"], out["finish_reason"]
    choice = chat_body(post(gw, "tools-main", "/v1/chat/completions", body))["choices"][0]
    return choice["message"].get("tool_calls") or [], choice["finish_reason"]


def _check_calls(calls: list[dict], finish: str, allowed: set[str]) -> None:
    assert finish == "tool_calls", finish
    assert calls
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        name = c["function"]["name"]
        assert name in allowed, name
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[name])
    assert len({c["id"] for c in calls}) == len(calls)


def test_named_tool_choice_always_calls_that_function(gw):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    results = run_all(lambda i: _call(gw, i, choice, None, 300), range(40))
    for calls, finish in results:
        _check_calls(calls, finish, {"get_weather"})
        assert len(calls) == 1
    assert_no_lease(gw, "tools-main")


def test_required_tool_choice_single_call(gw):
    results = run_all(lambda i: _call(gw, 100 + i, "required", False, 300), range(40))
    for calls, finish in results:
        _check_calls(calls, finish, {"get_weather", "search"})
        assert len(calls) == 1
    assert {c["function"]["name"] for calls, _ in results for c in calls} == {"get_weather", "search"}


def test_required_tool_choice_parallel_calls(gw):
    # each call is ~50 tokens; the budget (the context left) holds ~30 (the model decides how many)
    results = run_all(lambda i: _call(gw, 200 + i, "required", True, 1600), range(20))
    for calls, finish in results:
        _check_calls(calls, finish, {"get_weather", "search"})
    print("calls per answer:", sorted(len(c) for c, _ in results))
    assert max(len(c) for c, _ in results) > 1  # parallel calls do happen


def test_tool_result_sent_back_is_accepted(gw):
    client = gw.client("tools-main")
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300, seed=1,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    call = msg.tool_calls[0]
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "clear"})}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert second.choices[0].finish_reason == "length" and second.usage.completion_tokens == 8
    # the history (call and result) is in the prompt: longer than the question alone with the same tools
    alone = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1)
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 20


def test_auto_without_a_call_is_plain_content_and_tools_reach_the_prompt(gw):
    client = gw.client("tools-main")
    with_tools = client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS, max_tokens=8,
                                                temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    c = with_tools.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls and c.message.content
    # the fallback system section lists both functions' schemas
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 100


@pytest.mark.parametrize("extra,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools.[1].function.name"),
    # valid for the metaschema and compiles, but no arguments satisfy it: a forced call used to end
    # as a 200 holding the call's cut-off opening as content and no tool_calls
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"tools": TOOLS, "messages": ASK + [{"role": "tool", "content": "18C"}]}, "messages.[1].tool_call_id"),
])
def test_bad_tool_input_is_a_400_and_leaves_no_lease(gw, extra, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, **extra}
    assert_openai_error(post(gw, "tools-main", "/v1/chat/completions", body), 400, param)
    assert_no_lease(gw, "tools-main")
