"""worker.engine.model_runner: logit parity with transformers' LlamaForCausalLM over a paged KV
cache (full prefill, chunked prefill, mixed decode batches, shuffled block tables), in every weight
format, and greedy decoding of the real SmolLM2 model.

Parity bounds (max |logit difference| over every row of a schedule), per format:
- float32: 1e-4 absolute against transformers in fp32 (measured ~2e-5 on logits up to 7).
- bfloat16 activations (dense bf16, int8, int4): against transformers in fp32 on the weights the
  runner holds (its int8/int4 values, dequantized), so the bound covers only the runner's own
  arithmetic: 6 % of the largest logit. bf16 keeps 8 significant bits (2^-9 relative per rounding);
  each of ~8 roundings per layer (norm output, q/k/v, rope, attention, o, gate/up, down) adds one,
  and a 4-layer model with sharp attention measured 0.9-2.7 %.
- SmolLM2 against transformers in fp32 on the GGUF's own weights (logits up to 36): 5e-4 for
  float32 (30 layers; measured 1.2e-4); 1.0 for bf16 dense and int4 (~3 % of the largest logit:
  the int4 layers are the Q4_1 blocks themselves with bf16 scales, so both carry only bf16
  arithmetic; measured 0.36 / 0.52); 3.0 for int8 (~8 %: it re-quantizes the 4-bit blocks per
  row, a second rounding of the weights themselves; measured 1.40).
The pool is filled with NaN before each schedule: a read of any slot not written first would turn
a logit into NaN (a NaN survives masking), so parity also proves the lazily allocated pool
(`torch.empty`) is never read before it is written."""

from __future__ import annotations

import dataclasses
import random

import jinja2
import pytest
import torch

from worker.engine.model_runner import ForwardItem, ModelRunner
from worker.models import RANDOM_TINY_CONFIG, ModelConfig, build_random_llama, load_model

FORMATS = [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"), ("bfloat16", "int4")]
FP32_TOL = 1e-4       # absolute, float32
BF16_REL_TOL = 0.06   # of the largest reference logit, bf16 activations
SMOLLM2_TOL = {("float32", "none"): 5e-4, ("bfloat16", "none"): 1.0, ("bfloat16", "int8"): 3.0,
               ("bfloat16", "int4"): 1.0}


def effective_weight(w, quantization: str) -> torch.Tensor:
    """The dense fp32 weight a linear layer of this format holds, restated from the formats'
    definitions (worker/engine/weights.py): int8 = codes * bf16(row scale); int4 = (codes - 8) *
    bf16(scale) + bf16(zero) per group of 32, from the Q4_1 blocks when the source has them."""
    from worker.engine.weights import _int4_parts, _int8_parts, int4_shape_ok

    if quantization == "none":
        return w if isinstance(w, torch.Tensor) else w.dequantize()
    if quantization == "int4" and int4_shape_ok(*w.shape):
        codes, scale, zero = _int4_parts(w)
        out, k = codes.shape
        g = codes.view(out, k // 32, 32).float() - 8
        return (g * scale.bfloat16().float()[..., None] + zero.bfloat16().float()[..., None]).view(out, k)
    q, scale = _int8_parts(w)
    return q.float() * scale.bfloat16().float()[:, None]


def held_weights(model, quantization: str):
    """`model` with its linear layers replaced by the dense weights the runner holds in this format."""
    sd = {k: (effective_weight(v, quantization) if "_proj.weight" in k else
              (v if isinstance(v, torch.Tensor) else v.dequantize())) for k, v in model.state_dict.items()}
    return dataclasses.replace(model, state_dict=sd)


@pytest.fixture(scope="module")
def tiny():
    return load_model("random-tiny", progress=False)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def smollm2_runner(smollm2):
    """The default-format runner for the SmolLM2 tests (as `fairshare worker` builds it)."""
    return ModelRunner(smollm2, num_kv_blocks=24, block_size=8)


def variant(base, seed: int = 1, init_std: float = 0.08, **overrides):
    """`base` with other random weights/architecture: sharper weights so attention is far from uniform."""
    cfg = dict(RANDOM_TINY_CONFIG, **overrides)
    return dataclasses.replace(base, name="variant", config=ModelConfig.from_hf_dict(cfg),
                               state_dict=build_random_llama(cfg, seed=seed, init_std=init_std),
                               hf_config_dict=cfg, max_context_tokens=cfg["max_position_embeddings"])


def hf_logits(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    hf = model.to_hf_model()
    with torch.inference_mode():
        return [hf(torch.tensor([s])).logits[0].float() for s in seqs]


class Harness:
    """Drives a runner through a schedule of (sequence, n_tokens) steps and checks every logit row
    against transformers (`ref_model`, default `model`) within `tol`."""

    def __init__(self, model, seqs, block_size: int, seed: int = 0, runner: ModelRunner | None = None,
                 tol: float = FP32_TOL, ref_model=None, **fmt):
        self.rng = random.Random(seed)
        need = sum(-(-len(s) // block_size) for s in seqs)
        self.runner = runner or ModelRunner(model, num_kv_blocks=need + 7, block_size=block_size, **fmt)
        assert self.runner.block_size == block_size and self.runner.num_kv_blocks >= need
        num_blocks = self.runner.num_kv_blocks
        # NaN in the pool: any read of a slot not written first poisons the logits (NaN survives masking)
        self.runner.kv_cache.fill_(float("nan"))
        free = list(range(num_blocks))
        self.rng.shuffle(free)
        self.tables = [[free.pop() for _ in range(-(-len(s) // block_size))] for s in seqs]
        self.seqs, self.done = seqs, [0] * len(seqs)
        self.ref = hf_logits(ref_model or model, seqs)
        self.tol = tol
        self.worst = 0.0

    def step(self, plan: list[tuple[int, int]]) -> torch.Tensor:
        items = [ForwardItem(self.seqs[i][self.done[i]:self.done[i] + n], self.done[i], self.tables[i])
                 for i, n in plan]
        out = self.runner.forward(items)
        assert out.shape == (len(plan), self.runner.vocab_size) and out.dtype == torch.float32
        assert torch.isfinite(out).all()
        for (i, n), row in zip(plan, out):
            self.done[i] += n
            err = (self.ref[i][self.done[i] - 1] - row).abs().max().item()
            self.worst = max(self.worst, err)
            assert err < self.tol, (i, self.done[i], err)
        return out


def random_seqs(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def run_schedule(model, block_size: int, small: bool = False, runner: ModelRunner | None = None,
                 dtype: str = "float32", quantization: str = "none", tol: float | None = None, ref_model=None):
    """Four sequences (prompt + teacher-forced continuation) through chunked prefill, mixed steps
    and decodes; every logit row is compared with transformers on the weights the runner holds in
    this format. `small` halves the lengths (for the real model)."""
    if small:
        seqs = random_seqs(model.config.vocab_size, [22, 7, 36, 12])
        plan = [[(0, 10), (1, 3), (2, 16)],
                [(1, 1), (0, 9), (2, 18), (3, 9)],
                [(2, 2), (1, 1), (0, 1), (3, 1)]] + [[(3, 1), (0, 1), (1, 1)]] * 2
    else:
        seqs = random_seqs(model.config.vocab_size, [41, 10, 68, 24])
        plan = [[(0, 20), (1, 5), (2, 30)],            # first chunks of seqs 0 and 2, whole prompt of seq 1
                [(1, 1), (0, 17), (2, 34), (3, 20)],   # a decode mixed with later chunks (start_pos > 0)
                [(2, 4), (1, 1), (0, 1), (3, 1)]       # the last chunk of seq 2 (4 tokens) among decodes
                ] + [[(3, 1), (0, 1), (1, 1)]] * 3     # decodes of different lengths
    if ref_model is None:
        ref_model = held_weights(model, quantization) if quantization != "none" else model
    if tol is None:
        tol = FP32_TOL if dtype == "float32" else BF16_REL_TOL * max(r.abs().max().item()
                                                                      for r in hf_logits(ref_model, seqs))
    h = Harness(model, seqs, block_size, runner=runner, tol=tol, ref_model=ref_model, dtype=dtype,
                quantization=quantization)
    assert (h.runner.dtype, h.runner.quantization) == (getattr(torch, dtype), quantization)
    for step in plan:
        h.step(step)
    assert h.done == [len(s) for s in seqs]  # every token of every sequence was computed
    return h


@pytest.mark.parametrize("dtype,quantization", FORMATS)
def test_parity_random_tiny(tiny, dtype, quantization):
    h = run_schedule(tiny, block_size=16, dtype=dtype, quantization=quantization)
    assert h.worst < h.tol


@pytest.mark.parametrize("dtype,quantization", FORMATS)
def test_parity_variant_gqa_untied_llama3_rope_biases(tiny, dtype, quantization):
    """Sharper random weights, 4 query heads per KV head, untied lm_head, llama3 rope scaling that
    matters within these lengths, q/k/v/o and MLP biases, block size 4 (many blocks per sequence)."""
    model = variant(tiny, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                    rope_theta=50000.0, attention_bias=True, mlp_bias=True,
                    rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    h = run_schedule(model, block_size=4, dtype=dtype, quantization=quantization)
    assert h.worst < h.tol


def test_full_prefill_every_position_and_batch_independence(tiny):
    """Logits of a sequence do not depend on what else is in the batch."""
    model = variant(tiny, seed=3)
    seqs = random_seqs(model.config.vocab_size, [30, 30, 7], seed=5)
    h = Harness(model, seqs, block_size=8, dtype="float32", quantization="none")
    h.step([(0, 30), (1, 30), (2, 7)])
    alone = ModelRunner(model, num_kv_blocks=8, block_size=8, dtype="float32", quantization="none")
    solo = alone.forward([ForwardItem(seqs[1], 0, [3, 1, 7, 0])])
    batched = h.runner.forward([ForwardItem(seqs[1][-1:], 29, h.tables[1])])  # recompute last token
    torch.testing.assert_close(solo, batched, atol=FP32_TOL, rtol=0)


def test_runner_interface_details(tiny):
    r = ModelRunner(tiny, num_kv_blocks=4, block_size=16)
    assert (r.block_size, r.num_kv_blocks, r.vocab_size) == (16, 4, 49152)
    assert (r.dtype, r.quantization) == (torch.float32, "none")  # auto on a dense fp32 checkpoint
    assert r.forward([]).shape == (0, 49152)
    assert ModelRunner.kv_bytes_per_block(tiny, 16, torch.float32) == 4 * 2 * 16 * 4 * 32 * 4
    assert ModelRunner.kv_bytes_per_block(tiny, 16, None) == ModelRunner.kv_bytes_per_block(tiny, 16, torch.float32)
    assert ModelRunner.kv_bytes_per_block(tiny, 16, torch.bfloat16) == 4 * 2 * 16 * 4 * 32 * 2
    assert r.kv_cache_bytes == 4 * ModelRunner.kv_bytes_per_block(tiny, 16, torch.float32)
    params = sum(v.numel() for k, v in tiny.state_dict.items() if "_proj." in k)
    assert r.weight_bytes == 4 * (params + tiny.config.vocab_size * tiny.config.hidden_size)  # + tied head
    with pytest.raises(ValueError):
        r.forward([ForwardItem([1] * 20, 0, [0])])          # block table too short
    with pytest.raises(ValueError):
        r.forward([ForwardItem([], 0, [0])])                # no tokens
    with pytest.raises(ValueError):
        r.forward([ForwardItem([1], 5000, list(range(4)))])  # beyond the context
    b = ModelRunner(tiny, num_kv_blocks=4, block_size=16, dtype="bfloat16", quantization="int4")
    assert b.kv_cache.dtype == torch.bfloat16 and b.weight_bytes < r.weight_bytes / 2  # the bf16 head dominates
    with pytest.raises(ValueError, match="bfloat16"):
        ModelRunner(tiny, num_kv_blocks=4, dtype="float32", quantization="int4")
    with pytest.raises(ValueError, match="quantization"):
        ModelRunner(tiny, num_kv_blocks=4, quantization="int3")


@pytest.mark.parametrize("dtype,quantization", FORMATS)
def test_argmax_head_picks_the_dense_heads_token(tiny, dtype, quantization):
    """Steps whose items are all `argmax_only` (at most ArgmaxHead.max_rows) take the screened LM
    head: each row holds exactly `candidates` finite logits, the largest of them is the dense head's
    token and value (both rounded to the activation dtype; only the summation order differs); any
    other step returns the dense head's logits."""
    from worker.engine.weights import ArgmaxHead

    model = variant(tiny, seed=4)
    seqs = random_seqs(model.config.vocab_size, [9, 14, 5, 20, 11], seed=2)
    r = ModelRunner(model, num_kv_blocks=40, block_size=4, dtype=dtype, quantization=quantization)
    assert isinstance(r.argmax_head, ArgmaxHead) and r.resident_weight_bytes > r.weight_bytes + r.embed.nbytes
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(seqs))]
    r.forward([ForwardItem(s[:-3], 0, t) for s, t in zip(seqs, tables)])
    tol = 1e-5 if dtype == "float32" else 0.0
    checked = 0
    for j in range(3, 0, -1):
        for rows in (seqs[:1], seqs[:ArgmaxHead.max_rows]):
            items = [ForwardItem([s[-j]], len(s) - j, t) for s, t in zip(rows, tables)]
            dense = r.forward(items)  # recomputing a position rewrites the same K/V
            assert torch.isfinite(dense).all()
            for it in items:
                it.argmax_only = True
            screened = r.forward(items)
            assert ((screened > float("-inf")).sum(-1) == ArgmaxHead.candidates).all()
            assert torch.equal(screened.argmax(-1), dense.argmax(-1))
            torch.testing.assert_close(screened.max(-1).values, dense.max(-1).values, atol=tol, rtol=tol)
            checked += len(items)
    assert checked == 3 * (1 + ArgmaxHead.max_rows)
    too_many = [ForwardItem([s[-3]], len(s) - 3, t, argmax_only=True) for s, t in zip(seqs, tables)]
    assert len(too_many) > ArgmaxHead.max_rows and torch.isfinite(r.forward(too_many)).all()  # the dense head
    mixed = [ForwardItem([seqs[0][-3]], len(seqs[0]) - 3, tables[0], argmax_only=True),
             ForwardItem([seqs[1][-3]], len(seqs[1]) - 3, tables[1])]
    assert torch.isfinite(r.forward(mixed)).all()


def test_argmax_head_only_for_a_tied_head_and_when_asked(tiny):
    assert ModelRunner(tiny, num_kv_blocks=4).argmax_head is not None
    assert ModelRunner(tiny, num_kv_blocks=4, argmax_head=False).argmax_head is None
    untied = variant(tiny, tie_word_embeddings=False)
    assert ModelRunner(untied, num_kv_blocks=4).argmax_head is None  # its rows could not be gathered


def test_argmax_head_screen_packed_in_pieces_is_the_whole_table_packed(tiny):
    from worker.engine.weights import ArgmaxHead, Embedding, Int4Linear, _int4_parts

    table = tiny.state_dict["model.embed_tokens.weight"][:4096 + 48].bfloat16()  # a last piece of 48 rows
    whole = Int4Linear(*_int4_parts(table), None)
    pieces = ArgmaxHead(Embedding(table), torch.bfloat16, chunk_rows=1024).screen
    assert torch.equal(pieces.packed, whole.packed) and torch.equal(pieces.scale_zeros, whole.scale_zeros)


def test_format_choice():
    """auto runs weights as they ship: 4-bit blocks -> int4 (bf16 activations), 8-bit -> int8,
    dense fp32 -> fp32; bf16 on CUDA; quantization is CPU-only."""
    from worker.engine.weights import resolve_format
    from worker.models import BlockQuantized

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    q4 = BlockQuantized("q4_1", torch.zeros(16, 16, dtype=torch.uint8), torch.ones(16, 1, dtype=torch.float16),
                        torch.zeros(16, 1, dtype=torch.float16), 32)
    q8 = BlockQuantized("q8_0", torch.zeros(16, 32, dtype=torch.int8), torch.ones(16, 1, dtype=torch.float16))
    dense = {"w": torch.zeros(16, 32)}
    assert resolve_format({"w": q4, "n": torch.ones(4)}, cpu) == (torch.bfloat16, "int4")
    assert resolve_format({"w": q8}, cpu) == (torch.bfloat16, "int8")
    assert resolve_format(dense, cpu) == (torch.float32, "none")
    assert resolve_format(dense, cpu, "bfloat16", "int8") == (torch.bfloat16, "int8")
    assert resolve_format({"w": q4}, cpu, torch.float32, "none") == (torch.float32, "none")
    assert resolve_format({"w": q4}, cuda) == (torch.bfloat16, "none")
    with pytest.raises(ValueError, match="CPU"):
        resolve_format(dense, cuda, "auto", "int4")


def test_kv_pool_plan(tiny):
    """Default: room for max_running full-context sequences, capped at a share of memory but never
    below one full context; --kv-cache-mb overrides."""
    from worker.engine.model_runner import KV_MEMORY_FRACTION, plan_kv_pool

    per_block = ModelRunner.kv_bytes_per_block(tiny, 16, torch.float32)  # 64 KiB
    big = plan_kv_pool(tiny, 16, torch.float32, max_running=8, max_model_len=1000, memory_bytes=2**40)
    assert big.num_blocks == 8 * 63 and big.bytes == big.num_blocks * per_block and big.tokens == 8 * 63 * 16
    assert "8 running x 1,000 tokens" in big.describe() and "lazily" in big.describe()
    capped = plan_kv_pool(tiny, 16, torch.float32, max_running=8, max_model_len=1000, memory_bytes=2**24)
    assert capped.num_blocks == int(2**24 * KV_MEMORY_FRACTION // per_block) == 64 < big.num_blocks
    assert "capped" in capped.reason
    tiny_mem = plan_kv_pool(tiny, 16, torch.float32, max_running=8, max_model_len=None, memory_bytes=2**20)
    assert tiny_mem.num_blocks == 2048 // 16  # one full context of the model's 2,048 positions
    fixed = plan_kv_pool(tiny, 16, torch.bfloat16, max_running=8, max_model_len=None, kv_cache_mb=1)
    assert fixed.num_blocks == 2**20 // (per_block // 2) and fixed.dtype == torch.bfloat16


def test_engine_sizes_its_pool_from_max_running_and_context(tiny):
    from worker.engine.engine import Engine, EngineConfig

    engine = Engine(tiny, EngineConfig(max_running=4, max_model_len=256, dtype="bfloat16"))
    assert engine.kv_plan is not None and engine.runner.num_kv_blocks == engine.kv_plan.num_blocks == 4 * 16
    assert engine.runner.kv_cache.dtype == torch.bfloat16 and engine.max_model_len == 256
    sized = Engine(tiny, EngineConfig(kv_cache_mb=2))
    assert sized.runner.kv_cache_bytes == 2 * 2**20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_parity_on_cuda(tiny):
    model = variant(tiny, seed=2)
    seqs = random_seqs(model.config.vocab_size, [25, 6], seed=1)
    ref = hf_logits(model, seqs)
    r = ModelRunner(model, num_kv_blocks=8, block_size=16, device="cuda", dtype=torch.float32)
    out = r.forward([ForwardItem(seqs[0][:20], 0, [5, 2]), ForwardItem(seqs[1][:5], 0, [7])])
    out2 = r.forward([ForwardItem(seqs[0][20:], 20, [5, 2]), ForwardItem(seqs[1][5:], 5, [7])])
    for got, want in ((out[0], ref[0][19]), (out[1], ref[1][4]), (out2[0], ref[0][24]), (out2[1], ref[1][5])):
        assert (got.cpu() - want).abs().max().item() < 2e-3


@pytest.mark.smollm2
@pytest.mark.parametrize("dtype,quantization", FORMATS)
def test_parity_smollm2(smollm2, smollm2_runner, dtype, quantization):
    """Against transformers in fp32 on the GGUF's own weights (dequantized exactly)."""
    default = (smollm2_runner.dtype, smollm2_runner.quantization) == (getattr(torch, dtype), quantization)
    h = run_schedule(smollm2, block_size=8, small=True, runner=smollm2_runner if default else None,
                     dtype=dtype, quantization=quantization, tol=SMOLLM2_TOL[dtype, quantization], ref_model=smollm2)
    assert h.worst < h.tol


@pytest.mark.smollm2
def test_smollm2_int4_layers_are_the_gguf_blocks(smollm2):
    """The default format repacks the Q4_1 blocks: each held weight equals the file's within the
    bf16 rounding of its block's scale and zero (|w| <= 8 d + |zero|, so error <= (8 d + |zero|) 2^-8)."""
    from worker.engine.weights import _int4_parts

    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        w = smollm2.state_dict[name]
        assert w.kind == "q4_1"
        codes, scale, zero = _int4_parts(w)
        assert torch.equal(codes, w.codes())  # the 4-bit codes are the file's, unchanged
        held = effective_weight(w, "int4")
        bound = ((8 * scale + zero.abs()) * 2**-8).repeat_interleave(32, dim=1)
        assert ((held - w.dequantize()).abs() <= bound).all()


def greedy(runner: ModelRunner, prompt: list[int], max_new: int, eos: set[int], argmax_only: bool = False) -> list[int]:
    table = list(range(-(-(len(prompt) + max_new) // runner.block_size)))
    out = runner.forward([ForwardItem(prompt, 0, table, argmax_only)])
    generated: list[int] = []
    while True:
        tok = int(out[0].argmax())
        if tok in eos or len(generated) == max_new:
            return generated
        generated.append(tok)
        out = runner.forward([ForwardItem([tok], len(prompt) + len(generated) - 1, table, argmax_only)])


@pytest.mark.smollm2
def test_smollm2_greedy_answers_paris(smollm2, smollm2_runner):
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(smollm2.chat_template).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        bos_token=smollm2.bos_token, eos_token=smollm2.eos_token)
    prompt = smollm2.tokenizer.encode(text, add_special_tokens=False).ids
    eos = set(smollm2.eos_token_ids)
    tokens = greedy(smollm2_runner, prompt, 16, eos)
    answer = smollm2.tokenizer.decode(tokens)
    assert "Paris" in answer, answer
    assert greedy(smollm2_runner, prompt, 16, eos, argmax_only=True) == tokens  # the screened LM head
