"""fairshare.checks.require_at_least: the one size check of the core, ledger, block manager, model runner
and simulator, and that those constructors refuse bad sizes through it."""

from __future__ import annotations

import re

import pytest

from fairshare.checks import require_at_least
from loadtests.sim.runner import IterationTimeModel, SimulatedRunner, VirtualClock
from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler
from worker.scheduling.cost import LinearCost
from worker.scheduling.ledger import KVLedger
from worker.scheduling.policy import make_policy


def test_names_every_value_below_the_minimum_and_skips_unset_ones():
    require_at_least(1, a=1, b=2.5, c=None)
    with pytest.raises(ValueError) as e:
        require_at_least(1, a=0, b=3, c=-2)
    assert str(e.value) == "a must be >= 1 (got 0); c must be >= 1 (got -2)"
    with pytest.raises(ValueError, match=r"^jitter must be >= 0 \(got -0.1\)$"):
        require_at_least(0, jitter=-0.1)
    with pytest.raises(ValueError, match=r"must be >= 0.5"):
        require_at_least(0.5, x=0.25)


def _scheduler(**kw):
    cost = LinearCost(1.0, 2.0)
    return Scheduler(make_policy("vtc", cost), cost, BlockManager(64, 16), **kw)


@pytest.mark.parametrize("build, names", [
    (lambda: _scheduler(max_num_batched_tokens=0), "chunk_tokens"),
    (lambda: _scheduler(max_running=0), "max_running"),
    (lambda: _scheduler(prefill_slice=0), "prefill_slice"),
    (lambda: _scheduler(lower_tier_token_target=0), "lower_tier_token_target"),
    (lambda: KVLedger(8, 2, headroom_blocks=-1), "headroom_blocks"),
    (lambda: KVLedger(0, 0), "total_blocks must be >= 1 (got 0); max_running"),
    (lambda: BlockManager(0, 16), "num_blocks"),
    (lambda: SimulatedRunner(VirtualClock(), IterationTimeModel(0.01, 0.0, 0.0, 0.0), 16, block_size=0), "block_size"),
    (lambda: SimulatedRunner(VirtualClock(), IterationTimeModel(0.01, 0.0, 0.0, 0.0), 16, jitter=-1.0), "jitter must be >= 0"),
])
def test_constructors_refuse_bad_sizes_naming_them(build, names):
    with pytest.raises(ValueError, match=re.escape(names)):
        build()


def test_a_fresh_ledger_is_an_empty_pool():
    led = KVLedger(8, 2, headroom_blocks=1)
    assert (led.free, led.promised, led.running, led.holds) == (8, 0, 0, [])
