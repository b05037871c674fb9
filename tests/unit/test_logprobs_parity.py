"""The reference engine's logprobs match a transformers forward pass (`LlamaForCausalLM` on the same
random-tiny weights) within 1e-3: the chosen token's and the top alternatives', greedy and at a
temperature (the engine returns log-softmax(logits / T): after the temperature, as OpenAI does)."""

from __future__ import annotations

import pytest
import torch

from worker.engine.engine import Engine, EngineConfig
from worker.engine.sequence import SamplingParams
from worker.models import load_model

PROMPT = [1, 504, 3458, 314, 260, 1345, 28, 2030, 3326, 42]
TOP = 5


@pytest.fixture(scope="module")
def model():
    return load_model("random-tiny")


@pytest.fixture(scope="module")
def hf(model):
    return model.to_hf_model()


def _generate(model, sampling: SamplingParams):
    engine = Engine(model, EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=8))
    outs = []
    engine.add_request("r", "t", PROMPT, sampling, outs.append)
    while not outs or outs[-1].finish_reason is None:
        assert engine.step(), "the engine stopped before the request finished"
    tokens = [t for o in outs for t in o.token_ids]
    logprobs = [e for o in outs for e in o.logprobs]
    return tokens, logprobs


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_engine_logprobs_match_transformers(model, hf, temperature):
    sampling = SamplingParams(max_tokens=12, temperature=temperature, seed=5, ignore_eos=True, logprobs=True,
                              top_logprobs=TOP)
    tokens, logprobs = _generate(model, sampling)  # prefill in chunks of 8, then decode steps
    assert len(tokens) == len(logprobs) == 12
    with torch.inference_mode():
        logits = hf(torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1:].float()
    t = temperature if temperature > 0 else 1.0
    ref = torch.log_softmax(logits / t, dim=-1)
    for pos, (tok, lp, top) in enumerate(logprobs):
        assert tok == tokens[pos]
        assert lp == pytest.approx(float(ref[pos, tok]), abs=1e-3)
        ref_top = torch.topk(ref[pos], TOP)
        assert [v for _, v in top] == pytest.approx(ref_top.values.tolist(), abs=1e-3)
        for i, v in top:  # each alternative is the token it names (near-ties may come in another order)
            assert v == pytest.approx(float(ref[pos, i]), abs=1e-3)
        if temperature == 0:
            assert tok == top[0][0]  # greedy picks the most likely token


def test_logprobs_only_when_asked(model):
    tokens, logprobs = _generate(model, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(tokens) == 3 and logprobs == []
    _, logprobs = _generate(model, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=True))
    assert [len(top) for _, _, top in logprobs] == [0, 0, 0]


def test_greedy_tokens_do_not_depend_on_asking_for_logprobs(model):
    """Without logprobs a greedy request takes the screened LM head (worker/engine/weights.py
    ArgmaxHead), with them the dense head: the same tokens either way."""
    plain, _ = _generate(model, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    with_lp, _ = _generate(model, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True))
    assert len(plain) == 12 and plain == with_lp


def test_top_logprobs_needs_logprobs_and_at_most_20():
    with pytest.raises(ValueError):
        SamplingParams(top_logprobs=2).validate()
    with pytest.raises(ValueError):
        SamplingParams(logprobs=True, top_logprobs=21).validate()
    SamplingParams(logprobs=True, top_logprobs=20).validate()
