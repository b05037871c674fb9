"""Keeping a stream's connection alive while its first token is pending.

Under fair queueing a low-share tenant may legitimately wait longer in the worker's queue than a
proxy or load balancer lets a connection sit idle (often 60 s). So a streamed request, once
admitted, does not wait for its first token to answer: if the generation has not started within
``keepalive_interval_s`` (the *grace*: errors that come sooner still get their own HTTP status,
e.g. 400 for a request the worker refuses, 503 when no worker can take it), the gateway sends the
``200`` headers and then an SSE comment line every interval until the first token::

    : keep-alive

Comment lines (a line starting with ``:``) are part of the SSE standard (WHATWG HTML, "event stream
interpretation": the line is ignored); the official openai-python client's decoder skips them
(``openai._streaming.SSEDecoder.decode``; tests/integration/test_gateway_keepalive.py checks the
decoder and a real client). An error after the headers (the deadline, no worker) becomes the
stream's last ``data:`` event, in OpenAI's error shape.

How it runs (gateway/generation.py, gateway/streaming.py): a stream's start (routing, retries, the wait for the first tokens) is
a task of its own; the handler waits for it at most the grace (`started_within`), then returns the
SSE response, whose body sends `comments` until the task is done. A disconnect or the gateway's
stop cancels the task (the request's `gateway.watch.RequestWatch` notices them). A non-streamed
request waits in the handler's own task.

Non-streamed requests get nothing before their body: a status line cannot be taken back, so
sending bytes early (even JSON-legal leading whitespace) would turn every later error into a 200.
Clients that may queue long should stream, or the proxy's idle timeout must exceed the deadline.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

KEEPALIVE = b": keep-alive\n\n"


async def started_within(task: asyncio.Future, grace_s: float | None) -> bool:
    """Wait up to `grace_s` seconds (None: for ever) for `task`; True when it is done (its exception,
    if any, is raised), False when it is still running (it is not cancelled)."""
    await asyncio.wait({task}, timeout=grace_s)
    if task.done():
        task.result()
        return True
    return False


async def comments(task: asyncio.Future, interval_s: float) -> AsyncIterator[bytes]:
    """`KEEPALIVE` every `interval_s` seconds until `task` is done (then return; the caller reads it)."""
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=interval_s)
        if not done:
            yield KEEPALIVE


__all__ = ["KEEPALIVE", "comments", "started_within"]
