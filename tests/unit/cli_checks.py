"""Shared check for `fairshare worker` flag tests: a bad value is an argparse error."""

import pytest

from worker.cli import main


def assert_worker_usage_error(argv: list[str], message: str, capsys) -> None:
    """`fairshare worker ARGV` exits 2 with `message` on a `fairshare worker: error:` line and no
    traceback, before any model is loaded."""
    with pytest.raises(SystemExit) as exc:
        main(["--port", "1", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "fairshare worker: error:" in err and "Traceback" not in err
