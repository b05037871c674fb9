"""The gateway's shutdown always ends: a background task that swallows its cancellation is cancelled
again, and a lifespan step that hangs is cut off by the shutdown ceiling (stacks in the log, exit 1)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

from fairshare.ports import free_port
from gateway.background import RECANCEL_INTERVAL_S, cancel_and_wait

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cancel_and_wait_ends_a_task_that_swallows_its_first_cancellation():
    """grpc.aio can answer a cancellation with AioRpcError; a loop that catches it goes round again."""
    seen: list[str] = []

    async def swallowing_loop() -> None:
        while True:
            try:
                await asyncio.Event().wait()  # cancelled here
            except asyncio.CancelledError:
                if not seen:
                    seen.append("swallowed")  # the first cancellation is eaten, as a caught library error
                    continue
                seen.append("ended")
                raise

    async def main() -> tuple[bool, list[str]]:
        loop = asyncio.get_running_loop()
        task = loop.create_task(swallowing_loop())
        await asyncio.sleep(0)  # the task reaches its wait
        stopper = loop.create_task(cancel_and_wait(task))
        finished, _ = await asyncio.wait({stopper}, timeout=60 * RECANCEL_INTERVAL_S)  # a hang's ceiling
        if not finished:  # leave nothing running for asyncio.run to wait on
            stopper.cancel()
            task.cancel()
        return stopper in finished, seen

    stopped, what = asyncio.run(main())
    assert stopped, "cancel_and_wait never returned: the task swallowed its cancellation and ran on"
    assert what == ["swallowed", "ended"]


def test_cancel_and_wait_discards_a_tasks_error_and_tolerates_none():
    async def failing() -> None:
        raise RuntimeError("boom")

    async def main() -> bool:
        await cancel_and_wait(None)
        task = asyncio.get_running_loop().create_task(failing())
        await asyncio.sleep(0)
        await cancel_and_wait(task)
        return task.done()

    assert asyncio.run(main())


HANGING_APP = textwrap.dedent("""
    import asyncio, sys
    from contextlib import asynccontextmanager
    import uvicorn
    from fastapi import FastAPI
    from gateway.serve import DrainingServer

    @asynccontextmanager
    async def lifespan(app):
        yield
        print("lifespan shutdown: hanging", flush=True)
        await asyncio.Event().wait()  # a shutdown step that never ends

    app = FastAPI(lifespan=lifespan)
    config = uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="info",
                            timeout_graceful_shutdown=0.5)
    DrainingServer(config, drain_timeout_s=0.0, shutdown_ceiling_s=1.0).run()
""")


def test_a_hanging_shutdown_step_is_cut_off_with_every_threads_stack():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", HANGING_APP, str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:  # uvicorn says when it serves: the state SIGTERM needs, by construction
            lines.append(line)
            if "Uvicorn running on" in line:
                break
        assert any("Uvicorn running on" in x for x in lines), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=120)[0]  # a hang's ceiling; the process ends ~1.5 s after SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = "".join(lines) + rest
    assert "lifespan shutdown: hanging" in out, out
    assert proc.returncode == 1, (proc.returncode, out)
    assert "most recent call first" in out, out  # faulthandler's dump of the stuck threads
