"""`fairshare up`'s own command line: flags passed through to the worker and the gateway (one table,
definitions copied from the children's parsers), every taken port reported at once, the tenants
file header."""

from __future__ import annotations

import argparse
import socket

import pytest
import yaml

from fairshare.cli import up
from fairshare.cli.up_flags import PASS_THROUGH, PassThrough, child_parsers
from gateway.cli import build_parser as gateway_parser
from worker.cli import build_parser as worker_parser


def commands(*argv: str):
    args = up.build_parser().parse_args(list(argv))
    up.resolve_ports(args)
    w = up.worker_command(args)
    g = up.gateway_command(args, up.Path("/state"))
    return args, w[w.index("worker") + 1:], g[g.index("gateway") + 1:]


def test_pass_through_flags_reach_their_child_as_typed_and_parse_there():
    args, w, g = commands("--max-model-len", "512", "--policy", "drr", "--kv-quota", "--kv-soft-quota", "acme=0.5",
                          "--kv-soft-quota", "batch=0.25", "--no-prefix-cache", "--model-name", "tiny-chat",
                          "--lease-ttl-s", "4", "--request-timeout-s", "30", "--otel-exporter", "console",
                          "--dtype", "bfloat16", "--quantization", "int8")
    wa = worker_parser().parse_args(w)
    assert (wa.max_model_len, wa.policy, wa.kv_quota, wa.model_name) == (512, "drr", True, "tiny-chat")
    assert (wa.dtype, wa.quantization) == ("bfloat16", "int8")
    assert wa.kv_soft_quota == [("acme", 0.5), ("batch", 0.25)] and wa.no_prefix_cache is True
    assert wa.metrics_port == args.worker_metrics_port and wa.metrics_host == "127.0.0.1"
    assert wa.otel_exporter == "console"
    ga = gateway_parser().parse_args(g)
    assert (ga.lease_ttl_s, ga.request_timeout_s, ga.otel_exporter) == (4.0, 30.0, "console")
    assert ga.metrics_port == args.gateway_metrics_port and ga.metrics_host == "127.0.0.1"
    assert "--lease-ttl-s" not in w and "--max-model-len" not in g  # each flag goes only where it belongs


def test_flags_not_given_are_not_passed_so_the_children_keep_their_defaults():
    _, w, g = commands()
    wa = worker_parser().parse_args(w)
    assert wa.policy == "vtc" and wa.kv_quota is False and wa.max_model_len is None
    assert not [a for a in w if a.startswith("--kv") or a in ("--policy", "--max-running", "--dtype", "--quantization")]
    assert "--lease-ttl-s" not in g
    _, w, _ = commands("--no-kv-quota")
    assert "--no-kv-quota" in w


def test_a_bad_value_is_refused_by_fairshare_up_with_the_childs_message(capsys):
    with pytest.raises(SystemExit) as e:
        up.build_parser().parse_args(["--kv-soft-quota", "acme=3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-soft-quota" in err and "not in (0, 1]" in err
    with pytest.raises(SystemExit):
        up.build_parser().parse_args(["--max-running", "0"])
    assert "is not > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        up.build_parser().parse_args(["--policy", "lottery"])


def test_table_entries_a_child_lacks_are_left_out_and_listed():
    p = argparse.ArgumentParser()
    table = (("--max-model-len", ("worker",)), ("--no-such-flag", ("worker",)), ("--lease-ttl-s", ("gateway",)),
             ("--lease-ttl-s", ("worker",)))
    pt = PassThrough.add_to(p, child_parsers(), table)
    assert pt.missing == ["--no-such-flag", "--lease-ttl-s"]
    assert "--max-model-len" in pt.flags() and "--no-such-flag" not in pt.flags()
    with pytest.raises(SystemExit):
        p.parse_args(["--no-such-flag", "1"])


def test_every_wired_flag_is_in_the_help_and_the_table_names_real_flags():
    text = up.build_parser().format_help()
    args = up.build_parser().parse_args([])
    for flag in args._pass.flags():
        assert flag in text
    known = set(worker_parser()._option_string_actions) | set(gateway_parser()._option_string_actions)
    # entries a child does not have yet are the ones other work adds (e.g. --tier-min-share)
    assert set(args._pass.missing) == {f for f, _ in PASS_THROUGH if f not in known}


def test_every_taken_port_is_reported_at_once():
    socks = []
    try:
        for _ in range(2):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            s.listen()
            socks.append(s)
        a, b = (s.getsockname()[1] for s in socks)
        args = up.build_parser().parse_args(["--port", str(a), "--redis-port", str(b),
                                             "--worker-port", str(up.free_port())])
        with pytest.raises(up.UpError) as e:
            up.check_ports(args)
        msg = str(e.value)
        assert "\n" not in msg
        assert f"{a} on 127.0.0.1 (gateway; pass --port N)" in msg
        assert f"{b} on 127.0.0.1 (redis; pass --redis-port N)" in msg
        assert msg.startswith("already in use: port ") and msg.endswith("stop what uses them or choose other ports")
    finally:
        for s in socks:
            s.close()


def test_port_clashes_and_invalid_ports_are_reported_together():
    args = up.build_parser().parse_args(["--port", "0", "--worker-port", "7001", "--redis-port", "7001",
                                         "--gateway-metrics-port", "70000"])
    with pytest.raises(up.UpError) as e:
        up.check_ports(args)
    msg = str(e.value)
    assert "--port 0 is not a valid port" in msg and "--gateway-metrics-port 70000 is not a valid port" in msg
    assert "the redis and the worker cannot both use port 7001" in msg


def test_free_metrics_ports_are_distinct_from_the_others():
    args = up.build_parser().parse_args([])
    up.resolve_ports(args)
    ports = [args.port, args.worker_port, args.redis_port, args.gateway_metrics_port, args.worker_metrics_port]
    assert len(set(ports)) == 5


def test_the_demo_tenants_file_says_the_gateway_reloads_it(tmp_path):
    f = tmp_path / "tenants.yaml"
    up.write_demo_tenants(f)
    text = f.read_text()
    assert "edit and restart" not in text.lower() and "without a restart" in text
    assert "re-reads this file when it changes" in text
    assert [t["id"] for t in yaml.safe_load(text)["tenants"]] == ["acme", "globex"]
