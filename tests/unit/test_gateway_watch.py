"""RequestWatch: the one task per request that watches the client's connection, then settles."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from gateway.watch import RequestWatch
from tests.support.waits import wait_for_async


class Connection:
    """An ASGI receive channel: `leave()` makes the pending receive() answer http.disconnect."""

    def __init__(self):
        self.gone = asyncio.Event()
        self.reads = 0
        self.cancelled_reads = 0

    async def receive(self):
        self.reads += 1
        try:
            await self.gone.wait()
        except asyncio.CancelledError:
            self.cancelled_reads += 1
            raise
        return {"type": "http.disconnect"}

    def leave(self):
        self.gone.set()


def make(receive):
    calls = {"gone": 0, "settled": 0}
    release = asyncio.Event()
    release.set()

    def on_gone():
        calls["gone"] += 1

    async def settle():
        await release.wait()
        calls["settled"] += 1

    return calls, release, (lambda: RequestWatch(receive, on_gone, settle))


async def test_disconnect_is_noticed_at_once_and_settled_at_close():
    conn = Connection()
    calls, _, new = make(conn.receive)
    watch = new()
    await wait_for_async(lambda: conn.reads, "the watch reading the connection")
    conn.leave()
    await wait_for_async(lambda: calls["gone"], "the disconnect noticed while nothing else happens")
    assert calls == {"gone": 1, "settled": 0}  # settlement waits for the request to end
    await watch.close()
    await watch.close()
    assert calls == {"gone": 1, "settled": 1}


async def test_close_without_disconnect_stops_reading_and_settles_once():
    conn = Connection()
    calls, _, new = make(conn.receive)
    watch = new()
    await wait_for_async(lambda: conn.reads, "the watch reading the connection")
    await asyncio.gather(watch.close(), watch.close())
    assert calls == {"gone": 0, "settled": 1}
    assert conn.cancelled_reads == 1 and watch.task.done()
    conn.leave()  # the response is over: a disconnect now is no client leaving
    await asyncio.sleep(0)
    assert calls["gone"] == 0


async def test_settlement_completes_when_the_closer_is_cancelled():
    conn = Connection()
    calls, release, new = make(conn.receive)
    release.clear()  # settlement blocks (a slow Redis) until released
    watch = new()
    closer = asyncio.ensure_future(watch.close())
    await wait_for_async(lambda: conn.cancelled_reads, "the watch stopped reading")
    closer.cancel()
    await asyncio.gather(closer, return_exceptions=True)
    assert closer.cancelled() and calls["settled"] == 0
    release.set()
    await asyncio.wait_for(watch.task, 60)
    assert calls == {"gone": 0, "settled": 1}


async def test_nothing_to_watch_settles_at_close():
    calls, _, new = make(None)
    watch = new()
    await asyncio.sleep(0)
    assert calls == {"gone": 0, "settled": 0}
    await watch.close()
    assert calls == {"gone": 0, "settled": 1}


class Request:
    """What a session is to its watch: it holds the watch, the watch calls back into it."""

    def __init__(self, receive):
        self.settled = 0
        self.watch = RequestWatch(receive, self.on_gone, self.settle)

    def on_gone(self):
        pass

    async def settle(self):
        self.settled += 1


@pytest.mark.parametrize("watched", [True, False])
async def test_a_settled_request_is_freed_without_the_garbage_collector(watched):
    """Once settled, the watch holds nothing of its request: dropping the request frees it by reference
    counting alone (a cycle here left every request to the cyclic collector, a tenth of the gateway's CPU)."""
    conn = Connection()
    req = Request(conn.receive if watched else None)
    if watched:
        await wait_for_async(lambda: conn.reads, "the watch reading the connection")
    await req.watch.close()
    assert req.settled == 1
    ref = weakref.ref(req)
    gc.disable()
    try:
        del req
        assert ref() is None, "the settled request is still referenced (a reference cycle through its watch)"
    finally:
        gc.enable()
