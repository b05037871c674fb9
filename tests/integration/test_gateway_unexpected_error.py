"""An unexpected error in the gateway (a bug, not an APIError) is answered with an OpenAI-shaped 500
and counted as one in ``fairshare_gateway_requests_total``, and the request's lease is released.
The bug is planted in the in-process gateway (the worker's answer cannot be encoded)."""

from __future__ import annotations

import httpx

import gateway.completion as completion
from tests.integration.openai_helpers import HELLO, MODEL, assert_no_lease

TOKEN = "unexpected-metrics-token"


def test_an_unexpected_error_is_a_counted_500_and_releases_the_lease(gateway_factory, monkeypatch):
    gw = gateway_factory([{"id": "bug-t"}], metrics_token=TOKEN)
    real = completion.collect

    async def broken_collect(session, kind):
        body = await real(session, kind)
        body["choices"][0]["bad"] = float("nan")  # JSON cannot carry it: the response cannot be built
        return body

    monkeypatch.setattr(completion, "collect", broken_collect)
    r = httpx.post(gw.base_url + "/v1/chat/completions", headers={"authorization": f"Bearer {gw.keys['bug-t']}"},
                   json={"model": MODEL, "messages": HELLO, "max_tokens": 2}, timeout=60)
    assert r.status_code == 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    metrics = httpx.get(gw.base_url + "/metrics", headers={"authorization": f"Bearer {TOKEN}"}).text
    counted = [line for line in metrics.splitlines() if line.startswith("fairshare_gateway_requests_total{")
               and 'tenant="bug-t"' in line]
    assert any('status="500"' in line and line.endswith(" 1.0") for line in counted), counted
    assert not any('status="200"' in line for line in counted), counted
    assert_no_lease(gw, "bug-t")
