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

from fairshare.checks import require_at_least
from worker.engine.step_threads import StepThreads
from worker.engine.weights import make_argmax_head, make_embedding, make_linear, resolve_format, weight_bytes

__all__ = ["ForwardItem", "ModelRunner", "KVPoolPlan", "plan_kv_pool"]


@dataclass
class ForwardItem:
    """One sequence's share of a forward step.

    token_ids: new tokens to compute (a prefill chunk, or 1 decode token).
    start_pos: position of token_ids[0] in the sequence (= tokens already in the KV cache).
    block_table: KV pool block ids covering positions [0, start_pos + len(token_ids)),
    `block_size` positions each (block_table[i] holds positions i*block_size ... +block_size-1).
    argmax_only: the caller uses only the argmax of this item's logits (greedy, no logprobs, no
    grammar mask). When every item of a step says so, the runner may return logits that are exact
    for the LM head's top candidates and -inf elsewhere (`worker.engine.weights.ArgmaxHead`).
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    argmax_only: bool = False


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


class _Layer:
    """Weights of one decoder layer: norms (fp32), and linear layers in the runner's format:
    qkv [(H+2K)*D <- hidden] (q, k, v fused once), o, gate_up [2I <- hidden], down."""

    __slots__ = ("ln1", "qkv", "o", "ln2", "gate_up", "down")


def _available_memory_bytes() -> int:
    """Memory this process may use: the cgroup v2/v1 limit when one is set, else physical RAM."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path, encoding="ascii").read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            return int(text)
    return total


@dataclass(frozen=True)
class KVPoolPlan:
    """A KV pool size: `num_blocks` blocks of `block_size` tokens, `bytes` in all (see `plan_kv_pool`)."""

    num_blocks: int
    block_size: int
    bytes: int
    dtype: torch.dtype
    reason: str

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (f"KV pool {self.bytes / 2**20:,.0f} MiB ({self.num_blocks:,} blocks x {self.block_size} tokens = "
                f"{self.tokens:,} tokens, {str(self.dtype).replace('torch.', '')}; {self.reason}; "
                f"allocated lazily: pages become resident as blocks are first written)")


KV_MEMORY_FRACTION = 0.25  # default cap of the KV pool: this share of the memory the process may use


def plan_kv_pool(model, block_size: int, dtype: torch.dtype, max_running: int, max_model_len: int | None,
                 kv_cache_mb: float | None = None, memory_bytes: int | None = None) -> KVPoolPlan:
    """Size the KV pool. With `kv_cache_mb`: that many MiB. Otherwise (the default) room for
    `max_running` sequences of the full context (`max_model_len`, default the model's): more can
    never be used at once. That is capped at KV_MEMORY_FRACTION of `memory_bytes` (default: the
    cgroup limit or physical RAM), but never below one full-context sequence.
    Raises ValueError on sizes < 1."""
    require_at_least(1, block_size=block_size, max_running=max_running)
    per_block = ModelRunner.kv_bytes_per_block(model, block_size, dtype)
    context = int(max_model_len or model.max_context_tokens)
    if kv_cache_mb is not None:
        blocks = max(1, int(kv_cache_mb * 2**20 // per_block))
        reason = f"--kv-cache-mb {kv_cache_mb:g}"
    else:
        per_seq = -(-context // block_size)
        want = max_running * per_seq
        memory = memory_bytes or _available_memory_bytes()
        cap = max(per_seq, int(memory * KV_MEMORY_FRACTION // per_block))
        blocks = min(want, cap)
        reason = (f"{max_running} running x {context:,} tokens" if blocks == want else
                  f"{max_running} running x {context:,} tokens capped at {KV_MEMORY_FRACTION:.0%} of "
                  f"{memory / 2**30:.1f} GiB memory")
    return KVPoolPlan(blocks, block_size, blocks * per_block, dtype, reason)


class ModelRunner:
    """Runs a `worker.models.LoadedModel` over a paged KV cache.

    KV cache: one tensor [num_layers, num_kv_blocks, block_size, 2 (k, v), num_kv_heads, head_dim]
    in the activation dtype (a slot's K and V side by side, in the order the fused qkv projection
    emits them, so one `index_copy_` writes both and one `index_select` reads both), allocated with `torch.empty` (pages become resident as blocks are first
    written); no position is ever read before it is written (see `_decode_slots`), so its initial
    contents never matter. device: "cpu" or "cuda[:n]". dtype / quantization: see
    `worker.engine.weights.resolve_format` ("auto": the checkpoint's own format: int4 weights with
    bf16 activations for the default GGUF model; fp32 for a dense fp32 checkpoint on CPU; bf16 on
    CUDA). A torch.dtype for `dtype` is accepted too. Logits are always returned as float32.
    argmax_head: serve steps whose items are all `argmax_only` (at most `ArgmaxHead.max_rows` of
    them) through the screened head (`worker.engine.weights.ArgmaxHead`; CPU, tied LM head only);
    False: always the dense head.
    step_threads: how many CPU threads each forward step runs on (`worker.engine.step_threads`;
    default: torch's count at construction, small steps on one thread when OpenMP's waits sleep).
    Raises ValueError on bad sizes, a model without weights, or an unsupported format.
    Not thread-safe: one forward at a time.
    """

    def __init__(self, model, num_kv_blocks: int, block_size: int = 16, device: str = "cpu",
                 dtype: str | torch.dtype | None = "auto", quantization: str | None = "auto",
                 argmax_head: bool = True, step_threads: StepThreads | None = None) -> None:
        require_at_least(1, num_kv_blocks=num_kv_blocks, block_size=block_size)
        if not model.state_dict:
            raise ValueError(f"model {model.name!r} was loaded without weights")
        self.device = torch.device(device)
        # on CUDA the CPU threads only launch kernels: every step keeps torch's count
        self.step_threads = step_threads or StepThreads(min_rows=None if self.device.type != "cpu" else "auto")
        sd = model.state_dict
        self.format = resolve_format(sd, self.device, dtype, quantization)
        self.dtype = self.format.dtype
        self.quantization = self.format.quantization
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
        fmt, dev = self.format, self.device

        def norm(name: str) -> torch.Tensor:
            return sd[name].to(device=dev, dtype=torch.float32)

        def linear(names: list[str]):
            return make_linear([sd[n + ".weight"] for n in names], [sd.get(n + ".bias") for n in names], fmt, dev)

        with torch.inference_mode():
            self.embed, self.lm_head = make_embedding(sd["model.embed_tokens.weight"], sd.get("lm_head.weight"), fmt, dev)
            tied = sd.get("lm_head.weight") is None
            self.argmax_head = make_argmax_head(self.embed, tied, fmt, dev) if argmax_head else None
            self.norm = norm("model.norm.weight")
            self.layers: list[_Layer] = []
            for i in range(cfg.num_layers):
                p = f"model.layers.{i}."
                a, m = p + "self_attn.", p + "mlp."
                layer = _Layer()
                layer.ln1 = norm(p + "input_layernorm.weight")
                layer.ln2 = norm(p + "post_attention_layernorm.weight")
                layer.qkv = linear([a + "q_proj", a + "k_proj", a + "v_proj"])
                layer.o = linear([a + "o_proj"])
                layer.gate_up = linear([m + "gate_proj", m + "up_proj"])
                layer.down = linear([m + "down_proj"])
                self.layers.append(layer)
            inv = rope_inv_freq(self.head_dim, cfg.rope_theta, cfg.rope_scaling)
            freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv[None, :]
            half = self.head_dim // 2
            # HF "rotate half" layout: rotate_half(x) * sin == x.roll(half) * [-sin, sin] (halves)
            self.cos = torch.cat([freqs, freqs], dim=-1).cos().to(device=dev, dtype=self.dtype)
            sin = freqs.sin()
            self.sin_signed = torch.cat([-sin, sin], dim=-1).to(device=dev, dtype=self.dtype)
            self._half = half
        # a normal tensor (not an inference tensor), so callers may also copy/clear blocks
        self.kv_cache = torch.empty(cfg.num_layers, self.num_kv_blocks, self.block_size, 2,
                                    self.num_kv_heads, self.head_dim, device=dev, dtype=self.dtype)
        # per-layer [slots, 2K, D] views of the pool (K heads, then V heads), made once (not per step)
        self._kv_views = [self.kv_cache[li].view(-1, 2 * self.num_kv_heads, self.head_dim)
                          for li in range(cfg.num_layers)]
        self._eps = torch.tensor(self.eps, dtype=torch.float32, device=dev)
        self._inv_hidden = 1.0 / cfg.hidden_size
        self.intermediate = cfg.intermediate_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.weight_bytes = sum(weight_bytes(lin) for layer in self.layers
                                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        self.weight_bytes += weight_bytes(self.lm_head)
        self.resident_weight_bytes = self.weight_bytes + self.embed.nbytes
        if self.argmax_head is not None:
            self.resident_weight_bytes += self.argmax_head.nbytes

    def step_weight_bytes(self, rows: int, argmax_only: bool = False) -> int:
        """Bytes of weights one forward step of `rows` logit rows reads: every linear layer once, and
        the dense LM head, or the screened one's 4-bit copy when the step takes it (see `forward`)."""
        head = self.argmax_head
        if head is not None and argmax_only and rows <= head.max_rows:
            return self.weight_bytes - weight_bytes(self.lm_head) + weight_bytes(head)
        return self.weight_bytes

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV pool (virtual: resident only where blocks were written)."""
        return self.kv_cache.numel() * self.kv_cache.element_size()

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype | None) -> int:
        """Bytes one KV block takes across all layers (K and V). dtype None means float32."""
        cfg = model.config
        elem = torch.empty((), dtype=dtype or torch.float32).element_size()
        return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem

    # ------------------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm (Zhang & Sennrich 2019) of the fp32 residual stream, cast to the activation dtype:
        x * w / sqrt(|x|^2 / n + eps). Written with `vector_norm` it is 6 ATen calls instead of
        F.rms_norm's ~11 on CPU (composite there): 6.6 vs 9.4 us per row of 576 here, same values;
        the cast to bf16 is the last product's own store (`out=`), one dispatch fewer than `.to`."""
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        inv = torch.addcmul(self._eps, norm, norm, value=self._inv_hidden).rsqrt_()
        if self.dtype == torch.float32:
            return (x * inv).mul_(weight)
        # the last product is computed in fp32 and rounded once as it is stored (no separate cast)
        return torch.mul(x * inv, weight, out=torch.empty(x.shape, dtype=self.dtype, device=x.device))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, heads, D] rotated by position (Su et al. 2021): x*cos + rotate_half(x)*sin, with
        rotate_half(x)*sin computed as x.roll(D/2)*[-sin, sin] (one op fewer than a cat of halves).
        `out` may be x itself (both products are taken before it is written)."""
        return torch.addcmul(x * cos, x.roll(self._half, -1), sin_signed, out=out)

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
            if min(it.token_ids) < 0 or max(it.token_ids) >= self.embed.num_embeddings:
                raise ValueError(f"token ids must be in [0, {self.embed.num_embeddings})")

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
        rows = sum(len(it.token_ids) for it in items)
        with torch.inference_mode():
            logits = self.step_threads.run(rows, self._forward, items)  # in the activation dtype
        # one copy, outside inference mode: a normal fp32 tensor callers may modify in place
        return logits.to(torch.float32, copy=True)

    def _decode_slots(self, dec: list[ForwardItem]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pool slots [B * Lmax] the batched decode attention reads, and its mask [B, 1, 1, Lmax]
        (None when all B sequences have the same length).

        Padding positions of a shorter sequence (p >= its length) are pointed at that sequence's own
        last position, which this step has just written: so every slot read holds K/V written by
        this or an earlier step, and the pool's initial contents (torch.empty) are never read, not
        even under the mask (a NaN there would survive masking: NaN * 0 is NaN)."""
        dev, bs = self.device, self.block_size
        lens = [it.start_pos + 1 for it in dec]
        lmax = max(lens)
        nblk = -(-lmax // bs)
        bt = torch.tensor([it.block_table[:nblk] + [0] * (nblk - min(nblk, len(it.block_table))) for it in dec],
                          dtype=torch.long, device=dev)  # [B, nblk]
        p = torch.arange(lmax, device=dev)
        if min(lens) == lmax:
            return (bt[:, p // bs] * bs + p % bs).flatten(), None
        last = torch.tensor(lens, device=dev)[:, None] - 1
        pc = torch.minimum(p[None, :], last)  # [B, Lmax]
        slots = (bt.gather(1, pc // bs) * bs + pc % bs).flatten()
        return slots, (p[None, :] <= last)[:, None, None, :]

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
        sin = self.sin_signed.index_select(0, pos_t).unsqueeze(1)

        # ---- attention plan (shared by all layers) ----
        B = len(dec)
        dec_idx = dec_mask = None
        if B:
            dec_idx, dec_mask = self._decode_slots(dec)
        pre_plan = []  # (first row, n, pool slots of positions [0, end) or None, mask or None)
        row = B
        for it in pre:
            n, s = len(it.token_ids), it.start_pos
            if s == 0:  # a whole prompt / first chunk: attend within the chunk, causal
                pre_plan.append((row, n, None, None))
            else:       # a later chunk: read the earlier positions (all written) from the pool
                end = s + n
                nblk = (end + bs - 1) // bs
                bt = torch.tensor(it.block_table[:nblk], dtype=torch.long, device=dev)
                p = torch.arange(end, device=dev)
                mask = p[None, :] <= torch.arange(s, end, device=dev)[:, None]  # [n, end]
                pre_plan.append((row, n, bt[p // bs] * bs + p % bs, mask))
            row += n

        x = self.embed.rows(ids_t)  # [T, hidden], fp32 residual stream
        T = x.shape[0]
        q_size, qk_end, inter = self.q_size, self.q_size + self.kv_size, self.intermediate
        scale, gqa = self.scale, G > 1
        # Each op below is a dispatch of ~1-2 us on this CPU, ~40 of them per layer: at batch 1 they
        # cost a quarter of the step, so the layer is written with as few as the math allows.
        for layer, pool in zip(self.layers, self._kv_views):
            qkv = layer.qkv(self._rms(x, layer.ln1))  # [T, (H + 2K) * D]: q, k, v
            qk = qkv[:, :qk_end].view(T, H + K, D)
            self._rope(qk, cos, sin, out=qk)  # q and k rotated in place, inside qkv
            kv = qkv[:, q_size:].view(T, 2 * K, D)  # a slot's K then V heads: the pool's layout
            pool.index_copy_(0, slots_t, kv)

            if B:
                # GQA without repeating K/V: the G query heads of a KV head act as G "query rows"
                qd = (qkv if B == T else qkv[:B])[:, :q_size].view(B, K, G, D)
                # one gather reads K and V (index_select is ~5x faster than advanced indexing here)
                kvd = pool.index_select(0, dec_idx).view(B, -1, 2 * K, D).transpose(1, 2)  # [B, 2K, L, D]
                attn = F.scaled_dot_product_attention(qd, kvd[:, :K], kvd[:, K:], attn_mask=dec_mask,
                                                      scale=scale).view(B, H * D)
            if pre_plan:
                outs = [attn] if B else []
                for start, n, gather, mask in pre_plan:
                    qp = qkv[start:start + n, :q_size].view(n, H, D).transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
                    if gather is None:
                        kvp = kv[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, 2K, n, D]
                        op = F.scaled_dot_product_attention(qp, kvp[:, :K], kvp[:, K:], is_causal=True, scale=scale,
                                                            enable_gqa=gqa)
                    else:
                        kvp = pool.index_select(0, gather).transpose(0, 1).unsqueeze(0)  # [1, 2K, end, D]
                        op = F.scaled_dot_product_attention(qp, kvp[:, :K], kvp[:, K:], attn_mask=mask, scale=scale,
                                                            enable_gqa=gqa)
                    outs.append(op[0].transpose(0, 1).reshape(n, H * D))
                attn = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
            x.add_(layer.o(attn))  # x is this step's own fp32 residual stream

            gate, up = layer.gate_up(self._rms(x, layer.ln2)).view(T, 2, inter).unbind(1)
            x.add_(layer.down(F.silu(gate).mul_(up)))

        h = self._rms(x.index_select(0, rows_out), self.norm)
        head = self.argmax_head
        if head is not None and len(items) <= head.max_rows and all(it.argmax_only for it in items):
            return head(h)  # float32 already
        return self.lm_head(h)
