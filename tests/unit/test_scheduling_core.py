"""The scheduling core's pieces (worker/scheduling/{core,ledger,tiers,decode_share,preemption}.py) and
the tier behaviour the issue measured on the old scheduler (service split 0.500 / 0.500 between an
interactive and a background tenant; the interactive request preempted for a background decode)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.unit.sched_steps import step
from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import SamplingParams, Sequence, SequenceStatus
from worker.scheduling.cost import LinearCost
from worker.scheduling.decode_share import split_by_tier, water_fill
from worker.scheduling.ledger import MIN_SHARE, RESERVATION, TIER, KVLedger
from worker.scheduling.policy import make_policy
from worker.scheduling.tiers import TierShares, validate_min_shares

_n = [0]


def seq(tenant, prompt=32, out=64, tier="interactive", weight=1.0):
    _n[0] += 1
    return Sequence(f"c{_n[0]}", tenant, [1000 + _n[0]] + [1] * (prompt - 1), SamplingParams(max_tokens=out),
                    weight=weight, tier=tier, max_tokens=out)


def test_the_core_imports_no_torch_grpc_sglang_or_engine():
    code = ("import sys, worker.scheduling.core, worker.scheduling.preemption, worker.scheduling.decode_share; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'grpc', 'sglang') "
            "or m.startswith('worker.engine')]; print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


# ---- ledger -------------------------------------------------------------------------------------
def test_a_holder_sees_only_the_holds_made_before_its_own():
    led = KVLedger(100, 4)
    led.sync(free=20, promised=5, running=2)
    led.hold(TIER, "a", "ra", 1, 10)
    led.hold(MIN_SHARE, "b", "rb", 1, 10)
    assert led.room("a", "ra") == 15 and led.free_slots("a", "ra") == 2      # nothing ahead of a's hold
    assert led.room("b", "rb") == 5 and led.free_slots("b", "rb") == 1       # a's hold is ahead of b's
    assert led.room("c", "rc") == -5 and led.free_slots("c", "rc") == 0      # both ahead of anyone else
    led.on_admit("a", "ra", 10)                                              # a's hold is used up
    assert [h.tenant_id for h in led.holds] == ["b"] and led.promised == 15 and led.running == 3
    led.new_iteration()
    assert led.holds == []


def test_the_reservation_holder_may_use_the_headroom_others_may_not():
    led = KVLedger(100, 8, headroom_blocks=5)
    led.sync(free=12, promised=0, running=1)
    led.hold(RESERVATION, "big", "r1", 0, 12)
    assert led.room("big", "r1") == 12 and led.room("small", "r2") == -5
    led.new_iteration()
    assert led.reservation() is not None  # kept across iterations until admitted or dropped


# ---- tiers ----------------------------------------------------------------------------------------
def test_deficit_accrues_clamps_and_drops_when_idle():
    t = TierShares({"background": 0.1}, floor_units=50)
    t.set_backlogged("background", True)
    t.charge("interactive", 100)
    assert t.deficit["background"] == pytest.approx(10) and t.owed("background")
    assert t.pick(["interactive", "background"]) == "background"
    t.charge("background", 1000)                       # far more than its share: clamped at -floor
    assert t.deficit["background"] == -50 and not t.owed("background")
    assert t.pick(["interactive", "background"]) == "interactive" and t.preemptible("background")
    t.charge("interactive", 700)                      # back to +20: owed again, not preemptible
    t.set_backlogged("background", False)              # no credit for idling
    assert t.deficit["background"] == 0 and t.preemptible("background")
    assert t.deficit["batch"] == 0                     # not backlogged: its deficit never moved


def test_min_share_validation():
    assert validate_min_shares({}) == {"batch": 0.05, "background": 0.05}
    for bad in ({"interactive": 0.1}, {"gold": 0.1}, {"batch": 1.0}, {"batch": 0.6, "background": 0.5}):
        with pytest.raises(ValueError):
            validate_min_shares(bad)


def test_water_fill_and_split_by_tier():
    assert water_fill({"a": 30, "b": 30}, {"a": 1, "b": 3}, 32) == {"a": 8, "b": 24}
    assert water_fill({"a": 30, "b": 5}, {"a": 1, "b": 3}, 32) == {"a": 27, "b": 5}   # b gives the rest away
    assert sum(water_fill({"a": 1, "b": 1, "c": 1}, {"a": 1, "b": 1, "c": 1}, 2).values()) == 2
    # fractional slots: by tenant id, or by `first` (the longest-waiting tenant) when given
    assert water_fill({"a": 2, "b": 2}, {"a": 1, "b": 1}, 1) == {"a": 1, "b": 0}
    assert water_fill({"a": 2, "b": 2}, {"a": 1, "b": 1}, 1, {"a": 7, "b": 3}) == {"a": 0, "b": 1}


def test_a_lower_tiers_few_tokens_rotate_among_its_tenants():
    """Beside an interactive tenant's work the background tier gets one token an iteration (the
    lower-tier token target's default): its tenants' decodes take turns, the one that waited
    longest first, instead of the first tenant id taking every one."""
    sched = Scheduler(make_policy("vtc"), LinearCost(), BlockManager(400, 16), 512, 16,
                      tiers=TierShares({"batch": 0.0, "background": 0.0}), lower_tier_token_target=1)
    bg = [seq("ga", out=400, tier="background"), seq("gb", out=400, tier="background")]
    for q in bg:
        sched.add(q)
    while not all(q.output_token_ids for q in bg):
        step(sched)   # the background alone: whole iterations
    chat = seq("chat", out=400)
    sched.add(chat)
    step(sched)
    assert chat.output_token_ids, "the interactive request decodes from the step after its arrival"
    before = [len(q.output_token_ids) for q in bg]
    for _ in range(20):
        step(sched)
    gained = [len(q.output_token_ids) - b for q, b in zip(bg, before)]
    assert sum(gained) == 20 and gained == [10, 10], gained
    order = ["interactive", "batch", "background"]
    assert split_by_tier({"interactive": 60, "background": 10}, order, {"background": 0.05}, 32) == \
        {"interactive": 30, "background": 2}


def test_a_lower_tier_arrival_is_not_held_behind_its_tiers_running_decodes():
    """Beside interactive work the batch tier gets one token an iteration. A batch request that
    arrives while another batch request decodes gets its prompt in (its prefill and the tier's
    decodes take turns, whichever waited longer first), instead of waiting for the interactive
    tier to go idle: it reaches its first token within twice its prompt length in iterations."""
    sched = Scheduler(make_policy("vtc"), LinearCost(), BlockManager(400, 16), 512, 16,
                      tiers=TierShares({"batch": 0.0, "background": 0.0}), lower_tier_token_target=1)
    chat, running = seq("chat", out=2000), seq("bulk", out=2000, tier="batch")
    for q in (chat, running):
        sched.add(q)
    while not (chat.output_token_ids and running.output_token_ids):
        step(sched)
    late = seq("bulk2", prompt=24, out=4, tier="batch")
    sched.add(late)
    for i in range(2 * 24 + 2):
        step(sched)
        if late.output_token_ids:
            break
    assert late.output_token_ids, "the batch arrival never got its first token beside the running batch decode"
    assert len(running.output_token_ids) >= 24, "the running batch decode kept about half of the tier's tokens"


# ---- the measurements, on the core --------------------------------------------------------
def both_backlogged(tiers: bool, iterations=600):
    sched = Scheduler(make_policy("vtc"), LinearCost(), BlockManager(512, 16), 256, 16,
                      tiers=TierShares(floor_units=128, enabled=tiers))
    for _ in range(300):
        sched.add(seq("chat", 100, 64, "interactive"))
        sched.add(seq("bulk", 100, 64, "background"))
    for _ in range(iterations):
        step(sched)
    return sched


def test_interactive_is_served_first_and_background_keeps_its_minimum_share():
    """Both tenants weight 1 and backlogged: the old scheduler split 0.500 / 0.500. With tiers the
    background tenant gets its minimum share (5 %) and no more than a little above it."""
    shares = both_backlogged(True).core.tiers.shares_of_service()
    assert 0.05 - 0.01 <= shares["background"] <= 0.10 and shares["interactive"] >= 0.90
    blind = both_backlogged(False).core.tiers.shares_of_service()
    assert blind["interactive"] == pytest.approx(0.5, abs=0.02)  # tier-blind: one tier, VTC splits evenly


def test_an_interactive_decode_is_never_preempted_for_a_background_one():
    """The old out-of-blocks victim was the newest admission whatever its tier: an interactive
    request admitted after background ones was preempted so a background decode could go on. Now
    a decode out of blocks takes from its own tier or a lower one only."""
    sched = Scheduler(make_policy("vtc"), LinearCost(), BlockManager(12, 16), 512, 8)
    bulk = [seq("bulk", 32, 200, "background") for _ in range(4)]    # 2 blocks each, growing
    for s in bulk:
        sched.add(s)
    step(sched)
    chat = seq("chat", 32, 200, "interactive")
    sched.add(chat)
    victims = []
    sched.core.subscribe(lambda v, reason, req: victims.append((v.tenant_id, reason, req and req.tenant_id)))
    for _ in range(150):
        step(sched)
    assert chat.num_preemptions == 0 and chat.status is SequenceStatus.RUNNING or chat.is_finished
    assert victims and all(v == "bulk" for v, _, _ in victims)
    assert sum(s.num_preemptions for s in bulk) >= 1


def test_admission_order_puts_higher_tiers_first_and_follows_vtc_within_a_tier():
    """What an executor with its own waiting queue (SGLang's calc_priority) sorts by."""
    sched = Scheduler(make_policy("vtc"), LinearCost(), BlockManager(1000, 16), 256, 8)
    b1, b2 = seq("bulk", tier="background"), seq("bulk", tier="background")
    a, c = seq("a", 64), seq("c", 64, weight=2.0)
    a2 = seq("a", 64)
    for s in (b1, b2, a, a2, c):
        sched.add(s)
    order = sched.core.admission_order()
    assert order[-2:] == [b1, b2]                     # the lower tier after every interactive request
    assert order.index(a) < order.index(a2)          # a tenant's queue in order
    assert order.index(c) < order.index(a2)          # c's projected counter (64/2) before a's second head (64)


def test_service_per_tier_reaches_the_snapshot_and_prometheus():
    """Engine.snapshot()["tiers"] (what GetLoad's TierLoad and the fairness report read) and the
    Prometheus tier series, from a simulated engine with an interactive and a background tenant."""
    from prometheus_client.parser import text_string_to_metric_families

    from worker.engine.engine import Engine, EngineConfig
    from worker.metrics import WorkerMetrics
    from loadtests.sim.runner import IterationTimeModel, SimModel, SimulatedRunner, VirtualClock

    clock = VirtualClock()
    engine = Engine(SimModel(), EngineConfig(max_running=4, num_kv_blocks=256),
                    SimulatedRunner(clock, IterationTimeModel(0.01, 0, 0, 0), 256), clock=clock)
    for i in range(40):
        for tenant, tier in (("chat", "interactive"), ("bulk", "background")):
            engine.add_request(f"{tenant}-{i}", tenant, [100 + i] + [1] * 63,
                               SamplingParams(max_tokens=16, ignore_eos=True), lambda o: None, tier=tier)
    for _ in range(200):
        engine.step()
    snap = engine.snapshot()
    t = snap["tiers"]
    assert t["interactive"]["service"] > t["background"]["service"] > 0
    assert t["background"]["min_share"] == 0.05 and t["interactive"]["min_share"] == 0.0
    assert snap["tier_scheduling"] and set(snap["preemptions_by_reason"]) == {"out-of-blocks", "reclaim", "tier",
                                                                             "returning"}
    samples = {}
    for fam in text_string_to_metric_families(WorkerMetrics(engine).render().decode()):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("fairshare_worker_tier_charged_service_units_total", (("tier", "background"),))] == \
        t["background"]["service"]
    assert samples[("fairshare_worker_tier_min_share", (("tier", "batch"),))] == 0.05
    assert ("fairshare_worker_preemptions_total", (("reason", "tier"),)) in samples


def test_drr_admission_order_grants_quanta_as_the_picks_do():
    """Issue 17: SGLang's plugin ranked tenants by DRRPolicy.order(), which never grants a quantum,
    so one tenant's whole queue went first (heads A0 A1 A2 ..., B never first). The core's
    admission order under DRR follows the rounds: the same sequence as pick() followed by a charge
    of each head's prefill, weights respected, and the policy's state untouched."""
    from worker.scheduling.drr import DRRPolicy

    cost = LinearCost()
    sched = Scheduler(make_policy("drr"), cost, BlockManager(1000, 16), 256, 8)
    reqs = [seq("w1", 192, 32) for _ in range(12)] + [seq("w3", 192, 32, weight=3.0) for _ in range(12)]
    for s in reqs:
        sched.add(s)
    policy = sched.core.policy
    before = (dict(policy.deficit), policy._ptr, policy._fresh)
    order = [s.tenant_id for s in sched.core.admission_order()]
    assert (dict(policy.deficit), policy._ptr, policy._fresh) == before  # a projection, no side effect
    assert sorted(order) == sorted(s.tenant_id for s in reqs)

    ref = DRRPolicy(cost, quantum=policy.quantum)   # the definition: pick, then charge the head's prefill
    queued = {"w1": 12, "w3": 12}
    for t, w in (("w1", 1.0), ("w3", 3.0)):
        ref.account(t, w, "interactive")
        ref.on_arrival(t, w, "interactive")
    picks = []
    while any(queued.values()):
        t = ref.pick([t for t, n in queued.items() if n], {})
        picks.append(t)
        ref.charge(t, cost.prefill(192))
        queued[t] -= 1
    assert order == picks
    assert "w3" in order[:6] and order[:12].count("w3") >= 2 * order[:12].count("w1")   # 3 : 1 while both queue
    assert order[:12] != ["w1"] * 12                                                    # not tenant by tenant


# ---- the partial-prefill limit (SGLang's one chunked request) ----------------------------------------
def _long_prefills(limit):
    sched = Scheduler(make_policy("vtc"), LinearCost(), BlockManager(1000, 16), 256, 8, prefill_slice=256,
                      max_partial_prefills=limit)
    a, b = seq("a", 400, 4), seq("b", 400, 4)
    sched.add(a)
    sched.add(b)
    first = {c.seq.request_id: c.num_tokens for c in step(sched)}
    assert first == {a.request_id: 256}  # equal counters: a (first seen) takes the whole chunk
    return sched, a, b, {c.seq.request_id: c.num_tokens for c in step(sched)}


def test_with_one_partial_prefill_allowed_a_second_waits_until_the_first_finishes():
    """Unlimited, b (the smaller counter) takes the whole chunk and a is left mid-prefill beside
    it; with `max_partial_prefills=1` b's 400-token prompt cannot start while a's is unfinished, so
    a finishes first (144 tokens) and b, now the only partial prefill, takes the other 112."""
    _, a, b, free = _long_prefills(None)
    assert free == {b.request_id: 256}
    _, a, b, one = _long_prefills(1)
    assert one == {a.request_id: 144, b.request_id: 112}


def test_the_partial_prefill_limit_holds_throughout_and_everything_finishes():
    """Random-ish mix of prompts shorter and longer than the chunk, three tenants: after every
    iteration at most one request is mid-prefill, a short prompt still gets in beside a partial one
    (it finishes in the pick), and every request finishes."""
    sched = Scheduler(make_policy("vtc"), LinearCost(), BlockManager(2000, 16), 256, 6, prefill_slice=256,
                      max_partial_prefills=1)
    seqs = [seq(t, p, 8) for t, p in [("a", 600), ("b", 40), ("c", 300), ("a", 90), ("b", 500), ("c", 20)] * 3]
    for s in seqs:
        sched.add(s)
    beside = 0
    for _ in range(400):
        chunks = step(sched)
        mid = [s for s in sched.running if s.num_uncomputed > 1]
        assert len(mid) <= 1, [(s.request_id, s.num_uncomputed) for s in mid]
        prefills = [c for c in chunks if c.num_tokens > 1]
        beside += len(prefills) >= 2 and bool(mid)
        if not sched.has_work():
            break
    assert all(s.is_finished for s in seqs) and beside > 0
    with pytest.raises(ValueError):
        Scheduler(make_policy("vtc"), LinearCost(), BlockManager(10, 16), 256, 8, max_partial_prefills=0)
