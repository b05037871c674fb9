"""The test worker: `python -m tests.support.worker_main [--test-inject JSON ...] <flags of fairshare worker>`.

The real `fairshare worker` (the same flag parsing, model loading and `worker.server.serve`), with
one addition on the same gRPC server: the test-control service of tests/support/worker_control.py
(hold / release the engine, fault injection, the engine's event log), plugged in through `serve`'s
`configure` extension point. `--test-inject '{"kind": "reject", "prompt_contains": "..."}'`
(repeatable) arms a fault from the start, as the Control service's `Inject` would (for a worker
that a test restarts while traffic flows). Tests start it with `tests.conftest.start_worker` and
talk to it with `tests.support.control_client.WorkerControl`. Never used outside tests.
"""

from __future__ import annotations

import json
import sys

from tests.support.worker_control import install
from worker.cli import main


def split_test_flags(argv: list[str]) -> tuple[list[dict], list[str]]:
    """(the --test-inject rules, the other flags: those of fairshare worker)."""
    rules, rest = [], []
    it = iter(argv)
    for arg in it:
        if arg == "--test-inject":
            rules.append(json.loads(next(it)))
        elif arg.startswith("--test-inject="):
            rules.append(json.loads(arg.split("=", 1)[1]))
        else:
            rest.append(arg)
    return rules, rest


def run(argv: list[str]) -> int:
    rules, rest = split_test_flags(argv)

    def configure(server, engine, servicer) -> None:
        control = install(server, engine, servicer)
        for rule in rules:
            control.inject(rule)

    return main(rest, configure=configure)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
