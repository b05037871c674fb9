"""`fairshare.cli.supervisor.Supervisor` on real child processes, driven step by step on a fake clock
(the backoff and the crash window are the clock's, so nothing here waits on wall-clock time)."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from fairshare.cli.supervisor import ChildSpec, CrashLoop, Supervisor, describe_exit, spawn, stop_child
from tests.support.waits import wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sleeper_spec(tmp_path, name="worker", ready=None, serving=None, drains=False) -> ChildSpec:
    """A child that prints a line, then sleeps; ready (by default) once its current process printed it.
    drains: it exits with status 0 on SIGTERM, as the gateway and the worker do once drained."""
    on_term = "import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); " if drains else ""
    cmd = [sys.executable, "-c", f"{on_term}print('{name} says hello', flush=True); import time; time.sleep(120)"]
    started = []

    def start(children):
        started.append(spawn(name, cmd, tmp_path / f"{name}.log", echo=False, children=children))
        return started[-1]

    def said_hello() -> bool:
        return any("says hello" in line for line in started[-1].tail)

    def is_ready() -> bool:
        return (ready() if ready is not None else True) and said_hello()

    return ChildSpec(name, start, is_ready, ready_timeout_s=60, serving=serving, back_note="it is back for real")


def step_until(sup, pred, what: str) -> None:
    """Run supervisor steps (the fake clock stands still) until `pred()`; fails naming `what`."""
    wait_for(lambda: pred() or sup.step(), what)


def back(sup) -> bool:
    return bool(sup.notes) and "is back" in sup.notes[-1]


def kill(child) -> None:
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait(10)
    child.pump.join(5)


@pytest.fixture
def sup():
    notes: list[str] = []
    clock = Clock()
    s = Supervisor(restart_limit=3, restart_window_s=60, notify=notes.append, clock=clock)
    s.notes, s.fake_clock = notes, clock  # type: ignore[attr-defined]
    yield s
    s.stop_all()


def test_describe_exit():
    assert describe_exit(-9) == "killed by SIGKILL (signal 9)"
    assert describe_exit(1) == "exited with status 1"


def test_a_dead_child_is_restarted_after_its_backoff_and_announced(sup, tmp_path):
    changes = []
    sup.on_change = lambda: changes.append([c.proc.pid for c in sup.children])
    first = sup.launch(sleeper_spec(tmp_path))
    kill(first)
    sup.step()
    assert len(sup.notes) == 1
    note = sup.notes[0]
    assert note.startswith("fairshare up: the worker died: killed by SIGKILL (signal 9); restarting it in 0.5 s")
    assert "worker says hello" in note and "death 1 within 60 s" in note
    sup.step()  # backoff not over: nothing started
    assert sup.current("worker") is first
    sup.fake_clock.now += 0.5
    sup.step()  # started; ready once it printed its line
    second = sup.current("worker")
    assert second is not first and second.proc.poll() is None
    assert first not in sup.children and len(sup.children) == 1
    step_until(sup, lambda: back(sup), "the restart announced")
    assert sup.notes[-1].startswith(f"fairshare up: the worker is back (pid {second.proc.pid}, restart 1), 0.5 s")
    assert sup.notes[-1].endswith("; it is back for real")
    assert not sup.pending and changes[-1] == [second.proc.pid]


@pytest.mark.parametrize("sig,note", [(signal.SIGTERM, "; it drained first"), (signal.SIGKILL, "; it is back for real")])
def test_the_back_notice_says_whether_the_child_drained(sup, tmp_path, sig, note):
    """A child that ended on a SIGTERM (from someone else) drained before it went: its "is back" notice
    says so (drained_note) instead of the notice for a crash (back_note)."""
    spec = sleeper_spec(tmp_path)
    spec.drained_note = "it drained first"
    first = sup.launch(spec)
    os.kill(first.proc.pid, sig)
    first.proc.wait(10)
    first.pump.join(5)
    sup.step()
    sup.fake_clock.now += 0.5
    step_until(sup, lambda: back(sup), "the restart announced")
    assert sup.notes[-1].endswith(note), sup.notes[-1]


def term(child) -> None:
    os.kill(child.proc.pid, signal.SIGTERM)
    child.proc.wait(10)
    child.pump.join(5)


def test_a_clean_exit_after_a_drain_is_restarted_without_counting_as_a_death(sup, tmp_path):
    """A serving child that exits 0 on a SIGTERM someone else sent (the gateway's and the worker's
    drain) is restarted and announced as stopped; any number of such exits within the window never
    stop everything, and a crash afterwards is still death 1."""
    spec = sleeper_spec(tmp_path, drains=True)
    spec.drained_note = "it drained first"
    child = sup.launch(spec)
    for stop in range(1, 5):  # more than restart_limit (3) drains within the window
        term(child)
        assert child.proc.returncode == 0
        sup.step()
        assert sup.notes[-1].startswith("fairshare up: the worker stopped: exited with status 0 (a clean exit: it "
                                        "drained first); restarting it in 0.5 s (not counted as a death)"), sup.notes[-1]
        sup.fake_clock.now += 1
        step_until(sup, lambda: back(sup), f"the restart after drain {stop} announced")
        assert sup.notes[-1].endswith("; it drained first")
        child = sup.current("worker")
        assert child.proc.poll() is None
    assert not sup.crashes.get("worker")
    kill(child)
    sup.step()
    assert "died: killed by SIGKILL (signal 9)" in sup.notes[-1] and "death 1 within 60 s" in sup.notes[-1]


def test_a_clean_exit_while_coming_back_counts_as_a_death(sup, tmp_path):
    """A restarted child that exits 0 before it is serving again is broken, not draining: counted."""
    serving = {"yes": False}
    first = sup.launch(sleeper_spec(tmp_path, drains=True, serving=lambda: serving["yes"]))
    kill(first)
    sup.step()
    sup.fake_clock.now += 1
    step_until(sup, lambda: sup.pending["worker"].phase == "serving", "the restarted child ready")
    term(sup.current("worker"))
    sup.step()
    assert "died: exited with status 0" in sup.notes[-1] and "death 2 within 60 s" in sup.notes[-1], sup.notes[-1]


def test_the_restart_is_announced_only_once_it_serves(sup, tmp_path):
    serving = {"yes": False}
    first = sup.launch(sleeper_spec(tmp_path, serving=lambda: serving["yes"]))
    kill(first)
    sup.step()
    sup.fake_clock.now += 1
    step_until(sup, lambda: sup.pending["worker"].phase == "serving", "the restarted child ready")
    sup.step()
    assert "worker" in sup.pending and not any("is back" in n for n in sup.notes)
    serving["yes"] = True
    sup.step()
    assert "worker" not in sup.pending and "is back" in sup.notes[-1]


def test_three_deaths_within_the_window_stop_everything_with_one_line(sup, tmp_path):
    child = sup.launch(sleeper_spec(tmp_path))
    for death in (1, 2):
        kill(child)
        sup.step()
        assert f"death {death} within 60 s" in sup.notes[-1]
        sup.fake_clock.now += 10  # past the backoff (0.5 s, then 1 s), inside the window
        step_until(sup, lambda: back(sup), f"restart {death} announced")
        child = sup.current("worker")
        assert "is back" in sup.notes[-1] and child.proc.poll() is None
    kill(child)
    with pytest.raises(CrashLoop) as e:
        sup.step()
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("the worker died 3 times within 60 s (last: killed by SIGKILL (signal 9); "
                           "its last log line: 'worker says hello')"), line
    assert "stopping everything" in line and "worker.log" in line


def test_deaths_outside_the_window_do_not_add_up(sup, tmp_path):
    child = sup.launch(sleeper_spec(tmp_path))
    for _ in range(4):
        kill(child)
        sup.step()
        assert "death 1 within 60 s" in sup.notes[-1]  # the previous one is older than the window
        sup.fake_clock.now += 61
        step_until(sup, lambda: back(sup), "the restart announced")
        child = sup.current("worker")
    assert sup.restarts["worker"] == 4


def restarted_never_ready(sup, tmp_path) -> None:
    """Launch a child (ready), kill it, and let the supervisor restart it as a process never ready."""
    ready = {"yes": True}
    child = sup.launch(sleeper_spec(tmp_path, ready=lambda: ready["yes"]))
    ready["yes"] = False
    kill(child)
    sup.step()
    sup.fake_clock.now += 1
    sup.step()  # restarted, not ready
    assert sup.pending["worker"].phase == "starting"


def test_a_child_that_dies_while_coming_back_counts_again(sup, tmp_path):
    restarted_never_ready(sup, tmp_path)
    kill(sup.current("worker"))
    sup.step()
    assert "death 2 within 60 s" in sup.notes[-1] and "restarting it in 1 s" in sup.notes[-1]


def test_a_restart_that_never_gets_ready_stops_everything(sup, tmp_path):
    restarted_never_ready(sup, tmp_path)
    sup.fake_clock.now += 61  # past ready_timeout_s
    with pytest.raises(CrashLoop, match="was restarted but was not ready within 60 s"):
        sup.step()


def test_stop_child_stops_the_whole_group(tmp_path):
    children = []
    c = spawn("x", [sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "x.log", False, children)
    stop_child(c, timeout_s=10)
    assert c.proc.returncode is not None
