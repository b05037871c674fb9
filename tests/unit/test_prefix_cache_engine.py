"""The prefix cache inside the real engine (random-tiny Llama, real forward passes): a cache hit
reuses the matched blocks' K/V with the same logits and greedy tokens as a run without the cache,
namespaces keep tenants and salts apart, cached prompt tokens are charged at the declared rate,
the TTFT floor holds back first tokens, and the simulator's iteration time counts only computed
tokens."""

from __future__ import annotations

import pytest
import torch

from worker.engine.engine import Engine, EngineConfig
from worker.engine.sequence import SamplingParams
from loadtests.sim.runner import IterationTimeModel, SimModel, SimulatedRunner, VirtualClock

PROMPT = [(7 * j) % 500 + 3 for j in range(100)]          # 6 whole blocks of 16 + 4 tokens


@pytest.fixture(scope="module")
def tiny():
    from worker.models import load_model

    return load_model("random-tiny", progress=False)


class Recorder:
    """Wraps a runner: keeps the logits row of every item that ends a prompt."""

    def __init__(self, inner):
        self.inner = inner
        self.block_size, self.num_kv_blocks, self.vocab_size = inner.block_size, inner.num_kv_blocks, inner.vocab_size
        self.last_prompt_logits: list[torch.Tensor] = []
        self.prompt_len = None

    def forward(self, items):
        out = self.inner.forward(items)
        for i, it in enumerate(items):
            if it.start_pos + len(it.token_ids) == self.prompt_len:
                self.last_prompt_logits.append(out[i].clone())
        return out


def run(engine, requests):
    """requests: [(request id, tenant, prompt, salt)], each run to completion in turn. Returns
    {request id: (tokens, cached tokens, first_token_s)}."""
    outs: dict[str, list] = {}

    def cb(o):
        d = outs.setdefault(o.request_id, [[], 0, None])
        d[0] += o.token_ids
        if o.timings.first_token_s is not None and d[2] is None and o.token_ids:
            d[2] = o.timings.first_token_s
        if o.finish_reason is not None:
            d[1] = o.cached_tokens

    for rid, tenant, prompt, salt in requests:
        engine.add_request(rid, tenant, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), cb,
                           cache_salt=salt)
        while engine.step():
            pass
    return {k: tuple(v) for k, v in outs.items()}


def make(tiny, **cfg):
    from worker.engine.model_runner import ModelRunner

    rec = Recorder(ModelRunner(tiny, num_kv_blocks=128, block_size=16))
    rec.prompt_len = len(PROMPT)
    return Engine(tiny, EngineConfig(**cfg), rec), rec


def test_cache_hit_reuses_kv_with_the_same_logits_and_tokens(tiny):
    cached, rec = make(tiny)
    got = run(cached, [("a1", "A", PROMPT, ""), ("a2", "A", PROMPT, "")])
    assert got["a1"][1] == 0 and got["a2"][1] == 96
    plain, rec0 = make(tiny, prefix_cache=False)
    ref = run(plain, [("r", "A", PROMPT, "")])
    assert got["a2"][0] == got["a1"][0] == ref["r"][0]
    first, hit, base = rec.last_prompt_logits[0], rec.last_prompt_logits[1], rec0.last_prompt_logits[0]
    assert torch.allclose(hit, base, atol=1e-4, rtol=1e-4) and torch.allclose(first, base, atol=1e-4, rtol=1e-4)
    # control: the hit really reads the cached blocks (spoil their K/V and the logits change)
    blocks, n = cached.cache.match_prefix(cached_namespace(cached, "A"), PROMPT[:-1])
    assert n == 96
    cached.runner.inner.kv_cache[:, blocks] = 0
    run(cached, [("a3", "A", PROMPT, "")])
    assert not torch.allclose(rec.last_prompt_logits[2], base, atol=1e-3)


def cached_namespace(engine, tenant, salt=""):
    from worker.cache.namespace import derive_namespace

    return derive_namespace(engine.cache_secret, tenant, salt)


def test_namespaces_keep_tenants_and_salts_apart(tiny):
    engine, _ = make(tiny, cache_secret=b"k" * 32)
    ns_a = cached_namespace(engine, "A")
    got = run(engine, [("a1", "A", PROMPT, ""), ("b1", "B", PROMPT, ""), ("b2", "B", PROMPT, ns_a),
                       ("b3", "B", PROMPT, "A"), ("a2", "A", PROMPT, "s1"), ("a3", "A", PROMPT, "s1"),
                       ("a4", "A", PROMPT, ""), ("b4", "B", PROMPT, "")])
    assert got["a1"][1] == 0 and got["b1"][1] == 0  # same tokens, another tenant: nothing reused
    assert got["b2"][1] == 0 and got["b3"][1] == 0  # a salt naming A's namespace or id reaches nothing
    assert got["b4"][1] == 96                       # B's own blocks
    assert got["a2"][1] == 0 and got["a3"][1] == 96  # a salt is its own namespace
    assert got["a4"][1] == 96
    snap = engine.snapshot()
    by = {t["tenant_id"]: t for t in snap["tenants"]}
    assert by["A"]["cached_prompt_tokens"] == 192 and by["A"]["cache_blocks"] == 12
    assert snap["cache_hit_tokens"] == 96 * 3 and snap["cache_blocks"] == 6 * 5


def test_unsafe_global_namespace_shares_across_tenants(tiny):
    engine, _ = make(tiny, cache_isolation=False)
    got = run(engine, [("a1", "A", PROMPT, ""), ("b1", "B", PROMPT, "other-salt")])
    assert got["b1"][1] == 96


def test_public_prefix_is_shared_and_the_rest_stays_private(tiny):
    system = PROMPT[:40]                               # 2 whole blocks are public
    engine, _ = make(tiny, public_prefixes=[system])
    b_prompt = system + [9] * 60
    got = run(engine, [("a1", "A", PROMPT, ""), ("b1", "B", b_prompt, ""), ("b2", "B", PROMPT, "")])
    assert got["b1"][1] == 32 and got["b2"][1] == 32   # only the public blocks cross tenants
    assert engine.snapshot()["cache_public_blocks"] == 2


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_cached_prompt_tokens_are_charged_at_the_declared_rate(tiny, rate):
    engine, _ = make(tiny, cached_rate=rate, alpha=1.0, beta=2.0)
    run(engine, [("a1", "A", PROMPT, ""), ("a2", "A", PROMPT, "")])
    acct = engine.policy.accounts["A"]
    first = 100 + 2 * 8
    second = 4 + rate * 96 + 2 * 8
    assert acct.charged_service == pytest.approx(first + second)
    assert acct.prompt_tokens == 104                    # computed prompt tokens only
    assert f"cached prompt tokens at {rate:g}" in engine.cost.describe()


def test_ttft_floor_holds_back_the_first_token(tiny):
    from loadtests.sim.runner import ClockedRunner

    from worker.engine.model_runner import ModelRunner

    clock = VirtualClock()
    tm = IterationTimeModel(a=0.01, b=0.0, c=0.0, d=0.0)
    runner = ClockedRunner(ModelRunner(tiny, num_kv_blocks=64, block_size=16), clock, tm)
    engine = Engine(tiny, EngineConfig(ttft_floor_s={"interactive": 0.5}), runner, clock=clock)
    seen = []
    engine.add_request("x", "A", PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       lambda o: seen.append((clock(), list(o.token_ids), o.timings.first_token_s, o.finish_reason)),
                       tier="interactive", arrival_time=0.0)
    while engine.step():
        pass
    assert seen == []                                   # finished at 0.05 s, all held back
    assert engine.next_release_time() == 0.5
    clock.advance_to(0.5)
    engine.step()
    assert len(seen) == 1 and seen[0][0] == 0.5 and len(seen[0][1]) == 4 and seen[0][2] == 0.5
    assert seen[0][3] is not None
    # another tier has no floor
    engine.add_request("y", "A", PROMPT, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                       lambda o: seen.append((clock(), list(o.token_ids), o.timings.first_token_s, o.finish_reason)),
                       tier="batch")
    while engine.step():
        pass
    assert len(seen) == 2 and seen[1][2] < 0.5


def test_simulated_runner_does_not_compute_cached_positions():
    clock = VirtualClock()
    tm = IterationTimeModel(a=0.0, b=0.001, c=0.0, d=0.0)
    runner = SimulatedRunner(clock, tm, num_kv_blocks=256, block_size=16)
    engine = Engine(SimModel(), EngineConfig(num_kv_blocks=256), runner, clock=clock)
    prompt = list(range(1, 481))                      # 480 tokens
    for rid in ("a1", "a2"):
        start = clock()
        engine.add_request(rid, "A", prompt, SamplingParams(max_tokens=1, ignore_eos=True), lambda o: None)
        while engine.step():
            pass
        if rid == "a1":
            assert clock() - start == pytest.approx(0.480)
        else:                                           # 464 cached (29 blocks): 16 tokens computed
            assert clock() - start == pytest.approx(0.016)
