"""Paged KV cache: layout, page pools and reservation, the paged attention backend.

Layers (target layers, then MTP modules) are grouped by attention kind: one group for
full attention and one per sliding-window size. Each group has its own page pool and its
own block table `[max_batch, width]`. A full-attention request reserves
ceil((prompt + max_tokens + K) / page_size) pages at admission, so the decode loop never
allocates. A sliding-window group keeps only a ring of R pages per request, with
R * page_size > window + largest query chunk; its block table row is that ring tiled to
the table width, so position p maps to ring page (p // page_size) % R with no change to
the attention kernel (masking is by position, so older positions aliased onto the same
page are never seen: they are outside every window that could read them).

Page 0 of every pool is a null page that is never allocated: unused table entries point
there. Non-finite K/V are written as zeros (the engine reports the request that made them). Writes go through slot mappings (`page * page_size + offset`); positions outside
[0, limit) get DROP_SLOT and are dropped, never wrapped (a -1 index wraps in jnp).

Caches per layer: k, v [kv_heads, num_pages_of_its_group, page_size, head_dim].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_write import DROP_SLOT, slot_mapping, write_kv
from pallas_kernels.paged_attention import paged_attention

from .config import EngineConfig, ModelConfig
from .sharding import P, batch_axis, kv_heads_axis, shard_kernel


@dataclasses.dataclass(frozen=True)
class KVGroup:
    window: Optional[int]  # None: full attention
    num_pages: int  # including the null page 0
    ring_pages: int  # pages per request for sliding groups (0 for full attention)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Static description of all caches; it keys compiled programs."""

    page_size: int
    width: int  # block table entries per request
    groups: tuple  # KVGroup per group
    layer_group: tuple  # group index per layer (target layers, then MTP modules)
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    def pages_for(self, group: int, tokens: int) -> int:
        g = self.groups[group]
        return g.ring_pages if g.window is not None else math.ceil(tokens / self.page_size)

    def bytes_per_page(self) -> int:
        return 2 * self.kv_heads * self.page_size * self.head_dim * jnp.dtype(self.dtype).itemsize


def make_layout(cfg: ModelConfig, eng: EngineConfig, k: int, dtype, *,
                mtp_layers: Optional[int] = None) -> KVLayout:
    """Groups, pool sizes and table width for a model and engine config.

    Pool sizes: `eng.num_pages` per group if set; else `eng.kv_memory_gb` split across
    layers; else enough pages for every slot to hold `max_model_len` tokens.
    """
    n_mtp = cfg.num_mtp_modules if mtp_layers is None else mtp_layers
    windows = list(cfg.sliding_windows) + list(cfg.mtp_sliding_windows[:n_mtp])
    kinds = sorted({w for w in windows if w is not None})
    kind_index = {None: 0, **{w: i + 1 for i, w in enumerate(kinds)}}
    ps = eng.page_size
    width = math.ceil((eng.max_model_len + k + eng.prefill_chunk) / ps) + 1
    itemsize = jnp.dtype(dtype).itemsize
    page_bytes = 2 * cfg.num_kv_heads * ps * cfg.head_dim * itemsize
    groups = []
    for w in [None] + kinds:
        nlayers = sum(1 for x in windows if x == w)
        if w is None:
            per_req = math.ceil((eng.max_model_len + k) / ps)
            ring = 0
        else:
            ring = math.ceil((w + max(eng.prefill_chunk, k + 1) - 1) / ps) + 1
            per_req = ring
        if eng.num_pages is not None:
            n = eng.num_pages
        elif eng.kv_memory_gb is not None and w is None:  # the budget is for full attention
            n = int(eng.kv_memory_gb * 2**30 / max(1, page_bytes * nlayers))
        else:
            n = per_req * eng.max_batch
        n = max(n, per_req) if w is not None else n
        groups.append(KVGroup(window=w, num_pages=n + 1, ring_pages=ring))
    return KVLayout(page_size=ps, width=width, groups=tuple(groups),
                    layer_group=tuple(kind_index[w] for w in windows),
                    kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    dtype=jnp.dtype(dtype).name)


def init_caches(layout: KVLayout):
    """Zeroed k/v pages for every layer (tuple of (k, v))."""
    out = []
    for gi in layout.layer_group:
        shape = (layout.kv_heads, layout.groups[gi].num_pages, layout.page_size, layout.head_dim)
        out.append((jnp.zeros(shape, layout.dtype), jnp.zeros(shape, layout.dtype)))
    return tuple(out)


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

    def release(self, pages: list) -> None:
        for g, ids in enumerate(pages):
            self.free[g].extend(reversed(ids))

    def table_rows(self, pages: list) -> np.ndarray:
        """Block table rows [groups, width] for a reservation (rings tiled, rest null)."""
        rows = np.zeros((len(self.layout.groups), self.layout.width), np.int32)
        for g, ids in enumerate(pages):
            if self.layout.groups[g].window is not None:
                rows[g] = np.resize(np.asarray(ids, np.int32), self.layout.width)
            else:
                rows[g, : len(ids)] = ids
        return rows


class PagedKV:
    """The paged caches of one traced program and the attention backends over them.

    `attend(positions, kv_lens)` gives the backend for one forward over positions [b, t]
    (consecutive per row, ending at kv_lens - 1); it writes the new keys by slot mapping,
    dropping positions outside [0, limit), then attends. Successive forwards (verify, then
    each draft pass) see each other's writes; `caches` holds the final pages.

    With a mesh, the kernels run per shard: kv heads over `tp`; rows over `dp` when
    `batch_sharded` (the decode step), replicated otherwise (single-slot prefill). Pages
    are replicated over `dp`, so the new rows of all slots are gathered before the write.
    """

    def __init__(self, layout: KVLayout, caches, block_tables, limit, *, backend=None,
                 mesh=None, batch_sharded=True):
        self.layout, self.caches = layout, list(caches)
        self.block_tables, self.limit, self.backend = block_tables, limit, backend
        self.mesh = mesh
        rows = block_tables[0].shape[0]
        self.dp = batch_axis(mesh, rows) if batch_sharded else None
        self.tp = kv_heads_axis(mesh, layout.kv_heads)

    def _write(self, pages, k, v, slots):
        dp, tp = self.dp, self.tp

        def write(kp, vp, k, v, slots):
            if dp is not None:  # every dp replica of the pages takes every slot's rows
                k, v, slots = (jax.lax.all_gather(x, dp, axis=0, tiled=True)
                               for x in (k, v, slots))
            return write_kv(kp, vp, k, v, slots)

        page = P(tp, None, None, None)
        rows = P(dp, None, tp, None)
        fn = shard_kernel(write, self.mesh, (page, page, rows, rows, P(dp, None)), (page, page))
        # Non-finite K/V never enter the cache: a page outlives its request, and a stale
        # NaN seen by a padding row would reach real rows as 0 * NaN. The request that
        # produced it is stopped by the NaN checks on its own hiddens / logits.
        k, v = (jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x)) for x in (k, v))
        return fn(*pages, k, v, slots)

    def _attend(self, q, kp, vp, table, kv_lens, window):
        dp, tp = self.dp, self.tp

        def attn(q, kp, vp, table, kv_lens):
            return paged_attention(q, kp, vp, table, kv_lens, sliding_window=window,
                                   backend=self.backend)

        page = P(tp, None, None, None)
        rows = P(dp, None, tp, None)
        fn = shard_kernel(attn, self.mesh, (rows, page, page, P(dp, None), P(dp)), rows)
        return fn(q, kp, vp, table, kv_lens)

    def attend(self, positions, kv_lens):
        slots = [slot_mapping(bt, positions, self.layout.page_size, self.limit)
                 for bt in self.block_tables]

        def attend(layer, q, k, v, window):
            g = self.layout.layer_group[layer]
            kp, vp = self._write(self.caches[layer], k, v, slots[g])
            self.caches[layer] = (kp, vp)
            return self._attend(q, kp, vp, self.block_tables[g], kv_lens, window)

        return attend


__all__ = ["DROP_SLOT", "KVGroup", "KVLayout", "make_layout", "init_caches", "PageAllocator",
           "PagedKV"]
