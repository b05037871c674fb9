"""Load from wrk (https://github.com/wg/wrk; Debian package ``wrk``) for `fairshare bench gateway`.

wrk is an HTTP/1.1 load generator written in C: one of its threads drives tens of thousands of
requests per second, so the gateway under test, not the client, is what saturates, and the client's
own cost hardly shows in the latencies (a Python client such as httpx spends about as much CPU per
request as the gateway does, and at concurrency 1 its time is added to every request's latency).

`run_wrk` POSTs one JSON body over `connections` keep-alive connections for `duration_s` seconds
and checks every answer in wrk's Lua ``response`` callback: status 200 and a given marker in the body
(``"completion_tokens":16`` for a JSON answer, ``data: [DONE]`` for a stream). Latencies come from
wrk's own histogram (microsecond resolution).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# wrk's Lua: every thread counts its bad answers; `done` (the main state) sums them over the threads
# and prints one JSON line of figures. Latencies in wrk are microseconds.
_SCRIPT = """
wrk.method = "POST"
wrk.body = %(body)s
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = %(auth)s
local marker = %(marker)s
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) bad = 0; first_bad = "" end
function response(status, headers, body)
  if status ~= 200 or not string.find(body, marker, 1, true) then
    if bad == 0 then first_bad = status .. " " .. string.sub(body, 1, 300) end
    bad = bad + 1
  end
end
function done(summary, latency, requests)
  local nbad, why = 0, ""
  for _, t in ipairs(threads) do
    local b = t:get("bad")
    if b > 0 and why == "" then why = string.gsub(t:get("first_bad"), '[%%c"\\\\]', " ") end
    nbad = nbad + b
  end
  io.write(string.format('WRK {"requests": %%d, "duration_us": %%d, "bad": %%d, "errors": %%d, '
    .. '"p50_us": %%d, "p99_us": %%d, "mean_us": %%f, "first_bad": "%%s"}\\n',
    summary.requests, summary.duration, nbad,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.status
      + summary.errors.timeout,
    latency:percentile(50.0), latency:percentile(99.0), latency.mean, why))
end
"""


def _lua_string(s: str) -> str:
    """`s` as a Lua string literal (a JSON string literal is one, for the characters used here)."""
    return json.dumps(s)


@dataclass
class WrkResult:
    """One wrk run: `requests` answered in `wall_s` seconds; latency percentiles in seconds."""

    requests: int
    wall_s: float
    p50_s: float
    p99_s: float
    mean_s: float

    @property
    def rps(self) -> float:
        """Requests per second."""
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0


def answer_marker(stream: bool, max_tokens: int) -> str:
    """What every good answer to the benches' chat completion holds: a stream's ``data: [DONE]``,
    a JSON body's usage of exactly `max_tokens` completion tokens (the gateway writes compact JSON)."""
    return "data: [DONE]" if stream else f'"completion_tokens":{max_tokens}'


def wrk_path() -> str | None:
    """The wrk binary on PATH, or None."""
    return shutil.which("wrk")


def run_wrk(url: str, body: dict, api_key: str, marker: str, connections: int, duration_s: float,
            timeout_s: float = 60.0) -> WrkResult:
    """POST `body` (JSON) to `url` with ``Authorization: Bearer api_key`` over `connections`
    keep-alive connections (one wrk thread) for `duration_s` seconds.

    Raises FileNotFoundError when wrk is not on PATH, RuntimeError when wrk fails, when any answer
    is not a 200 holding `marker`, or on a socket error (connect/read/write/timeout)."""
    exe = wrk_path()
    if exe is None:
        raise FileNotFoundError("wrk is not on PATH (Debian: apt-get install wrk)")
    script = _SCRIPT % {"body": _lua_string(json.dumps(body, separators=(",", ":"))),
                        "auth": _lua_string(f"Bearer {api_key}"), "marker": _lua_string(marker)}
    with tempfile.TemporaryDirectory(prefix="fairshare-wrk-") as tmp:
        path = Path(tmp) / "chat.lua"
        path.write_text(script)
        secs = max(1, round(duration_s))
        cmd = [exe, "-t1", f"-c{connections}", f"-d{secs}s", "--timeout", "30s", "-s", str(path), url]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=secs + timeout_s)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("WRK ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    fig = json.loads(line[4:])
    if fig["bad"] or fig["errors"]:
        raise RuntimeError(f"wrk: {fig['bad']} bad answers and {fig['errors']} socket errors in "
                           f"{fig['requests']} requests; first bad answer: {fig['first_bad']!r}")
    return WrkResult(requests=fig["requests"], wall_s=fig["duration_us"] / 1e6, p50_s=fig["p50_us"] / 1e6,
                     p99_s=fig["p99_us"] / 1e6, mean_s=fig["mean_us"] / 1e6)
