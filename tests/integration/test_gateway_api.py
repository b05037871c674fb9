"""The gateway's OpenAI API against a real worker and a real Redis, through the official `openai` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "random-tiny"

TENANTS = [
    {"id": "api-a", "weight": 2.0, "tier": "interactive", "limits": {"rpm": 1000, "tpm": 1_000_000}},
    {"id": "api-b", "weight": 1.0, "tier": "batch", "limits": {"rpm": 1000, "tpm": 1_000_000}},
    {"id": "api-nomodels", "allowed_models": ["other-model"]},
]


@pytest.fixture(scope="module")
def gw(gateway_factory):
    return gateway_factory(TENANTS)


def test_models_list(gw):
    models = gw.client("api-a").models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert gw.client("api-nomodels").models.list().data == []


def test_chat_completion_basic(gw):
    c = gw.client("api-a")
    r = c.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                    max_tokens=5, temperature=0)
    comp = r.parse()
    assert comp.object == "chat.completion" and comp.model == MODEL
    assert comp.choices[0].message.role == "assistant" and comp.choices[0].finish_reason == "length"
    assert comp.usage.completion_tokens == 5 and comp.usage.prompt_tokens > 10
    assert comp.usage.total_tokens == comp.usage.prompt_tokens + 5
    assert comp.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.headers["x-ratelimit-limit-requests"] == "1000"
    assert r.headers["x-ratelimit-limit-tokens"] == "1000000"
    assert int(r.headers["x-ratelimit-remaining-tokens"]) < 1_000_000


def test_stream_basic(gw):
    c = gw.client("api-a")
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=6, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.usage is None for ch in chunks)
