"""The gateway's per-endpoint metrics use one label per endpoint, streamed or not: ``chat`` for
/v1/chat/completions and ``completions`` for /v1/completions (docs/observability.md)."""

from __future__ import annotations

from tests.support.waits import wait_for


def _samples(gw, name: str) -> dict[tuple[str, str], float]:
    """{(tenant, endpoint): value} of one sample name in the app's registry."""
    out = {}
    for metric in gw.app.state.gw.metrics.registry.collect():
        for s in metric.samples:
            if s.name == name:
                out[(s.labels["tenant"], s.labels["endpoint"])] = s.value
    return out


def test_streamed_and_plain_requests_share_the_endpoint_label(gateway_factory):
    gw = gateway_factory([{"id": "labels"}])
    client = gw.client("labels")
    client.completions.create(model="random-tiny", prompt="one", max_tokens=2)
    for _ in client.completions.create(model="random-tiny", prompt="two", max_tokens=2, stream=True):
        pass
    client.chat.completions.create(model="random-tiny", messages=[{"role": "user", "content": "three"}], max_tokens=2)
    for _ in client.chat.completions.create(model="random-tiny", messages=[{"role": "user", "content": "four"}],
                                            max_tokens=2, stream=True):
        pass
    # a stream's latency is observed when its body settles, just after the client read [DONE]
    wait_for(lambda: sum(v for (t, _), v in _samples(gw, "fairshare_gateway_request_seconds_count").items()
                         if t == "labels") == 4, "the latency of all four requests was recorded")
    latency = {k: v for k, v in _samples(gw, "fairshare_gateway_request_seconds_count").items() if k[0] == "labels"}
    requests = {k: v for k, v in _samples(gw, "fairshare_gateway_requests_total").items() if k[0] == "labels"}
    assert latency == {("labels", "completions"): 2, ("labels", "chat"): 2}
    assert requests == latency
