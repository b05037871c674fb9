"""SSEResponse: settlement in every case and write failures, at the ASGI level."""

from __future__ import annotations

import asyncio

from gateway.sse import DONE, SSEResponse, event

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/"}


def make(gen_factory):
    calls = {"gone": 0, "closed": 0, "gen_finally": 0, "started": 0}

    async def body():
        calls["started"] += 1
        try:
            async for b in gen_factory():
                yield b
        finally:
            calls["gen_finally"] += 1

    async def on_close():
        calls["closed"] += 1

    def on_gone():
        calls["gone"] += 1

    return SSEResponse(body(), on_disconnect=on_gone, on_close=on_close, headers={"x-ratelimit-limit-tokens": "7"}), calls


def events(*payloads):
    """A body factory: one SSE event per payload, then ``[DONE]``."""
    async def gen():
        for payload in payloads:
            yield event(payload)
        yield DONE
    return gen


def recorder():
    """An ASGI ``send`` that keeps every message: returns (messages, send)."""
    sent = []

    async def send(msg):
        sent.append(msg)
    return sent, send


def body_of(sent) -> bytes:
    """The response body: every message after ``http.response.start``."""
    return b"".join(m.get("body", b"") for m in sent[1:])


async def test_normal_stream_sends_headers_first_and_closes_once():
    resp, calls = make(events({"a": 1}))
    sent, send = recorder()
    disconnect = asyncio.Event()

    async def receive():
        await disconnect.wait()
        return {"type": "http.disconnect"}

    await resp(SCOPE, receive, send)
    assert sent[0]["type"] == "http.response.start"
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"x-ratelimit-limit-tokens"] == b"7"
    assert body_of(sent) == b'data: {"a":1}\n\ndata: [DONE]\n\n'
    assert calls == {"gone": 0, "closed": 1, "gen_finally": 1, "started": 1}


async def test_client_gone_before_first_byte_still_settles():
    async def gen():
        yield b"never"

    resp, calls = make(gen)

    async def receive():
        return {"type": "http.disconnect"}

    async def send(msg):
        raise OSError("connection reset")

    await resp(SCOPE, receive, send)
    assert calls["gone"] == 1 and calls["closed"] == 1  # settled although the body never ran


async def test_the_response_leaves_the_connection_to_the_request_watch():
    """The request's RequestWatch reads `receive` (one task per request); the response never does."""
    resp, calls = make(events({"n": 1}))
    sent, send = recorder()

    async def receive():
        raise AssertionError("SSEResponse read the connection")

    await resp(SCOPE, receive, send)
    assert body_of(sent) == b'data: {"n":1}\n\ndata: [DONE]\n\n'
    assert calls == {"gone": 0, "closed": 1, "gen_finally": 1, "started": 1}


async def body_writes(gen_factory):
    """Run a response over `gen_factory`'s body: ([(body, more_body) of each body message], calls)."""
    resp, calls = make(gen_factory)
    sent, send = recorder()

    async def receive():
        raise AssertionError("SSEResponse read the connection")

    await resp(SCOPE, receive, send)
    return [(m.get("body"), m.get("more_body")) for m in sent[1:]], calls


async def test_the_done_event_ends_the_body_in_its_own_write():
    """``[DONE]`` (with the usage chunk before it, as streams send them) is the last body message,
    ``more_body`` false: no empty message after it; the generator is closed and the response settled."""
    async def gen():
        yield event({"n": 1})
        yield event({"usage": {}}) + DONE

    writes, calls = await body_writes(gen)
    assert writes == [(b'data: {"n":1}\n\n', True), (b'data: {"usage":{}}\n\n' + DONE, False)]
    assert calls == {"gone": 0, "closed": 1, "gen_finally": 1, "started": 1}


async def test_a_body_without_done_still_ends_with_an_empty_write():
    """An error event ends a stream without ``[DONE]``: the body ends after it, as before."""
    async def gen():
        yield event({"error": {"message": "x"}})

    writes, calls = await body_writes(gen)
    assert writes == [(b'data: {"error":{"message":"x"}}\n\n', True), (b"", False)]
    assert calls["closed"] == 1 and calls["gen_finally"] == 1
