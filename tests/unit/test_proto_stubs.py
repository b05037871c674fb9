"""The generated gRPC stubs under fairshare/v1 must match proto/fairshare/v1/worker.proto."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_not_stale(tmp_path):
    rc = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"), f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", str(ROOT / "proto/fairshare/v1/worker.proto")],
        capture_output=True, text=True,
    )
    assert rc.returncode == 0, rc.stderr
    for name in ("worker_pb2.py", "worker_pb2_grpc.py", "worker_pb2.pyi"):
        fresh = (tmp_path / "fairshare/v1" / name).read_text()
        committed = (ROOT / "fairshare/v1" / name).read_text()
        assert fresh == committed, f"fairshare/v1/{name} is stale: run `make proto` and commit the result"
