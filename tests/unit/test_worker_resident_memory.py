"""worker.cli.resident_mb_of counts a tensor's own resident pages (mincore), not its neighbours':
the KV pool's share of the worker's memory printed at start relies on it."""

from __future__ import annotations

import mmap

import torch

from worker.cli import resident_mb_of


def test_untouched_pages_are_not_resident_and_written_ones_are():
    # a fresh anonymous mapping (as a large torch.empty gets): no page is resident until written
    # (torch.empty itself may be handed memory the allocator recycled, so the test maps its own)
    region = mmap.mmap(-1, 256 * 2**20)
    pool = torch.frombuffer(region, dtype=torch.uint8)
    neighbour = torch.ones(8 * 2**20, dtype=torch.uint8)  # resident memory elsewhere in the process
    assert resident_mb_of(pool) < 1
    pool[: 32 * 2**20].fill_(1)
    assert 32 <= resident_mb_of(pool) < 33
    pool[-1] = 1  # one more page at the far end
    assert 32 < resident_mb_of(pool) < 33
    assert 8 <= resident_mb_of(neighbour) < 9
    del pool


def test_empty_tensor():
    assert resident_mb_of(torch.empty(0)) == 0.0
