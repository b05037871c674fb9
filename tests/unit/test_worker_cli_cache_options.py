"""`fairshare worker` prefix-cache flags: bad values are argparse errors (exit 2, one `error:` line,
no traceback); the public prefix file is checked against the model's tokenizer and vocabulary, so a
prefix that could never be shared is refused (or, shorter than one block, warned about)."""

from __future__ import annotations

import json
import logging

import pytest

from worker.cli import build_parser
from worker.cache.options import cache_settings, load_public_prefixes
from worker.models import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("random-tiny", load_weights=False)


def settings(tiny, tmp_path, content, *argv):
    f = tmp_path / "public.json"
    f.write_text(content if isinstance(content, str) else json.dumps(content))
    p = build_parser()
    args = p.parse_args(["--public-prefix-file", str(f), *argv])
    return cache_settings(p, args, tiny.tokenizer, tiny.config.vocab_size)


@pytest.mark.parametrize("content,message", [
    ("{bad json", "--public-prefix-file: Expecting property name"),
    ({"a": 1}, "must hold a JSON list"),
    ([[1, -2]], "public prefix #0 is neither"),
    ([[]], "public prefix #0 is neither"),
    (["ok text", ""], "public prefix #1 encodes to zero tokens"),
    ([[1, 2], [5, 10**9]], "public prefix #1 has token id 1000000000, not below the model's vocabulary size"),
])
def test_bad_public_prefix_file_is_an_argparse_error(tiny, tmp_path, content, message, capsys):
    with pytest.raises(SystemExit) as exc:
        settings(tiny, tmp_path, content)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_public_prefix_file_is_an_argparse_error(capsys):
    p = build_parser()
    with pytest.raises(SystemExit) as exc:
        cache_settings(p, p.parse_args(["--public-prefix-file", "/nonexistent/public.json"]))
    assert exc.value.code == 2 and "No such file" in capsys.readouterr().err


def test_good_public_prefixes_load_and_a_short_one_is_warned_about(tiny, tmp_path, caplog):
    vocab = tiny.config.vocab_size
    long_ids = list(range(40))
    with caplog.at_level(logging.WARNING, logger="fairshare.worker"):
        s = settings(tiny, tmp_path, [long_ids, [vocab - 1] * 3, "You are a helpful assistant."], "--block-size", "16")
    short_text = list(tiny.tokenizer.encode("You are a helpful assistant.", add_special_tokens=False).ids)
    assert s["public_prefixes"] == [long_ids, [vocab - 1] * 3, short_text]
    warned = [r.getMessage() for r in caplog.records if "shorter than one KV block" in r.getMessage()]
    assert len(warned) == 2 and warned[0].startswith("public prefix #1 is 3 token(s)")
    assert load_public_prefixes(tmp_path / "public.json", tiny.tokenizer) == s["public_prefixes"]
