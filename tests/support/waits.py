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


def _failure(what, timeout_s: float, last: Any, error: BaseException | None) -> AssertionError:
    msg = f"state never reached within {timeout_s:g} s: {_describe(what)}; last value {last!r}"
    if error is not None:
        msg += f"; last error {error!r}"
    return AssertionError(msg)


def wait_for(predicate: Callable[[], Any], what: str | Callable[[], str], timeout_s: float = DEFAULT_TIMEOUT_S,
             interval_s: float = 0.02, ignore: tuple[type[BaseException], ...] = ()) -> Any:
    """Call `predicate()` every `interval_s` seconds until it returns a truthy value; return that value.

    what: the state waited for (a string, or a callable giving one, e.g. with the last GetLoad), named
    in the AssertionError raised when `timeout_s` seconds pass without it. ignore: exception types a
    probe may raise meanwhile ("not yet", e.g. a worker that does not answer yet); others propagate.
    """
    deadline = time.monotonic() + timeout_s
    last, error = None, None
    while True:
        try:
            last = predicate()
            error = None
            if last:
                return last
        except ignore as exc:
            error = exc
        if time.monotonic() > deadline:
            raise _failure(what, timeout_s, last, error)
        time.sleep(interval_s)


async def wait_for_async(predicate: Callable[[], Any], what: str | Callable[[], str],
                         timeout_s: float = DEFAULT_TIMEOUT_S, interval_s: float = 0.01,
                         ignore: tuple[type[BaseException], ...] = ()) -> Any:
    """`wait_for` in a coroutine: `predicate` may be a plain or an async function; polls with asyncio.sleep."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last, error = None, None
    while True:
        try:
            last = predicate()
            if inspect.isawaitable(last):
                last = await last
            error = None
            if last:
                return last
        except ignore as exc:
            error = exc
        if loop.time() > deadline:
            raise _failure(what, timeout_s, last, error)
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
