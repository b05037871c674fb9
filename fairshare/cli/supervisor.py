"""Child processes of `fairshare up` and the supervisor that restarts them.

- `spawn` / `stop_child`: a child in its own process group, its output copied to a log file by a pump
  thread (and echoed to the terminal while ``child.echo`` is set), stopped with SIGTERM to the group,
  then SIGKILL after a timeout.
- `Signals`: SIGINT/SIGTERM raise `Stop` in the main thread, except inside ``deferred()`` sections
  (while a child is being started and not yet recorded), so every started child is always stopped.
- `Supervisor`: starts children from `ChildSpec`s and watches them. A child that dies is restarted
  after a backoff (0.5 s, doubled per crash within the window, at most 8 s) and announced in one
  line when it dies and when it is back; a child that dies `restart_limit` times within
  `restart_window_s` seconds is not restarted again: `watch()` raises `CrashLoop`, whose message is
  the one line that says which child and why (exit status or signal, last log line). The same policy
  as systemd's ``Restart=always`` with ``StartLimitBurst``/``StartLimitIntervalSec``, except for a
  child that served and then ended cleanly (status 0, or a SIGTERM someone else sent it): the gateway
  and the worker exit so only after draining on a SIGTERM (`clean_exit`), which is an operator's
  stop or a rolling restart, not a crash. It is restarted after the first backoff and announced as
  stopped, and it does not count toward `restart_limit`; a child that ends so while it is being
  restarted (before it is ready and serving again) counts, as any death then does.
- Lines of a child's output that start with a marker in `ChildSpec.notices` are forwarded to the
  terminal as one-line notices (the gateway's rejected reloads of the tenants file).
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

TAIL_LINES = 40
STOP_TIMEOUT_S = 15.0  # per child; the gateway and worker drain for less than this
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 8.0


class Stop(Exception):
    """Raised in the main thread by SIGINT/SIGTERM."""


class ChildDied(Exception):
    """A child exited while it was being started (before supervision begins)."""

    def __init__(self, child: "Child"):
        super().__init__(child.name)
        self.child = child


class CrashLoop(Exception):
    """A child died `restart_limit` times within the window (or never became ready again); the
    message is the one line to print."""


# --------------------------------------------------------------------------------------------
# Signals
# --------------------------------------------------------------------------------------------

class Signals:
    """SIGINT/SIGTERM raise `Stop` in the main thread, except inside `deferred()` sections (while a
    child is being started and not yet recorded), where the stop is raised once the section ends."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.depth = 0
        self.pending: int | None = None
        self.stopping = False

    def handler(self, signum, _frame):
        if self.stopping:  # a second Ctrl-C while stopping: the stop is already under way
            return
        if self.depth:
            self.pending = signum
            return
        self.stopping = True
        raise Stop(signum)

    class _Section:
        def __init__(self, outer: "Signals"):
            self.outer = outer

        def __enter__(self):
            self.outer.depth += 1

        def __exit__(self, *exc):
            self.outer.depth -= 1
            if not self.outer.depth and self.outer.pending is not None and exc[0] is None:
                signum, self.outer.pending = self.outer.pending, None
                self.outer.stopping = True
                raise Stop(signum)
            return False

    def deferred(self) -> "Signals._Section":
        return Signals._Section(self)


SIGNALS = Signals()


# --------------------------------------------------------------------------------------------
# One child
# --------------------------------------------------------------------------------------------

try:
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    """Ask Linux to send SIGTERM to this child if `fairshare up` itself dies (e.g. SIGKILL)."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    """A started child: its process, log file and the last lines it printed."""

    name: str
    proc: subprocess.Popen
    log_path: Path | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    echo: threading.Event = field(default_factory=threading.Event)
    pump: threading.Thread | None = None
    on_line: Callable[[str], None] | None = None  # called (pump thread) with every complete line

    def last_lines(self) -> list[str]:
        """The last lines it printed (from its log file when the pump kept none)."""
        lines = list(self.tail)
        if not lines and self.log_path and self.log_path.exists():
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()][-TAIL_LINES:]
        return lines

    def last_line(self) -> str:
        """Its last non-empty output line, or "" (the pump thread is joined first, so nothing is missed)."""
        if self.pump is not None:
            self.pump.join(2)
        lines = [ln for ln in self.last_lines() if not ln.startswith("==== ")]
        line = lines[-1] if lines else ""
        return line if len(line) <= 200 else line[:197] + "..."


def _pump(child: Child) -> None:
    """Copy a child's output to its log file; echo it to the terminal while `child.echo` is set."""
    assert child.proc.stdout is not None
    fd = child.proc.stdout.fileno()
    partial = b""
    with open(child.log_path, "ab") as log:  # type: ignore[arg-type]
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            log.write(chunk)
            log.flush()
            if child.echo.is_set():
                try:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.buffer.flush()
                except (OSError, ValueError):
                    pass
            partial += chunk
            *lines, partial = partial.split(b"\n")
            for raw in lines:
                _add_tail_line(child, raw)
            if len(partial) > 65536:
                partial = partial[-4096:]
    if partial.strip():
        _add_tail_line(child, partial)


def _add_tail_line(child: Child, raw: bytes) -> None:
    # a progress bar redraws itself with \r: keep only its last state
    segs = [seg for seg in raw.split(b"\r") if seg.strip()]
    if not segs:
        return
    line = segs[-1].decode("utf-8", "replace").rstrip()
    child.tail.append(line)
    if child.on_line is not None:
        try:
            child.on_line(line)
        except Exception:  # a notice must never stop the pump
            pass


def spawn(name: str, cmd: list[str], log_path: Path, echo: bool, children: list[Child],
          env: dict | None = None, on_line: Callable[[str], None] | None = None) -> Child:
    """Start a child in its own session (process group), output piped through a pump thread; the
    child is appended to `children` before a Ctrl-C can interrupt, so it is always stopped."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
    with SIGNALS.deferred():
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent, env=env or os.environ.copy(),
        )
        child = Child(name=name, proc=proc, log_path=log_path, on_line=on_line)
        children.append(child)
    if echo:
        child.echo.set()
    child.pump = threading.Thread(target=_pump, args=(child,), name=f"pump-{name}", daemon=True)
    child.pump.start()
    return child


def stop_child(child: Child, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the child's process group, wait up to `timeout_s`, then SIGKILL the group."""
    proc = child.proc
    pgid = proc.pid  # start_new_session: the child leads its own group
    if proc.poll() is None:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            print(f"fairshare up: {child.name} did not stop within {timeout_s:.0f} s; killing it", file=sys.stderr)
    # whatever is left in the group (the leader if it ignored SIGTERM, or its helpers) goes now
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    if child.pump is not None:
        child.pump.join(2)


def clean_exit(returncode: int) -> bool:
    """True for the end of a child that drained before it went: exit status 0 (the gateway and the
    worker exit 0 once drained on SIGTERM), or killed by SIGTERM itself."""
    return returncode in (0, -signal.SIGTERM)


def describe_exit(returncode: int) -> str:
    """``killed by SIGKILL (signal 9)`` or ``exited with status 1``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by {name} (signal {-returncode})"
    return f"exited with status {returncode}"


def wait_ready(child: Child, ready: Callable[[], bool], timeout_s: float, what: str,
               others: list[Child] = (), poll_s: float = 0.25) -> None:
    """Poll `ready()` until true. Raises ChildDied when `child` (or one of `others`) exits first,
    TimeoutError naming `what` after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for c in [child, *others]:
            if c.proc.poll() is not None:
                raise ChildDied(c)
        if ready():
            return
        time.sleep(poll_s)
    raise TimeoutError(f"{what} was not ready after {timeout_s:.0f} s (log: {child.log_path})")


# --------------------------------------------------------------------------------------------
# Supervision
# --------------------------------------------------------------------------------------------

@dataclass
class ChildSpec:
    """How to (re)start one child and when it counts as up.

    start(children) spawns it and appends it to `children` (see `spawn`); ready() polls it; serving()
    (optional) polls what must hold before its restart is announced as done (for the worker: the
    gateway routes to it again). back_note: words added to the "is back" notice; drained_note: the
    words instead when it ended on a SIGTERM (it drained and settled its requests before it went).
    """

    name: str
    start: Callable[[list[Child]], Child]
    ready: Callable[[], bool]
    ready_timeout_s: float
    serving: Callable[[], bool] | None = None
    back_note: str = ""
    drained_note: str | None = None


@dataclass
class _Restart:
    died_at: float
    phase: str  # "backoff" -> "starting" -> "serving"
    due: float  # backoff: when to start; starting/serving: the deadline
    child: Child | None = None
    sigterm: bool = False  # the child ended cleanly while serving (`clean_exit`: it drained first)


def shown_path(path: Path | None) -> str:
    """`path` relative to the working directory when it lies inside it (shorter to copy), else absolute."""
    if path is None:
        return "-"
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class Supervisor:
    """Starts children and keeps them running (see the module docstring).

    restart_limit / restart_window_s: a child that dies this many times within this many seconds
    stops everything (`CrashLoop`). notify(line): where one-line notices go (default: stderr).
    on_change(): called after every (re)start, e.g. to rewrite run.json with the new pids.
    """

    def __init__(self, restart_limit: int = 3, restart_window_s: float = 60.0,
                 notify: Callable[[str], None] | None = None, on_change: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if restart_limit < 1:
            raise ValueError("restart_limit must be >= 1")
        self.restart_limit = restart_limit
        self.restart_window_s = restart_window_s
        self.notify = notify or (lambda line: print(line, file=sys.stderr, flush=True))
        self.on_change = on_change or (lambda: None)
        self.clock = clock
        self.children: list[Child] = []  # the processes to stop, in start order
        self.specs: dict[str, ChildSpec] = {}
        self.crashes: dict[str, collections.deque] = {}
        self.restarts: dict[str, int] = {}
        self.pending: dict[str, _Restart] = {}

    def current(self, name: str) -> Child | None:
        """The latest process of child `name`."""
        return next((c for c in reversed(self.children) if c.name == name), None)

    def launch(self, spec: ChildSpec, others_must_live: bool = True) -> Child:
        """First start of a child: spawn it and wait until ready. Raises ChildDied (it, or an already
        started child, exited) or TimeoutError."""
        self.specs[spec.name] = spec
        child = spec.start(self.children)
        self.on_change()
        others = [c for c in self.children if c is not child] if others_must_live else []
        wait_ready(child, spec.ready, spec.ready_timeout_s, f"the {spec.name}", others)
        return child

    # -- the watch loop ---------------------------------------------------------------------------
    def watch(self, poll_s: float = 0.25, until: Callable[[], bool] = lambda: False) -> None:
        """Restart children that die, until `until()` is true (never, by default: a signal ends it
        with `Stop`). Raises CrashLoop when a child dies too often or does not come back."""
        while not until():
            self.step()
            time.sleep(poll_s)

    def step(self) -> None:
        """One round: notice deaths, advance every restart in progress."""
        for child in list(self.children):
            if child.name not in self.pending and child.proc.poll() is not None:
                self._died(child, serving=True)
        for name, r in list(self.pending.items()):
            self._advance(name, r)

    def _died(self, child: Child, serving: bool = False) -> None:
        """`child` has exited: schedule its restart, or raise CrashLoop. serving: it had been serving
        (not coming back from an earlier death), so a clean exit is a drain, not a death."""
        now = self.clock()
        name = child.name
        reason = describe_exit(child.proc.returncode)
        last = child.last_line()
        crashes = self.crashes.setdefault(name, collections.deque())
        while crashes and now - crashes[0] > self.restart_window_s:
            crashes.popleft()
        if serving and clean_exit(child.proc.returncode):
            self.notify(f"fairshare up: the {name} stopped: {reason} (a clean exit: it drained first); restarting it "
                        f"in {BACKOFF_FIRST_S:g} s (not counted as a death); its last log line: {last!r}")
            backoff = BACKOFF_FIRST_S
        else:
            crashes.append(now)
            log = f"log: {shown_path(child.log_path)}" if child.log_path else "it left no log"
            if len(crashes) >= self.restart_limit:
                raise CrashLoop(f"the {name} died {len(crashes)} times within {self.restart_window_s:g} s (last: "
                                f"{reason}; its last log line: {last!r}); not restarting it again: stopping "
                                f"everything ({log})")
            backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (len(crashes) - 1))
            self.notify(f"fairshare up: the {name} died: {reason}; restarting it in {backoff:g} s (death "
                        f"{len(crashes)} within {self.restart_window_s:g} s, death {self.restart_limit} stops "
                        f"everything); its last log line: {last!r}")
        try:  # whatever is left of its process group goes too
            os.killpg(child.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.pending[name] = _Restart(died_at=now, phase="backoff", due=now + backoff, child=child,
                                      sigterm=clean_exit(child.proc.returncode))

    def _advance(self, name: str, r: _Restart) -> None:
        spec = self.specs[name]
        now = self.clock()
        if r.phase == "backoff":
            if now < r.due:
                return
            with SIGNALS.deferred():  # the new one takes the dead one's place (the stop order stays)
                at = self.children.index(r.child) if r.child in self.children else len(self.children)
                if r.child in self.children:
                    self.children.remove(r.child)
                r.child = spec.start(self.children)
                self.children.remove(r.child)
                self.children.insert(at, r.child)
            self.on_change()
            r.phase, r.due = "starting", now + spec.ready_timeout_s
            return
        child = r.child
        assert child is not None
        if child.proc.poll() is not None:  # died again while coming back
            del self.pending[name]
            self._died(child)
            return
        if now > r.due:
            what = "ready" if r.phase == "starting" else "serving"
            raise CrashLoop(f"the {name} was restarted but was not {what} within {spec.ready_timeout_s:.0f} s; "
                            f"stopping everything (log: {shown_path(child.log_path)})")
        if r.phase == "starting":
            if not spec.ready():
                return
            r.phase = "serving"
        if spec.serving is not None and not self._others_pending(name) and not spec.serving():
            return
        del self.pending[name]
        self.restarts[name] = self.restarts.get(name, 0) + 1
        words = spec.drained_note if r.sigterm and spec.drained_note is not None else spec.back_note
        note = f"; {words}" if words else ""
        self.notify(f"fairshare up: the {name} is back (pid {child.proc.pid}, restart {self.restarts[name]}), "
                    f"{now - r.died_at:.1f} s after it died{note}")

    def _others_pending(self, name: str) -> bool:
        return any(n != name for n in self.pending)

    def stop_all(self) -> None:
        """Stop every child, the last started first (gateway, worker, Redis)."""
        for c in reversed(self.children):
            c.echo.clear()
            stop_child(c)


__all__ = ["Child", "ChildDied", "ChildSpec", "CrashLoop", "SIGNALS", "Signals", "Stop", "Supervisor",
           "clean_exit", "describe_exit", "shown_path", "spawn", "stop_child", "wait_ready"]
