"""Paged KV-cache block accounting (PagedAttention, Kwon et al., SOSP 2023, §4.2), with an
optional radix prefix cache (worker/cache/radix.py) sharing blocks between requests.

The pool holds `num_blocks` blocks of `block_size` token slots each. A sequence's block table maps
its token positions to blocks: position p lives in block `block_table[p // block_size]`, slot
`p % block_size`. This class only does the bookkeeping; the model runner owns the tensors.

With a cache, a block is in one of three states: on the free list; *private* to one sequence; or
*cached* (in the radix tree, with a reference count of the sequences whose tables contain it). A
cached block with no reference is *evictable*: it counts as free (`num_free`) and is evicted on
demand when an allocation needs more than the free list has. Freeing a sequence drops its
references and returns only its private blocks to the free list, so a shared block is never freed
while another request uses it.
"""

from __future__ import annotations

from collections import deque

from fairshare.checks import require_at_least
from worker.engine.sequence import Sequence


class BlockManager:
    """Free list of KV blocks, per-sequence block tables and (optionally) the prefix cache.

    num_blocks: blocks in the pool (> 0). block_size: tokens per block (> 0). cache: a
    `worker.cache.radix.RadixCache` over the same block size (None: no prefix caching).
    Raises ValueError on bad sizes; MemoryError when `allocate` is called without room
    (callers check `can_allocate` first).
    """

    def __init__(self, num_blocks: int, block_size: int = 16, cache=None) -> None:
        require_at_least(1, num_blocks=num_blocks, block_size=block_size)
        if cache is not None and cache.block_size != block_size:
            raise ValueError("the prefix cache's block size must equal the pool's")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = cache
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}  # private block id -> request id, to catch double frees
        self._match: dict[str, tuple[int, list[int]]] = {}  # request id -> (cache version, matched blocks)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can get: the free list plus evictable (unreferenced) cached blocks."""
        return len(self._free) + (self.cache.num_evictable if self.cache is not None else 0)

    @property
    def num_used(self) -> int:
        """Blocks held by live requests (cached blocks they reference included; evictable ones not)."""
        return self.num_blocks - self.num_free

    @property
    def num_free_list(self) -> int:
        """Blocks on the free list (neither held by a request nor cached)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks in the prefix cache (referenced or evictable)."""
        return self.cache.num_blocks if self.cache is not None else 0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs to compute `num_new_tokens` more tokens."""
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_new_tokens` more tokens, evicting unreferenced cached
        blocks when the free list is short. Raises MemoryError."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free:
            raise MemoryError(f"need {need} KV blocks, {self.num_free} free")
        if need > len(self._free):
            self._free.extend(self.cache.evict(need - len(self._free)))
        for _ in range(need):
            block = self._free.popleft()
            self._owner[block] = seq.request_id
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> int:
        """Drop all of `seq`'s blocks: its private ones return to the pool, its references on cached
        ones are released (they stay cached). Returns how many blocks the table had."""
        n = len(seq.block_table)
        private = self.cache.release(seq.block_table) if self.cache is not None else seq.block_table
        for block in private:
            owner = self._owner.pop(block, None)
            if owner != seq.request_id:
                raise RuntimeError(f"KV block {block} freed by {seq.request_id} but owned by {owner}")
            self._free.append(block)
        seq.block_table = []
        seq.num_cache_inserted_blocks = 0
        self._match.pop(seq.request_id, None)
        return n

    # ---- prefix cache ---------------------------------------------------------------------------
    def _lookup_tokens(self, seq: Sequence) -> list[int]:
        """Tokens a cache lookup may cover: all but the last (at least one token is computed, so
        there are logits to sample from)."""
        return seq.all_token_ids[:seq.num_tokens - 1]

    def _matched(self, seq: Sequence) -> list[int]:
        """Cached blocks a waiting `seq` would reuse now (memoised per cache version)."""
        if self.cache is None or seq.block_table:
            return []
        memo = self._match.get(seq.request_id)
        if memo is None or memo[0] != self.cache.version:
            blocks, _ = self.cache.match_prefix(seq.cache_namespace, self._lookup_tokens(seq))
            memo = self._match[seq.request_id] = (self.cache.version, blocks)
        return memo[1]

    def admission_need(self, seq: Sequence) -> int:
        """Blocks (counted against `num_free`) a waiting `seq` takes to finish its prefill: the
        uncached part, plus matched cached blocks that are evictable now (using them makes them
        unavailable to others)."""
        matched = self._matched(seq)
        need = self.blocks_needed(seq, seq.num_uncomputed)
        if not matched:
            return need
        idle = sum(1 for b in matched if self.cache.refcount(b) == 0)
        return max(0, need - len(matched)) + idle

    def attach_prefix(self, seq: Sequence) -> int:
        """On admission: reuse the longest cached prefix of `seq` (references taken; the table
        starts with those blocks and `num_computed_tokens` is set to the tokens they hold).
        Returns the cached tokens (0 without a cache or a hit)."""
        if self.cache is None or seq.block_table or seq.num_computed_tokens:
            return 0
        self._match.pop(seq.request_id, None)
        blocks, n = self.cache.acquire(seq.cache_namespace, self._lookup_tokens(seq), seq.tenant_id)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = n
        seq.num_cache_inserted_blocks = len(blocks)
        return n

    def cache_computed(self, seq: Sequence) -> None:
        """Insert `seq`'s computed whole blocks into the cache (as prefill or decode completes them;
        blocks adopted by the cache stop being private). No-op without a cache."""
        if self.cache is None:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_cache_inserted_blocks:
            return
        tokens = seq.all_token_ids[:full * self.block_size]
        for block in self.cache.insert(seq.cache_namespace, tokens, seq.block_table[:full], seq.tenant_id):
            self._owner.pop(block, None)
        seq.num_cache_inserted_blocks = full

    def flush_cache(self) -> int:
        """Evict every unreferenced cached block to the free list; returns how many."""
        if self.cache is None:
            return 0
        freed = self.cache.flush()
        self._free.extend(freed)
        return len(freed)
