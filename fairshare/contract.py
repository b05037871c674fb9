"""Mappings between the gRPC contract's enums and the names both tiers use.

- `TIER_NAMES`: `fairshare.v1.Tier` value → tier name (`fairshare.tiers`); an unspecified tier
  counts as `fairshare.tiers.DEFAULT_TIER`.
- `TIER_ENUMS`: tier name → `fairshare.v1.Tier` value.
- `FINISH_ENUMS`: finish reason name (`stop` | `length` | `abort` | `handed_back`) →
  `fairshare.v1.FinishReason`.
- `MAX_HAND_BACKS`: how many times the gateway lets one request be handed back by a worker before
  its first token (`GenerateRequest.may_hand_back`; worker/scheduling/handback.py): once, so a
  request never ping-pongs between full workers.
- `SERVICE_NAME`: the gRPC service name, also used for `grpc.health.v1` checks.
- `INVALID_METADATA_KEY`: trailing-metadata key of a worker's INVALID_ARGUMENT that names the faulty
  input (value ``grammar``: the request's grammar does not compile), so the gateway can answer with
  the right OpenAI ``param``.
- `grammar_of`: a request's `SamplingParams.grammar` as the ``(kind, source)`` pair every worker
  compiles (worker/engine/grammar.py), or None.
"""

from __future__ import annotations

from fairshare.tiers import DEFAULT_TIER, Tier
from fairshare.v1 import worker_pb2

SERVICE_NAME = "fairshare.v1.Worker"
INVALID_METADATA_KEY = "fairshare-invalid"
# The details of a generation whose deadline passed, as grpc gives them for a call (GenerateMany
# ends such a generation with them on both sides: worker/multiplex.py, gateway/worker_stream.py).
DEADLINE_DETAILS = "Deadline Exceeded"

# `fairshare.tiers.Tier.X` <-> proto `TIER_X`, by name (a tier added to one and not the other fails here)
TIER_ENUMS = {t.value: worker_pb2.Tier.Value(f"TIER_{t.name}") for t in Tier}
TIER_NAMES = {worker_pb2.TIER_UNSPECIFIED: DEFAULT_TIER, **{v: k for k, v in TIER_ENUMS.items()}}
FINISH_ENUMS = {"stop": worker_pb2.FINISH_REASON_STOP, "length": worker_pb2.FINISH_REASON_LENGTH,
                "abort": worker_pb2.FINISH_REASON_ABORT, "handed_back": worker_pb2.FINISH_REASON_HANDED_BACK}
MAX_HAND_BACKS = 1


def grammar_of(p: worker_pb2.SamplingParams) -> tuple[str, str] | None:
    """(kind, source) of the request's grammar (worker/engine/grammar.py kinds: ``json_schema``,
    ``json_object`` with an empty source, ``regex``, ``ebnf``, ``structural_tag``), or None."""
    if not p.HasField("grammar"):
        return None
    kind = p.grammar.WhichOneof("kind")
    if kind is None:
        return None
    value = getattr(p.grammar, kind)
    return kind, ("" if kind == "json_object" else value)
