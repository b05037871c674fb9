"""Tool calling: how tools reach the prompt, how the model's calls are read back, and how a forced
call is enforced.

A model family writes tool calls in its own format; a **tool-call parser** knows one format and is
chosen per model in the gateway settings (``tool_call_parser``, default ``hermes``):

- ``hermes``: the format of Hermes-2-Pro, Qwen2.5 and SmolLM-family templates: each call is
  ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``, one after another (an
  ``"parameters"`` key is read as ``"arguments"``); text before the first call is the message content.
- ``none``: never parse (the output is always plain content).

Each parser gives, for one format:

- `ToolCallParser.stream()`: an incremental reader (`ToolCallStream`) fed the text deltas of one
  choice; it returns the content to show and each call once its closing tag arrived. Streamed and
  non-streamed responses use the same reader, so they agree exactly. A block that is not a well-formed
  call of a declared function is passed through as content, unchanged.
- `ToolCallParser.system_prompt(tools)`: the fallback system section that lists the tools and the
  call format, for chat templates that have no ``tools`` variable (the gateway checks the template;
  templates that take ``tools`` render them themselves).
- `ToolCallParser.render_call(...)`/`render_result(...)`: how past calls and tool results are
  written back into such a fallback prompt (assistant text with the call blocks; a ``user`` turn
  wrapping the result in ``<tool_response>`` tags).
- `ToolCallParser.structural_tag(...)`: the xgrammar structural tag that forces calls in this format
  (``tool_choice: "required"`` or a named function; with ``parallel_tool_calls: false`` exactly one
  call), each call's arguments constrained to its function's ``parameters`` JSON Schema. The worker
  compiles it (worker/engine/grammar.py) or hands it to SGLang's grammar backend.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

# whitespace allowed between JSON tokens inside a constrained call (a bound, so a weak model cannot
# pad forever; one space is what ", " and ": " need)
MAX_JSON_WHITESPACE = 1


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` + 24 hex characters."""
    return "call_" + secrets.token_hex(12)


def function_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """The ``parameters`` JSON Schema of an OpenAI tool dict (no parameters: an object with none)."""
    params = (tool.get("function") or {}).get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


@dataclass
class ToolCallStream:
    """Incremental reader of one choice's output. `feed(delta)` and `finish()` return
    ``(content, calls)``: content text to show now and the calls completed now (OpenAI
    ``tool_calls`` items without ``index``). Whitespace right before a call is dropped (so is
    trailing whitespace once a call was made); everything else is shown as written."""

    parser: "ToolCallParser"
    names: frozenset[str]
    buf: str = ""        # text not decided yet (in a call: the call's body so far)
    held: str = ""       # whitespace held back in content: shown only if more content follows
    in_call: bool = False
    dropped: str = ""    # the whitespace dropped before the block being read (restored if it is no call)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """Consume a text delta."""
        self.buf += delta
        return self._drain()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """End of output: what is still held back (an unterminated block is content)."""
        content, calls = self._drain()
        rest = (self.dropped + self.parser.begin + self.buf) if self.in_call else self.buf
        self.buf, self.in_call = "", False
        if rest.strip() or (rest and not self.calls):
            content += self.held + rest
        elif not self.calls:
            content += self.held
        self.held = ""
        return content, calls

    def _content(self, text: str, out: list[str]) -> None:
        """Show `text` (content), holding back its trailing whitespace."""
        if text.strip():
            body = text.rstrip()
            out.append(self.held + body)
            self.held = text[len(body):]
        else:
            self.held += text

    def _drain(self) -> tuple[str, list[dict[str, Any]]]:
        begin, end = self.parser.begin, self.parser.end
        out: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self.in_call:
                j = self.buf.find(end)
                if j < 0:
                    break
                body, self.buf = self.buf[:j], self.buf[j + len(end):]
                self.in_call = False
                call = self.parser.read_call(body, self.names)
                if call is None:  # not a call of a declared function: shown as it was written
                    self._content(self.dropped + begin + body + end, out)
                else:
                    self.calls.append(call)
                    calls.append(call)
                continue
            i = self.buf.find(begin)
            if i >= 0:
                before, self.buf = self.buf[:i], self.buf[i + len(begin):]
                self._content(before, out)
                self.dropped, self.held = self.held, ""  # whitespace before a call is dropped
                self.in_call = True
                continue
            keep = _partial_suffix(self.buf, begin)  # a possible start of the begin tag waits
            text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            self._content(text, out)
            break
        return "".join(out), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """One tool-call format (see the module docstring). Subclasses set `name`, `begin`, `end`."""

    name = "none"
    begin = ""
    end = ""

    def stream(self, tools: list[dict[str, Any]]) -> ToolCallStream | None:
        """A reader for one choice (None: this parser never finds calls)."""
        return None

    def read_call(self, body: str, names: frozenset[str]) -> dict[str, Any] | None:
        """The OpenAI tool call written in `body` (the text between the tags), or None."""
        return None

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Fallback system section describing `tools` (templates without a ``tools`` variable)."""
        return ""

    def render_call(self, name: str, arguments: str) -> str:
        """A past call as the model writes it (fallback prompts; here: the call as JSON)."""
        return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)

    def render_result(self, content: str) -> str:
        """A tool result as a user turn shows it (fallback prompts)."""
        return content

    def structural_tag(self, tools: list[dict[str, Any]], only: str | None, parallel: bool) -> dict[str, Any] | None:
        """The structural tag forcing calls (`only`: the one function to call; else any declared one,
        at least one call, exactly one unless `parallel`). None: this parser cannot force calls."""
        return None


class HermesToolParser(ToolCallParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Hermes / Qwen / SmolLM)."""

    name = "hermes"
    begin = "<tool_call>"
    end = "</tool_call>"

    def stream(self, tools: list[dict[str, Any]]) -> ToolCallStream:  # noqa: D102
        names = frozenset(str((t.get("function") or {}).get("name")) for t in tools)
        return ToolCallStream(self, names)

    def read_call(self, body: str, names: frozenset[str]) -> dict[str, Any] | None:  # noqa: D102
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return {"id": new_call_id(), "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:  # noqa: D102
        lines = ["# Tools", "",
                 "You can call functions to help answer the user. The functions you may call are described "
                 "inside <tools></tools> tags, one JSON object each:", "<tools>"]
        lines += [json.dumps(t, ensure_ascii=False) for t in tools]
        lines += ["</tools>", "",
                  "To call a function, write a JSON object with the function's name and its arguments inside "
                  "<tool_call></tool_call> tags, one block per call:",
                  "<tool_call>", '{"name": "<function name>", "arguments": {<arguments as JSON>}}', "</tool_call>"]
        return "\n".join(lines)

    def render_call(self, name: str, arguments: str) -> str:  # noqa: D102
        try:
            args: Any = json.loads(arguments) if arguments else {}
        except ValueError:
            args = arguments
        return f"{self.begin}\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + f"\n{self.end}"

    def render_result(self, content: str) -> str:  # noqa: D102
        return f"<tool_response>\n{content}\n</tool_response>"

    def _tag(self, tool: dict[str, Any]) -> dict[str, Any]:
        name = (tool.get("function") or {}).get("name")
        return {"type": "tag", "begin": f"{self.begin}\n" + '{"name": ' + json.dumps(name) + ', "arguments": ',
                "content": {"type": "json_schema", "json_schema": function_parameters(tool),
                            "max_whitespace_cnt": MAX_JSON_WHITESPACE},
                "end": "}\n" + self.end}

    def structural_tag(self, tools, only, parallel):  # noqa: D102
        chosen = [t for t in tools if only is None or (t.get("function") or {}).get("name") == only]
        calls = {"type": "tags_with_separator", "tags": [self._tag(t) for t in chosen], "separator": "\n",
                 "at_least_one": True, "stop_after_first": bool(only is not None or not parallel)}
        # models of this format often end a call with a newline before EOS: allowed, not read as
        # "another call follows"
        trailing = {"type": "optional", "content": {"type": "const_string", "value": "\n"}}
        return {"type": "structural_tag", "format": {"type": "sequence", "elements": [calls, trailing]}}


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesToolParser, "none": ToolCallParser}


def get_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`. Raises ValueError for an unknown name."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(sorted(PARSERS))})") from None


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      parser: ToolCallParser) -> list[dict[str, Any]]:
    """`messages` rewritten for a chat template that knows nothing of tools: the tools' system
    section first (merged into a leading system message), past assistant calls written as the model
    writes them, tool results as user turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if m["role"] == "assistant" and calls:
            parts = [m.get("content") or ""] + [parser.render_call(c["function"]["name"], c["function"]["arguments"])
                                                for c in calls]
            m["content"] = "\n".join(p for p in parts if p)
        elif m["role"] == "tool":
            m = {"role": "user", "content": parser.render_result(m.get("content") or "")}
        out.append(m)
    section = parser.system_prompt(tools) if tools else ""
    if section:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


__all__ = ["HermesToolParser", "PARSERS", "ToolCallParser", "ToolCallStream", "fallback_messages", "get_parser",
           "function_parameters", "new_call_id"]
