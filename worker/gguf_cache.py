"""Converting a Llama-family GGUF file into FairShare's model cache (a Hugging Face layout).

Libraries do the reading: the `gguf` package's `GGUFReader` reads the tensors (format:
ggml-org/ggml docs/gguf.md), and transformers builds the config (`AutoConfig`, its GGUF mapping)
and the tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, saved as
`tokenizer.json`). Ours are the naming of tensors, the storage of their blocks, and one fix where
transformers is measurably wrong: it has no rule for llama.cpp's "smollm" pre-tokenizer (digits
split off first), so it tokenizes digits after whitespace unlike llama.cpp and the original
SmolLM2 tokenizer (`_DIGITS_FIRST`).

- Q4_1 and Q8_0 tensors stay in their blocks (`worker.models.BlockQuantized`), so the runner can
  repack the 4-bit weights for its int4 kernel instead of dequantizing them; F32/F16/BF16 tensors
  are kept as they are; any other block type is dequantized to fp32 with `gguf.quants.dequantize`.
- q/k rows are un-permuted as transformers' GGUF loader does (llama.cpp's converter interleaves the
  two rotary halves of each head); a row permutation keeps the blocks (they run along a row).

Measured on this 2-core machine for SmolLM2-135M (98 MB file): reader ~2 s, config ~3 s,
tokenizer ~3 s; once per cache directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["convert_gguf", "write_config", "write_tokenizer", "gguf_tensor", "gguf_pre_tokenizer", "GGUF_TO_HF"]

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_TO_HF = {"layers": _LAYER_NAMES, "top": _TOP_NAMES}


def _hf_name(name: str) -> str:
    """GGUF tensor name (llama.cpp's standard names) -> HF Llama parameter name. Raises ValueError."""
    base, _, suffix = name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no Llama equivalent")


def gguf_tensor(t):
    """One `gguf.ReaderTensor` as a torch tensor [out, in] (or [n]) or a `BlockQuantized`."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    from worker.models import BlockQuantized

    shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists the innermost dimension first
    qtype = Q(int(t.tensor_type))
    if qtype in (Q.F32, Q.F16):
        return torch.from_numpy(np.array(t.data).reshape(shape)).float()
    if qtype == Q.BF16:
        return torch.from_numpy(np.array(t.data).reshape(shape)).view(torch.bfloat16)
    raw = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(shape[0], -1)
    if qtype == Q.Q4_1:  # per 32 weights: fp16 d, fp16 m, 16 bytes (weights j and j+16 in byte j)
        blocks = raw.view(shape[0], -1, 20)
        d, m, qs = blocks[..., 0:2], blocks[..., 2:4], blocks[..., 4:]
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(shape)  # ggml order within the block
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        return BlockQuantized("q4_1", packed.contiguous(), d.contiguous().view(torch.float16).squeeze(-1),
                              m.contiguous().view(torch.float16).squeeze(-1), 32)
    if qtype == Q.Q8_0:  # per 32 weights: fp16 d, 32 int8
        blocks = raw.view(shape[0], -1, 34)
        d, qs = blocks[..., 0:2], blocks[..., 2:]
        return BlockQuantized("q8_0", qs.contiguous().view(torch.int8).reshape(shape),
                              d.contiguous().view(torch.float16).squeeze(-1), None, 32)
    return torch.from_numpy(np.ascontiguousarray(dequantize(t.data, qtype), dtype=np.float32)).reshape(shape)


def _unpermute_rows(w, n_head: int):
    """Undo llama.cpp's q/k row permutation (as transformers' GGUF loader does): within each head,
    GGUF row 2i+j (j in {0, 1}) is HF row j*half + i."""
    import torch

    rows = w.shape[0]
    half = rows // n_head // 2
    index = torch.arange(rows).view(n_head, half, 2).transpose(1, 2).reshape(-1)
    return w.take_rows(index) if hasattr(w, "take_rows") else w[index].contiguous()


def write_config(gguf_path: Path, out: Path) -> dict:
    """config.json and generation_config.json as transformers builds them from the GGUF metadata
    (`AutoConfig.from_pretrained(dir, gguf_file=...)`); returns the config dict."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    d = cfg.to_dict()
    for key in ("_name_or_path", "_model_name_or_path", "transformers_version"):
        d.pop(key, None)
    d["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(d["model_type"], "LlamaForCausalLM")]
    (out / "config.json").write_text(json.dumps(d, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {k: d.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}, indent=2))
    return d


def convert_gguf(gguf_path: Path, out: Path, progress: bool = True) -> None:
    """Write config.json, generation_config.json, model.safetensors (GGUF blocks kept, HF names)
    and the tokenizer files for `gguf_path` into the directory `out`. Raises ValueError for a
    tensor without a Llama equivalent or an architecture the runner lacks."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    from worker.models import ModelConfig

    config = ModelConfig.from_hf_dict(write_config(gguf_path, out))  # raises for architectures we lack
    reader = GGUFReader(gguf_path)
    flat = {}
    try:
        from tqdm import tqdm
        tensors = tqdm(reader.tensors, desc="fairshare: reading GGUF", unit="tensor", file=sys.stderr,
                       disable=not progress)
    except ImportError:  # pragma: no cover - tqdm is a worker dependency
        tensors = reader.tensors
    for t in tensors:
        name = _hf_name(t.name)
        w = gguf_tensor(t)
        if ".self_attn.q_proj." in name:
            w = _unpermute_rows(w, config.num_heads)
        elif ".self_attn.k_proj." in name:
            w = _unpermute_rows(w, config.num_kv_heads)
        flat.update(w.to_tensors(name) if hasattr(w, "to_tensors") else {name: w})
    pre = gguf_pre_tokenizer(gguf_path, reader)
    del reader
    save_file(flat, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(gguf_path, out, config.max_position_embeddings, pre)


# GGUF pre-tokenizer names (`tokenizer.ggml.pre`) that transformers' GGUF tokenizer builder does not
# map, so it falls back to GPT-2's regex, and the rule llama.cpp applies for them (llama-vocab.cpp:
# the regexes "\\p{N}" then GPT-2's, i.e. every digit split off alone first). For SmolLM2 ("smollm")
# this is also what its original tokenizer.json does. Without it, 377 of the 2,400 test strings
# (all with digits next to whitespace, e.g. "\n 1e-9", "   12345", "\r\n2397") tokenize differently.
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "codeshell")


def _pre_tokenizer_fix(pre: str | None, backend) -> bool:
    """Put llama.cpp's rule for `pre` in front of the backend tokenizer's pre-tokenizer when
    transformers lacks it. Returns whether anything changed."""
    from tokenizers import pre_tokenizers

    if pre not in _DIGITS_FIRST:
        return False
    current = backend.pre_tokenizer
    if "Digits" in repr(current):  # a transformers version that already does it
        return False
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), current])
    return True


def gguf_pre_tokenizer(gguf_path: Path, reader=None) -> str | None:
    """The file's `tokenizer.ggml.pre` (llama.cpp's pre-tokenizer name), or None. reader: a
    `gguf.GGUFReader` already open on the file. Without one, transformers' metadata-only reader
    (`transformers.integrations.gguf.read_gguf_metadata`: 0.04 s for SmolLM2's file, against 6.3 s
    for a `GGUFReader`, which parses the 49,152-token vocabulary element by element) where this
    transformers has it, else a `GGUFReader`."""
    if reader is None:
        try:
            from transformers.integrations.gguf import read_gguf_metadata
        except ImportError:  # an older transformers
            from gguf import GGUFReader

            reader = GGUFReader(gguf_path)
        else:
            pre = read_gguf_metadata(str(gguf_path))[0].get("tokenizer.ggml.pre")
            return None if pre is None else str(pre)
    field = reader.fields.get("tokenizer.ggml.pre")
    return None if field is None else str(field.contents())


def write_tokenizer(gguf_path: Path, out: Path, model_max_length: int | None = None,
                    pre_tokenizer: str | None = None) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja, as transformers builds them
    from the GGUF metadata (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, then
    `save_pretrained`), with llama.cpp's pre-tokenizer rule where transformers lacks the file's
    (`_DIGITS_FIRST`). pre_tokenizer: the file's `tokenizer.ggml.pre` when the caller has read it.
    Checked token for token in tests/unit/test_models.py."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    _pre_tokenizer_fix(pre_tokenizer or gguf_pre_tokenizer(gguf_path), tok.backend_tokenizer)
    if model_max_length:
        tok.model_max_length = model_max_length
    tok.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only", "name_or_path"):  # where it was read from: not a property
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
