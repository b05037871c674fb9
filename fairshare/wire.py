"""Mappings between the gRPC contract's enums and the names both tiers use.

- `TIER_NAMES`: `fairshare.v1.Tier` value → tier name (`interactive` | `batch` | `background`);
  an unspecified tier counts as `interactive`.
- `TIER_ENUMS`: tier name → `fairshare.v1.Tier` value.
- `FINISH_ENUMS`: finish reason name (`stop` | `length` | `abort`) → `fairshare.v1.FinishReason`.
- `SERVICE_NAME`: the gRPC service name, also used for `grpc.health.v1` checks.
- `INVALID_METADATA_KEY`: trailing-metadata key of a worker's INVALID_ARGUMENT that names the faulty
  input (value ``grammar``: the request's grammar does not compile), so the gateway can answer with
  the right OpenAI ``param``.
"""

from __future__ import annotations

from fairshare.v1 import worker_pb2

SERVICE_NAME = "fairshare.v1.Worker"
INVALID_METADATA_KEY = "fairshare-invalid"

TIER_NAMES = {
    worker_pb2.TIER_UNSPECIFIED: "interactive",
    worker_pb2.TIER_INTERACTIVE: "interactive",
    worker_pb2.TIER_BATCH: "batch",
    worker_pb2.TIER_BACKGROUND: "background",
}
TIER_ENUMS = {"interactive": worker_pb2.TIER_INTERACTIVE, "batch": worker_pb2.TIER_BATCH,
              "background": worker_pb2.TIER_BACKGROUND}
FINISH_ENUMS = {"stop": worker_pb2.FINISH_REASON_STOP, "length": worker_pb2.FINISH_REASON_LENGTH,
                "abort": worker_pb2.FINISH_REASON_ABORT}
