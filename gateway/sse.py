"""Server-sent events as OpenAI streams them: ``data: {json}`` lines, then ``data: [DONE]``.

`SSEResponse` is a StreamingResponse that always closes the body generator and awaits `on_close`
(settlement) at the end, even when the client vanished before the first byte and the generator
never ran; a write that fails calls `on_disconnect`. The event that ends with ``data: [DONE]`` ends
the body in the same write (``more_body`` false: the server adds the chunked terminator to it), not
in an empty write of its own after it. It does not read the connection itself: the
request's `gateway.watch.RequestWatch` does (one task per request), and notices a disconnect while
the stream waits for the worker.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def event(obj: Any) -> bytes:
    """One SSE event carrying `obj` as compact JSON (non-ASCII kept as UTF-8)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response over an async generator of already-encoded events.

    `on_disconnect` is called (once) when a write to the client fails; `on_close` is awaited once the
    response is over, whatever happened.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], *, on_disconnect: Callable[[], None],
                 on_close: Callable[[], Awaitable[None]] | None = None,
                 headers: Mapping[str, str] | None = None, status_code: int = 200) -> None:
        h = dict(SSE_HEADERS)
        h.update(headers or {})
        super().__init__(content, status_code=status_code, headers=h, media_type=self.media_type)
        self._on_disconnect = on_disconnect
        self._on_close = on_close
        self._notified = False

    async def stream_response(self, send: Send) -> None:
        """Send the headers, then each event as it comes; the one ending with `DONE` is the last."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            if chunk.endswith(DONE):  # JSON events escape newlines: only the end of the stream ends so
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _gone(self) -> None:
        if not self._notified:
            self._notified = True
            self._on_disconnect()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            await self.stream_response(send)
            finished = True
        except OSError:  # the client went away while we were writing
            self._gone()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # the generator's own errors were handled inside it
                    pass
            if self._on_close is not None:
                await self._on_close()
        if finished and self.background is not None:
            await self.background()
