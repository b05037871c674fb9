"""The grammar a chat completion's output must follow, as the worker contract's `Grammar`.

- ``response_format: {"type": "json_schema", "json_schema": {"schema": S}}``: a JSON value valid
  against S (``strict`` true or false alike: constrained decoding always enforces the schema);
  without a schema, and for ``{"type": "json_object"}``: any JSON object.
- ``tool_choice: "required"`` or a named function: the model's tool-call format with at least one
  call (exactly one with ``parallel_tool_calls: false`` or a named function), each call's arguments
  valid against its function's parameters (the parser's structural tag, gateway/tools.py).
- ``tool_choice: "auto"`` with a JSON response format: either tool calls or the JSON answer.
- otherwise (``auto`` alone, ``none``, ``text``): no grammar.

The worker compiles it (xgrammar, worker/engine/grammar.py; SGLang's own grammar backend on the
SGLang worker). JSON Schemas were checked against the metaschema when the request was validated;
one the worker still cannot compile comes back as a 400 naming `param`.
"""

from __future__ import annotations

import json

from fairshare.v1 import worker_pb2 as pb

from .errors import invalid_request
from .schemas import ChatCompletionRequest, ResponseFormatJSONSchema
from .tools import MAX_JSON_WHITESPACE, ToolCallParser


def grammar_for(req: ChatCompletionRequest, parser: ToolCallParser) -> tuple[pb.Grammar | None, str | None]:
    """(grammar or None, the request parameter a worker's compile error names: ``response_format``, or
    ``tools`` when the request forces tool calls).

    Raises APIError 400 when the request forces tool calls and the model's tool-call format cannot
    express them (parser ``none``)."""
    fmt = req.json_format()
    if req.calls_tools():
        tools = req.tool_dicts()
        forced = req.forced_function()
        parallel = req.parallel_tool_calls is not False
        if forced is not None or req.tool_choice == "required":
            tag = parser.structural_tag(tools, forced, parallel)
            if tag is None:
                raise invalid_request(f"tool_choice {'required' if forced is None else 'naming a function'} is not "
                                      f"supported for this model (its tool-call parser is '{parser.name}').",
                                      "tool_choice", "unsupported_value")
            # what the worker may fail to compile here is a function's parameters schema
            return pb.Grammar(structural_tag=json.dumps(tag, ensure_ascii=False)), "tools"
        tag = parser.structural_tag(tools, None, parallel) if fmt is not None else None
        if tag is not None:  # auto: tool calls, or else the JSON answer
            answer = {"type": "json_schema", "json_schema": fmt, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
            either = {"type": "structural_tag", "format": {"type": "or", "elements": [tag["format"], answer]}}
            return pb.Grammar(structural_tag=json.dumps(either, ensure_ascii=False)), "response_format"
    if fmt is None:
        return None, None
    rf = req.response_format
    if isinstance(rf, ResponseFormatJSONSchema) and rf.json_schema.schema_ is not None:
        return pb.Grammar(json_schema=json.dumps(rf.json_schema.schema_, ensure_ascii=False)), "response_format"
    return pb.Grammar(json_object=True), "response_format"


__all__ = ["grammar_for"]
