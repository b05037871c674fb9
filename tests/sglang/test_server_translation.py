"""`fairshare worker --engine sglang` pieces that run without a GPU: request translation, output
translation (token and text deltas, stop strings, usage), model facts, the CLI dispatch."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from fairshare.v1 import worker_pb2
from worker import sglang_server as ss
from worker.sglang_plugin import tenant as tn
from worker.sglang_plugin.state import FairShareState

FACTS = ss.ModelFacts(name="m", max_context_tokens=64, vocab_size=100)


def make_request(**kw) -> worker_pb2.GenerateRequest:
    req = worker_pb2.GenerateRequest(
        request_id=kw.pop("request_id", "req-1"),
        tenant=worker_pb2.Tenant(id=kw.pop("tenant", "acme"), weight=kw.pop("weight", 2.0),
                                 tier=worker_pb2.TIER_BATCH, cache_namespace=kw.pop("ns", "ns-acme")),
        prompt_token_ids=kw.pop("prompt", [1, 2, 3]),
        cache_salt=kw.pop("salt", ""),
    )
    s = req.sampling
    s.max_tokens = kw.pop("max_tokens", 8)
    s.temperature = kw.pop("temperature", 0.0)
    for k, v in kw.items():
        if k in ("stop", "stop_token_ids"):
            getattr(s, k).extend(v)
        else:
            setattr(s, k, v)
    return req


def test_request_translation_carries_signed_tenant_and_namespace():
    kw = ss.request_to_sglang(make_request(salt="client-salt", seed=7, top_k=5, stop=["\n\n"], stop_token_ids=[9]),
                              FACTS, "sec")
    assert kw["input_ids"] == [1, 2, 3] and kw["stream"] is True
    assert kw["rid"] == ss.sglang_rid("req-1") and len(kw["rid"]) == 35
    # the worker-derived namespace of (tenant, client salt); the gateway's cache_namespace plays no part
    assert kw["extra_key"] == tn.extra_key_for("acme", "client-salt", "sec")
    assert kw["extra_key"] == ss.request_to_sglang(make_request(salt="client-salt", ns="other"), FACTS, "sec")["extra_key"]
    assert kw["extra_key"] not in {tn.extra_key_for("acme", "", "sec"), tn.extra_key_for("evil", "client-salt", "sec"),
                                   tn.extra_key_for("acme", "client-salt", "other-secret")}
    assert kw["cache_salt"] == "client-salt"
    sp = kw["sampling_params"]
    assert sp["max_new_tokens"] == 8 and sp["temperature"] == 0.0 and sp["top_k"] == 5 and sp["top_p"] == 1.0
    assert sp["stop"] == ["\n\n"] and sp["stop_token_ids"] == [9] and sp["sampling_seed"] == 7
    tag, _ = tn.verify(sp["custom_params"][tn.CUSTOM_PARAM_KEY], "sec", rid=kw["rid"])
    assert tag == tn.TenantTag("acme", 2.0, "batch", verified=True)
    assert tn.verify(sp["custom_params"][tn.CUSTOM_PARAM_KEY], "sec", rid=ss.sglang_rid("other")) is None
    # What the plugin does with it in SGLang's scheduler: attributes it, keeps the namespace
    req = type("Req", (), {})()
    req.rid, req.origin_input_ids, req.output_ids, req.lora_id = kw["rid"], kw["input_ids"], [], None
    req.extra_key, req.cache_salt = kw["extra_key"], kw["cache_salt"]
    req.sampling_params = type("SP", (), {"custom_params": sp["custom_params"], "max_new_tokens": 8})()
    st = FairShareState("vtc", secret="sec")
    st.on_arrival(req)
    assert st.policy.accounts["acme"].weight == 2.0 and req.extra_key == kw["extra_key"]


def test_request_translation_defaults_and_limits():
    kw = ss.request_to_sglang(make_request(max_tokens=0, prompt=[5] * 60), FACTS, "sec")
    assert kw["sampling_params"]["max_new_tokens"] == 4          # rest of the context
    assert kw["cache_salt"] is None and kw["sampling_params"]["top_k"] == -1
    assert "stop" not in kw["sampling_params"] and "sampling_seed" not in kw["sampling_params"]
    rids = {ss.sglang_rid(f"r{i}") for i in range(100)} | {ss.sglang_rid("r1" * 10)}
    assert all(not a.startswith(b) for a in rids for b in rids if a != b)   # prefix-free (SGLang aborts by prefix)
    for bad in (dict(prompt=[]), dict(prompt=[1] * 64), dict(prompt=[100]), dict(tenant=""),
                dict(temperature=-1.0), dict(top_p=1.5)):
        with pytest.raises(ss.InvalidRequest):
            ss.request_to_sglang(make_request(**bad), FACTS, "sec")


def test_request_translation_of_logprobs_and_grammars():
    kw = ss.request_to_sglang(make_request(logprobs=True, top_logprobs=4), FACTS, "sec")
    assert (kw["return_logprob"], kw["top_logprobs_num"], kw["logprob_start_len"]) == (True, 4, -1)
    assert "return_logprob" not in ss.request_to_sglang(make_request(), FACTS, "sec")
    for kind, value, key, expected in (("json_schema", '{"type": "string"}', "json_schema", '{"type": "string"}'),
                                       ("json_object", True, "json_schema", '{"type": "object"}'),
                                       ("regex", "[a-z]+", "regex", "[a-z]+"),
                                       ("ebnf", 'root ::= "x"', "ebnf", 'root ::= "x"'),
                                       ("structural_tag", '{"type": "structural_tag"}', "structural_tag",
                                        '{"type": "structural_tag"}')):
        req = make_request()
        setattr(req.sampling.grammar, kind, value)
        sp = ss.request_to_sglang(req, FACTS, "sec")["sampling_params"]
        assert sp[key] == expected
        assert not {"json_schema", "regex", "ebnf", "structural_tag"} - {key} & set(sp)
    for bad in (dict(top_logprobs=3), dict(logprobs=True, top_logprobs=21)):
        with pytest.raises(ss.InvalidRequest):
            ss.request_to_sglang(make_request(**bad), FACTS, "sec")


@pytest.mark.parametrize("incremental", [False, True])
def test_stream_translation_carries_logprobs(incremental):
    """SGLang's `output_token_logprobs` ((logprob, id, text) per position) and `output_top_logprobs`
    (a list of those per position) become one TokenLogprob per token, in order, in either stream mode."""
    tok = _char_tokenizer()
    tr = ss.StreamTranslator([1], incremental, tok)
    steps = [[(3, -0.1), (4, -0.2)], [(5, -0.3)]]
    all_lp, all_top, all_ids, msgs = [], [], [], []
    for i, step in enumerate(steps):
        new_lp = [(lp, t, None) for t, lp in step]
        new_top = [[(lp, t, None), (lp - 1, 9, None)] for t, lp in step]
        all_lp += new_lp
        all_top += new_top
        all_ids += [t for t, _ in step]
        meta = {"finish_reason": {"type": "length"} if i == len(steps) - 1 else None,
                "output_token_logprobs": new_lp if incremental else list(all_lp),
                "output_top_logprobs": new_top if incremental else list(all_top)}
        msgs.append(tr.feed({"output_ids": [t for t, _ in step] if incremental else list(all_ids), "meta_info": meta}))
    got = [(e.token_id, round(e.logprob, 3), [(a.token_id, round(a.logprob, 3)) for a in e.top])
           for m in msgs for e in m.logprobs]
    assert got == [(3, -0.1, [(3, -0.1), (9, -1.1)]), (4, -0.2, [(4, -0.2), (9, -1.2)]), (5, -0.3, [(5, -0.3), (9, -1.3)])]
    assert [len(m.logprobs) for m in msgs] == [len(m.token_ids) for m in msgs]


def test_served_model_names(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32}))
    f = ss.read_model_facts(tmp_path, name=["main", "alias"])
    assert f.name == "main" and f.served_names == ["main", "alias"]
    assert ss.read_model_facts(tmp_path).served_names == [tmp_path.resolve().name]
    p = ss.build_parser()
    args = p.parse_args(["--model", "/m", "--served-model-name", "a", "b"])
    from worker.cli import served_names

    assert served_names(p, args) == ["a", "b"]


def _char_tokenizer() -> Tokenizer:
    vocab = {c: i for i, c in enumerate(["<eos>", *"abcdefghijklmnopqrstuvwxyz", " ", "."])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return tok


def ids(tok, text):
    return [tok.token_to_id(c) for c in text]


@pytest.mark.parametrize("incremental", [False, True])
def test_stream_translation_cumulative_or_incremental(incremental):
    tok = _char_tokenizer()
    tr = ss.StreamTranslator([1, 2], incremental, tok, stop=None, skip_ids={0})
    chunks = [ids(tok, "ab"), ids(tok, "c"), ids(tok, "d") + [0]]
    seen = []
    msgs = []
    for i, chunk in enumerate(chunks):
        seen += chunk
        last = i == len(chunks) - 1
        meta = {"finish_reason": {"type": "stop", "matched": 0} if last else None, "prompt_tokens": 2,
                "completion_tokens": len(seen), "cached_tokens": 1}
        msgs.append(tr.feed({"output_ids": list(chunk if incremental else seen), "meta_info": meta}))
    assert [list(m.token_ids) for m in msgs] == chunks
    assert "".join(m.text_delta for m in msgs) == "abcd"
    final = msgs[-1]
    assert final.finish_reason == worker_pb2.FINISH_REASON_STOP
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_prompt_tokens) == (2, 5, 1)
    assert all(not m.finish_reason for m in msgs[:-1])


def test_stream_translation_never_emits_a_stop_string():
    tok = _char_tokenizer()
    tr = ss.StreamTranslator([1], False, tok, stop=["xyz"])
    out, text = [], ""
    for n in range(1, 8):
        full = ids(tok, "abxyzqq"[:n])
        fin = {"type": "stop", "matched": "xyz"} if n == 7 else None
        m = tr.feed({"output_ids": full, "meta_info": {"finish_reason": fin, "prompt_tokens": 1}})
        if m is not None:
            out.append(m)
            text += m.text_delta
            assert "x" not in text   # never even the beginning of the stop string
    assert text == "ab" and out[-1].finish_reason == worker_pb2.FINISH_REASON_STOP


def test_finish_reasons():
    assert ss.finish_reason_of({}) == (None, None, None)
    assert ss.finish_reason_of({"finish_reason": {"type": "length", "length": 3}})[0] == worker_pb2.FINISH_REASON_LENGTH
    assert ss.finish_reason_of({"finish_reason": {"type": "abort", "message": "m", "status_code": 400}}) == (
        worker_pb2.FINISH_REASON_ABORT, "m", 400)


def test_read_model_facts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32, "max_position_embeddings": 128,
                                                      "eos_token_id": [2, 3]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    (tmp_path / "tokenizer.json").write_text(_char_tokenizer().to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": "{{x}}"}))
    f = ss.read_model_facts(tmp_path, context_len=100)
    assert (f.max_context_tokens, f.vocab_size, f.eos_token_ids, f.eos_token, f.chat_template) == (
        100, 32, [2, 3, 4], "<eos>", "{{x}}")


def test_cli_dispatches_engine_sglang(monkeypatch, tmp_path):
    from worker import cli

    called = {}
    monkeypatch.setattr(ss, "main", lambda argv: called.setdefault("argv", argv) and 7)
    assert cli.main(["--engine", "sglang", "--model", str(tmp_path)]) == 7
    assert called["argv"] == ["--engine", "sglang", "--model", str(tmp_path)]
    args = ss.build_parser().parse_args(["--engine", "sglang", "--model", "/m", "--tp-size", "2",
                                         "--mem-fraction-static", "0.8"])
    assert ss.engine_kwargs(args) == {"model_path": "/m", "tp_size": 2, "log_level": "error",
                                      "skip_tokenizer_init": False, "enable_metrics": True, "mem_fraction_static": 0.8}
