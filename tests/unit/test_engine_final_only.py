"""`Engine.add_request(final_only=True)`: the caller gets one output, the final one, holding every
token and all the text a per-iteration caller gets across its outputs (random-tiny Llama, real
forward passes, greedy), with the same finish reason and usage; an abort still ends it."""

from __future__ import annotations

import pytest

from worker.engine.engine import Engine, EngineConfig
from worker.engine.sequence import FinishReason, SamplingParams

PROMPT = [(11 * j) % 400 + 5 for j in range(40)]


@pytest.fixture(scope="module")
def tiny():
    from worker.models import load_model

    return load_model("random-tiny", progress=False)


def engine_for(tiny) -> Engine:
    from worker.engine.model_runner import ModelRunner

    return Engine(tiny, EngineConfig(), ModelRunner(tiny, num_kv_blocks=64, block_size=16))


def test_final_only_gets_the_whole_answer_in_one_output(tiny):
    engine = engine_for(tiny)
    streamed, final = [], []
    sampling = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("s", "A", PROMPT, SamplingParams(**sampling), streamed.append)
    engine.add_request("f", "B", PROMPT, SamplingParams(**sampling), final.append, final_only=True)
    while engine.step():
        pass
    assert len(streamed) > 1 and len(final) == 1
    (out,) = final
    assert out.finish_reason is FinishReason.LENGTH is streamed[-1].finish_reason
    assert out.token_ids == [t for o in streamed for t in o.token_ids] and len(out.token_ids) == 12
    assert out.text_delta == "".join(o.text_delta for o in streamed)
    assert (out.prompt_tokens, out.completion_tokens) == (streamed[-1].prompt_tokens, streamed[-1].completion_tokens)
    assert out.timings.first_token_s is not None


def test_an_aborted_final_only_request_gets_its_final_output(tiny):
    engine = engine_for(tiny)
    got = []
    engine.add_request("f", "A", PROMPT, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True), got.append,
                       final_only=True)
    assert engine.step()
    while not engine.scheduler.by_id["f"].output_token_ids:  # a state, not a sleep: run until a token exists
        assert engine.step(), "the request never produced a token"
    assert got == []
    assert engine.abort("f")
    engine.step()
    assert len(got) == 1 and got[0].finish_reason is FinishReason.ABORT and len(got[0].token_ids) >= 1
