"""The request head is bounded (gateway/http_guard.py): a head over `max_header_bytes` gets 431 and
an unfinished one 408 after `header_timeout_s`, each OpenAI-shaped, and the connection is closed; a
connection that never speaks is closed; a request whose head fits (with a body far larger than the
head limit, in the same reads) is served. Raw sockets against a real in-process gateway; the timeout
case waits on the gateway closing the socket (bounded by a read timeout that names the state)."""

from __future__ import annotations

import json
import socket

import pytest

from tests.integration.openai_helpers import HELLO, MODEL

LIMIT, TIMEOUT_S = 4096, 1.0


@pytest.fixture(scope="module")
def gw(gateway_factory):
    return gateway_factory([{"id": "head-t"}], max_header_bytes=LIMIT, header_timeout_s=TIMEOUT_S)


def _connect(gw) -> socket.socket:
    host, port = gw.base_url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    return s


def _read_all(s: socket.socket, what: str) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except socket.timeout:
        raise AssertionError(f"the gateway never closed the connection ({what}); read so far: {out[:200]!r}")
    return out


def _error(raw: bytes, status: int) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_a_head_over_the_limit_gets_431_and_the_connection_is_closed(gw):
    with _connect(gw) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        s.sendall(b"X-Pad: " + b"a" * (LIMIT * 4) + b"\r\n")  # never finished: the parser would buffer on
        err = _error(_read_all(s, "oversized head"), 431)
    assert err["code"] == "request_header_fields_too_large" and str(LIMIT) in err["message"]


def test_an_unfinished_head_gets_408_and_a_silent_connection_is_closed(gw):
    with _connect(gw) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and then nothing
        err = _error(_read_all(s, "unfinished head"), 408)
    assert err["code"] == "request_timeout"
    with _connect(gw) as s:
        assert _read_all(s, "connection that never sent a byte") == b""


def test_a_head_within_the_limit_with_a_large_body_is_served(gw):
    body = json.dumps({"model": MODEL, "messages": HELLO + [{"role": "user", "content": "hello world " * 500}],
                       "max_tokens": 1}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {gw.keys['head-t']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with _connect(gw) as s:
        assert len(body) > LIMIT
        s.sendall(head + body)  # head and body in the same reads
        raw = _read_all(s, "a served request")
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:300]


@pytest.mark.parametrize("garbage", [b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32 + b"\r\n\r\n",
                                     b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
                                     b"GET / HTTP/9.9 trailing\r\n\r\n"],
                         ids=["tls-hello", "negative-length", "bad-request-line"])
def test_bytes_that_are_not_http_get_an_openai_shaped_400_and_the_connection_is_closed(gw, garbage):
    with _connect(gw) as s:
        s.sendall(garbage)
        err = _error(_read_all(s, "invalid HTTP"), 400)
    assert err["code"] == "invalid_http_request" and "not a valid HTTP/1.1 request" in err["message"]


def test_a_websocket_upgrade_request_is_served_as_plain_http(gw):
    """The gateway has no WebSocket endpoint: the Upgrade header is ignored and the request gets the
    OpenAI-shaped answer any HTTP request to that path gets (here 401: no key), not a bodiless 403."""
    with _connect(gw) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                  b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        s.settimeout(30)
        raw = b""
        while b"\r\n\r\n" not in raw or len(raw.partition(b"\r\n\r\n")[2]) < 20:
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401 "), raw[:300]
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
