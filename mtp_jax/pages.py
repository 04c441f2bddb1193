"""Host-side KV page pools: free lists per KV group, reservations, block-table rows.

Plain Python and numpy (no jax), so the scheduler that hands out pages runs and tests
without it. The layout (`kv_cache.KVLayout`) says how many pages each group has and how
many a request of n positions needs.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


class PageAllocator:
    """Host-side free lists, one per group. Page 0 is the null page, never handed out."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self.free = [list(range(g.num_pages - 1, 0, -1)) for g in layout.groups]

    def can_fit(self, tokens: int) -> bool:
        return all(len(self.free[g]) >= self.layout.pages_for(g, tokens)
                   for g in range(len(self.layout.groups)))

    def ever_fits(self, tokens: int) -> bool:
        return all(self.layout.pages_for(g, tokens) <= grp.num_pages - 1
                   for g, grp in enumerate(self.layout.groups))

    def reserve(self, tokens: int) -> Optional[list]:
        """Pages per group for a request of `tokens` positions, or None if they don't fit."""
        if not self.can_fit(tokens):
            return None
        return [[self.free[g].pop() for _ in range(self.layout.pages_for(g, tokens))]
                for g in range(len(self.layout.groups))]

    def grow(self, pages: list, tokens: int) -> Optional[list]:
        """Extend a reservation in place to `tokens` positions (full-attention pages; a
        sliding group's ring is fixed): the new page ids, or None if they don't fit."""
        more = [max(0, self.layout.pages_for(g, tokens) - len(ids)) if grp.window is None
                else 0 for g, (grp, ids) in enumerate(zip(self.layout.groups, pages))]
        if any(len(self.free[g]) < n for g, n in enumerate(more)):
            return None
        new = [[self.free[g].pop() for _ in range(n)] for g, n in enumerate(more)]
        for ids, extra in zip(pages, new):
            ids.extend(extra)
        return new

    def free_pages(self, group: int = 0) -> int:
        return len(self.free[group])

    def release(self, pages: list) -> None:
        for g, ids in enumerate(pages):
            self.free[g].extend(reversed(ids))

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
