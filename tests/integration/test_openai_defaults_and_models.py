"""Output budgets without ``max_tokens``, model aliases and per-tenant model lists, against the real
gateway, real workers and Redis (official `openai` client and raw HTTP for the headers).

- ``/v1/completions`` without ``max_tokens``: 16 tokens (OpenAI's default); chat: the tenant's declared
  default, else the operator's for the model, else 1024 tokens; never past the context. The TPM
  reservation is prompt + that default: ``x-ratelimit-limit-tokens - x-ratelimit-remaining-tokens``
  on a fresh tenant.
- a worker started with ``--served-model-name random-tiny tiny-alias`` serves both names
  (``GetModelInfo.served_model_names``); ``/v1/models`` lists only the names a tenant's ``models``
  allow; another name is a 404 ``model_not_found`` that leaves no lease.
"""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from fairshare.v1 import worker_pb2 as pb
from fairshare.v1 import worker_pb2_grpc as pb_grpc
from gateway.config import CHAT_DEFAULT_MAX_TOKENS
from tests.conftest import start_worker
from tests.integration.openai_helpers import (HELLO, MODEL, assert_no_lease, assert_openai_error, chat_body,
                                              completion_body, post)

TPM = 1_000_000
TENANTS = [
    {"id": "def-plain", "limits": {"tpm": TPM}},
    {"id": "def-own", "limits": {"tpm": TPM}, "default_max_tokens": 12},
    {"id": "def-per-model", "limits": {"tpm": TPM}, "default_max_tokens": {"other-model": 99, "*": 7}},
]
OPERATOR_DEFAULT = 20


@pytest.fixture(scope="module")
def gw(gateway_factory):
    return gateway_factory(TENANTS, default_max_tokens={MODEL: OPERATOR_DEFAULT})


def reserved(resp: httpx.Response) -> int:
    """Tokens the request reserved from a full TPM bucket (the headers are taken at admission)."""
    return int(resp.headers["x-ratelimit-limit-tokens"]) - int(resp.headers["x-ratelimit-remaining-tokens"])


def test_completions_default_to_16_tokens_and_reserve_prompt_plus_16(gw):
    r = post(gw, "def-plain", "/v1/completions", {"model": MODEL, "prompt": "This is a test.", "ignore_eos": True})
    body = completion_body(r)
    u = body["usage"]
    assert u["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"
    assert reserved(r) == u["prompt_tokens"] + 16
    assert_no_lease(gw, "def-plain")


@pytest.mark.parametrize("tenant,expected", [("def-own", 12), ("def-per-model", 7)])
def test_chat_uses_the_tenants_declared_default(gw, tenant, expected):
    r = post(gw, tenant, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "ignore_eos": True})
    body = chat_body(r)
    assert body["usage"]["completion_tokens"] == expected and body["choices"][0]["finish_reason"] == "length"
    assert reserved(r) == body["usage"]["prompt_tokens"] + expected


def test_chat_uses_the_operators_default_for_the_model(gw):
    client = gw.client("def-plain")
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, extra_body={"ignore_eos": True})
    r = raw.parse()
    assert r.usage.completion_tokens == OPERATOR_DEFAULT and r.choices[0].finish_reason == "length"
    assert (int(raw.headers["x-ratelimit-limit-tokens"]) - int(raw.headers["x-ratelimit-remaining-tokens"])
            == r.usage.prompt_tokens + OPERATOR_DEFAULT)


def test_the_default_never_passes_the_context(gw):
    # a prompt ~30 tokens short of the 2048-token context: the default (20) fits, then does not
    long_prompt = " ".join(["word"] * 2000)
    probe = completion_body(post(gw, "def-plain", "/v1/completions", {"model": MODEL, "prompt": long_prompt,
                                                                    "max_tokens": 1}))
    room = 2048 - probe["usage"]["prompt_tokens"]
    assert 0 < room < 100
    text = " ".join(["word"] * (2000 + room - 5))
    r = post(gw, "def-plain", "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": None,
                                                "ignore_eos": True})
    body = completion_body(r)
    left = 2048 - body["usage"]["prompt_tokens"]
    assert left < 16 and body["usage"]["completion_tokens"] == left
    assert reserved(r) == 2048


def test_builtin_chat_default_reserves_prompt_plus_1024(gateway_factory):
    g = gateway_factory([{"id": "def-builtin", "limits": {"tpm": TPM}}, {"id": "def-probe"}])
    prompt = chat_body(post(g, "def-probe", "/v1/chat/completions",
                            {"model": MODEL, "messages": HELLO, "max_tokens": 1}))["usage"]["prompt_tokens"]
    headers = {"authorization": f"Bearer {g.keys['def-builtin']}"}
    with httpx.stream("POST", g.base_url + "/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "messages": HELLO, "stream": True}) as r:
        assert r.status_code == 200
        assert reserved(r) == prompt + CHAT_DEFAULT_MAX_TOKENS
        next(r.iter_lines())  # then hang up: the lease goes with the stream


# -- served model names and per-tenant model lists ---------------------------------------------------

@pytest.fixture(scope="module")
def alias_worker(tmp_path_factory):
    proc, addr = start_worker("--served-model-name", "random-tiny", "tiny-alias",
                              log_path=tmp_path_factory.mktemp("alias-worker") / "worker.log")
    yield addr
    proc.terminate()
    proc.wait(15)


@pytest.fixture(scope="module")
def alias_gw(gateway_factory, alias_worker):
    return gateway_factory([{"id": "mod-all"}, {"id": "mod-alias", "models": ["tiny-alias"]},
                            {"id": "mod-old-key", "allowed_models": ["random-tiny"]}], workers=[alias_worker])


def test_worker_reports_every_served_name(alias_worker):
    with grpc.insecure_channel(alias_worker) as ch:
        info = pb_grpc.WorkerStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model_name == "random-tiny" and list(info.served_model_names) == ["random-tiny", "tiny-alias"]


def test_models_lists_what_the_key_may_use(alias_gw):
    assert sorted(m.id for m in alias_gw.client("mod-all").models.list()) == ["random-tiny", "tiny-alias"]
    assert [m.id for m in alias_gw.client("mod-alias").models.list()] == ["tiny-alias"]
    assert [m.id for m in alias_gw.client("mod-old-key").models.list()] == ["random-tiny"]
    assert alias_gw.client("mod-alias").models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError):
        alias_gw.client("mod-alias").models.retrieve("random-tiny")


def test_alias_serves_and_answers_under_its_name(alias_gw):
    r = alias_gw.client("mod-alias").chat.completions.create(model="tiny-alias", messages=HELLO, max_tokens=3)
    assert r.model == "tiny-alias" and r.usage.completion_tokens <= 3
    r = alias_gw.client("mod-all").completions.create(model="random-tiny", prompt="Hi", max_tokens=2)
    assert r.model == "random-tiny"


@pytest.mark.parametrize("tenant,model", [("mod-alias", "random-tiny"), ("mod-old-key", "tiny-alias"),
                                          ("mod-all", "no-such-model")])
def test_a_model_the_tenant_may_not_use_is_404_model_not_found(alias_gw, tenant, model):
    for path, extra in (("/v1/chat/completions", {"messages": HELLO}), ("/v1/completions", {"prompt": "Hi"})):
        r = post(alias_gw, tenant, path, {"model": model, "max_tokens": 2, **extra})
        err = assert_openai_error(r, 404, "model", "model_not_found")
        assert err["type"] == "invalid_request_error" and model in err["message"]
    assert_no_lease(alias_gw, tenant)
