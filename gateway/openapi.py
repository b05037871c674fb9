"""The gateway's OpenAPI 3.1 document (served at ``/openapi.json``): the three ``/v1`` endpoints.

Request bodies are the JSON schemas of the pydantic models in `gateway.schemas` (the ones the app
validates with), with unknown fields marked as not allowed where the app refuses them (top level,
messages, text parts, stream_options). Every
error response is the OpenAI error object. Used by clients and by the schemathesis test in
tests/reliability/test_hostile_input.py.
"""

from __future__ import annotations

import copy
from typing import Any

from .schemas import ChatCompletionRequest, CompletionRequest

_REF = "#/components/schemas/{model}"
_CLOSED = ("ChatMessage", "TextPart", "StreamOptions")

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "additionalProperties": False,
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}

_ERRORS = {
    "400": "invalid request (validation, unknown field, context length, request larger than a limit)",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "413": "request body larger than the configured limit",
    "429": "rate limited (retry-after and x-ratelimit-* headers)",
    "503": "no worker, Redis unavailable with a fail-closed tier, or shutting down (retry-after)",
    "504": "the generation did not finish within the request timeout",
}


def _error_responses(codes: list[str]) -> dict[str, Any]:
    return {c: {"description": _ERRORS[c],
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for c in codes}


def _body_schema(model, components: dict[str, Any]) -> dict[str, Any]:
    schema = copy.deepcopy(model.model_json_schema(ref_template=_REF, mode="validation"))
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    schema["additionalProperties"] = False
    components[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``."""
    components: dict[str, Any] = {"Error": ERROR_SCHEMA}
    chat = _body_schema(ChatCompletionRequest, components)
    text = _body_schema(CompletionRequest, components)
    for name in _CLOSED:  # objects whose unknown fields the app refuses (schemas.check_known_fields)
        if name in components:
            components[name]["additionalProperties"] = False
    completion_ok = {"200": {"description": "a completion (JSON), or server-sent events when stream is true",
                             "content": {"application/json": {"schema": {"type": "object"}},
                                         "text/event-stream": {"schema": {"type": "string"}}}}}
    errors = ["400", "401", "404", "413", "429", "503", "504"]

    def post(op_id: str, summary: str, ref: dict[str, Any]) -> dict[str, Any]:
        return {"post": {"operationId": op_id, "summary": summary,
                         "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
                         "responses": {**completion_ok, **_error_responses(errors)}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "FairShare gateway (OpenAI-compatible)", "version": "1"},
        "security": [{"bearerAuth": []}],
        "paths": {
            "/v1/models": {"get": {
                "operationId": "listModels", "summary": "Models the tenant may use",
                "responses": {"200": {"description": "model list",
                                      "content": {"application/json": {"schema": {"type": "object"}}}},
                              **_error_responses(["401"])}}},
            "/v1/chat/completions": post("createChatCompletion", "Chat completion", chat),
            "/v1/completions": post("createCompletion", "Text completion", text),
        },
        "components": {"schemas": components,
                       "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}}},
    }


__all__ = ["ERROR_SCHEMA", "openapi_document"]
