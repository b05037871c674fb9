"""The one victim rule (`RoomMaker.victims_in_order`, worker/scheduling/preemption.py): the reference
engine's out-of-blocks and tier preemptions take their victims from it, and the SGLang plugin's decode
retraction order is it (tests/sglang/test_plugin_state.py checks that side)."""

from __future__ import annotations

from tests.unit.sched_steps import make_seq, step
from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler
from worker.scheduling.cost import LinearCost
from worker.scheduling.policy import make_policy
from worker.scheduling.quota import KVQuota, KVQuotaConfig


def running_scheduler(specs, blocks=100, quota=None):
    """A reference scheduler with `specs` [(tenant, tier)] admitted one per step, in this order, and
    decoding. The lower-tier token target is off: at its default (one token an iteration beside a
    higher tier) a second background prompt waits behind the first one's decodes, and the order of
    victims, not that rule, is what these tests look at."""
    sched = Scheduler(make_policy("vtc"), LinearCost(), BlockManager(blocks, 16), 512, 16, quota=quota,
                      lower_tier_token_target=None)
    seqs = []
    for tenant, tier in specs:
        s = make_seq(tenant, 32, 64, tier=tier)
        seqs.append(s)
        sched.add(s)
        # a lower tier's prefill may take several steps beside a higher tier (its token target)
        for _ in range(64):
            step(sched)
            if s.request_id in sched.core.running and s.output_token_ids:
                break
        assert s.request_id in sched.core.running, f"{s.request_id} ({tier}) admitted and decoding within 64 steps"
    assert len(sched.core.running) == len(specs), "every request admitted and running"
    return sched, seqs


def ids(entries):
    return [e.request_id for e in entries]


def test_lowest_tier_first_then_newest_admission_and_the_requester_last():
    sched, s = running_scheduler([("i", "interactive"), ("g", "background"), ("i", "interactive"),
                                  ("g", "background"), ("b", "batch")])
    room = sched.core.room
    assert ids(room.victims_in_order()) == [s[3].request_id, s[1].request_id, s[4].request_id,
                                            s[2].request_id, s[0].request_id]
    # for an interactive decode: every tier may be taken (lowest first); the requester comes last
    req = sched.core.entries[s[0].request_id]
    order = ids(room.victims_in_order(requester=req))
    assert order[-1] == s[0].request_id and order[:2] == [s[3].request_id, s[1].request_id]
    assert sched.core.decode_victim(req).request_id == order[0]         # the reference's victim: the first
    # for a background decode: only its own tier, then itself
    bg = sched.core.entries[s[1].request_id]
    assert ids(room.victims_in_order(requester=bg)) == [s[3].request_id, s[1].request_id]
    # tier preemption for a batch head: strictly lower tiers only, never the requester
    head = sched.core.entries[s[4].request_id]
    assert ids(room.victims_in_order(requester=head, reason="tier")) == [s[3].request_id, s[1].request_id]


def test_with_kv_quotas_the_tenant_over_its_soft_quota_goes_first():
    quota = KVQuota(KVQuotaConfig(enabled=True, headroom=0.0, watermark=1.0, soft={"a": 0.04}), 100)
    sched, s = running_scheduler([("a", "interactive")] * 4 + [("b", "interactive")], quota=quota)
    held = {e.request_id: sched.core.executor.blocks_held(e.handle) for e in sched.core.running.values()}
    soft = quota.soft_blocks("a")
    order = ids(sched.core.room.victims_in_order())
    a_newest_first = [x.request_id for x in s[3::-1]]
    # a is over its soft quota (4 blocks): its newest requests go first while it stays over, then
    # the newest admission (b's), then a's older requests
    over, left = [], sum(held[r] for r in a_newest_first)
    for r in a_newest_first:
        if left <= soft:
            break
        over.append(r)
        left -= held[r]
    assert len(over) >= 2 and order[:len(over)] == over
    assert order[len(over)] == s[4].request_id
    assert order == over + [s[4].request_id] + [r for r in a_newest_first if r not in over]
    assert ids(Scheduler(make_policy("vtc"), LinearCost(), BlockManager(10, 16), 512, 4).core.room.victims_in_order()) == []
