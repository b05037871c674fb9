"""Case SC3 (../shared/cases/scheduling.md) on the real worker: tenant `bulk` (tier background) keeps
every running slot busy with 30 concurrent streamed requests (max_tokens BULK_TOKENS); tenant `chat` (tier
interactive) then sends one 20-token prompt with max_tokens 16. Right value: `chat`'s request takes
a slot at once (a background request is preempted if needed): its TTFT stays within 1.5x its TTFT on
an idle worker plus one iteration.

TTFT is asserted in engine iterations (`Timings.first_token_iterations`: iterations started after
the request reached the engine until its first token was committed), not in seconds: the worker
runs with `--max-running 30`, so bulk's 30 requests take every slot, and they hold them for hundreds of
iterations each, far longer than chat needs. The seconds are printed (`pytest -s`) and measured by
`fairshare bench scheduler --sc3` on the same construction.

Once directly over gRPC, once through the gateway with the official openai client and the tiers set
in the tenants file (chat interactive, bulk background).

Bulk's requests are long (BULK_TOKENS output tokens): for `tier_grace_iterations` (1024) iterations
after chat's last work the background takes at most 16 tokens an iteration
(worker/scheduling/decode_share.py), decodes first, so it fills every slot only once the grace is
over, and its requests must still be running then.
"""

from __future__ import annotations

import math
import threading

import pytest

from tests.integration.sched_cases import (Stream, cancel_all, load, prompt, request, stub_for, tenants, wait_for,
                                           worker)
from tests.support.waits import join_all

SLOTS = 30
BULK_TOKENS = 1536  # outlasts the grace at 16 tokens an iteration shared by ~16 running requests


@pytest.fixture(scope="module")
def sc3_worker(tmp_path_factory):
    yield from worker(tmp_path_factory, "sc3-worker", "--max-running", str(SLOTS))


def test_case_sc3_interactive_request_takes_a_slot_at_once(sc3_worker):
    stub = stub_for(sc3_worker)
    idle = Stream(stub, request("chat", "interactive", prompt(20, 1), 16)).join()
    assert idle.tokens == 16 and idle.first_token_iterations >= 1
    wait_for(stub, lambda ld: ld.running == 0 and ld.kv_blocks_used == 0, "idle after chat's solo request")

    bulk = [Stream(stub, request("bulk", "background", prompt(32, 100 + i), BULK_TOKENS)) for i in range(SLOTS)]
    try:
        ld = wait_for(stub, lambda ld: tenants(ld).get("bulk") is not None and tenants(ld)["bulk"].running == SLOTS,
                      f"bulk holds all {SLOTS} running slots")
        assert ld.running == SLOTS and ld.tier_scheduling
        chat = Stream(stub, request("chat", "interactive", prompt(20, 2), 16)).join()
        after = load(stub)
        by = tenants(after)
        print(f"SC3: chat TTFT {chat.first_token_iterations} iteration(s) / {chat.first_token_s:.3f} s beside "
              f"{SLOTS} bulk streams; idle {idle.first_token_iterations} iteration(s) / {idle.first_token_s:.3f} s")
        assert chat.tokens == 16
        # its TTFT within 1.5x its idle TTFT plus one iteration, in iterations
        assert chat.first_token_iterations <= math.floor(1.5 * idle.first_token_iterations) + 1
        # it took a slot at once: a bulk request was preempted for it, and none of bulk's had ended
        assert after.tier_preemptions >= 1 and by["bulk"].preemptions >= 1 and by["chat"].preemptions == 0
        assert by["bulk"].finished == 0
    finally:
        cancel_all(stub, bulk)


def test_case_sc3_through_the_gateway_with_tiers_from_the_tenants_file(sc3_worker, gateway_factory):
    """The same through the gateway: the tenants file gives chat the interactive tier and bulk the
    background tier; the official openai client streams. While bulk's 30 streams hold every slot,
    chat's request is served to completion before any of bulk's ends, by preempting bulk's work."""
    gw = gateway_factory([{"id": "chat", "tier": "interactive"}, {"id": "bulk", "tier": "background"}],
                         workers=[sc3_worker])
    stub = stub_for(sc3_worker)
    wait_for(stub, lambda ld: ld.running == 0, "idle worker before the gateway case")
    before = tenants(load(stub))
    bulk_finished = before["bulk"].finished if "bulk" in before else 0
    bulk_preempted = before["bulk"].preemptions if "bulk" in before else 0
    tier_preempted = load(stub).tier_preemptions
    client = gw.client("bulk", timeout=600.0)
    stop = threading.Event()

    def bulk_stream(i: int) -> None:
        s = client.chat.completions.create(model="random-tiny", messages=[{"role": "user", "content": f"bulk job {i}"}],
                                           max_tokens=BULK_TOKENS, stream=True, extra_body={"ignore_eos": True})
        with s:  # closed by its own reader: a close from the test's thread can leave this read blocked
            for _ in s:
                if stop.is_set():
                    break

    threads = [threading.Thread(target=bulk_stream, args=(i,), daemon=True) for i in range(SLOTS)]
    for t in threads:
        t.start()
    try:
        wait_for(stub, lambda ld: tenants(ld).get("bulk") is not None and tenants(ld)["bulk"].running == SLOTS,
                 f"bulk (through the gateway) holds all {SLOTS} running slots")
        chat = gw.client("chat").chat.completions.create(
            model="random-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        for chunk in chat:
            if chunk.usage is not None:
                usage = chunk.usage
        after = load(stub)
        by = tenants(after)
        assert usage is not None and usage.completion_tokens == 16
        assert by["chat"].tier == 1 and by["bulk"].tier == 3  # TIER_INTERACTIVE, TIER_BACKGROUND from the tenants file
        assert by["bulk"].finished == bulk_finished  # chat did not wait for a bulk request to end
        assert by["bulk"].preemptions > bulk_preempted and after.tier_preemptions > tier_preempted
        assert by["chat"].preemptions == 0
    finally:
        stop.set()  # each reader ends at its next chunk (bulk keeps decoding) and closes its stream
        join_all(threads, "every bulk reader ended after the stop")
        wait_for(stub, lambda ld: ld.running == 0 and ld.waiting == 0 and ld.kv_blocks_used == 0,
                 "idle after closing every bulk stream (no KV block leaked)")
