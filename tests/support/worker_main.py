"""The test worker: `python -m tests.support.worker_main <the flags of fairshare worker>`.

The real `fairshare worker` (the same flag parsing, model loading and `worker.server.serve`), with
one addition on the same gRPC server: the test-control service of tests/support/worker_control.py
(hold / release the engine, fault injection, the engine's event log), plugged in through `serve`'s
`configure` extension point. Tests start it with `tests.conftest.start_worker` and talk to it with
`tests.support.control_client.WorkerControl`. Never used outside tests.
"""

from __future__ import annotations

import sys

from tests.support.worker_control import install
from worker.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], configure=install))
