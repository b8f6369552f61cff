"""KV blocks of one DP group: reference counts and a prefix cache of full blocks.

Every rank of the group uses the same block ids. A block is in exactly one of
three states: free (unreferenced, holds nothing worth keeping), cached
(unreferenced, holds a full block of known tokens, evictable, least recently
used first) or in use (referenced by ``ref`` sequence tables). Sequences that
share a prefix (the n samples of one prompt, or later requests with the same
system prompt) point at the same blocks.

A full block is identified by a hash chain: ``key = hash((parent_key, tokens))``,
starting from ``ROOT``. A lookup walks the chain from the first block and
checks each hit's parent and tokens, so a hash collision is a miss, never a
wrong block. Entries live in a namespace: ``None`` for the shared prefix cache;
the n samples of one prompt use their own namespace when the cache is off, and
those blocks are freed (not kept) once unreferenced.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Hashable

ROOT = 0  # the parent key of a sequence's first block


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_key(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


@dataclass(frozen=True)
class CacheEntry:
    namespace: Hashable | None
    key: int
    parent: int
    tokens: tuple[int, ...]


@dataclass
class CacheStats:
    queried_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of those, found in cached blocks

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached and unreferenced, LRU first
        self._entries: dict[int, CacheEntry] = {}  # block -> what it holds (cached or in use)
        self._index: dict[tuple[Hashable | None, int], int] = {}  # (namespace, key) -> block
        self.stats = CacheStats()

    # ---- counts ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for later prefix hits."""
        return len(self._evictable)

    @property
    def num_unused(self) -> int:
        """Blocks holding nothing (neither in use nor cached)."""
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def cached_blocks(self) -> list[int]:
        """The unreferenced cached blocks, most recently used first."""
        return list(reversed(self._evictable))

    # ---- allocation and release -----------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks referenced once each; cached blocks are evicted (least recently used) only
        when no free block is left."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
            self._ref[block] = 1
            out.append(block)
        return out

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (in use or cached)."""
        for b in blocks:
            if self._ref[b] == 0:
                self._evictable.pop(b)
            self._ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each; an unreferenced block is kept for later hits when it holds a
        cached full block of the shared namespace, else freed."""
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] > 0:
                continue
            entry = self._entries.get(b)
            if entry is not None and entry.namespace is None and self.enable_caching:
                self._evictable[b] = None
            else:
                self._forget(b)
                self._free.append(b)

    def _forget(self, block: int) -> None:
        entry = self._entries.pop(block, None)
        if entry is not None and self._index.get((entry.namespace, entry.key)) == block:
            del self._index[(entry.namespace, entry.key)]

    # ---- the prefix cache -------------------------------------------------------------------------

    def match_prefix(self, tokens: list[int], namespace: Hashable | None, max_tokens: int) -> list[int]:
        """The longest run of cached full blocks holding ``tokens[:k * block_size]`` with
        ``k * block_size <= max_tokens``; each returned block gets one more reference."""
        self.stats.queried_tokens += len(tokens)
        hits = self._walk(tokens, namespace, max_tokens)
        self.share(hits)
        for b in hits:  # recently used: last to be evicted
            if b in self._evictable:
                self._evictable.move_to_end(b)
        self.stats.hit_tokens += len(hits) * self.block_size
        return hits

    def cached_prefix(self, tokens: list[int], namespace: Hashable | None, max_tokens: int) -> int:
        """How many leading tokens ``match_prefix`` would find cached now; references, LRU order and
        stats are left as they are (for an admission placement weighing the groups)."""
        return len(self._walk(tokens, namespace, max_tokens)) * self.block_size

    def _walk(self, tokens: list[int], namespace: Hashable | None, max_tokens: int) -> list[int]:
        bs = self.block_size
        hits: list[int] = []
        parent = ROOT
        for start in range(0, max_tokens - bs + 1, bs):
            chunk = tuple(tokens[start : start + bs])
            key = chain_key(parent, chunk)
            block = self._index.get((namespace, key))
            if block is None:
                break
            entry = self._entries[block]
            if entry.parent != parent or entry.tokens != chunk:
                break  # a hash collision: a miss
            hits.append(block)
            parent = key
        return hits

    def register(self, table: list[int], tokens: list[int], first: int, count: int,
                 namespace: Hashable | None) -> None:
        """Record blocks ``table[first:first + count]`` as holding their full blocks of ``tokens``
        (their KV is computed). Blocks already indexed (a shared prefix) are left as they are."""
        bs = self.block_size
        parent = ROOT
        if first > 0:
            prev = self._entries.get(table[first - 1])
            if prev is None:
                return  # the chain is broken above: nothing below can be found by a lookup
            parent = prev.key
        for i in range(first, first + count):
            block = table[i]
            if block in self._entries:
                parent = self._entries[block].key
                continue
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = chain_key(parent, chunk)
            if (namespace, key) not in self._index:
                self._index[(namespace, key)] = block
            self._entries[block] = CacheEntry(namespace, key, parent, chunk)
            parent = key

    def flush_cache(self) -> None:
        """Forget what every block holds: cached blocks become free, blocks in use stay with their
        sequences but are no longer found by lookups (nor registered further)."""
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._free.append(block)
        self._entries.clear()
        self._index.clear()

    def entry(self, block: int) -> CacheEntry | None:
        return self._entries.get(block)

    def indexes(self, entry: CacheEntry) -> bool:
        """Whether a block of this pool is found for ``entry``'s prefix."""
        return (entry.namespace, entry.key) in self._index

    def adopt(self, block: int, entry: CacheEntry) -> None:
        """Index ``block`` (in use, after a KV migration) as holding ``entry``'s tokens."""
        self._entries[block] = entry
        self._index.setdefault((entry.namespace, entry.key), block)

    # ---- invariants -------------------------------------------------------------------------------

    def check(self, owned: list[int]) -> list[str]:
        """Problems with the blocks, given every sequence table entry of the group (empty: none)."""
        problems = []
        counts: dict[int, int] = {}
        for b in owned:
            counts[b] = counts.get(b, 0) + 1
        wrong = [b for b in range(self.num_blocks) if self._ref[b] != counts.get(b, 0)]
        if wrong:
            problems.append(f"reference counts differ from the tables for blocks {wrong[:8]}")
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free):
            problems.append("a block is free twice")
        in_use = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        if free & evictable or free & in_use or evictable & in_use:
            problems.append("a block is in two states (free, cached, in use)")
        if len(free) + len(evictable) + len(in_use) != self.num_blocks:
            problems.append(f"{len(in_use)} in use + {len(evictable)} cached + {len(free)} free "
                            f"!= {self.num_blocks} blocks")
        return problems
