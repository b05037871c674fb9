"""Case SC4 (../shared/cases/scheduling.md) on the real worker: tenant `chat` (interactive) keeps the
worker saturated; tenant `bulk` (background, minimum share 5 %) is backlogged the whole time. Right
value: `bulk` receives at least 5 % of the charged service over the window (less one prefill
chunk); it is never starved for longer than the window the minimum share implies.

The window is counted in engine iterations, not seconds: chat's 200 requests and bulk's 40 are
sized (in tokens) so that both tiers stay backlogged for far more than the 400 iterations measured
on a worker with 8 running slots and a 256-token chunk, and the test waits on GetLoad's iteration
counter and each tier's `backlogged` flag (a wait that fails names the state that never came).
Service per tier is GetLoad's `TierLoad.charged_service` at both ends of the window.
"""

from __future__ import annotations

import pytest

from tests.integration.sched_cases import Stream, cancel_all, load, prompt, request, stub_for, tiers, wait_for, worker

CHUNK = 256
WINDOW = 400  # iterations


@pytest.fixture(scope="module")
def sc4_worker(tmp_path_factory):
    yield from worker(tmp_path_factory, "sc4-worker", "--max-running", "8", "--max-num-batched-tokens", str(CHUNK),
                      "--tier-min-share", "background=0.05")


def _both_backlogged(ld) -> bool:
    t = tiers(ld)
    return t["interactive"].backlogged and t["background"].backlogged and t["interactive"].waiting > 0 \
        and t["background"].waiting > 0


def test_case_sc4_background_keeps_its_minimum_share_beside_a_saturating_interactive_tenant(sc4_worker):
    stub = stub_for(sc4_worker)
    chat = [Stream(stub, request("chat", "interactive", prompt(96, i), 32)) for i in range(200)]
    bulk = [Stream(stub, request("bulk", "background", prompt(96, 1000 + i), 24)) for i in range(40)]
    try:
        start = wait_for(stub, _both_backlogged, "both tiers backlogged with requests queued")
        end = wait_for(stub, lambda ld: ld.iterations >= start.iterations + WINDOW,
                       f"{WINDOW} iterations after both tiers became backlogged")
        assert _both_backlogged(end), f"a tier stopped being backlogged inside the window: {end}"
        a, b = tiers(start), tiers(end)
        total = sum(b[t].charged_service - a[t].charged_service for t in b)
        got = b["background"].charged_service - a["background"].charged_service
        chat_got = b["interactive"].charged_service - a["interactive"].charged_service
        print(f"SC4: over {end.iterations - start.iterations} iterations bulk got {got:.0f} of {total:.0f} service units "
              f"({got / total:.1%}; minimum share 5 %), chat {chat_got / total:.1%}; bulk blocked "
              f"{b['background'].blocked_iterations - a['background'].blocked_iterations} iterations")
        assert b["background"].min_share == pytest.approx(0.05)
        assert got >= 0.05 * total - CHUNK                 # at least its minimum share, less one prefill chunk
        assert chat_got >= 0.8 * total                     # strict priority: it is not an even split either
        assert b["background"].running + b["background"].waiting > 0
        # never starved: bulk requests keep finishing inside the window
        assert end.tenants and {t.tenant_id: t for t in end.tenants}["bulk"].finished > \
            {t.tenant_id: t for t in start.tenants}["bulk"].finished
    finally:
        cancel_all(stub, chat + bulk)
    assert load(stub).kv_blocks_used == 0
