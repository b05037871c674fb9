"""Limits on a request's head (request line and headers), which uvicorn's httptools protocol lacks.

uvicorn bounds nothing before the body: a client may send a head of any size (the parser buffers
it: 20 connections of 50 MiB unfinished headers took 1 GiB) or never finish it (a connection held
open for ever with a few bytes: slowloris). The body has its own bounds (`--max-body-bytes`,
`--body-timeout-s`, gateway/plan.py). This protocol adds the two for the head, as nginx
(`large_client_header_buffers`, `client_header_timeout`) and Node (`maxHeaderSize`,
`headersTimeout`) have them:

- a head over `max_header_bytes` (default 64 KiB) gets ``431 Request Header Fields Too Large``, an
  OpenAI-shaped error body, and the connection is closed;
- a head not complete `header_timeout_s` (default 10 s) after its first byte, or a new connection
  that sends nothing for that long, gets ``408`` (when something was sent) and is closed.

Bytes that are not HTTP (uvicorn answers them with a plain-text 400) get the same OpenAI-shaped
error body as every other refusal: ``400``, code ``invalid_http_request``, and the connection is
closed. A WebSocket upgrade request (the gateway has no WebSocket endpoint; uvicorn's handshake
answered 403 with no body) is served as the plain HTTP request it also is.

Between requests on a kept-alive connection uvicorn's own keep-alive timeout applies, as before.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0


def _response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bounded request head (module docstring). The bounds are
    class attributes: `guarded_protocol` makes a subclass with the configured ones."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes: int | None = 0  # bytes of the head read so far; None once it is complete
        self._head_started = False
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(self.header_timeout_s, self._head_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_bytes is not None:
            self._head_bytes += len(data)
        super().data_received(data)
        # still in the head after this read (bytes past its end, the body, do not count: the parser
        # completed the head then, on_headers_complete): bounded by the read size over the limit
        if self._head_bytes is not None and self._head_bytes > self.max_header_bytes:
            self._refuse(_response(431, "Request Header Fields Too Large",
                                   f"Request header fields too large: at most {self.max_header_bytes} bytes.",
                                   "request_header_fields_too_large"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_started = True
        if self._head_bytes is None:  # a further request on this connection: its head is bounded again
            self._head_bytes = 0
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        self._cancel_head_timer()
        super().on_headers_complete()

    def _cancel_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._head_bytes is None or self.transport.is_closing():
            return
        if self._head_started or self._head_bytes:
            self._refuse(_response(408, "Request Timeout",
                                   f"The request's headers did not arrive within {self.header_timeout_s:g} s.",
                                   "request_timeout"))
        else:
            self.transport.close()  # connected, never spoke

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes its parser rejects (``httptools.HttpParserError``), in the
        OpenAI shape instead of plain text; the connection is closed."""
        self._refuse(_response(400, "Bad Request", f"{msg.rstrip('.')}: the bytes sent are not a valid HTTP/1.1 request.",
                               "invalid_http_request"))

    def _should_upgrade(self) -> bool:
        """Never: the gateway serves no WebSocket, so an ``Upgrade`` header is ignored (RFC 9110,
        section 7.8, lets a server do so) and the request is served as plain HTTP, rather than
        uvicorn's bodiless 403 from its WebSocket handshake."""
        return False

    def _unsupported_upgrade_warning(self) -> None:
        """Silent: the header is the client's to send, and a warning per request would let any client
        fill the log."""

    def _refuse(self, response: bytes) -> None:
        self._head_bytes = None
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self.transport.write(response)
            self.transport.close()


def guarded_protocol(max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                     header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> type[GuardedHttpToolsProtocol]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``) with these bounds (bytes,
    seconds). Raises ValueError on a non-positive bound."""
    if max_header_bytes <= 0 or not header_timeout_s > 0:
        raise ValueError("max_header_bytes and header_timeout_s must be > 0")
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                {"max_header_bytes": int(max_header_bytes), "header_timeout_s": float(header_timeout_s)})


def protocol_for(settings) -> type[GuardedHttpToolsProtocol]:
    """`guarded_protocol` with the bounds of `settings` (a `GatewaySettings`; None: the defaults)."""
    if settings is None:
        return guarded_protocol()
    return guarded_protocol(settings.max_header_bytes, settings.header_timeout_s)


__all__ = ["DEFAULT_HEADER_TIMEOUT_S", "DEFAULT_MAX_HEADER_BYTES", "GuardedHttpToolsProtocol", "guarded_protocol",
           "protocol_for"]
