"""A successful answer goes out before its settlement (docs/architecture.md, "Settlement after the
answer"): the client has its whole JSON body, or its stream to ``[DONE]``, while the release of its
lease is still held back; let go, the release lands and nothing is left.

The settlement is held at `AdmissionControl.settle` (the real one runs once the test lets it go;
what it does is tested in test_gateway_admission.py), so the order is reached by construction: the
client's answer can only be complete while the lease is held if the answer did not wait for it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.integration.openai_helpers import HELLO, MODEL
from tests.support.waits import wait_for


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_answer_is_complete_before_its_lease_is_released(gateway_factory, monkeypatch, stream):
    gw = gateway_factory([{"id": "after-t"}])
    control = gw.app.state.gw.control
    real = control.settle
    gate, began = threading.Event(), threading.Event()

    async def held_settle(lease, used_tokens):
        began.set()
        if not await asyncio.to_thread(gate.wait, 300):
            raise AssertionError("the test never let the settlement go")
        return await real(lease, used_tokens)

    monkeypatch.setattr(control, "settle", held_settle)
    client = gw.client("after-t")
    answer: dict = {}

    def ask():
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, stream=True,
                                                         stream_options={"include_usage": True}))
            answer["usage"] = chunks[-1].usage  # the usage chunk comes with [DONE]: the stream is over
        else:
            answer["usage"] = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4).usage

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    try:
        wait_for(began.is_set, "the settlement began")
        t.join(120)
        assert not t.is_alive(), "the client never got its whole answer while the settlement was held"
        assert answer["usage"].completion_tokens >= 1
        held = gw.leases("after-t", settled=False)
        assert len(held) == 1, held  # the answer is out; the lease is still held: the release comes after
    finally:
        gate.set()
    assert gw.leases("after-t") == {}  # (waits for the released settlement: tests/support/settlement.py)
