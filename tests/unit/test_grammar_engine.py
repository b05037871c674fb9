"""Grammar-constrained decoding in the reference engine (xgrammar, worker/engine/grammar.py) on the
random tiny model: constrained and free requests in the same iteration, the mask applied per row,
termination at the end of the grammar, compile errors, and the JSON control-character mask."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from worker.engine.engine import Engine, EngineConfig
from worker.engine import grammar as grammar_module
from worker.engine.grammar import Constraint, InvalidGrammar, apply_masks, no_allowed_token
from worker.engine.sequence import FinishReason, SamplingParams
from worker.models import load_model

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99},
                                           "word": {"type": "string", "maxLength": 8}},
          "required": ["ok", "n", "word"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine():
    e = Engine(load_model("random-tiny"), EngineConfig(num_kv_blocks=256, max_running=16))
    e.compile_grammar("json_object")  # builds the vocabulary tables once for the module
    return e


class Recorder:
    """Per request: outputs; per step: the request ids whose token was sampled in that step."""

    def __init__(self):
        self.outs: dict[str, list] = {}

    def cb(self, out):
        self.outs.setdefault(out.request_id, []).append(out)

    def text(self, rid):
        return "".join(o.text_delta for o in self.outs[rid])

    def done(self, rid):
        return bool(self.outs.get(rid)) and self.outs[rid][-1].finish_reason is not None


def run(engine, rec, rids, steps=2000):
    for _ in range(steps):
        if all(rec.done(r) for r in rids):
            return
        engine.step()
    raise AssertionError(f"requests never finished: {[r for r in rids if not rec.done(r)]}")


def test_constrained_and_free_requests_share_iterations(engine):
    rec = Recorder()
    grammar = engine.compile_grammar("json_schema", json.dumps(SCHEMA))
    rids = []
    for i in range(4):
        engine.add_request(f"c{i}", "t", [1, 2, 3, 4 + i], SamplingParams(max_tokens=200, seed=i, grammar=grammar),
                           rec.cb)
        engine.add_request(f"f{i}", "t", [1, 2, 3, 4 + i], SamplingParams(max_tokens=30, seed=i, ignore_eos=True),
                           rec.cb)
        rids += [f"c{i}", f"f{i}"]
    engine.step()  # one prefill step admits all eight (their prompts fit the token budget)
    # every request got its first token in that same step: constrained and free rows in one batch
    assert all(len(rec.outs.get(r, [])) == 1 and rec.outs[r][0].token_ids for r in rids)
    run(engine, rec, rids)
    for i in range(4):
        out = rec.outs[f"c{i}"]
        assert out[-1].finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(rec.text(f"c{i}")), SCHEMA)
        assert out[-1].completion_tokens == sum(len(o.token_ids) for o in out)
        assert rec.outs[f"f{i}"][-1].completion_tokens == 30  # free rows are not cut by any grammar


def test_mask_touches_only_constrained_rows(engine):
    grammar = engine.compile_grammar("json_schema", json.dumps(SCHEMA))
    logits = torch.randn(3, engine.runner.vocab_size, generator=torch.Generator().manual_seed(0))
    masked = apply_masks(logits.clone(), [None, Constraint(grammar), None])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = torch.isfinite(masked[1])
    assert 0 < int(allowed.sum()) < 50  # the first token must open the object: few tokens allowed
    tok = engine.model.tokenizer
    assert all(tok.decode([int(i)]).startswith("{") for i in allowed.nonzero().flatten())


def _sample_json(engine, grammar, bias, gen, without_json_mask=False) -> str:
    c, out = Constraint(grammar), []
    if without_json_mask:
        c.static_mask = None
    while not c.terminated:
        logits = apply_masks(torch.randn(1, engine.runner.vocab_size, generator=gen) + bias, [c])
        tok = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
        assert c.accept(tok)
        out.append(tok)
        assert len(out) < 200, "the grammar never ended"
    return engine.model.tokenizer.decode(out)


def test_json_grammars_never_emit_raw_control_characters(engine):
    """xgrammar's rule for length-bounded strings lets raw control characters through (invalid JSON);
    the JSON mask must not. The sampler is pushed towards them: every token whose text holds a control
    character other than a newline gets +20 on its logit."""
    tok = engine.model.tokenizer
    vocab = engine.runner.vocab_size
    bias = torch.zeros(vocab)
    for i in range(vocab):
        if any(ord(ch) < 0x20 and ch != "\n" for ch in tok.decode([i])):
            bias[i] = 20.0
    schema = {"type": "object", "properties": {f"s{i}": {"type": "string", "maxLength": 6} for i in range(3)},
              "required": [f"s{i}" for i in range(3)], "additionalProperties": False}
    grammar = engine.compile_grammar("json_schema", json.dumps(schema))
    gen = torch.Generator().manual_seed(1)
    unmasked = _sample_json(engine, grammar, bias, gen, without_json_mask=True)
    assert any(ord(ch) < 0x20 for ch in unmasked)  # what xgrammar alone lets through
    for _ in range(5):
        text = _sample_json(engine, grammar, bias, gen)
        assert not any(ord(ch) < 0x20 for ch in text), repr(text)
        jsonschema.validate(json.loads(text), schema)


def test_regex_grammar_and_length_limit(engine):
    rec = Recorder()
    g = engine.compile_grammar("regex", r"(yes|no) [0-9]{3}")
    engine.add_request("rx", "t", [5, 6, 7], SamplingParams(max_tokens=50, seed=3, grammar=g), rec.cb)
    g2 = engine.compile_grammar("json_schema", json.dumps({"type": "array", "items": {"type": "integer"},
                                                           "minItems": 100}))
    engine.add_request("long", "t", [5, 6, 7], SamplingParams(max_tokens=5, seed=3, grammar=g2), rec.cb)
    run(engine, rec, ["rx", "long"])
    text = rec.text("rx")
    assert text[:3] in ("yes", "no ") and text.split(" ")[1].isdigit() and len(text.split(" ")[1]) == 3
    assert rec.outs["long"][-1].finish_reason is FinishReason.LENGTH  # budget first: cut, as OpenAI does


@pytest.mark.parametrize("kind,source", [
    ("json_schema", "not json"),
    ("json_schema", '{"type": "objekt"}'),
    ("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}'),
    ("regex", "([a-"),
    ("ebnf", "root ::= undefined_rule"),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}'),
    ("yaml", "a: 1"),
])
def test_grammars_that_do_not_compile_raise_invalid_grammar(engine, kind, source):
    with pytest.raises(InvalidGrammar) as e:
        engine.compile_grammar(kind, source)
    assert "/project/" not in str(e.value) and str(e.value)  # xgrammar's C++ location is cut off


@pytest.mark.parametrize("source", ['{"$ref": "#"}', '{"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}'])
def test_a_schema_no_output_satisfies_is_invalid_at_compile_time(engine, source):
    """It compiles, but no token can start it: before, its request sampled from all -inf logits (a
    NaN softmax) and failed the whole batch it ran in; now it is refused before it is queued."""
    with pytest.raises(InvalidGrammar, match="allows no first token"):
        engine.compile_grammar("json_schema", source)


def _tool_tag(parameters: dict) -> str:
    """A forced-call structural tag as the gateway builds it (gateway/tools.py, hermes) for one tool."""
    from gateway.tools import get_parser

    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    return json.dumps(get_parser("hermes").structural_tag(tools, None, True))


@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}])
def test_a_structural_tag_holding_a_schema_nothing_satisfies_is_invalid(engine, schema):
    """The tag itself allows a first token (the call's fixed opening), and its tool's parameters then
    allow none: before, the request got a 200 whose content was the cut-off opening and no tool call;
    now the schema is refused at compile time, named by the text before it. The same tag with a
    satisfiable schema compiles; so does the answer's schema inside an 'or' with the calls."""
    with pytest.raises(InvalidGrammar, match=r"the JSON schema after .*\"name\": \"f\".*allows no first token"):
        engine.compile_grammar("structural_tag", _tool_tag(schema))
    engine.compile_grammar("structural_tag", _tool_tag({"type": "object", "properties": {"x": {"type": "integer"}}}))
    calls = json.loads(_tool_tag({"type": "object"}))["format"]
    either = {"type": "structural_tag", "format": {"type": "or", "elements": [
        calls, {"type": "json_schema", "json_schema": schema}]}}
    with pytest.raises(InvalidGrammar, match="the JSON schema of the answer"):
        engine.compile_grammar("structural_tag", json.dumps(either))


class DeadEndAfter(Constraint):
    """The real grammar for `n` tokens, then a mask that allows nothing (a grammar at a dead end, which
    xgrammar's own grammars should never reach: the engine's guard is what is under test)."""

    n = 3

    def fill(self, bitmask, row):
        super().fill(bitmask, row)
        if self.matcher_tokens >= self.n:
            bitmask[row] = 0

    def accept(self, token):
        self.matcher_tokens = getattr(self, "matcher_tokens", 0) + 1
        return super().accept(token)

    matcher_tokens = 0


def test_a_grammar_at_a_dead_end_stops_its_request_alone(engine, monkeypatch):
    """The dead-end request stops (STOP, with what it produced) and leaves the batch; the other
    constrained request and a free one in the same iterations finish normally, the engine has not
    failed and every KV block is back."""
    free_before = engine.block_manager.num_free
    g = engine.compile_grammar("regex", r"[a-z]{40}")
    rec = Recorder()
    monkeypatch.setattr(grammar_module, "Constraint", DeadEndAfter)
    engine.add_request("dead", "t1", [9, 8, 7], SamplingParams(max_tokens=40, seed=1, grammar=g), rec.cb)
    engine.step()  # admits "dead" with the dead-end grammar; the next two get the real one
    monkeypatch.setattr(grammar_module, "Constraint", Constraint)
    engine.add_request("live", "t2", [9, 8, 7], SamplingParams(max_tokens=40, seed=2, grammar=g), rec.cb)
    engine.add_request("free", "t3", [9, 8, 7], SamplingParams(max_tokens=20, seed=3, ignore_eos=True), rec.cb)
    run(engine, rec, ["dead", "live", "free"])
    dead = rec.outs["dead"][-1]
    assert dead.finish_reason is FinishReason.STOP and dead.error is None
    assert dead.completion_tokens == DeadEndAfter.n and rec.text("dead").isalpha()
    assert rec.outs["live"][-1].finish_reason is FinishReason.STOP and len(rec.text("live")) == 40
    assert rec.outs["free"][-1].finish_reason is FinishReason.LENGTH
    assert engine.failed is None
    assert engine.block_manager.num_free == free_before


def test_no_allowed_token_names_only_constrained_rows_with_every_logit_masked():
    logits = torch.zeros(3, 8)
    logits[1] = float("-inf")
    logits[2] = float("-inf")
    assert no_allowed_token(logits, [object(), object(), None]) == [1]
