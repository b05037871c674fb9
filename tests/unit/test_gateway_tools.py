"""The gateway's tool-call side (gateway/tools.py, gateway/structured.py) and logprob token texts
(gateway/logprobs.py): parsing Hermes calls streamed in any chunking exactly as non-streamed, what is
not a call staying content, the fallback prompt for templates without tools, and the structural tag
that forces calls accepting exactly well-formed calls (checked with xgrammar's matcher)."""

from __future__ import annotations

import pytest

from gateway.logprobs import TokenTexts
from gateway.schemas import validate_request
from gateway.structured import grammar_for
from gateway.tokenization import ChatTokenizer, TokenizerFiles
from gateway.tools import fallback_messages, get_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]
CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def read(text: str, size: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed `text` to a fresh reader in chunks of `size` characters."""
    reader = get_parser("hermes").stream(TOOLS)
    content, calls = "", []
    for i in range(0, len(text), size):
        c, k = reader.feed(text[i:i + size])
        content, calls = content + c, calls + k
    c, k = reader.finish()
    return content + c, [(x["function"]["name"], x["function"]["arguments"]) for x in calls + k]


@pytest.mark.parametrize("text,content,calls", [
    ("Just an answer.  ", "Just an answer.  ", []),
    (CALL_A, "", [("get_weather", '{"city": "Paris"}')]),
    ("Let me look.\n" + CALL_A + "\n" + CALL_B + "\n", "Let me look.", [("get_weather", '{"city": "Paris"}'),
                                                                       ("now", "{}")]),
    ('<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo"}}</tool_call>', "",
     [("get_weather", '{"city": "Oslo"}')]),
    ('<tool_call>{"name": "launch", "arguments": {}}</tool_call> ok',  # not a declared function
     '<tool_call>{"name": "launch", "arguments": {}}</tool_call> ok', []),
    ("x <tool_call>{broken json</tool_call>", "x <tool_call>{broken json</tool_call>", []),
    ("cut short <tool_call>\n{\"name\": \"now\"", "cut short <tool_call>\n{\"name\": \"now\"", []),
    ("a <tool_ca", "a <tool_ca", []),
])
def test_hermes_reader_streamed_in_any_chunking_equals_whole(text, content, calls):
    for size in (1, 2, 3, 5, 11, len(text) or 1):
        assert read(text, size) == (content, calls)


def test_each_call_gets_its_own_openai_id():
    reader = get_parser("hermes").stream(TOOLS)
    _, calls = reader.feed(CALL_B + "\n" + CALL_B)
    assert len(calls) == 2 and all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_fallback_prompt_lists_tools_and_rewrites_history():
    parser = get_parser("hermes")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    out = fallback_messages(messages, TOOLS, parser)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert "<tools>" in out[0]["content"] and '"get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": CALL_A}
    assert out[3] == {"role": "user", "content": "<tool_response>\n18C\n</tool_response>"}
    # the rendered past call reads back as the same call
    assert read(out[2]["content"], 4)[1] == [("get_weather", '{"city": "Paris"}')]


def test_templates_with_a_tools_variable_render_tools_themselves(tokenizer_files):
    template = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                "{% for c in m.tool_calls or [] %} CALL {{ c.function.arguments.city }}{% endfor %}\n{% endfor %}")
    tok = ChatTokenizer(TokenizerFiles(tokenizer_files.tokenizer_json, template))
    assert tok.supports_tools
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                                "arguments": '{"city": "Rome"}'}}]}]
    text = tok.render_chat(history, TOOLS, get_parser("hermes"))
    assert text.startswith("TOOL get_weather\nTOOL now\n") and "CALL Rome" in text  # arguments as an object
    plain = ChatTokenizer(TokenizerFiles(tokenizer_files.tokenizer_json, "{% for m in messages %}{{ m.content }}"
                                                                         "{% endfor %}"))
    assert not plain.supports_tools
    assert "<tools>" in plain.render_chat([{"role": "user", "content": "hi"}], TOOLS, get_parser("hermes"))


@pytest.fixture(scope="module")
def tokenizer_files():
    from worker.models import load_model

    m = load_model("random-tiny", load_weights=False)
    return TokenizerFiles(m.tokenizer_json, m.chat_template)


@pytest.fixture(scope="module")
def compiler():
    from worker.engine.grammar import GrammarCompiler
    from worker.models import load_model

    m = load_model("random-tiny", load_weights=False)
    return GrammarCompiler(m.tokenizer, m.config.vocab_size, m.eos_token_ids)


def _accepts(compiled, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled.compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("choice,parallel,good,bad", [
    ({"type": "function", "function": {"name": "get_weather"}}, None,
     [CALL_A], [CALL_B, CALL_A + "\n" + CALL_A, "Sure! " + CALL_A, '<tool_call>\n{"name": "get_weather", '
                                                                     '"arguments": {}}\n</tool_call>']),
    ("required", False, [CALL_A, CALL_B, CALL_B + "\n"], ["", CALL_A + "\n" + CALL_B, "plain text", CALL_A + "\n\n"]),
    ("required", True, [CALL_A, CALL_A + "\n" + CALL_B, CALL_A + "\n" + CALL_B + "\n"], ["", "plain text"]),
])
def test_forced_tool_choice_grammar_accepts_exactly_well_formed_calls(compiler, choice, parallel, good, bad):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    req = validate_request(body, "chat")
    req.refuse_unsupported()
    grammar, param = grammar_for(req, get_parser("hermes"))
    assert param == "tools" and grammar.WhichOneof("kind") == "structural_tag"
    compiled = compiler.compile("structural_tag", grammar.structural_tag)
    for text in good:
        assert _accepts(compiled, text), text
    for text in bad:
        assert not _accepts(compiled, text), text


def test_auto_tools_with_a_json_format_allow_calls_or_the_json_answer(compiler):
    req = validate_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                                "type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}}}},
                           "chat")
    grammar, param = grammar_for(req, get_parser("hermes"))
    compiled = compiler.compile(grammar.WhichOneof("kind"), grammar.structural_tag)
    assert param == "response_format"
    assert _accepts(compiled, CALL_A) and _accepts(compiled, '{"v": 3}') and not _accepts(compiled, "hello")


def test_no_grammar_without_a_format_or_a_forced_call():
    for extra in ({}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"},
                  {"response_format": {"type": "text"}}):
        req = validate_request({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}, "chat")
        assert grammar_for(req, get_parser("hermes")) == (None, None)
    req = validate_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                            "response_format": {"type": "json_object"}}, "chat")
    assert grammar_for(req, get_parser("hermes"))[0].json_object


def test_token_texts_bytes_rebuild_the_text(tokenizer_files):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_files.tokenizer_json)
    texts = TokenTexts(tok)
    text = "Grüße, 日本語 and emoji 🙂!"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert b"".join(texts.bytes_of(i) for i in ids).decode() == text
    shown = [texts.token_of(i) for i in ids]
    assert any(s.startswith("bytes:\\x") for s in shown)  # a token holding part of a character
    assert all(not s.startswith("bytes:") or len(texts.bytes_of(i)) < 4 for s, i in zip(shown, ids))
    item = texts.item(ids[0], -0.5)
    assert item == {"token": shown[0], "logprob": -0.5, "bytes": list(texts.bytes_of(ids[0]))}


def test_a_model_without_a_tool_call_format_cannot_force_calls():
    from gateway.errors import APIError

    req = validate_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                            "tool_choice": "required"}, "chat")
    with pytest.raises(APIError) as e:
        grammar_for(req, get_parser("none"))
    assert (e.value.status, e.value.param, e.value.code) == (400, "tool_choice", "unsupported_value")
    assert get_parser("none").stream(TOOLS) is None  # and its output is never read as calls
    with pytest.raises(ValueError):
        get_parser("mistral")
