"""Worker discovery (gateway/discovery.py): entry syntax, DNS through the system resolver, files
re-read on change, a failing source keeping its last answer; the pool adds and retires workers."""

from __future__ import annotations

import asyncio
import os

import pytest

from gateway.config import GatewaySettings
from gateway.discovery import Discovery, Source, join_hostport, parse_sources, split_hostport
from gateway.routing import WorkerPool


def test_entry_syntax():
    kinds = [(s.kind, s.target) for s in parse_sources(
        ["10.0.0.1:50051", "[::1]:9", "dns:///workers.ns.svc.cluster.local:50051", "dns:w:1", "file:///etc/w.txt",
         "file:rel/w.txt", " "])]
    assert kinds == [("static", "10.0.0.1:50051"), ("static", "[::1]:9"),
                     ("dns", "workers.ns.svc.cluster.local:50051"), ("dns", "w:1"), ("file", "/etc/w.txt"),
                     ("file", "rel/w.txt")]
    for bad in ["nohost", "host:", "host:99999", "dns:///name", "dns://8.8.8.8/name:1", "file://", "::1:5"]:
        with pytest.raises(ValueError):
            parse_sources([bad])
    assert split_hostport("[fe80::1]:7") == ("fe80::1", 7) and join_hostport("fe80::1", 7) == "[fe80::1]:7"
    with pytest.raises(ValueError, match="host:port"):
        GatewaySettings(workers="a:1,dns:///b", secret="x")


async def test_dns_entry_resolves_every_address_with_the_system_resolver():
    (src,) = parse_sources(["dns:///localhost:50051"])
    addrs = await src.resolve()
    assert "127.0.0.1:50051" in addrs and all(a.endswith(":50051") for a in addrs)


async def test_file_entry_is_reread_when_it_changes_and_a_failing_source_keeps_its_last_answer(tmp_path):
    f = tmp_path / "workers.txt"
    f.write_text("# the pool\n127.0.0.1:1\n\n127.0.0.1:2  # second\n")
    seen = []
    d = Discovery(parse_sources([f"file://{f}", "127.0.0.1:9"]), seen.append, interval_s=1.0)
    assert await d.resolve_once() == {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:9"}
    await d.resolve_once()
    assert len(seen) == 1  # unchanged: no new callback
    f.write_text("127.0.0.1:2\n127.0.0.1:3\n")
    os.utime(f, ns=(os.stat(f).st_atime_ns, os.stat(f).st_mtime_ns + 10_000_000))
    assert await d.resolve_once() == {"127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:9"}
    f.unlink()  # unreadable: the last answer stands
    assert await d.resolve_once() == {"127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:9"}
    assert d.sources[0].failing
    f.write_text("127.0.0.1:4\nnot-an-address\n")
    assert await d.resolve_once() == {"127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:9"}  # malformed: kept
    assert len(seen) == 2


async def test_dns_failure_keeps_the_last_addresses():
    src = Source("dns", "name.invalid:50051", last={"10.1.1.1:50051"})
    d = Discovery([src], lambda a: None)
    assert await d.resolve_once() == {"10.1.1.1:50051"} and src.failing


async def test_pool_adds_new_workers_and_retires_the_ones_that_left(tmp_path):
    f = tmp_path / "workers.txt"
    f.write_text("127.0.0.1:1\n")
    # no background rounds after the first: the test drives resolving and polling itself
    pool = WorkerPool([f"file://{f}"], discovery_interval_s=3600, health_interval_s=3600, health_timeout_s=0.2)
    assert pool.workers == []  # a file is read when the pool starts
    await pool.start()
    await pool._first_round.wait()
    try:
        assert [w.addr for w in pool.workers] == ["127.0.0.1:1"]
        f.write_text("127.0.0.1:2\n")
        os.utime(f, ns=(os.stat(f).st_atime_ns, os.stat(f).st_mtime_ns + 10_000_000))
        await pool.discovery.resolve_once()
        by = {w.addr: w for w in pool.workers}
        assert set(by) == {"127.0.0.1:1", "127.0.0.1:2"} and by["127.0.0.1:1"].retired
        assert not by["127.0.0.1:2"].retired
        by["127.0.0.1:1"].local_inflight = 10  # a stream still open there: kept until it ends
        await pool.poll_once()
        assert "127.0.0.1:1" in {w.addr for w in pool.workers}
        by["127.0.0.1:1"].local_inflight = 0
        await pool.poll_once()
        assert [w.addr for w in pool.workers] == ["127.0.0.1:2"]
    finally:
        await pool.stop()
    await asyncio.sleep(0)
