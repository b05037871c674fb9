"""Case SC5 (../shared/cases/scheduling.md) on the real worker: the KV pool is full of `bulk`'s
(background) running decodes; `chat` (interactive) sends a request that needs blocks. Right value:
`bulk`'s work is preempted (recompute) to make room; `chat`'s running work is never preempted for
`bulk`; the preempted request resumes before `bulk`'s newer requests.

Construction (sizes in tokens, so the state lasts): a pool of 8 blocks of 256 tokens. Bulk's first
8 requests (100-token prompts, 150 output tokens) take one block each and never need a second one,
so the pool stays exactly full for 150 iterations; bulk's 2 newer requests wait for a block. Chat's
request (250-token prompt, 20 output tokens) needs a block to be admitted and, 6 tokens later, a
second one for its own decodes: both are taken from bulk (tier preemption, then out of blocks with
bulk as the victim), never from chat. Event order across streams comes from the engine iteration
each message carries.
"""

from __future__ import annotations

import pytest

from tests.integration.sched_cases import Stream, cancel_all, load, prompt, request, stub_for, tenants, wait_for, worker

BLOCKS, BLOCK = 8, 256


@pytest.fixture(scope="module")
def sc5_worker(tmp_path_factory):
    yield from worker(tmp_path_factory, "sc5-worker", "--num-kv-blocks", str(BLOCKS), "--block-size", str(BLOCK),
                      "--max-running", "64")


def test_case_sc5_background_is_preempted_for_interactive_memory_never_the_reverse(sc5_worker):
    stub = stub_for(sc5_worker)
    first = [Stream(stub, request("bulk", "background", prompt(100, i), 150)) for i in range(BLOCKS)]
    streams = list(first)
    try:
        wait_for(stub, lambda ld: tenants(ld).get("bulk") is not None and tenants(ld)["bulk"].running == BLOCKS
                 and ld.kv_blocks_used == BLOCKS, f"the pool's {BLOCKS} blocks all held by bulk's running decodes")
        newer = [Stream(stub, request("bulk", "background", prompt(100, 50 + i), 150)) for i in range(2)]
        streams += newer
        ld = wait_for(stub, lambda ld: tenants(ld)["bulk"].waiting == 2, "bulk's 2 newer requests waiting for a block")
        assert ld.kv_blocks_used == BLOCKS and tenants(ld)["bulk"].running == BLOCKS
        chat = Stream(stub, request("chat", "interactive", prompt(250, 99), 20))
        streams.append(chat)
        chat.join()
        after = load(stub)
        by = tenants(after)
        assert chat.tokens == 20 and chat.first_token_iterations <= 2
        # bulk's work made the room: for chat's admission (tier) and for chat's second block
        assert after.tier_preemptions >= 1 and by["bulk"].preemptions >= 2
        assert by["chat"].preemptions == 0            # chat's running work is never preempted for bulk
        # the preempted requests resume before bulk's newer requests: wait until the newer ones have
        # their first tokens (once the first wave's requests end), then compare iterations
        wait_for(stub, lambda ld: all(s.first_iteration() is not None for s in newer),
                 "bulk's newer requests streaming (admitted once the first wave's requests ended)")
        preempted = [s for s in first if s.resumed_after_gap() is not None]
        assert len(preempted) >= 2, "the preempted bulk requests show no pause in their streams"
        resumed = max(s.resumed_after_gap() for s in preempted)
        assert all(s.first_iteration() >= resumed for s in newer), (
            [s.resumed_after_gap() for s in preempted], [s.first_iteration() for s in newer])
    finally:
        cancel_all(stub, streams)
