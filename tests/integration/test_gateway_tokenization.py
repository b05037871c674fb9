"""The gateway's tokenizing (tokenizers + sandboxed Jinja, no torch) equals Hugging Face's
`apply_chat_template` on the tokenizer and template the worker serves."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import grpc
import pytest
from hypothesis import example, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from fairshare.v1 import worker_pb2 as pb
from fairshare.v1 import worker_pb2_grpc as pb_grpc
from gateway.tokenization import ChatTokenizer, PromptTooLong, TemplateError, TokenizerFiles, compile_chat_template

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Bonjour, ça va ? 你好，世界 🌍🚀"},
     {"role": "assistant", "content": "Très bien."}, {"role": "user", "content": "  spaces\n\nand lines  "}],
    [{"role": "user", "content": "<|im_start|> literal special text"}],
]


@pytest.fixture(scope="module")
def info(worker_addr) -> pb.ModelInfo:
    with grpc.insecure_channel(worker_addr, options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
        return pb_grpc.WorkerStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)


@pytest.fixture(scope="module")
def real_tokenizer(info) -> ChatTokenizer:
    return ChatTokenizer(TokenizerFiles(info.tokenizer_json, info.chat_template, info.bos_token, info.eos_token))


def test_matches_hf_apply_chat_template(info):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(info.tokenizer_json),
                                 bos_token=info.bos_token, eos_token=info.eos_token)
    hf.chat_template = info.chat_template
    ours = ChatTokenizer(TokenizerFiles(info.tokenizer_json, info.chat_template, info.bos_token, info.eos_token))
    for conv in CONVERSATIONS:
        text = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        assert ours.render_chat(conv) == text
        ids = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ours.encode_chat(conv) == list(ids)
    assert ours.encode_text("Once upon a time") == hf("Once upon a time")["input_ids"]


LONG_RUNS = [" " * 500, "\n" + " " * 300, "\t" * 200, "\n" * 200, "<|im_start|>" * 40, "<|im_end|>\n" * 30,
             "a" * 400, "🚀" * 100, "你好" * 150, "def f(x):\n    return x  # " * 20, "\u200b" * 50, "é" * 300]


@hyp_settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=80), st.sampled_from(LONG_RUNS)), max_size=6).map("".join))
@example("\x16")  # a byte SmolLM2's vocabulary has no symbol for: encoded to no token (found by this test)
@example("\x04\x06\x13\x14\x16\x1d" * 50 + "\U00040000\U00080000")  # every such byte of valid UTF-8
def test_min_tokens_never_exceeds_the_real_encoding(real_tokenizer, text):
    """The length bound the gateway refuses over-context prompts with is a lower bound of the real
    SmolLM2 tokenizer's count, for raw text and for the rendered chat (code, CJK, emoji, whitespace runs,
    special-token text, zero-width characters)."""
    tok = real_tokenizer
    assert tok.min_tokens(text) <= len(tok.encode_text(text))
    rendered = tok.render_chat([{"role": "user", "content": text}])
    assert tok.min_tokens(rendered) <= len(tok.encode_chat([{"role": "user", "content": text}]))


def test_min_tokens_is_tight_enough_to_matter_and_refuses_before_encoding(real_tokenizer):
    tok = real_tokenizer
    assert tok.max_token_bytes == 81  # SmolLM2's longest token: a newline and 80 spaces (byte-level)
    text = "word " * 400_000  # 2 MB
    assert tok.min_tokens(text) == -(-len(text) // 81)
    with pytest.raises(PromptTooLong) as e:
        tok.encode_text(text, limit=2047)
    assert e.value.at_least == tok.min_tokens(text) and e.value.limit == 2047
    assert tok.encode_text("word " * 100, limit=2047) == tok.encode_text("word " * 100)  # under it: encoded as usual


def test_bytes_the_vocabulary_cannot_encode_are_not_counted(real_tokenizer):
    """SmolLM2's byte-level BPE has no unknown token and no symbol for 21 byte values: text made of
    them encodes to nothing, so the bound counts only the bytes a token can stand for."""
    tok = real_tokenizer
    assert list(tok.dropped_bytes) == [4, 6, 19, 20, 22, 29, 192, 193, 241, 242, *range(245, 256)]
    assert tok.encode_text("\x16" * 5000) == [] and tok.min_tokens("\x16" * 5000) == 0
    text = "\x16" * 5000 + "word " * 1000
    assert tok.min_tokens(text) == -(-len("word " * 1000) // 81) <= len(tok.encode_text(text))


def test_no_bound_when_the_model_may_drop_characters_unseen():
    """A BPE that is not byte-level, without an unknown token or byte fallback, drops characters it has
    no symbol for (which cannot be listed): no bound. With an unknown token, every character counts."""
    spec = json.loads(WORD_LEVEL_JSON)
    spec["model"] = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": {"a": 0}, "merges": []}
    tok = ChatTokenizer(TokenizerFiles(json.dumps(spec), ""))
    assert tok.encode_text("b " * 5000) == []
    assert tok.dropped_bytes is None and tok.min_tokens("b " * 5000) == 0
    assert ChatTokenizer(TokenizerFiles(WORD_LEVEL_JSON, "")).dropped_bytes == b""


def test_no_bound_when_a_normalizer_may_shorten_the_text():
    spec = json.loads(WORD_LEVEL_JSON)
    spec["normalizer"] = {"type": "Strip", "strip_left": True, "strip_right": True}
    tok = ChatTokenizer(TokenizerFiles(json.dumps(spec), ""))
    assert tok.min_tokens("a" + " " * 10_000) == 0
    assert tok.encode_text(" " * 10_000 + "a", limit=1) == [1]


def test_sha_agrees_with_worker(info):
    files = TokenizerFiles(info.tokenizer_json, info.chat_template)
    assert info.tokenizer_sha256 in files.sha256_variants()


WORD_LEVEL_JSON = '{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,' \
                  '"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,' \
                  '"model":{"type":"WordLevel","vocab":{"[UNK]":0,"a":1},"unk_token":"[UNK]"}}'


def test_template_sandbox_and_errors():
    t = compile_chat_template("{{ raise_exception('roles must alternate') }}")
    tok_json = WORD_LEVEL_JSON
    tok = ChatTokenizer(TokenizerFiles(tok_json, "{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(TemplateError, match="roles must alternate"):
        tok.render_chat([{"role": "user", "content": "a"}])
    evil = ChatTokenizer(TokenizerFiles(tok_json, "{{ messages.__class__.__mro__ }}"))
    with pytest.raises(TemplateError):  # the sandbox refuses attribute escapes
        evil.render_chat([{"role": "user", "content": "a"}])
    gen = ChatTokenizer(TokenizerFiles(tok_json, "{% for m in messages %}{% generation %}{{ m.content }}"
                                                 "{% endgeneration %}{% endfor %}{{ messages | tojson }}"))
    assert gen.render_chat([{"role": "user", "content": "é<"}]) == 'é<[{"role": "user", "content": "é<"}]'
    assert t is not None


def test_gateway_never_imports_torch():
    code = ("import sys, gateway.app, gateway.cli, loadtests.bench.gateway, gateway.serve, fairshare.config;"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_encoding_a_huge_prompt_lets_other_threads_run(kind):
    """A megabyte prompt is encoded without holding the GIL: the gateway encodes large bodies on a
    thread, and an encoder that kept the GIL would stop its event loop (every other tenant's streams)
    for the seconds the encoding takes. By construction: a thread encodes the prompt twice while this
    one keeps taking timestamps; while an encoding holds the GIL this thread cannot take any, so each
    encoding's middle third must hold some of them (an encoding takes ~0.3 s of CPU here, thousands
    of scheduler slices, whatever the load)."""
    tok = ChatTokenizer(TokenizerFiles(WORD_LEVEL_JSON, "{% for m in messages %}{{ m.content }}{% endfor %}"))
    text = "a " * 300_000
    windows: list[tuple[float, float]] = []
    lengths: list[int] = []

    def encode() -> None:
        for _ in range(2):
            start = time.perf_counter()
            ids = tok.encode_chat([{"role": "user", "content": text}]) if kind == "chat" else tok.encode_text(text)
            windows.append((start, time.perf_counter()))
            lengths.append(len(ids))

    worker = threading.Thread(target=encode)
    samples: list[float] = []
    worker.start()
    while worker.is_alive():
        samples.append(time.perf_counter())
    worker.join()
    assert lengths == [300_000, 300_000]
    for i, (start, end) in enumerate(windows):
        third = (end - start) / 3
        inside = sum(1 for t in samples if start + third < t < end - third)
        assert inside > 0, (f"encoding {i + 1} ({end - start:.2f} s) held the GIL: this thread took no "
                            f"timestamp in its middle third")


def test_tokenizer_digest_is_computed_once(monkeypatch):
    """`system_fingerprint` names the tokenizer's sha256 in every response: it is computed once per
    tokenizer, not per response (SmolLM2's tokenizer JSON is 3.4 MB, ~8 ms of hashing)."""
    import gateway.tokenization as tokenization

    calls = []
    real = tokenization.tokenizer_sha256
    monkeypatch.setattr(tokenization, "tokenizer_sha256", lambda *a: calls.append(1) or real(*a))
    files = TokenizerFiles(WORD_LEVEL_JSON, "{{ messages[0]['content'] }}")
    tok = ChatTokenizer(files)
    digests = {tok.sha256 for _ in range(100)}
    assert digests == {real(WORD_LEVEL_JSON, "{{ messages[0]['content'] }}")} and len(calls) == 1
