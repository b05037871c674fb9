"""Paged KV-cache block accounting (PagedAttention, Kwon et al., SOSP 2023, §4.2).

The pool holds `num_blocks` blocks of `block_size` token slots each. A sequence's block table maps
its token positions to blocks: position p lives in block `block_table[p // block_size]`, slot
`p % block_size`. This class only does the bookkeeping; the model runner owns the tensors.
"""

from __future__ import annotations

from collections import deque

from worker.engine.sequence import Sequence


class BlockManager:
    """Free list of KV blocks and per-sequence block tables.

    num_blocks: blocks in the pool (> 0). block_size: tokens per block (> 0).
    Raises ValueError on bad sizes; MemoryError when `allocate` is called without room
    (callers check `can_allocate` first).
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0 (got {num_blocks}, {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}  # block id -> request id, to catch double frees

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs to compute `num_new_tokens` more tokens."""
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_new_tokens` more tokens. Raises MemoryError."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self._free):
            raise MemoryError(f"need {need} KV blocks, {len(self._free)} free")
        for _ in range(need):
            block = self._free.popleft()
            self._owner[block] = seq.request_id
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> int:
        """Return all of `seq`'s blocks to the pool; returns how many were freed."""
        n = len(seq.block_table)
        for block in seq.block_table:
            owner = self._owner.pop(block, None)
            if owner != seq.request_id:
                raise RuntimeError(f"KV block {block} freed by {seq.request_id} but owned by {owner}")
            self._free.append(block)
        seq.block_table = []
        return n
