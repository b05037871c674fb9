"""A compact Llama-family forward pass over a paged KV cache (the reference backend, CPU or CUDA).

Algorithms and their sources:
- Llama architecture: Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models";
  grouped-query attention (GQA): Ainslie et al. 2023; SwiGLU MLP: Shazeer 2020, "GLU Variants
  Improve Transformer".
- RMSNorm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".
- Rotary position embedding (RoPE): Su et al. 2021, "RoFormer"; in the "rotate half" layout of
  Hugging Face transformers' Llama. Scaling "linear" (Chen et al. 2023, position interpolation) and
  "llama3" (Meta's Llama 3.1 frequency-dependent rescaling, as in transformers'
  `_compute_llama3_parameters`).
- Paged KV cache: Kwon et al., SOSP 2023, "Efficient Memory Management for Large Language Model
  Serving with PagedAttention": the cache is a pool of fixed-size blocks; each sequence owns a
  block table mapping its logical blocks to pool blocks.
- Mixing prefill chunks and decode tokens in one step: Agrawal et al. 2024 (Sarathi-Serve,
  chunked prefill); the whole batch is flattened to one [T, hidden] matrix so each weight is
  multiplied once per layer per step (Yu et al., OSDI 2022, Orca's selective batching).

Attention: every prefill chunk runs `scaled_dot_product_attention` against its own sequence's
keys (gathered from the pool when the chunk does not start at 0); all single-token decodes of a
step run in ONE padded batched call, with the GQA query heads folded onto their KV head
(q [B, kv_heads, group, head_dim] against k [B, kv_heads, L, head_dim]) so K/V are never repeated.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ForwardItem", "ModelRunner"]


@dataclass
class ForwardItem:
    """One sequence's share of a forward step.

    token_ids: new tokens to compute (a prefill chunk, or 1 decode token).
    start_pos: position of token_ids[0] in the sequence (= tokens already in the KV cache).
    block_table: KV pool block ids covering positions [0, start_pos + len(token_ids)),
    `block_size` positions each (block_table[i] holds positions i*block_size ... +block_size-1).
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim // 2] (fp32), with optional linear / llama3 scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope scaling {kind!r} is not implemented (default, linear, llama3 are)")


def _onednn_usable() -> bool:
    if os.environ.get("FAIRSHARE_ONEDNN", "1") == "0":
        return False
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


class _Linear:
    """y = x @ W.T + b for x [T, in].

    On CPU in fp32 the weight is also packed ONCE into oneDNN's blocked layout (as torch.compile's
    CPU weight prepacking does), used when T >= 2: MKL's `F.linear` re-packs the whole weight on
    every small-batch call, and measured here (AVX2 EPYC, 1 thread, SmolLM2 decode step) the packed
    path is 1.2-1.6x faster at 2-32 rows. At T == 1 (a GEMV) the plain weight streams faster, so it
    is kept as well (this doubles weight memory on CPU). Elsewhere: plain `F.linear`.
    """

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool) -> None:
        self.weight, self.bias, self.packed = weight, bias, None
        if prepack:
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
                probe = torch.linspace(-1, 1, 3 * weight.shape[1], dtype=weight.dtype).view(3, -1)
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
                if torch.allclose(got, F.linear(probe, weight, bias), atol=1e-3, rtol=1e-3):
                    self.packed = packed
            except (RuntimeError, NotImplementedError):  # pragma: no cover - builds without oneDNN ops
                pass

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] > 1:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class _Layer:
    """Weights of one decoder layer: norms, and fused projections qkv [(H+2K)*D -> hidden],
    o, gate_up [2I <- hidden], down."""

    __slots__ = ("ln1", "qkv", "o", "ln2", "gate_up", "down")


class ModelRunner:
    """Runs a `worker.models.LoadedModel` over a paged KV cache.

    KV cache: one tensor [num_layers, 2 (k, v), num_kv_blocks, block_size, num_kv_heads, head_dim]
    in `dtype`, allocated at construction. device: "cpu" or "cuda[:n]". dtype: weights, activations
    and cache; default float32 on CPU and bfloat16 on CUDA. Logits are always returned as float32.
    Not thread-safe: one forward at a time.
    """

    def __init__(self, model, num_kv_blocks: int, block_size: int = 16, device: str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        if num_kv_blocks < 1 or block_size < 1:
            raise ValueError("num_kv_blocks and block_size must be >= 1")
        if not model.state_dict:
            raise ValueError(f"model {model.name!r} was loaded without weights")
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        cfg = model.config
        self.config = cfg
        self.block_size = int(block_size)
        self.num_kv_blocks = int(num_kv_blocks)
        self.vocab_size = int(cfg.vocab_size)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.group = self.num_heads // self.num_kv_heads
        self.eps = cfg.rms_norm_eps
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.max_positions = int(model.max_context_tokens)

        sd = model.state_dict

        def w(name: str) -> torch.Tensor:
            return sd[name].to(device=self.device, dtype=self.dtype)

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in sd else None

        def cat(names: list[str]) -> torch.Tensor | None:
            if not any(n in sd for n in names):
                return None
            parts = [w(n) if n in sd else torch.zeros(sd[n.replace(".bias", ".weight")].shape[0],
                                                       device=self.device, dtype=self.dtype) for n in names]
            return torch.cat(parts, 0).contiguous()

        with torch.inference_mode():
            pack = self.device.type == "cpu" and self.dtype == torch.float32 and _onednn_usable()
            self.embed = w("model.embed_tokens.weight")
            head = self.embed if "lm_head.weight" not in sd else w("lm_head.weight")
            self.lm_head = _Linear(head, None, pack)
            self.norm = w("model.norm.weight")
            self.layers: list[_Layer] = []
            for i in range(cfg.num_layers):
                p = f"model.layers.{i}."
                a, m = p + "self_attn.", p + "mlp."
                layer = _Layer()
                layer.ln1 = w(p + "input_layernorm.weight")
                layer.ln2 = w(p + "post_attention_layernorm.weight")
                layer.qkv = _Linear(cat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                                    cat([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]), pack)
                layer.o = _Linear(w(a + "o_proj.weight"), opt(a + "o_proj.bias"), pack)
                layer.gate_up = _Linear(cat([m + "gate_proj.weight", m + "up_proj.weight"]),
                                        cat([m + "gate_proj.bias", m + "up_proj.bias"]), pack)
                layer.down = _Linear(w(m + "down_proj.weight"), opt(m + "down_proj.bias"), pack)
                self.layers.append(layer)
            self.onednn = self.lm_head.packed is not None
            inv = rope_inv_freq(self.head_dim, cfg.rope_theta, cfg.rope_scaling)
            freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]: HF "rotate half" layout
            self.cos = emb.cos().to(device=self.device, dtype=self.dtype)
            self.sin = emb.sin().to(device=self.device, dtype=self.dtype)
        # a normal tensor (not an inference tensor), so callers may also copy/clear blocks
        self.kv_cache = torch.zeros(cfg.num_layers, 2, self.num_kv_blocks, self.block_size,
                                    self.num_kv_heads, self.head_dim, device=self.device, dtype=self.dtype)
        self.intermediate = cfg.intermediate_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype | None) -> int:
        """Bytes one KV block takes across all layers (K and V). dtype None means float32 (the CPU
        default; an upper bound for bfloat16 on CUDA)."""
        cfg = model.config
        elem = torch.empty((), dtype=dtype or torch.float32).element_size()
        return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem

    # ------------------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm (Zhang & Sennrich 2019), computed in fp32 as HF Llama does."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by position (Su et al. 2021): x*cos + rotate_half(x)*sin."""
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def _validate(self, items: list[ForwardItem]) -> None:
        """Cheap host-side checks, so a bad item raises ValueError instead of a device-side assert."""
        for it in items:
            n = len(it.token_ids)
            if n == 0:
                raise ValueError("a ForwardItem has no tokens")
            end = it.start_pos + n
            if it.start_pos < 0 or end > self.max_positions:
                raise ValueError(f"positions [{it.start_pos}, {end}) exceed the model's {self.max_positions}")
            used = it.block_table[: -(-end // self.block_size)]
            if len(used) * self.block_size < end:
                raise ValueError(f"block_table of {len(it.block_table)} blocks cannot hold {end} positions")
            if min(used) < 0 or max(used) >= self.num_kv_blocks:
                raise ValueError(f"block ids must be in [0, {self.num_kv_blocks})")
            if min(it.token_ids) < 0 or max(it.token_ids) >= self.embed.shape[0]:
                raise ValueError(f"token ids must be in [0, {self.embed.shape[0]})")

    def forward(self, items: list[ForwardItem]) -> torch.Tensor:
        """Compute the items' tokens, write their K/V into the paged cache and return the float32
        logits of the LAST token of each item: shape [len(items), vocab_size] (on `self.device`).

        Token j of an item sits at position start_pos + j and attends to positions 0..that of its
        own sequence; positions before start_pos are read from the cache (they must have been
        computed by earlier calls with the same blocks). Raises ValueError on malformed items.
        """
        if not items:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        self._validate(items)
        with torch.inference_mode():
            logits = self._forward(items)
        return logits.clone()  # a normal tensor: callers may modify it in place outside inference mode

    def _forward(self, items: list[ForwardItem]) -> torch.Tensor:
        dev, bs = self.device, self.block_size
        H, K, D, G = self.num_heads, self.num_kv_heads, self.head_dim, self.group

        # ---- flatten the batch, decodes first: rows [0, B) are the B decode tokens, then each
        # prefill chunk is a contiguous run of rows; attention outputs concatenate in that order ----
        order = sorted(range(len(items)), key=lambda i: len(items[i].token_ids) > 1)  # stable
        dec = [items[i] for i in order if len(items[i].token_ids) == 1]
        pre = [items[i] for i in order if len(items[i].token_ids) > 1]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last_row = [0] * len(items)
        for i in order:
            it = items[i]
            n, s = len(it.token_ids), it.start_pos
            ids.extend(it.token_ids)
            r = range(s, s + n)
            pos.extend(r)
            bt = it.block_table
            slots.extend(bt[p // bs] * bs + p % bs for p in r)
            last_row[i] = len(ids) - 1
        rows_out = torch.tensor(last_row, dtype=torch.long, device=dev)
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        slots_t = torch.tensor(slots, dtype=torch.long, device=dev)
        cos = self.cos.index_select(0, pos_t).unsqueeze(1)  # [T, 1, D]
        sin = self.sin.index_select(0, pos_t).unsqueeze(1)

        # ---- attention plan (shared by all layers) ----
        B = len(dec)
        dec_idx = dec_mask = None
        if B:
            lens = [it.start_pos + 1 for it in dec]
            lmax = max(lens)
            nblk = (lmax + bs - 1) // bs
            bt = torch.tensor([it.block_table[:nblk] + [0] * (nblk - min(nblk, len(it.block_table))) for it in dec],
                              dtype=torch.long, device=dev)  # [B, nblk]
            p = torch.arange(lmax, device=dev)
            dec_idx = (bt[:, p // bs] * bs + p % bs).flatten()  # [B*Lmax] pool slots (padding -> block 0, masked)
            if min(lens) < lmax:
                dec_mask = (p[None, :] < torch.tensor(lens, device=dev)[:, None])[:, None, None, :]  # [B,1,1,L]
        pre_plan = []  # (first row, n, pool slots of positions [0, end) or None, mask or None)
        row = B
        for it in pre:
            n, s = len(it.token_ids), it.start_pos
            if s == 0:  # a whole prompt / first chunk: attend within the chunk, causal
                pre_plan.append((row, n, None, None))
            else:       # a later chunk: read the earlier positions from the pool
                end = s + n
                nblk = (end + bs - 1) // bs
                bt = torch.tensor(it.block_table[:nblk], dtype=torch.long, device=dev)
                p = torch.arange(end, device=dev)
                mask = p[None, :] <= torch.arange(s, end, device=dev)[:, None]  # [n, end]
                pre_plan.append((row, n, bt[p // bs] * bs + p % bs, mask))
            row += n

        x = self.embed.index_select(0, ids_t)  # [T, hidden]
        T = x.shape[0]
        qk_end = self.q_size + self.kv_size
        for li, layer in enumerate(self.layers):
            h = self._rms(x, layer.ln1)
            qkv = layer.qkv(h)
            qk = self._rope(qkv[:, :qk_end].view(T, H + K, D), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, qk_end:].view(T, K, D)
            kc = self.kv_cache[li, 0].view(-1, K, D)
            vc = self.kv_cache[li, 1].view(-1, K, D)
            kc.index_copy_(0, slots_t, k)
            vc.index_copy_(0, slots_t, v)

            outs = []
            if B:
                # GQA without repeating K/V: the G query heads of a KV head act as G "query rows"
                qd = q[:B].reshape(B, K, G, D)
                # (index_select is ~5x faster than advanced indexing for these row gathers)
                kd = kc.index_select(0, dec_idx).view(B, -1, K, D).transpose(1, 2)  # [B, K, L, D]
                vd = vc.index_select(0, dec_idx).view(B, -1, K, D).transpose(1, 2)
                od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dec_mask, scale=self.scale)
                outs.append(od.reshape(B, H * D))
            for start, n, gather, mask in pre_plan:
                qp = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
                if gather is None:
                    kp = k[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, K, n, D]
                    vp = v[start:start + n].transpose(0, 1).unsqueeze(0)
                    op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale,
                                                        enable_gqa=G > 1)
                else:
                    kp = kc.index_select(0, gather).transpose(0, 1).unsqueeze(0)  # [1, K, end, D]
                    vp = vc.index_select(0, gather).transpose(0, 1).unsqueeze(0)
                    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=self.scale,
                                                        enable_gqa=G > 1)
                outs.append(op[0].transpose(0, 1).reshape(n, H * D))
            attn = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
            x = x + layer.o(attn)

            h = self._rms(x, layer.ln2)
            gu = layer.gate_up(h)
            x = x + layer.down(F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate:])

        last = x.index_select(0, rows_out)
        return self.lm_head(self._rms(last, self.norm)).float()
