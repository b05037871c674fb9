"""Incremental detokenization (case OA2's kind: no broken multi-byte characters) and stop strings."""

import pytest

from worker.engine.detokenizer import IncrementalDetokenizer, stop_string_holdback

TEXTS = [
    "东京是日本的首都。北京是中国的首都。",
    "Emoji: 😀👍🏽🚀 — and a family 👨‍👩‍👧‍👦!",
    "Ünïcödé façade, naïve café; Ελληνικά; русский; العربية; हिन्दी",
    " leading space and  double  spaces\nnew line\ttab",
]


@pytest.fixture(scope="module")
def tokenizer():
    from worker.models import load_model

    return load_model("random-tiny").tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_case_oa2_stream_deltas_concatenate_to_full_text_without_replacement_chars(tokenizer, text):
    prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > 3
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    # some token really does split a character (otherwise this test would prove nothing)
    assert any(d == "" for d in deltas[:-1]) or text.isascii()


def test_skipped_ids_render_nothing(tokenizer):
    eos = tokenizer.token_to_id("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, [1, 2], skip_token_ids={eos})
    assert detok.add(eos) == ""


def test_stop_string_holdback():
    assert stop_string_holdback("hello wor", ["world"]) == 3
    assert stop_string_holdback("hello", ["xyz"]) == 0
    assert stop_string_holdback("ab", ["abc", "b"]) == 2
    assert stop_string_holdback("", ["abc"]) == 0
