"""`fairshare gateway` flags: one table (gateway.cli.GATEWAY_FLAGS) builds the parser and the settings."""

from __future__ import annotations

import pytest

from gateway.cli import GATEWAY_FLAGS, _settings_from_args, build_parser
from gateway.config import GatewaySettings


def test_every_flag_sets_a_settings_field():
    fields = set(GatewaySettings.model_fields)
    dests = [dest for _, dest, _, _ in GATEWAY_FLAGS]
    assert len(dests) == len(set(dests)), "two flags set the same field"
    assert not set(dests) - fields, f"flags naming no GatewaySettings field: {sorted(set(dests) - fields)}"


def test_flags_reach_the_settings_typed(monkeypatch):
    for name in [k for k in __import__("os").environ if k.startswith("FAIRSHARE_")]:
        monkeypatch.delenv(name)
    args = build_parser().parse_args([
        "--tenants", "t.yaml", "--replicas", "3", "--no-worker-auth", "--redis-cluster", "--routing", "prefix",
        "--lease-ttl-s", "2.5", "--workers", "a:1,b:2", "--secret-file", "s"])
    s = _settings_from_args(args)
    assert (str(s.tenants_file), s.gateway_replicas, s.worker_auth, s.redis_cluster, s.routing, s.lease_ttl_s,
            s.workers) == ("t.yaml", 3, False, True, "prefix", 2.5, ["a:1", "b:2"])
    assert s.public_metrics is False  # a switch left off keeps the default


def test_unset_flags_leave_the_environment(monkeypatch):
    monkeypatch.setenv("FAIRSHARE_LEASE_TTL_S", "7")
    monkeypatch.setenv("FAIRSHARE_WORKER_AUTH", "false")
    s = _settings_from_args(build_parser().parse_args([]))
    assert s.lease_ttl_s == 7.0 and s.worker_auth is False


@pytest.mark.parametrize("argv", [["--routing", "random"], ["--otel-exporter", "jaeger"], ["--port", "x"]])
def test_bad_values_are_refused(argv):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
