"""worker.engine.model_runner: logit parity with transformers' LlamaForCausalLM over a paged KV
cache (full prefill, chunked prefill, mixed decode batches, shuffled block tables), and greedy
decoding of the real SmolLM2 model."""

from __future__ import annotations

import dataclasses
import random

import jinja2
import pytest
import torch

from worker.engine.model_runner import ForwardItem, ModelRunner
from worker.models import RANDOM_TINY_CONFIG, ModelConfig, build_random_llama, load_model

TOL = 1e-3  # max abs logit difference allowed in fp32


@pytest.fixture(scope="module")
def tiny():
    return load_model("random-tiny", progress=False)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def smollm2_runner(smollm2):
    """One runner for the SmolLM2 tests (packing 135M weights takes a few seconds on 2 cores)."""
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
    """Drives a runner through a schedule of (sequence, n_tokens) steps and checks every logit row."""

    def __init__(self, model, seqs, block_size: int, seed: int = 0, runner: ModelRunner | None = None):
        self.rng = random.Random(seed)
        need = sum(-(-len(s) // block_size) for s in seqs)
        self.runner = runner or ModelRunner(model, num_kv_blocks=need + 7, block_size=block_size)
        assert self.runner.block_size == block_size and self.runner.num_kv_blocks >= need
        num_blocks = self.runner.num_kv_blocks
        # garbage in the pool: a bug that reads unwritten or foreign slots cannot hide behind zeros
        self.runner.kv_cache.normal_()
        free = list(range(num_blocks))
        self.rng.shuffle(free)
        self.tables = [[free.pop() for _ in range(-(-len(s) // block_size))] for s in seqs]
        self.seqs, self.done = seqs, [0] * len(seqs)
        self.ref = hf_logits(model, seqs)
        self.worst = 0.0

    def step(self, plan: list[tuple[int, int]]) -> torch.Tensor:
        items = [ForwardItem(self.seqs[i][self.done[i]:self.done[i] + n], self.done[i], self.tables[i])
                 for i, n in plan]
        out = self.runner.forward(items)
        assert out.shape == (len(plan), self.runner.vocab_size) and out.dtype == torch.float32
        for (i, n), row in zip(plan, out):
            self.done[i] += n
            err = (self.ref[i][self.done[i] - 1] - row).abs().max().item()
            self.worst = max(self.worst, err)
            assert err < TOL, (i, self.done[i], err)
        return out


def random_seqs(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def run_schedule(model, block_size: int, small: bool = False, runner: ModelRunner | None = None):
    """Four sequences (prompt + teacher-forced continuation) through chunked prefill, mixed steps
    and decodes; every logit row is compared. `small` halves the lengths (for the real model)."""
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
    h = Harness(model, seqs, block_size, runner=runner)
    for step in plan:
        h.step(step)
    assert h.done == [len(s) for s in seqs]  # every token of every sequence was computed
    return h


def test_parity_random_tiny(tiny):
    h = run_schedule(tiny, block_size=16)
    assert h.worst < TOL


def test_parity_variant_gqa_untied_llama3_rope_biases(tiny):
    """Sharper random weights, 4 query heads per KV head, untied lm_head, llama3 rope scaling that
    matters within these lengths, q/k/v/o and MLP biases, block size 4 (many blocks per sequence)."""
    model = variant(tiny, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                    rope_theta=50000.0, attention_bias=True, mlp_bias=True,
                    rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    h = run_schedule(model, block_size=4)
    assert h.worst < TOL


def test_full_prefill_every_position_and_batch_independence(tiny):
    """Logits of a sequence do not depend on what else is in the batch."""
    model = variant(tiny, seed=3)
    seqs = random_seqs(model.config.vocab_size, [30, 30, 7], seed=5)
    h = Harness(model, seqs, block_size=8)
    h.step([(0, 30), (1, 30), (2, 7)])
    alone = ModelRunner(model, num_kv_blocks=8, block_size=8)
    solo = alone.forward([ForwardItem(seqs[1], 0, [3, 1, 7, 0])])
    batched = h.runner.forward([ForwardItem(seqs[1][-1:], 29, h.tables[1])])  # recompute last token
    torch.testing.assert_close(solo, batched, atol=TOL, rtol=0)


def test_runner_interface_details(tiny):
    r = ModelRunner(tiny, num_kv_blocks=4, block_size=16)
    assert (r.block_size, r.num_kv_blocks, r.vocab_size) == (16, 4, 49152)
    assert r.forward([]).shape == (0, 49152)
    assert ModelRunner.kv_bytes_per_block(tiny, 16, torch.float32) == 4 * 2 * 16 * 4 * 32 * 4
    assert ModelRunner.kv_bytes_per_block(tiny, 16, None) == ModelRunner.kv_bytes_per_block(tiny, 16, torch.float32)
    assert ModelRunner.kv_bytes_per_block(tiny, 16, torch.bfloat16) == 4 * 2 * 16 * 4 * 32 * 2
    assert r.kv_cache.numel() * 4 == 4 * ModelRunner.kv_bytes_per_block(tiny, 16, torch.float32)
    with pytest.raises(ValueError):
        r.forward([ForwardItem([1] * 20, 0, [0])])          # block table too short
    with pytest.raises(ValueError):
        r.forward([ForwardItem([], 0, [0])])                # no tokens
    with pytest.raises(ValueError):
        r.forward([ForwardItem([1], 5000, list(range(4)))])  # beyond the context


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
def test_parity_smollm2(smollm2, smollm2_runner):
    h = run_schedule(smollm2, block_size=8, small=True, runner=smollm2_runner)
    assert h.worst < TOL


def greedy(runner: ModelRunner, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    table = list(range(-(-(len(prompt) + max_new) // runner.block_size)))
    out = runner.forward([ForwardItem(prompt, 0, table)])
    generated: list[int] = []
    while True:
        tok = int(out[0].argmax())
        if tok in eos or len(generated) == max_new:
            return generated
        generated.append(tok)
        out = runner.forward([ForwardItem([tok], len(prompt) + len(generated) - 1, table)])


@pytest.mark.smollm2
def test_smollm2_greedy_answers_paris(smollm2, smollm2_runner):
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(smollm2.chat_template).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        bos_token=smollm2.bos_token, eos_token=smollm2.eos_token)
    prompt = smollm2.tokenizer.encode(text, add_special_tokens=False).ids
    answer = smollm2.tokenizer.decode(greedy(smollm2_runner, prompt, 16, set(smollm2.eos_token_ids)))
    assert "Paris" in answer, answer
