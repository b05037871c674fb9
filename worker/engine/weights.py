"""Weight formats of the reference runner and the linear layers over them.

`dtype` is the activation and KV-cache dtype; `quantization` the format of the linear layers'
weights. Each weight is held ONCE, in the format its kernel reads (fused q/k/v and gate/up
projections are built once in that format; nothing else is kept beside them):

| quantization | weight bytes / parameter | layout | kernel |
|---|---:|---|---|
| none, float32 | 4 | oneDNN-prepacked on CPU (as torch.compile's CPU weight prepacking), plain on CUDA | `mkldnn._linear_pointwise` / `F.linear` |
| none, bfloat16 | 2 | same | same |
| int8 | 1 + 2 per row | int8, one symmetric scale per output row | `aten._weight_int8pack_mm` |
| int4 | 0.5 + 4 / 32 | 4-bit codes, groups of 32 inputs with a scale and a zero each | `aten._weight_int4pack_mm_for_cpu` |

The quantized kernels are weight-only: activations stay bfloat16 (these kernels have no fast
float32 path: measured here 20-100x slower), products accumulate in fp32.

int4 follows the "tinygemm" convention of those kernels, w = (q - 8) * scale + zero, q in 0..15.
GGUF Q4_1 blocks (32 weights, w = d * q + m; ggml-org/ggml `block_q4_1`) map onto it exactly
with scale = d and zero = m + 8 d, so the default model's 4-bit weights are repacked, not
re-quantized (d and m are stored as bfloat16: a relative change of at most 2^-9 per scale).
Dense or other sources are quantized by round-to-nearest: int4 per group of 32 from the group's
min and max, int8 per row from the row's largest magnitude (Dettmers et al. 2022,
"LLM.int8()", absmax quantization; Frantar et al. 2022, GPTQ, for the group-wise int4 layout).

The embedding keeps the checkpoint's rows (GGUF blocks stay blocks; gathered rows are dequantized)
and the LM head is dense in the activation dtype, prepacked on CPU (see `make_embedding`): a packed
layout cannot be gathered, and the plain GEMV is 2-3x slower (measured: 49,152 x 576 bf16 at 1 row,
3.3 ms plain vs 1.5 ms packed). A quantized LM head was measured and not taken, on SmolLM2's tied
Q8_0 table against its exact fp32 logits over 240 hidden states: int4 (groups of 32, re-quantized
from Q8_0) max |logit error| 3.76 and 67 % argmax agreement; int8 per row 0.71 and 90 %; the bf16
head 0.13 and 97 %; and at 1 row the int8 kernel is no faster than the packed bf16 GEMV here.
Greedy steps instead screen the vocabulary with a 4-bit copy and score only the best candidates
exactly (`ArgmaxHead`): the full logits are never approximate, only absent.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["WeightFormat", "resolve_format", "make_linear", "Embedding", "make_embedding", "ArgmaxHead",
           "make_argmax_head", "QUANTIZATIONS", "DTYPES", "cpu_has_bf16", "weight_bytes"]

QUANTIZATIONS = ("auto", "none", "int8", "int4")
DTYPES = ("auto", "float32", "bfloat16")
GROUP = 32  # int4 group size along the input dimension (= GGUF's block size)


class WeightFormat(NamedTuple):
    """Resolved format: `dtype` of activations and KV cache; `quantization` "none", "int8" or "int4"."""

    dtype: torch.dtype
    quantization: str

    def describe(self) -> str:
        d = str(self.dtype).replace("torch.", "")
        return d if self.quantization == "none" else f"{self.quantization} weights, {d} activations"


def cpu_has_bf16() -> bool:
    """True when this CPU computes bfloat16 natively (AVX512-BF16 or AMX), per /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def _source_quantization(state_dict) -> str:
    """The format a checkpoint ships in: int4 for 4-bit blocks, int8 for 8-bit blocks, else none."""
    kinds = {getattr(v, "kind", None) for v in state_dict.values()}
    if "q4_1" in kinds:
        return "int4"
    if "q8_0" in kinds:
        return "int8"
    return "none"


def resolve_format(state_dict, device: torch.device, dtype: str | torch.dtype | None = "auto",
                   quantization: str | None = "auto") -> WeightFormat:
    """Pick the format. `quantization="auto"` runs the weights as the checkpoint ships them (GGUF
    4-bit blocks -> int4, 8-bit -> int8, dense -> none): never less precise than the file, and the
    fewest bytes per token. `dtype="auto"`: bfloat16 on CUDA and with quantized weights (the CPU kernels
    take bf16 activations), and for bf16-stored weights on a CPU with native bf16; float32 otherwise. On CUDA only "none" is offered
    (the int4/int8 kernels used here are CPU kernels). dtype=None means "auto".

    Raises ValueError for an unknown name, a quantization on CUDA, or int8/int4 with float32
    activations (those kernels need bfloat16).
    """
    quantization = quantization or "auto"
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    on_cuda = device.type == "cuda"
    if quantization == "auto":
        quantization = "none" if on_cuda else _source_quantization(state_dict)
    if on_cuda and quantization != "none":
        raise ValueError(f"--quantization {quantization} uses CPU kernels; on CUDA use --quantization none")
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        name = dtype or "auto"
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
        if name == "auto":
            stored_bf16 = any(getattr(v, "dtype", None) == torch.bfloat16 for v in state_dict.values())
            name = ("bfloat16" if on_cuda or quantization != "none" or (stored_bf16 and cpu_has_bf16())
                    else "float32")
        resolved = getattr(torch, name)
    if quantization != "none" and resolved != torch.bfloat16:
        raise ValueError(f"--quantization {quantization} needs --dtype bfloat16 (its CPU kernel has no fast "
                         f"float32 path)")
    return WeightFormat(resolved, quantization)


# ---------------------------------------------------------------------------------------------
# Linear layers
# ---------------------------------------------------------------------------------------------
def _onednn_usable() -> bool:
    if os.environ.get("FAIRSHARE_ONEDNN", "1") == "0":
        return False
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


class DenseLinear:
    """y = x @ W.T + b, x [T, in] in the weight's dtype. On CPU the weight is held only in oneDNN's
    blocked layout (packed once; `mkldnn._linear_pointwise`), measured 1.2-3x faster than MKL's
    `F.linear`, which re-packs the whole weight on every small-batch call; elsewhere plain."""

    __slots__ = ("weight", "bias", "packed", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias, self.packed = weight, bias, False
        self.out_features = weight.shape[0]
        if weight.device.type == "cpu" and _onednn_usable():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
                probe = torch.linspace(-1, 1, 3 * weight.shape[1], dtype=weight.dtype).view(3, -1)
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
                tol = 1e-3 if weight.dtype == torch.float32 else 3e-2
                if torch.allclose(got.float(), F.linear(probe, weight, bias).float(), atol=tol, rtol=tol):
                    self.weight, self.packed = packed, True
            except (RuntimeError, NotImplementedError):  # pragma: no cover - builds without these ops
                pass

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + _nbytes(self.bias)


class Int8Linear:
    """y = (x @ q.T) * scale + b: q int8 [out, in], scale bf16 [out]; x bf16 [T, in]."""

    __slots__ = ("q", "scale", "bias", "out_features")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.q, self.scale, self.bias = q.contiguous(), scale.to(torch.bfloat16).contiguous(), bias
        self.out_features = q.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        return self.q.numel() + _nbytes(self.scale) + _nbytes(self.bias)


class Int4Linear:
    """y = x @ W.T + b with W [out, in] held as 4-bit codes packed by
    `aten._convert_weight_to_int4pack_for_cpu` and `scale_zeros` bf16 [in / 32, out, 2];
    W[n, k] = (q[n, k] - 8) * scale[k // 32, n] + zero[k // 32, n]. x bf16 [T, in]."""

    __slots__ = ("packed", "scale_zeros", "bias", "out_features")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        """codes: [out, in] integers 0..15; scale, zero: [out, in / 32] (any float dtype)."""
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        self.scale_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.bias = bias
        self.out_features = codes.shape[0]

    @classmethod
    def stacked(cls, layers: list["Int4Linear"]) -> "Int4Linear":
        """One layer whose output rows are `layers`' rows in order (each built from a multiple of 64
        rows: the packed layout then concatenates row-wise); lets a large weight be packed in pieces."""
        out = cls.__new__(cls)
        out.packed = torch.cat([layer.packed for layer in layers])
        out.scale_zeros = torch.cat([layer.scale_zeros for layer in layers], dim=1).contiguous()
        out.bias = None
        out.out_features = sum(layer.out_features for layer in layers)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zeros)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed) + _nbytes(self.scale_zeros) + _nbytes(self.bias)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _dense(w, dtype: torch.dtype) -> torch.Tensor:
    """A source weight (tensor or `worker.models.BlockQuantized`) as a dense tensor of `dtype`."""
    if isinstance(w, torch.Tensor):
        return w.to(dtype)
    return w.dequantize(torch.float32).to(dtype)


def _int4_parts(w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes 0..15 [out, in], scale [out, in/32], zero [out, in/32]) in the tinygemm convention.

    Q4_1 blocks of 32 map exactly (scale = d, zero = m + 8 d); anything else is quantized by
    round-to-nearest per group of 32 from the group's min and max."""
    if getattr(w, "kind", None) == "q4_1" and w.group_size == GROUP:
        scale, minimum = w.scale.float(), w.minimum.float()
        return w.codes(), scale, minimum + 8 * scale
    dense = _dense(w, torch.float32)
    out, k = dense.shape
    if k % GROUP:
        raise ValueError(f"int4 needs the input size ({k}) to be a multiple of {GROUP}")
    g = dense.view(out, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).view(out, k)
    return codes, scale, lo + 8 * scale


def _int8_parts(w) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale [out]): symmetric absmax per output row."""
    dense = _dense(w, torch.float32)
    scale = (dense.abs().amax(-1) / 127).clamp_min(1e-12)
    return torch.round(dense / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def int4_shape_ok(out_features: int, in_features: int) -> bool:
    """Whether the CPU int4 kernel takes this shape (it needs out % 16 == 0 and in % 32 == 0)."""
    return out_features % 16 == 0 and in_features % GROUP == 0


def make_linear(parts: list, biases: list, fmt: WeightFormat, device: torch.device):
    """One linear layer whose output rows are `parts` stacked in order (e.g. q, k, v), built once
    in `fmt`. parts: source weights [out_i, in] (tensors or BlockQuantized); biases: a tensor or
    None per part (a missing bias of a biased layer counts as zeros). Returns a callable x -> y.
    An int4 layer whose shape the int4 kernel cannot take (`int4_shape_ok`) is built as int8."""
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(p.shape[0]) for p, b in zip(parts, biases)])
        bias = bias.to(device=device, dtype=fmt.dtype)
    quantization = fmt.quantization
    if quantization == "int4" and not int4_shape_ok(sum(p.shape[0] for p in parts), parts[0].shape[1]):
        quantization = "int8"  # the int4 kernel's shape limits; int8 has none
    if quantization == "int4":
        codes, scale, zero = zip(*(_int4_parts(p) for p in parts))
        return Int4Linear(torch.cat(codes), torch.cat(scale), torch.cat(zero), bias)
    if quantization == "int8":
        qs, scales = zip(*(_int8_parts(p) for p in parts))
        return Int8Linear(torch.cat(qs), torch.cat(scales), bias)
    weight = torch.cat([_dense(p, fmt.dtype) for p in parts]) if len(parts) > 1 else _dense(parts[0], fmt.dtype)
    return DenseLinear(weight.to(device).contiguous(), bias)


class Embedding:
    """Token embedding rows, gathered from the source's own format: GGUF blocks (dequantized per
    gathered row, exactly as the file defines them) or a dense table. `rows(ids)` -> [T, hidden]
    float32 (the residual stream's dtype)."""

    def __init__(self, source) -> None:
        self.source = source  # BlockQuantized [V, H] or a dense tensor [V, H]
        self.num_embeddings = source.shape[0]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.source, torch.Tensor):
            return self.source.index_select(0, ids).float()
        return self.source.take_rows(ids).dequantize(torch.float32)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.source) if isinstance(self.source, torch.Tensor) else int(self.source.nbytes)


def make_embedding(embed, head, fmt: WeightFormat, device: torch.device):
    """(Embedding, LM head). embed: the source embedding [V, H]; head: the source LM head, or None
    when tied to the embedding.

    The embedding keeps the source's format (GGUF blocks stay blocks; a dense table is cast to
    the activation dtype). The LM head is dense in the activation dtype, packed on CPU, in every
    format: measured on this CPU (49,152 x 576, 1 thread) bf16 packed takes 1.5 / 2.6 / 5.5 ms at
    1 / 8 / 32 rows against 1.6 / 3.7 / 15.5 ms for the int8 kernel, and it rounds each weight
    (2^-9 relative) instead of re-quantizing whole rows. A tied head is therefore a second layout
    of the embedding (a packed layout cannot be gathered)."""
    if not isinstance(embed, torch.Tensor) and device.type != "cpu":
        embed = embed.dequantize(torch.float32)  # the block gather runs on the CPU only
    if isinstance(embed, torch.Tensor):
        embed = embed.to(device=device, dtype=fmt.dtype).contiguous()
    emb = Embedding(embed)
    weight = _dense(embed if head is None else head, fmt.dtype).to(device).contiguous()
    return emb, DenseLinear(weight, None)


class ArgmaxHead:
    """The LM head for rows whose caller uses only the argmax (greedy decoding without logprobs or
    a grammar): a cheap 4-bit screen ranks the whole vocabulary, and the `candidates` it ranks
    highest are scored exactly; every other logit is -inf. Exactly as the dense head does (the same
    weights rounded to the activation dtype, fp32 accumulation, the score rounded to the activation
    dtype: only the summation order differs), so the argmax, ties included (to the lowest id), is
    the dense head's whenever the dense head's top token is among the candidates: a greedy request
    gets the same tokens whether or not it asks for logprobs.

    Screen: the tied embedding re-quantized to int4 (round-to-nearest, groups of 32, `Int4Linear`),
    a quarter of the bf16 head's bytes. Measured on SmolLM2 (49,152 x 576, 1 thread): 1.1 / 1.7 ms
    at 1 / 4 rows against 2.0 / 2.2 ms for the packed bf16 head, but 3.3 against 2.9 ms at 8 rows,
    so it serves at most `max_rows` rows. Over 200 decode states of 8 chat prompts the dense head's
    argmax ranked at most 5th in the screen (max |screen - dense| 4.7 on logits up to ~36), so 64
    candidates leave a wide margin; the exact scores of 64 rows cost ~0.05 ms.

    `__call__(h)`: h [R, hidden] in the activation dtype, R <= max_rows -> float32 [R, vocab]."""

    max_rows = 4
    candidates = 64

    def __init__(self, embedding: "Embedding", dtype: torch.dtype, chunk_rows: int = 4096) -> None:
        self.embedding, self.dtype = embedding, dtype
        src, vocab = embedding.source, embedding.num_embeddings
        # packed 4,096 rows at a time: the temporaries of a whole-table pass (fp32 copies, int32
        # codes) would add ~0.5 GB to the worker's peak for SmolLM2
        pieces = []
        for start in range(0, vocab, chunk_rows):
            rows = torch.arange(start, min(start + chunk_rows, vocab))
            part = src.index_select(0, rows) if isinstance(src, torch.Tensor) else src.take_rows(rows)
            pieces.append(Int4Linear(*_int4_parts(part), None))
        self.screen = Int4Linear.stacked(pieces)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        rows, hidden = h.shape
        top = self.screen(h.to(torch.bfloat16)).topk(self.candidates, dim=-1).indices  # [R, k]
        w = self.embedding.rows(top.flatten()).to(self.dtype).float().view(rows, self.candidates, hidden)
        # rounded to the activation dtype as the dense head's output is, so ties break the same way
        exact = torch.bmm(w, h.float().unsqueeze(-1)).squeeze(-1).to(self.dtype).float()  # [R, k]
        out = torch.full((rows, self.embedding.num_embeddings), float("-inf"), dtype=torch.float32, device=h.device)
        return out.scatter_(1, top, exact)

    @property
    def nbytes(self) -> int:
        return self.screen.nbytes


def make_argmax_head(embedding: "Embedding", tied: bool, fmt: WeightFormat, device: torch.device) -> ArgmaxHead | None:
    """An `ArgmaxHead` over a tied LM head on the CPU (the exact rows are gathered from the embedding,
    so an untied head would need a second, gatherable copy), or None when it does not apply."""
    vocab, hidden = embedding.source.shape
    if not tied or device.type != "cpu" or vocab <= ArgmaxHead.candidates or not int4_shape_ok(vocab, hidden):
        return None
    return ArgmaxHead(embedding, fmt.dtype)


def weight_bytes(layer) -> int:
    """Bytes a layer's weights take (what one forward step reads once)."""
    return int(layer.nbytes)
