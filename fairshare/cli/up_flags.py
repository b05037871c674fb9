"""Flags `fairshare up` passes through to the worker and the gateway, from one table.

Each entry of `PASS_THROUGH` names a flag and the children it goes to. `fairshare up` copies the
flag's definition (option strings, help, choices, nargs, repetition, ``--x/--no-x`` pairs) from the
child's own argument parser (`worker.cli.build_parser`, `gateway.cli.build_parser`), so its help and
validation are the child's; what the user types is passed on as typed, after the child's own type
check. An entry whose flag the child does not have (yet) is left out (`PassThrough.missing`): adding
a flag to a child and to this table is all it takes to wire it.

Flags `fairshare up` decides itself (addresses and ports, ``--model``, ``--metrics-port``,
``--drain-timeout``) are not in the table.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field
from typing import Callable

WORKER, GATEWAY = "worker", "gateway"

# flag, the children it goes to
PASS_THROUGH: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the model as clients name it, and its context length
    ("--served-model-name", (WORKER,)),
    ("--model-name", (WORKER,)),
    ("--max-model-len", (WORKER,)),
    # scheduling
    ("--policy", (WORKER,)),
    ("--tier-min-share", (WORKER,)),
    ("--tier-scheduling", (WORKER,)),
    ("--iteration-token-target", (WORKER,)),
    ("--lower-tier-token-target", (WORKER,)),
    ("--lower-tier-grace-iterations", (WORKER,)),
    ("--lower-tier-idle-token-target", (WORKER,)),
    ("--hand-back-after-s", (WORKER,)),  # (a pool: fairshare up --workers N)
    ("--max-running", (WORKER,)),
    ("--max-num-batched-tokens", (WORKER,)),
    ("--alpha", (WORKER,)),
    ("--beta", (WORKER,)),
    # KV cache and per-tenant KV quotas (docs/memory-isolation.md)
    ("--num-kv-blocks", (WORKER,)),
    ("--kv-cache-mb", (WORKER,)),
    ("--block-size", (WORKER,)),
    ("--kv-quota", (WORKER,)),
    ("--kv-watermark", (WORKER,)),
    ("--kv-headroom", (WORKER,)),
    ("--kv-shared-buffer", (WORKER,)),
    ("--kv-hard-cap", (WORKER,)),
    ("--kv-soft-quota", (WORKER,)),
    ("--kv-hard-cap-for", (WORKER,)),
    # prefix cache (docs/cache-isolation.md)
    ("--no-prefix-cache", (WORKER,)),
    ("--public-prefix-file", (WORKER,)),
    ("--cached-rate", (WORKER,)),
    ("--ttft-floor", (WORKER,)),
    ("--threads", (WORKER,)),
    # the runner's weight format (docs/engine.md)
    ("--dtype", (WORKER,)),
    ("--quantization", (WORKER,)),
    ("--metrics-max-tenants", (WORKER,)),
    # engine faults (worker/faults.py)
    ("--engine-fault-limit", (WORKER,)),
    ("--engine-fault-window-s", (WORKER,)),
    ("--engine-failure-exit-s", (WORKER,)),
    # gateway
    ("--lease-ttl-s", (GATEWAY,)),
    ("--request-timeout-s", (GATEWAY,)),
    ("--tier-request-timeout-s", (GATEWAY,)),
    ("--keepalive-interval-s", (GATEWAY,)),
    ("--redis-outage-policy", (GATEWAY,)),
    ("--max-body-bytes", (GATEWAY,)),
    ("--body-timeout-s", (GATEWAY,)),
    ("--default-max-tokens", (GATEWAY,)),
    ("--tool-call-parser", (GATEWAY,)),
    # both tiers
    ("--otel-exporter", (WORKER, GATEWAY)),
)


def child_parsers() -> dict[str, argparse.ArgumentParser]:
    """The worker's and the gateway's argument parsers (neither import torch or the web stack)."""
    from gateway.cli import build_parser as gateway_parser
    from worker.cli import build_parser as worker_parser

    return {WORKER: worker_parser(), GATEWAY: gateway_parser()}


def _raw(check: Callable[[str], object] | None):
    """argparse type: validate with the child's own `check`, keep the text as typed."""

    def parse(text: str) -> str:
        if check is not None:
            check(text)  # raises ArgumentTypeError / ValueError: argparse prints the child's message
        return text

    parse.__name__ = getattr(check, "__name__", "value")
    return parse


@dataclass
class _Wired:
    dest: str
    action: argparse.Action  # the child's
    children: tuple[str, ...]


@dataclass
class PassThrough:
    """The pass-through flags added to one `fairshare up` parser (see the module docstring)."""

    wired: list[_Wired] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # table entries no child has

    @classmethod
    def add_to(cls, parser: argparse.ArgumentParser, parsers: dict[str, argparse.ArgumentParser] | None = None,
               table=PASS_THROUGH) -> "PassThrough":
        """Add every table flag that its children define to `parser`, in a group per child."""
        parsers = parsers or child_parsers()
        groups = {
            WORKER: parser.add_argument_group("worker flags", "passed to `fairshare worker` (see its --help)"),
            GATEWAY: parser.add_argument_group("gateway flags", "passed to `fairshare gateway` (see its --help)"),
        }
        both = parser.add_argument_group("flags for both", "passed to the worker and the gateway")
        out, seen = cls(), set()
        for flag, targets in table:
            found = [parsers[t]._option_string_actions.get(flag) for t in targets]
            if any(a is None for a in found):
                out.missing.append(flag)
                continue
            action = found[0]
            if id(action) in seen:  # an alias of a flag already wired
                continue
            seen.add(id(action))
            mine = copy.copy(action)
            mine.dest = f"_pass_{len(out.wired)}"
            mine.default = argparse.SUPPRESS
            mine.required = False
            if mine.metavar is None and action.choices is None:
                mine.metavar = action.dest.upper()  # the child's name, not ours
            if action.type is not None:
                mine.type = _raw(action.type)
            if action.choices is not None and not all(isinstance(c, str) for c in action.choices):
                mine.choices = None  # the child checks typed choices itself
            (groups[targets[0]] if len(targets) == 1 else both)._add_action(mine)
            out.wired.append(_Wired(mine.dest, action, tuple(targets)))
        return out

    def flags(self) -> list[str]:
        """Every option string wired (e.g. ``--kv-quota``, ``--no-kv-quota``)."""
        return [s for w in self.wired for s in w.action.option_strings]

    def given(self, args: argparse.Namespace, flag: str):
        """The value the user gave for `flag` (as typed), or None when not given."""
        for w in self.wired:
            if flag in w.action.option_strings:
                return getattr(args, w.dest, None)
        return None

    def default(self, flag: str):
        """The child's default for `flag` (None when unknown)."""
        for w in self.wired:
            if flag in w.action.option_strings:
                return w.action.default
        return None

    def argv(self, args: argparse.Namespace, child: str) -> list[str]:
        """The arguments for `child` from what the user gave, in the child's own spelling."""
        out: list[str] = []
        for w in self.wired:
            if child not in w.children or not hasattr(args, w.dest):
                continue
            out += _to_argv(w.action, getattr(args, w.dest))
        return out


def _to_argv(action: argparse.Action, value) -> list[str]:
    """Arguments that make the child's `action` parse `value` (the text the user typed)."""
    opts = action.option_strings
    if isinstance(action, argparse.BooleanOptionalAction):
        neg = next((o for o in opts if o.startswith("--no-")), None)
        return [opts[0]] if value else ([neg] if neg else [])
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)):
        return [opts[0]]
    if isinstance(action, argparse._CountAction):
        return [opts[0]] * int(value)
    if isinstance(action, argparse._AppendAction):
        out = []
        for v in value:
            out += [opts[0], *(v if isinstance(v, list) else [v])]
        return out
    if isinstance(value, list):
        return [opts[0], *map(str, value)]
    return [opts[0], str(value)]


__all__ = ["GATEWAY", "PASS_THROUGH", "PassThrough", "WORKER", "child_parsers"]
