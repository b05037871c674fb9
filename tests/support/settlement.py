"""Waiting for the gateway's settlements of answered requests (in-process gateways only).

The gateway settles a successful request right after the last byte of its answer (the JSON body,
or a stream's ``[DONE]``; docs/architecture.md, "Settlement after the answer"), so a test that reads
Redis the moment it has its response could read before the release. `wait_answered_settled`
waits for the state instead: no finished request is still open in the gateway (``gw.live`` holds
a session until its settlement is done).
"""

from __future__ import annotations

from tests.support.waits import wait_for


def settling(gw) -> list[str]:
    """Request ids of finished requests whose settlement is not done yet (gw: `gateway.state.Gateway`)."""
    return [s.rid for s in tuple(gw.live) if s.finished]


def wait_answered_settled(gw, timeout_s: float = 60.0) -> None:
    """Return once every finished request of `gw` has settled (its lease released, or the release
    owed while Redis is down). Fails naming the requests still settling."""
    wait_for(lambda: not settling(gw), lambda: f"the gateway settled its answered requests; still settling: "
             f"{settling(gw)}", timeout_s=timeout_s)


__all__ = ["settling", "wait_answered_settled"]
