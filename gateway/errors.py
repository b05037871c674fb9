"""OpenAI-shaped errors: every error body is ``{"error": {"message", "type", "param", "code"}}``.

`APIError` is raised anywhere in the request path; `install_handlers(app)` turns it, FastAPI's
validation errors, unknown routes and unexpected exceptions into that shape (never a traceback and
never FastAPI's default 422 body).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("fairshare.gateway")


class APIError(Exception):
    """An error answered to the client with HTTP `status` and the OpenAI error body.

    `headers` (e.g. ``retry-after`` and ``x-ratelimit-*``) are added to the response.
    """

    def __init__(self, status: int, message: str, type: str, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, extra_headers: Mapping[str, str] | None = None) -> JSONResponse:
        """A JSONResponse carrying this error and its headers (plus `extra_headers`)."""
        headers = dict(extra_headers or {})
        headers.update(self.headers)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 ``invalid_request_error``."""
    return APIError(400, message, "invalid_request_error", param, code)


def missing_api_key() -> APIError:
    """401 for a request without an API key."""
    return APIError(401, "You didn't provide an API key. You need to provide your API key in an Authorization "
                         "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                    "invalid_request_error", None, "missing_api_key")


def invalid_api_key(key: str) -> APIError:
    """401 for an unknown API key; only the key's last 4 characters are echoed."""
    shown = ("sk-..." + key[-4:]) if len(key) > 8 else "sk-..."
    return APIError(401, f"Incorrect API key provided: {shown}.", "invalid_request_error", None, "invalid_api_key")


def model_not_found(model: str) -> APIError:
    """404 for a model that does not exist or that the tenant may not use."""
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    "invalid_request_error", "model", "model_not_found")


def server_error(message: str = "The server had an error while processing your request.") -> APIError:
    """500 ``server_error``."""
    return APIError(500, message, "server_error", None, None)


def retry_headers(retry_after_s: float) -> dict[str, str]:
    """``retry-after`` (whole seconds, rounded up, at least 1) and ``retry-after-ms`` (milliseconds,
    at least 1; the official openai-python client prefers it) for a wait of `retry_after_s` seconds."""
    return {"retry-after": str(max(1, math.ceil(retry_after_s))),
            "retry-after-ms": str(max(1, round(retry_after_s * 1000)))}


def client_closed() -> APIError:
    """499 (nginx's "client closed request"): the client disconnected before the answer; logged and
    counted, never seen by the client."""
    return APIError(499, "Client closed the request.", "invalid_request_error", None, "client_closed_request")


def body_too_large(limit: int) -> APIError:
    """413 for a request body over `limit` bytes."""
    return APIError(413, f"Request body too large: at most {limit} bytes.", "invalid_request_error", None,
                    "request_too_large")


def body_timeout(timeout_s: float) -> APIError:
    """408 for a request body that did not arrive within `timeout_s` seconds (shorter than its
    ``content-length``, or sent too slowly); the connection is closed."""
    return APIError(408, f"The request body did not arrive within {timeout_s:g} s.", "invalid_request_error", None,
                    "request_timeout", {"connection": "close"})


def unavailable(message: str, retry_after_s: float | None = None) -> APIError:
    """503 ``server_error`` (no worker, Redis down, shutting down); with `retry_after_s`, the
    `retry_headers` of that wait."""
    headers = retry_headers(retry_after_s) if retry_after_s is not None else {}
    return APIError(503, message, "server_error", None, "service_unavailable", headers)


def upstream_timeout(message: str) -> APIError:
    """504 ``server_error``: the worker did not finish within the gateway's request deadline."""
    return APIError(504, message, "server_error", None, "timeout")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes", "json-or-python", "lax-or-strict"}


def _is_type_tag(item: str) -> bool:
    """pydantic adds union members (``str``, ``list[...]``, model class names) to error locations."""
    return (item in _TYPE_TAGS or "[" in item or item.startswith("function-")
            or (item[:1].isupper() and item.isalnum()))


def _loc_to_param(loc: Iterable[Any]) -> str | None:
    """pydantic error location -> OpenAI ``param`` (``messages.[0].role``)."""
    parts: list[str] = []
    for item in loc:
        if item == "body" and not parts:
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and not _is_type_tag(item):
            parts.append(item)
    return ".".join(parts) if parts else None


def from_validation_error(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic's error list into one 400 naming the first offending field in ``param``."""
    if not errors:
        return invalid_request("Invalid request.")
    first = errors[0]
    param = _loc_to_param(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    typ = first.get("type", "")
    if typ == "value_error" and isinstance((first.get("ctx") or {}).get("error"), Exception):
        msg = str(first["ctx"]["error"])  # our validator's own words, without pydantic's "Value error, "
    if typ == "missing":
        message = f"Missing required parameter: '{param}'."
        code = "missing_required_parameter"
    elif typ == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
        code = "unknown_parameter"
    else:
        message = f"Invalid value for '{param}': {msg}" if param else msg
        code = "invalid_value"
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return invalid_request(message, param, code)


def install_handlers(app: FastAPI) -> None:
    """Register handlers so that every error leaves the app in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(list(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def _pyd_validation(request: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = APIError(404, f"Invalid URL ({request.method} {request.url.path})", "invalid_request_error")
        elif exc.status_code == 405:
            err = APIError(405, f"Method {request.method} not allowed for {request.url.path}",
                           "invalid_request_error")
        else:
            err = APIError(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500
                           else "server_error")
        return err.response(getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return server_error().response()
