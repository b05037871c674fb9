"""Block-granular radix prefix cache, namespaced per tenant (docs/cache-isolation.md).

The idea of keeping finished requests' KV blocks in a radix tree over token ids so that later
requests sharing a prefix reuse them is RadixAttention (Zheng et al., "SGLang: Efficient Execution
of Structured Language Model Programs", NeurIPS 2024, §3). This one is written for FairShare:

- **Keys.** One tree per root key `(kind, namespace, public prefix index)`. A node holds a run of
  whole KV blocks: `tokens` (a multiple of `block_size` token ids) and the pool block ids that hold
  their K/V. Edges are keyed by the first block's tokens; a node is split when an insert diverges
  inside it. Only whole blocks are cached, so a cache hit is always block-aligned.
- **Namespaces.** A lookup never leaves its namespace's tree, so tenants (and a tenant's different
  salts) never share blocks, except the **public prefixes**: operator-listed token sequences (e.g. a
  shared system prompt). When a prompt starts with one (exact tokens, the longest listed one wins),
  its whole blocks live in the public tree, shared by every tenant, and the rest of the prompt in
  the tenant's tree rooted at `(namespace, index of that public prefix)`. While a sequence is
  still a strict beginning of a public prefix, none of its blocks are inserted (it may yet turn
  public); a prompt that stops inside one is never cached.
- **References.** Every cached block has a reference count: how many live requests use it (a
  request takes references with `acquire`, and an inserted block starts with one, held by the
  request that computed it). `release` drops them. A block with no reference is *evictable*; the
  block manager counts it as free for admission and evicts on demand. A request holding a block
  holds every block above it on its path (an insert adopts a request's blocks only while the path
  so far consists of that request's own blocks), so every unreferenced block can be evicted leaf
  first.
- **Eviction** (`evict(n)`): one block at a time, from the tail of an unreferenced leaf of the
  *owner* (tenant) furthest over its share of the private cache (footprint − share, share =
  private blocks · w / Σ w over tenants holding cache; weights via `set_weight`, default 1), least
  recently used first within that owner. Public blocks go last. So a tenant that floods the cache
  evicts its own blocks before anyone else's.

Units: tokens (token ids), blocks (pool block ids). No torch, no grpc.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from worker.cache.namespace import PUBLIC_NAMESPACE

PUBLIC_OWNER = PUBLIC_NAMESPACE  # footprint key of the public tree's blocks


class _Node:
    """A run of whole blocks. tokens: tuple of len(blocks) * block_size ids. A root has none."""

    __slots__ = ("tokens", "blocks", "children", "parent", "owner", "last_access", "root_key")

    def __init__(self, tokens: tuple, blocks: list[int], parent: "_Node | None", owner: str, root_key: tuple) -> None:
        self.tokens = tokens
        self.blocks = blocks
        self.children: dict[tuple, _Node] = {}
        self.parent = parent
        self.owner = owner
        self.last_access = 0
        self.root_key = root_key


@dataclass
class PrefixHits:
    """Prompt tokens looked up in a prefix cache (`lookup_tokens`) and, of those, served from it
    (`hit_tokens`): what every prefix-cache hit figure is made of (the radix cache's own counters,
    the simulated pool's, the cache benchmark's)."""

    lookup_tokens: int = 0
    hit_tokens: int = 0

    def add(self, lookup_tokens: int, hit_tokens: int) -> None:
        """Count a lookup of `lookup_tokens` prompt tokens of which `hit_tokens` were cached."""
        self.lookup_tokens += lookup_tokens
        self.hit_tokens += hit_tokens

    @property
    def hit_rate(self) -> float:
        """hit_tokens / lookup_tokens (NaN before any lookup)."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else math.nan


@dataclass
class CacheStats:
    """Counters since start. lookups / hits: `acquire` calls, and those that matched at least one
    block. tokens: prompt tokens looked up by `acquire` and served from the cache, in all and per
    tenant in `by_tenant`. inserted / evicted: blocks."""

    lookups: int = 0
    hits: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    tokens: PrefixHits = field(default_factory=PrefixHits)
    by_tenant: dict[str, PrefixHits] = field(default_factory=dict)

    def count_lookup(self, tenant: str, lookup_tokens: int, hit_tokens: int) -> None:
        """One `acquire` of `lookup_tokens` tokens for `tenant`, `hit_tokens` of them cached."""
        self.lookups += 1
        self.hits += 1 if hit_tokens else 0
        self.tokens.add(lookup_tokens, hit_tokens)
        self.by_tenant.setdefault(tenant, PrefixHits()).add(lookup_tokens, hit_tokens)


class RadixCache:
    """Tenant-namespaced radix tree over KV block ids with reference counts.

    block_size: tokens per block (> 0). public_prefixes: token-id lists shared across tenants
    (only their whole blocks are shared; shorter than a block: ignored).
    Raises ValueError on a bad block size.
    """

    def __init__(self, block_size: int, public_prefixes: Iterable[Sequence[int]] = ()) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self.block_size = block_size
        self._roots: dict[tuple, _Node] = {}
        self._refs: dict[int, int] = {}          # cached block -> live references
        self._node_of: dict[int, _Node] = {}
        self._footprint: dict[str, int] = {}     # owner -> cached blocks (referenced or not)
        self._heaps: dict[str, list] = {}        # owner -> [(last_access, seq, node)], lazily pruned
        self._weights: dict[str, float] = {}
        self._tick = 0
        self._seq = 0
        self.num_evictable = 0                   # cached blocks with no reference
        self.version = 0                         # bumped on every change (lets callers memoise lookups)
        self.stats = CacheStats()
        seen: list[tuple] = []
        for p in public_prefixes:
            aligned = tuple(int(t) for t in p[: len(p) // block_size * block_size])
            if aligned and aligned not in seen:
                seen.append(aligned)
        # longest first; the index (position in this list) names the private tree after the prefix
        self._public = sorted(enumerate(seen), key=lambda e: -len(e[1]))

    # ---- figures ------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks held by the cache (referenced or not)."""
        return len(self._refs)

    @property
    def num_public_blocks(self) -> int:
        return self._footprint.get(PUBLIC_OWNER, 0)

    def holds(self, block: int) -> bool:
        return block in self._refs

    def refcount(self, block: int) -> int:
        """Live references to a cached block. Raises KeyError when the block is not cached."""
        return self._refs[block]

    def footprint(self, owner: str) -> int:
        """Blocks cached in `owner`'s namespaces (`PUBLIC_OWNER`: the public tree)."""
        return self._footprint.get(owner, 0)

    def footprints(self) -> dict[str, int]:
        return {o: n for o, n in self._footprint.items() if n}

    def set_weight(self, owner: str, weight: float) -> None:
        """Weight of `owner`'s share of the private cache (> 0; default 1)."""
        if not weight > 0:
            raise ValueError("weight must be > 0")
        self._weights[owner] = float(weight)

    # ---- lookup -------------------------------------------------------------------------------
    def _segments(self, namespace: str, tokens: tuple, owner: str) -> list[tuple[tuple, str, int, int]]:
        """(root key, owner, lo, hi) token ranges, block-aligned, covering the whole blocks of `tokens`."""
        bs = self.block_size
        n = len(tokens) // bs * bs
        for idx, p in self._public:
            a = len(p)
            if a <= n and tokens[:a] == p:
                segs = [(("public", PUBLIC_NAMESPACE, -1), PUBLIC_OWNER, 0, a)]
                if n > a:
                    segs.append((("private", namespace, idx), owner, a, n))
                return segs
        return [(("private", namespace, -1), owner, 0, n)] if n else []

    def _walk(self, node: _Node, tokens: tuple, lo: int, hi: int) -> tuple[list[tuple[_Node, int]], int]:
        """Follow `tokens[lo:hi]` down from `node`: [(node, blocks matched in it)], end position."""
        bs = self.block_size
        path: list[tuple[_Node, int]] = []
        i = lo
        while i < hi:
            child = node.children.get(tokens[i:i + bs])
            if child is None:
                break
            nb, k = len(child.blocks), 1
            while k < nb and i + (k + 1) * bs <= hi and child.tokens[k * bs:(k + 1) * bs] == tokens[i + k * bs:i + (k + 1) * bs]:
                k += 1
            path.append((child, k))
            i += k * bs
            if k < nb:
                break
            node = child
        return path, i

    def _match(self, namespace: str, token_ids: Sequence[int]) -> tuple[list[int], list[_Node]]:
        tokens = tuple(token_ids)
        blocks: list[int] = []
        nodes: list[_Node] = []
        for root_key, _, lo, hi in self._segments(namespace, tokens, ""):
            root = self._roots.get(root_key)
            if root is None:
                break
            path, end = self._walk(root, tokens, lo, hi)
            for node, k in path:
                blocks.extend(node.blocks[:k])
                nodes.append(node)
            if end < hi:
                break
        return blocks, nodes

    def match_prefix(self, namespace: str, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Longest cached prefix of `token_ids` in `namespace` (and the public tree): (block ids,
        cached tokens = len(blocks) * block_size). A pure lookup: takes no reference, changes no
        LRU order or statistics (use `acquire` to use the blocks)."""
        blocks, _ = self._match(namespace, token_ids)
        return blocks, len(blocks) * self.block_size

    def acquire(self, namespace: str, token_ids: Sequence[int], tenant: str = "") -> tuple[list[int], int]:
        """`match_prefix`, then take one reference on every matched block (release them with
        `release`), mark the path recently used and count the lookup in `stats` (for `tenant`).
        Returns (block ids, cached tokens)."""
        blocks, nodes = self._match(namespace, token_ids)
        self._tick += 1
        for node in nodes:
            node.last_access = self._tick
        for b in blocks:
            r = self._refs[b]
            if r == 0:
                self.num_evictable -= 1
            self._refs[b] = r + 1
        hit = len(blocks) * self.block_size
        self.stats.count_lookup(tenant, len(token_ids), hit)
        self.version += 1
        return blocks, hit

    def release(self, blocks: Iterable[int]) -> list[int]:
        """Drop one reference on each cached block of `blocks`; returns the blocks that are not
        cached (the caller's private ones, which it frees itself). Raises RuntimeError when a
        cached block has no reference left to drop."""
        private: list[int] = []
        for b in blocks:
            r = self._refs.get(b)
            if r is None:
                private.append(b)
                continue
            if r <= 0:
                raise RuntimeError(f"KV block {b} released more often than referenced")
            self._refs[b] = r - 1
            if r == 1:
                self.num_evictable += 1
                node = self._node_of[b]
                if not node.children:
                    self._push(node)
        self.version += 1
        return private

    # ---- insert -------------------------------------------------------------------------------
    def insert(self, namespace: str, token_ids: Sequence[int], blocks: Sequence[int], tenant: str) -> list[int]:
        """Cache the whole blocks of `token_ids` (K/V computed, held in `blocks`, one block per
        `block_size` tokens) in `namespace`, attributed to `tenant`.

        Blocks already cached on this path are left as they are; the caller's block at a position
        the tree already holds with another block is a duplicate and stays the caller's, and so
        does everything after it. Newly cached ("adopted") blocks start with one reference, the
        caller's. Returns the adopted block ids. Raises ValueError when an adopted block is already
        cached elsewhere.
        """
        bs = self.block_size
        tokens = tuple(token_ids)
        n_full = min(len(tokens) // bs, len(blocks))
        tokens = tokens[:n_full * bs]
        adopted: list[int] = []
        if self._undecided(tokens):
            return adopted
        self._tick += 1
        for root_key, owner, lo, hi in self._segments(namespace, tokens, tenant):
            node = self._roots.get(root_key)
            if node is None:
                node = self._roots[root_key] = _Node((), [], None, owner, root_key)
            i = lo
            while i < hi:
                child = node.children.get(tokens[i:i + bs])
                if child is None:
                    new = list(blocks[i // bs:hi // bs])
                    for b in new:
                        if b in self._refs:
                            raise ValueError(f"KV block {b} is already cached")
                    leaf = _Node(tokens[i:hi], new, node, owner, root_key)
                    leaf.last_access = self._tick
                    node.children[tokens[i:i + bs]] = leaf
                    for b in new:
                        self._refs[b] = 1
                        self._node_of[b] = leaf
                    self._footprint[owner] = self._footprint.get(owner, 0) + len(new)
                    self.stats.inserted_blocks += len(new)
                    adopted.extend(new)
                    i = hi
                    break
                path, _ = self._walk(node, tokens, i, hi)
                _, k = path[0]
                if list(blocks[i // bs:i // bs + k]) != child.blocks[:k]:
                    self._done_inserting(adopted)
                    return adopted  # a duplicate: the caller's block is not the cached one
                child.last_access = self._tick
                i += k * bs
                if k < len(child.blocks):
                    if i >= hi:
                        break
                    child = self._split(child, k)
                node = child
        self._done_inserting(adopted)
        return adopted

    def _undecided(self, tokens: tuple) -> bool:
        """Whether `tokens` (whole blocks) are a strict beginning of a longer public prefix: the
        sequence may still grow into it, and then its blocks belong in the public tree, not in the
        private one, so nothing is cached yet (a block's tree must not change as its sequence grows)."""
        n = len(tokens)
        return any(len(p) > n and p[:n] == tokens for _, p in self._public)

    def _done_inserting(self, adopted: list[int]) -> None:
        if adopted:
            self.version += 1

    def _split(self, node: _Node, k: int) -> _Node:
        """Split `node` after its first k blocks; returns the new upper node (the lower part keeps
        the original object, its children and its leaf status)."""
        bs = self.block_size
        parent = node.parent
        assert parent is not None
        upper = _Node(node.tokens[:k * bs], node.blocks[:k], parent, node.owner, node.root_key)
        upper.last_access = node.last_access
        parent.children[node.tokens[:bs]] = upper
        node.tokens = node.tokens[k * bs:]
        node.blocks = node.blocks[k:]
        node.parent = upper
        upper.children[node.tokens[:bs]] = node
        for b in upper.blocks:
            self._node_of[b] = upper
        return upper

    # ---- eviction -----------------------------------------------------------------------------
    def _push(self, node: _Node) -> None:
        """Queue `node` for eviction. Lazy: an entry whose node is no longer an evictable leaf is
        dropped when it comes up, and one whose node was used since is re-queued at its new time.
        Every evictable leaf has an entry (pushed when it becomes one), so `num_evictable` blocks
        can always be evicted, leaf first."""
        heapq.heappush(self._heaps.setdefault(node.owner, []), (node.last_access, self._next_seq(), node))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _evictable_leaf(self, node: _Node) -> bool:
        parent = node.parent
        return (bool(node.blocks) and not node.children and parent is not None
                and parent.children.get(node.tokens[:self.block_size]) is node and self._refs[node.blocks[-1]] == 0)

    def _victim(self) -> _Node | None:
        """The least recently used unreferenced leaf of the owner furthest over its share."""
        private = {o: n for o, n in self._footprint.items() if n and o != PUBLIC_OWNER}
        total = sum(private.values())
        wsum = sum(self._weights.get(o, 1.0) for o in private) or 1.0
        order = sorted((o for o in private if self._heaps.get(o)),
                       key=lambda o: (-(private[o] - total * self._weights.get(o, 1.0) / wsum), o))
        if self._heaps.get(PUBLIC_OWNER):
            order.append(PUBLIC_OWNER)
        for owner in order:
            heap = self._heaps[owner]
            while heap:
                stamp, _, node = heap[0]
                if not self._evictable_leaf(node):
                    heapq.heappop(heap)  # pushed again when it becomes an evictable leaf
                elif stamp != node.last_access:
                    heapq.heapreplace(heap, (node.last_access, self._next_seq(), node))  # used since
                else:
                    return node
        return None

    def evict(self, n_blocks: int) -> list[int]:
        """Evict up to `n_blocks` unreferenced blocks (rule in the module docstring); returns the
        freed block ids (fewer when not enough are unreferenced)."""
        bs = self.block_size
        freed: list[int] = []
        while len(freed) < n_blocks:
            node = self._victim()
            if node is None:
                break
            key = node.tokens[:bs]
            b = node.blocks.pop()
            node.tokens = node.tokens[:-bs]
            del self._refs[b]
            del self._node_of[b]
            self._footprint[node.owner] -= 1
            self.num_evictable -= 1
            self.stats.evicted_blocks += 1
            freed.append(b)
            if node.blocks:
                continue  # still the same (valid) heap entry on top
            parent = node.parent
            assert parent is not None
            del parent.children[key]
            node.parent = None
            if parent.parent is None:
                if not parent.children:
                    del self._roots[parent.root_key]
            elif not parent.children and self._refs[parent.blocks[-1]] == 0:
                self._push(parent)
        if freed:
            self.version += 1
        return freed

    def flush(self) -> list[int]:
        """Evict every unreferenced block; returns them."""
        return self.evict(len(self._refs))

    # ---- checks -------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the internal invariants (for tests): every cached block in exactly one node,
        footprints and the evictable count agree with the tree, references never negative, and a
        block's references are at most its parent's."""
        seen: dict[int, _Node] = {}
        foot: dict[str, int] = {}
        stack = [(r, None) for r in self._roots.values()]
        while stack:
            node, above = stack.pop()
            assert node.parent is None or len(node.tokens) == len(node.blocks) * self.block_size
            for b in node.blocks:
                assert b not in seen and self._node_of[b] is node
                seen[b] = node
                r = self._refs[b]
                assert r >= 0 and (above is None or r <= above)
                above = r
            foot[node.owner] = foot.get(node.owner, 0) + len(node.blocks)
            for key, child in node.children.items():
                assert child.parent is node and child.tokens[:self.block_size] == key
                stack.append((child, above))
        assert set(seen) == set(self._refs)
        assert {o: n for o, n in foot.items() if n} == self.footprints()
        assert self.num_evictable == sum(1 for r in self._refs.values() if r == 0)


__all__ = ["CacheStats", "PUBLIC_OWNER", "RadixCache"]
