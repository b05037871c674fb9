"""Log probabilities through the official `openai` client against the real gateway and worker.

- chat ``logprobs`` + ``top_logprobs``: one entry per content token; top-1 logprob >= every other
  alternative; with temperature 0 the chosen token is the top-1 (same logprob); the entries' bytes
  make up the content; streamed entries equal the non-streamed ones (same seed).
- completions ``logprobs: N``: tokens, token_logprobs, top_logprobs (N alternatives plus the sampled
  token) and text_offset, streamed equal to non-streamed.
- every body and chunk validates as the `openai` package's `ChatCompletion` / `ChatCompletionChunk` /
  `Completion`.
- bad input: ``top_logprobs`` out of range or without ``logprobs``, completions ``logprobs`` > 5:
  OpenAI-shaped 400, no lease left.
"""

from __future__ import annotations

import pytest

from tests.integration.openai_helpers import (HELLO, MODEL, assert_no_lease, assert_openai_error, chat_body,
                                              chat_chunks, completion_body, completion_chunks, post, streamed_chat)

TENANTS = [{"id": "lp-main", "limits": {"rpm": 100000, "tpm": 100_000_000}}]


@pytest.fixture(scope="module")
def gw(gateway_factory):
    return gateway_factory(TENANTS)


def _check_entries(entries: list[dict], top_n: int, greedy: bool) -> None:
    assert entries
    for e in entries:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["logprob"] <= 0 and isinstance(e["bytes"], list)
        tops = e["top_logprobs"]
        assert len(tops) == top_n
        lps = [t["logprob"] for t in tops]
        assert lps == sorted(lps, reverse=True)  # top-1 >= every other alternative
        assert all(t["logprob"] <= 0 for t in tops)
        if greedy:
            assert tops[0]["bytes"] == e["bytes"] and tops[0]["logprob"] == pytest.approx(e["logprob"], abs=1e-6)
        else:
            assert e["logprob"] <= tops[0]["logprob"] + 1e-6


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_chat_logprobs_consistent_and_streamed_equals_non_streamed(gw, temperature):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 20, "temperature": temperature, "seed": 11,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 5}
    full = chat_body(post(gw, "lp-main", "/v1/chat/completions", body))["choices"][0]
    entries = full["logprobs"]["content"]
    assert full["logprobs"]["refusal"] is None
    _check_entries(entries, 5, greedy=temperature == 0)
    assert len(entries) == 20
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", "replace") == full["message"]["content"]
    streamed = streamed_chat(chat_chunks(gw, "lp-main", body))
    assert streamed["content"] == full["message"]["content"]
    assert streamed["logprobs"] == entries


@pytest.mark.parametrize("top", [5, 20])
def test_logprobs_under_a_grammar_leave_out_the_tokens_it_masks(gw, top):
    """A grammar that allows fewer tokens than `top_logprobs` asks for: the masked tokens (probability
    0) are no alternatives, so every logprob is a finite number (JSON has no -inf: this was a 500,
    and -Infinity in the stream) and the chosen token is the first alternative at temperature 0."""
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3, "temperature": 0, "logprobs": True,
            "top_logprobs": top, "response_format": {"type": "json_schema", "json_schema": {
                "name": "flag", "strict": True, "schema": {"type": "boolean"}}}}
    full = chat_body(post(gw, "lp-main", "/v1/chat/completions", body))["choices"][0]
    entries = full["logprobs"]["content"]
    assert entries and full["message"]["content"] in ("true", "false")
    for e in entries:
        assert 1 <= len(e["top_logprobs"]) <= top
        assert e["top_logprobs"][0]["bytes"] == e["bytes"]
    if top == 20:  # a boolean's grammar allows far fewer than 20 tokens where it ends
        assert any(len(e["top_logprobs"]) < top for e in entries), [len(e["top_logprobs"]) for e in entries]
        assert all(-9999.0 < t["logprob"] <= 0 for t in e["top_logprobs"])
    streamed = streamed_chat(chat_chunks(gw, "lp-main", body))
    assert streamed["logprobs"] == entries
    assert_no_lease(gw, "lp-main")


def test_chat_logprobs_through_the_openai_client(gw):
    client = gw.client("lp-main")
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.content) == 6
    assert all(len(t.top_logprobs) == 2 and t.token == t.top_logprobs[0].token for t in lp.content)
    # logprobs without top_logprobs: the chosen tokens only
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, logprobs=True,
                                       extra_body={"ignore_eos": True})
    assert [len(t.top_logprobs) for t in r.choices[0].logprobs.content] == [0, 0, 0, 0]
    # not asked: null
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert r.choices[0].logprobs is None


def test_completions_logprobs_shape_and_stream(gw):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "logprobs": 3,
            "ignore_eos": True}
    full = completion_body(post(gw, "lp-main", "/v1/completions", body))["choices"][0]
    lp = full["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 12
    for tok, tlp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert tok in top and top[tok] == pytest.approx(tlp)  # greedy: the chosen token is the most likely
        assert tlp == pytest.approx(max(top.values()))
        assert 1 <= len(top) <= 4
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    chunks = completion_chunks(gw, "lp-main", body)
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for ch in c["choices"]:
            for k in merged:
                merged[k] += (ch["logprobs"] or {}).get(k, [])
    assert merged == lp
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == full["text"]
    client = gw.client("lp-main")
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=0, extra_body={"ignore_eos": True})
    assert [len(t) for t in r.choices[0].logprobs.top_logprobs] == [1, 1, 1]  # the sampled token only


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
])
def test_bad_logprobs_are_a_400_and_leave_no_lease(gw, path, extra, param):
    base = {"model": MODEL, "max_tokens": 4}
    base.update({"messages": HELLO} if path.endswith("chat/completions") else {"prompt": "Hi"})
    assert_openai_error(post(gw, "lp-main", path, {**base, **extra}), 400, param)
    assert_no_lease(gw, "lp-main")
