"""gateway/deadlines.py and its settings: whose deadline a request has."""

from __future__ import annotations

import pytest

from fairshare.config import TenantConfig, Tier
from fairshare.worker_auth import Claims
from gateway.config import GatewaySettings
from gateway.deadlines import SDK_GRACE_S, request_deadline
from gateway.errors import APIError


def settings(**kw) -> GatewaySettings:
    return GatewaySettings(secret="s", worker_auth=False, **kw)


def test_tier_defaults_and_overrides():
    s = settings()
    assert s.tier_request_timeout_s == {Tier.INTERACTIVE: 600.0, Tier.BATCH: None, Tier.BACKGROUND: None}
    s = settings(tier_request_timeout_s="batch=3600,interactive=none")
    assert s.tier_request_timeout_s == {Tier.INTERACTIVE: None, Tier.BATCH: 3600.0, Tier.BACKGROUND: None}
    s = settings(tier_request_timeout_s='{"background": 7200}')
    assert s.tier_request_timeout_s[Tier.BACKGROUND] == 7200.0 and s.tier_request_timeout_s[Tier.INTERACTIVE] == 600
    with pytest.raises(ValueError):
        settings(tier_request_timeout_s="interactive=-5")


def test_whose_deadline():
    s = settings()
    inter, bg = TenantConfig(id="a"), TenantConfig(id="b", tier="background")
    d = request_deadline(s, inter, {}, stream=True, now=100.0)
    assert (d.at, d.owner, d.source) == (700.0, "server", "tier interactive")
    assert request_deadline(s, bg, {}, stream=True, now=100.0).at is None  # background: none unless set
    d = request_deadline(s, TenantConfig(id="c", request_timeout_s=30), {}, stream=False, now=0.0)
    assert (d.at, d.source) == (30.0, "tenant c")
    d = request_deadline(settings(request_timeout_s=5), bg, {}, stream=False, now=0.0)
    assert (d.at, d.source) == (5.0, "request_timeout_s")  # one deadline for every tier
    # the client may shorten it, never lengthen it
    d = request_deadline(s, inter, {"x-request-timeout": "20"}, stream=True, now=0.0)
    assert (d.at, d.owner) == (20.0, "client") and d.error().status == 408
    d = request_deadline(s, inter, {"x-request-timeout": "9000"}, stream=True, now=0.0)
    assert (d.at, d.owner) == (600.0, "server") and d.error().status == 504
    # the SDK's timeout counts for a non-streamed request only (a stream's gaps are kept alive)
    # ... and its deadline runs SDK_GRACE_S past it, so the SDK's own timeout fires first (no 408 race)
    assert request_deadline(s, bg, {"x-stainless-read-timeout": "60"}, stream=False, now=0.0).at == 60.0 + SDK_GRACE_S
    sdk = request_deadline(s, inter, {"x-stainless-read-timeout": "599.5"}, stream=False, now=0.0)
    assert (sdk.at, sdk.seconds, sdk.owner) == (600.0, 599.5, "client")  # never past the server's
    assert request_deadline(s, bg, {"x-stainless-read-timeout": "60"}, stream=True, now=0.0).at is None
    assert request_deadline(s, bg, {"x-stainless-read-timeout": "junk"}, stream=False, now=0.0).at is None
    with pytest.raises(APIError) as err:
        request_deadline(s, inter, {"x-request-timeout": "soon"}, stream=False)
    assert err.value.status == 400


def test_error_bodies():
    from gateway.deadlines import Deadline

    e = Deadline(1.0, 30.0, "server", "tier interactive").error(started=False)
    assert (e.status, e.type, e.code) == (504, "server_error", "timeout") and "did not start" in e.message
    e = Deadline(1.0, 2.5, "client", "x-request-timeout").error()
    assert (e.status, e.type, e.code) == (408, "invalid_request_error", "request_timeout")
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_worker_auth_settings():
    with pytest.raises(RuntimeError, match="no worker-auth keys"):
        GatewaySettings(secret="s", worker_keys=None, worker_keys_file=None).worker_signer()
    assert settings().worker_signer() is None
    signer = GatewaySettings(secret="s", worker_keys="k:" + "z" * 20).worker_signer()
    assert signer.token(Claims("Abort", "r")).startswith("fs1.k.")
