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
- `STREAM_MESSAGE_BYTES`, `fitting`: how much one GenerateMany message carries (its opens one way,
  its events the other), so that a burst never meets the channel's message limit.
- `grammar_of`: a request's `SamplingParams.grammar` as the ``(kind, source)`` pair every worker
  compiles (worker/engine/grammar.py), or None.
"""

from __future__ import annotations

from typing import Iterable

from fairshare.tiers import DEFAULT_TIER, Tier
from fairshare.v1 import worker_pb2

SERVICE_NAME = "fairshare.v1.Worker"
INVALID_METADATA_KEY = "fairshare-invalid"
# The details of a generation whose deadline passed, as grpc gives them for a call (GenerateMany
# ends such a generation with them on both sides: worker/multiplex.py, gateway/worker_stream.py).
DEADLINE_DETAILS = "Deadline Exceeded"
# One GenerateMany message (GenerateManyIn's opens, GenerateManyOut's events), in bytes: well under the
# 64 MiB both ends accept (worker/grpc_server.py, gateway/routing.py), which one Generate call had to
# itself (a single open or event larger than this goes alone, as it went in its own call).
STREAM_MESSAGE_BYTES = 8 * 2**20

# `fairshare.tiers.Tier.X` <-> proto `TIER_X`, by name (a tier added to one and not the other fails here)
TIER_ENUMS = {t.value: worker_pb2.Tier.Value(f"TIER_{t.name}") for t in Tier}
TIER_NAMES = {worker_pb2.TIER_UNSPECIFIED: DEFAULT_TIER, **{v: k for k, v in TIER_ENUMS.items()}}
FINISH_ENUMS = {"stop": worker_pb2.FINISH_REASON_STOP, "length": worker_pb2.FINISH_REASON_LENGTH,
                "abort": worker_pb2.FINISH_REASON_ABORT, "handed_back": worker_pb2.FINISH_REASON_HANDED_BACK}
MAX_HAND_BACKS = 1


def fitting(sizes: Iterable[int], limit: int) -> int:
    """How many of the leading items, given their sizes in bytes in order (read lazily, only as far
    as needed), one message of at most `limit` bytes carries: at least one, whatever its size (0 when
    `sizes` is empty). The per-item framing (tag and length, a few bytes) is left to the slack
    between `limit` and the channel's limit."""
    total = n = 0
    for size in sizes:
        total += size
        if n and total > limit:
            break
        n += 1
    return n


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
