"""Host-side KV page pools: free lists per KV group, reservations, block-table rows (and
the prefix cache's idle pages reclaimed on demand, prefix_cache.py).

Plain Python and numpy (no jax), so the scheduler that hands out pages runs and tests
without it. The layout (`kv_cache.KVLayout`) says how many pages each group has and how
many a request of n positions needs.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


class PageAllocator:
    """Host-side free lists, one per group. Page 0 is the null page, never handed out."""

    def __init__(self, layout: KVLayout, cache=None):
        self.layout = layout
        self.free = [list(range(g.num_pages - 1, 0, -1)) for g in layout.groups]
        # prefix_cache.PrefixCache: its idle blocks' pages are reclaimed when the free
        # lists run short (None: no prefix caching)
        self.cache = cache

    def available(self, group: int) -> int:
        """Pages of `group` that can be handed out: free, or held by idle cached blocks."""
        return len(self.free[group]) + (self.cache.idle_pages() if self.cache else 0)

    def can_fit(self, tokens: int, held: int = 0) -> bool:
        """Whether `tokens` positions fit, `held` of their pages per group given already
        (cached blocks)."""
        return all(self.available(g) >= self.layout.pages_for(g, tokens) - held
                   for g in range(len(self.layout.groups)))

    def _take(self, group: int, n: int) -> list:
        """n pages of `group`, idle cached blocks evicted for them when the free list is
        short (`can_fit` said they fit)."""
        short = n - len(self.free[group])
        if short > 0 and self.cache is not None:
            self.release_blocks(self.cache.evict(short))
        return [self.free[group].pop() for _ in range(n)]

    def ever_fits(self, tokens: int) -> bool:
        return all(self.layout.pages_for(g, tokens) <= grp.num_pages - 1
                   for g, grp in enumerate(self.layout.groups))

    def reserve(self, tokens: int, held: Optional[list] = None) -> Optional[list]:
        """Pages per group for a request of `tokens` positions, or None if they don't fit.
        `held`: per group, the page ids its first positions have already (cached blocks)."""
        held = held or [[] for _ in self.layout.groups]
        if not self.can_fit(tokens, len(held[0])):
            return None
        return [list(ids) + self._take(g, self.layout.pages_for(g, tokens) - len(ids))
                for g, ids in enumerate(held)]

    def grow(self, pages: list, tokens: int) -> Optional[list]:
        """Extend a reservation in place to `tokens` positions (full-attention pages; a
        sliding group's ring is fixed): the new page ids, or None if they don't fit."""
        more = [max(0, self.layout.pages_for(g, tokens) - len(ids)) if grp.window is None
                else 0 for g, (grp, ids) in enumerate(zip(self.layout.groups, pages))]
        if any(self.available(g) < n for g, n in enumerate(more)):
            return None
        new = [self._take(g, n) for g, n in enumerate(more)]
        for ids, extra in zip(pages, new):
            ids.extend(extra)
        return new

    def free_pages(self, group: int = 0) -> int:
        """Pages of `group` no running request holds (idle cached blocks included)."""
        return self.available(group)

    def release(self, pages: list) -> None:
        for g, ids in enumerate(pages):
            self.free[g].extend(reversed(ids))

    def release_blocks(self, blocks: list) -> None:
        """Free cached blocks' pages: per block, one page id per group."""
        self.release([[b[g] for b in blocks] for g in range(len(self.layout.groups))])

    def table_rows(self, pages: list) -> np.ndarray:
        return table_rows(self.layout, pages)


def table_rows(layout, pages: list) -> np.ndarray:
    """Block table rows [groups, width] for a reservation (rings tiled, rest null)."""
    rows = np.zeros((len(layout.groups), layout.width), np.int32)
    for g, ids in enumerate(pages):
        if layout.groups[g].window is not None:
            rows[g] = np.resize(np.asarray(ids, np.int32), layout.width)
        else:
            rows[g, : len(ids)] = ids
    return rows


__all__ = ["PageAllocator", "table_rows"]
