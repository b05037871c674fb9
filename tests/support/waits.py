"""Waiting for a state in tests: poll until it holds, or fail saying which state never came.

    wait_for(lambda: load().waiting == 20, "20 requests waiting on the worker")

The timeout is a ceiling against a hang, never part of what a test checks: a test waits for the
state it needs (on the engine's own counters and events, on Redis, on the gateway's state), so a
slow or loaded machine only makes it wait longer. Pick a ceiling far above what the slowest machine
needs; `DEFAULT_TIMEOUT_S` is generous on purpose.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable

DEFAULT_TIMEOUT_S = 120.0


def _describe(what: str | Callable[[], str]) -> str:
    try:
        return what() if callable(what) else what
    except Exception as exc:  # noqa: BLE001 - the message must still come out
        return f"(describing the state failed: {exc!r})"


class _Poll:
    """One wait's bookkeeping: the last value and ignored error seen, and the deadline's verdict."""

    def __init__(self, what, timeout_s: float, ignore: tuple[type[BaseException], ...], now: Callable[[], float]):
        self.what, self.timeout_s, self.ignore, self.now = what, timeout_s, ignore, now
        self.deadline = now() + timeout_s
        self.last: Any = None
        self.error: BaseException | None = None

    def seen(self, value: Any) -> bool:
        """Record a probe's value; True when it is the state waited for."""
        self.last, self.error = value, None
        return bool(value)

    def give_up_if_late(self) -> None:
        """AssertionError naming the state, the last value and the last ignored error, past the deadline."""
        if self.now() > self.deadline:
            msg = f"state never reached within {self.timeout_s:g} s: {_describe(self.what)}; last value {self.last!r}"
            if self.error is not None:
                msg += f"; last error {self.error!r}"
            raise AssertionError(msg)


def wait_for(predicate: Callable[[], Any], what: str | Callable[[], str], timeout_s: float = DEFAULT_TIMEOUT_S,
             interval_s: float = 0.02, ignore: tuple[type[BaseException], ...] = ()) -> Any:
    """Call `predicate()` every `interval_s` seconds until it returns a truthy value; return that value.

    what: the state waited for (a string, or a callable giving one, e.g. with the last GetLoad), named
    in the AssertionError raised when `timeout_s` seconds pass without it. ignore: exception types a
    probe may raise meanwhile ("not yet", e.g. a worker that does not answer yet); others propagate.
    """
    poll = _Poll(what, timeout_s, ignore, time.monotonic)
    while True:
        try:
            if poll.seen(predicate()):
                return poll.last
        except ignore as exc:
            poll.error = exc
        poll.give_up_if_late()
        time.sleep(interval_s)


async def wait_for_async(predicate: Callable[[], Any], what: str | Callable[[], str],
                         timeout_s: float = DEFAULT_TIMEOUT_S, interval_s: float = 0.01,
                         ignore: tuple[type[BaseException], ...] = ()) -> Any:
    """`wait_for` in a coroutine: `predicate` may be a plain or an async function; polls with asyncio.sleep."""
    poll = _Poll(what, timeout_s, ignore, asyncio.get_running_loop().time)
    while True:
        try:
            value = predicate()
            if poll.seen(await value if inspect.isawaitable(value) else value):
                return poll.last
        except ignore as exc:
            poll.error = exc
        poll.give_up_if_late()
        await asyncio.sleep(interval_s)


def join_all(threads, what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join `threads`; AssertionError naming `what` if one is still running after `timeout_s` in all
    (instead of going on to fail later on results a live thread has not written yet)."""
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        raise AssertionError(f"not finished within {timeout_s:g} s: {what} ({len(alive)} thread(s) still running)")
