"""Helpers of the prefix-cache cases (CI1, CI3): a worker with a known cache secret, prompts, GetLoad."""

from __future__ import annotations

import os
from contextlib import contextmanager

import grpc

from fairshare.v1 import worker_pb2 as pb
from fairshare.v1 import worker_pb2_grpc as pb_grpc
from tests.conftest import start_worker, stop_worker

MODEL = "random-tiny"
SECRET = "ci-cache-secret-0123456789abcdef"


def prompt_tokens(n: int = 512, seed: int = 0) -> list[int]:
    """A deterministic n-token prompt (ids clear of the special tokens of the random-tiny vocabulary)."""
    return [1000 + (seed * 7919 + 37 * j) % 39000 for j in range(n)]


@contextmanager
def cache_worker(tmp_path, *extra: str, secret: str = SECRET):
    """A `fairshare worker` (random-tiny) whose FAIRSHARE_CACHE_SECRET is `secret`; yields its address."""
    old = os.environ.get("FAIRSHARE_CACHE_SECRET")
    os.environ["FAIRSHARE_CACHE_SECRET"] = secret
    try:
        proc, addr = start_worker(*extra, log_path=tmp_path / "worker.log")
    finally:
        if old is None:
            os.environ.pop("FAIRSHARE_CACHE_SECRET", None)
        else:
            os.environ["FAIRSHARE_CACHE_SECRET"] = old
    try:
        yield addr
    finally:
        stop_worker(proc)


def get_load(addr: str) -> pb.Load:
    with grpc.insecure_channel(addr) as ch:
        return pb_grpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=10)


def cached_tokens(client, prompt: list[int], salt: str | None = None) -> int:
    """Send a completion (official openai client); return usage.prompt_tokens_details.cached_tokens."""
    extra = {"ignore_eos": True}
    if salt is not None:
        extra["cache_salt"] = salt
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0, extra_body=extra)
    assert r.usage.prompt_tokens == len(prompt)
    details = r.usage.prompt_tokens_details
    assert details is not None
    return int(details.cached_tokens or 0)
