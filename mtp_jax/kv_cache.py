"""Paged KV cache: layout, page pools and reservation, the paged attention backend.

Layers (target layers, then MTP modules) are grouped by attention kind: one group for
full attention and one per sliding-window size. Each group has its own page pool and its
own block table `[max_batch, width]`. A full-attention request holds pages as it grows:
the prompt's at admission, then before every dispatch the host hands each running request
the pages that dispatch can write (`PageAllocator.grow`), so the decode loop itself never
allocates (scheduler.py: preemption when the pool runs out). A sliding-window group keeps only a ring of R pages per request, with
R * page_size > window + largest query chunk; its block table row is that ring tiled to
the table width, so position p maps to ring page (p // page_size) % R with no change to
the attention kernel (masking is by position, so older positions aliased onto the same
page are never seen: they are outside every window that could read them).

Page 0 of every pool is a null page that is never allocated: unused table entries point
there. Non-finite K/V are written as zeros (the engine reports the request that made them). Writes go through slot mappings (`page * page_size + offset`); positions outside
[0, limit) get DROP_SLOT and are dropped, never wrapped (a -1 index wraps in jnp).

Caches per layer: k [kv_heads, num_pages_of_its_group, page_size, head_dim] and v [..,
v_head_dim], with that layer's own kv head count (MiMo-V2-Flash's sliding layers have twice
the kv heads of its full layers; the page pool is shared by layer kind, the arrays are
per layer); with
latent attention (MLA, `latent` layouts) one array per layer, (kv,) [1, num_pages,
page_size, kv_lora_rank + rope dims]: a token's latent and rope key, which is its key for
every head and, in its first kv_lora_rank dims, its value (pallas_kernels/paged_mla.py).
A DeepSeek Sparse Attention layer (dsa.py) adds its index keys, [1, num_pages, page_size,
index_head_dim] in the same pages (and, for fp8 pages, their per-token scales), and attends
over the tokens its indexer selects (`pallas_kernels.dsa`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels.kv_write import DROP_SLOT, slot_mapping, write_pages
from pallas_kernels import paged_mla as mla_kernel
from pallas_kernels.common import resolve_backend
from pallas_kernels.paged_attention import paged_attention

from .config import ConfigError, EngineConfig, ModelConfig
from .delta_rule import mix_tokens, state_shapes
from .dsa import check_kernels as check_dsa_kernels
from .dsa import index_dim, paged_sparse_mla, paged_topk
from .model import cache_entry
from .pages import PageAllocator  # noqa: F401  (host-side, jax-free; re-exported)
from .quant import FP8_KV_DTYPE, FP8_MAX, latent_row_scale
from .sharding import P, batch_axis, kv_heads_axis, shard_kernel
from .tree import compact_pages


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
    layer_dims: tuple  # (kv heads, key dims, value dims) per layer; value dims 0 if latent
    dtype: str
    latent: bool = False  # MLA: one cached row per token, keys and values in one
    # fp8 pages: per layer (k scales [kv heads], v scales [kv heads]); the stored value
    # times its head's scale is the key / value (calibration.calibrate_kv_scales). A latent
    # layer: ((latent scale, rope scale), ()), for the row's two parts
    scales: Optional[tuple] = None
    # per layer: None, or for a linear-attention layer its spec (specs.GDNSpec): it holds
    # no pages but a conv and a recurrent state per slot (delta_rule.py); empty: none is
    linear: tuple = ()
    slots: int = 0  # requests the per-slot states are sized for (max_batch)
    state_dtype: str = "float32"  # the conv states' dtype (the model's)

    def is_linear(self, layer: int) -> bool:
        return bool(self.linear) and self.linear[layer] is not None
    # DeepSeek Sparse Attention: per layer, the index-key dims a token caches in an array of
    # its own after the latent row's, [1, pages, page_size, dims] (0: none; empty: no layer);
    # fp8 pages add each token's index-key scale, [1, pages, page_size, 1] float32
    index_dims: tuple = ()

    @property
    def arrays_per_layer(self) -> int:
        return 1 if self.latent else 2

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def head_dim(self) -> int:
        """Key dims per cached token (a latent row's width for MLA); the same in every
        attention layer of the models we load."""
        return next(d for i, (_, d, _) in enumerate(self.layer_dims) if not self.is_linear(i))

    def page_shapes(self, layer: int) -> tuple:
        """Shapes of the cache arrays of one layer: (k, v), or (kv,) when latent; a
        linear-attention layer's (conv, recurrent) states [slots, ...] instead."""
        if self.is_linear(layer):
            return tuple((self.slots,) + x for x in state_shapes(self.linear[layer]))
        heads, dims, v_dims = self.layer_dims[layer]
        pages = self.groups[self.layer_group[layer]].num_pages
        k = (heads, pages, self.page_size, dims)
        shapes = (k,) if self.latent else (k, (heads, pages, self.page_size, v_dims))
        if self.index_dims and self.index_dims[layer]:
            shapes += ((1, pages, self.page_size, self.index_dims[layer]),)
            if self.scales is not None:
                shapes += ((1, pages, self.page_size, 1),)
        return shapes

    def page_dtypes(self, layer: int) -> tuple:
        """The dtype of each array of `page_shapes(layer)`: the pages', and float32 for
        the per-token index-key scales of fp8 pages; a linear layer's state dtypes."""
        if self.is_linear(layer):  # (conv, recurrent) states
            return (self.state_dtype, "float32")
        n = len(self.page_shapes(layer))
        extra = 1 if self.index_dims and self.index_dims[layer] and self.scales is not None \
            else 0
        return (self.dtype,) * (n - extra) + ("float32",) * extra

    def pages_for(self, group: int, tokens: int) -> int:
        g = self.groups[group]
        return g.ring_pages if g.window is not None else math.ceil(tokens / self.page_size)

    def bytes_per_page(self, group: int = 0) -> int:
        """Bytes one page id of `group` holds over all the group's layers."""
        return page_bytes(self.layer_dims, [g == group for g in self.layer_group],
                          self.page_size, self.dtype, self.index_dims,
                          4 if self.scales is not None else 0)


def page_bytes(layer_dims, members, page_size: int, dtype, index_dims=(),
               index_scale_bytes: int = 0) -> int:
    """Bytes of one page id over the layers flagged in `members` (k and v, or a latent
    row, per layer, and a DSA layer's index keys with, for fp8 pages, their scales)."""
    index_dims = index_dims or (0,) * len(layer_dims)
    return page_size * sum(
        jnp.dtype(dtype).itemsize * (heads * (dims + v_dims) + idx)
        + (index_scale_bytes if idx else 0)
        for (heads, dims, v_dims), idx, m in zip(layer_dims, index_dims, members) if m)


def make_layout(cfg: ModelConfig, eng: EngineConfig, k: int, dtype, *,
                mtp_layers: Optional[int] = None, scales: Optional[tuple] = None) -> KVLayout:
    """Groups, pool sizes and table width for a model and engine config.

    Pool sizes: `eng.num_pages` per group if set; else `eng.kv_memory_gb` split across
    layers (fp8 pages: twice as many in the same memory); else enough pages for every slot
    to hold `max_model_len` tokens. `dtype`: the model's; `eng.kv_dtype` "fp8" stores
    float8_e4m3fn pages instead, with `scales` per layer (required then).
    """
    n_mtp = cfg.num_mtp_modules if mtp_layers is None else mtp_layers
    model_dtype = dtype
    if eng.kv_dtype == "fp8":
        if scales is None:
            raise ValueError("an fp8 KV layout needs per-layer scales")
        dtype = FP8_KV_DTYPE
        scales = tuple(scales[: cfg.num_layers + n_mtp])
    else:
        scales = None
    windows = list(cfg.sliding_windows) + list(cfg.mtp_sliding_windows[:n_mtp])
    kinds = sorted({w for w in windows if w is not None})
    kind_index = {None: 0, **{w: i + 1 for i, w in enumerate(kinds)}}
    ps = eng.page_size
    width = math.ceil((eng.max_model_len + k + eng.prefill_chunk) / ps) + 1
    n_layers = len(windows)
    # a linear-attention layer holds no pages (dims 0: no bytes in its group's pages)
    entries = [(0, 0, 0, False) if cfg.is_linear(i) else cache_entry(cfg, i)
               for i in range(n_layers)]
    latent = any(e[3] for e in entries)
    layer_dims = tuple(e[:3] for e in entries)
    linear = tuple(cfg.layer_spec(i).attention if cfg.is_linear(i) else None
                   for i in range(n_layers))
    index_dims = tuple(index_dim(cfg, i) for i in range(len(windows)))
    index_dims = index_dims if any(index_dims) else ()
    groups = []
    for w in [None] + kinds:
        group_bytes = page_bytes(layer_dims, [x == w for x in windows], ps, dtype, index_dims,
                                 4 if scales is not None else 0)
        if w is None:
            per_req = math.ceil((eng.max_model_len + k) / ps)
            ring = 0
        else:
            ring = math.ceil((w + max(eng.prefill_chunk, k + 1) - 1) / ps) + 1
            per_req = ring
        if eng.num_pages is not None:
            n = eng.num_pages
        elif eng.kv_memory_gb is not None and w is None:  # the budget is for full attention
            n = int(eng.kv_memory_gb * 2**30 / max(1, group_bytes))
        else:
            n = per_req * eng.max_batch
        n = max(n, per_req) if w is not None else n
        groups.append(KVGroup(window=w, num_pages=n + 1, ring_pages=ring))
    return KVLayout(page_size=ps, width=width, groups=tuple(groups),
                    layer_group=tuple(kind_index[w] for w in windows),
                    layer_dims=layer_dims, dtype=jnp.dtype(dtype).name, latent=latent,
                    scales=scales, linear=linear if any(x is not None for x in linear) else (),
                    slots=eng.max_batch, state_dtype=jnp.dtype(model_dtype).name,
                    index_dims=index_dims)


def check_kernels(layout: KVLayout, eng: EngineConfig, cfg: ModelConfig) -> None:
    """ConfigError, before anything compiles, for a latent (MLA) cache the chosen paged-MLA
    kernel cannot tile (e.g. a kv_lora_rank off the TPU's 128-lane tiles), with why; the
    same for the DSA kernels of a sparse-attention model (dsa.check_kernels)."""
    if layout.index_dims:
        check_dsa_kernels(layout, eng, cfg)
    if not layout.latent:
        return
    backend = resolve_backend(eng.attention_backend, mla_kernel.BACKEND_ENV_VAR, "paged-MLA")
    if backend == "reference":
        return
    for q_len in sorted({1, eng.prefill_chunk}):
        block = mla_kernel.default_block_config(eng.max_batch, q_len, cfg.num_heads,
                                                layout.page_size, layout.width,
                                                layout.head_dim, layout.dtype, backend)
        try:
            mla_kernel.check_tiling(backend, v_dim=cfg.mla.kv_lora_rank,
                                    head_dim=layout.head_dim, page_size=layout.page_size,
                                    dtype=layout.dtype, cfg=block)
        except ValueError as e:
            raise ConfigError(f"kv_lora_rank={cfg.mla.kv_lora_rank}, qk_rope_head_dim="
                              f"{cfg.mla.qk_rope_dim}, page_size={layout.page_size}: {e}") from None


def init_caches(layout: KVLayout):
    """Zeroed pages for every layer: (k, v), or (kv,) for a latent layout (a DSA layer's
    index keys, and their fp8 scales, after it); a linear-attention layer's zeroed states
    (conv in the model dtype, recurrent in f32)."""
    return tuple(tuple(jnp.zeros(shape, dtype) for shape, dtype in
                       zip(layout.page_shapes(i), layout.page_dtypes(i)))
                 for i in range(layout.num_layers))


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
                 mesh=None, batch_sharded=True, state_rows=None, fresh=None,
                 keep_states=False):
        self.layout, self.caches = layout, list(caches)
        self.block_tables, self.limit, self.backend = block_tables, limit, backend
        self.mesh = mesh
        rows = block_tables[0].shape[0]
        self.dp = batch_axis(mesh, rows) if batch_sharded else None
        # linear-attention states: row r reads and writes slot state_rows[r] (None: row r
        # is slot r; a row of slot max_batch writes nothing), from zeros where fresh[r]
        # (a prompt's first chunk); with keep_states the states after every token of the
        # forward are held in `pending` until `commit_states` picks one per row
        self.state_rows, self.fresh, self.keep_states = state_rows, fresh, keep_states
        self.pending: dict = {}

    def _scales(self, layer):
        """(k scale [H], v scale [H]) f32 of an fp8 layer, ((latent, rope) [2],) of an
        fp8 latent layer, else ()."""
        if self.layout.scales is None:
            return ()
        return tuple(jnp.asarray(s, jnp.float32) for s in self.layout.scales[layer] if s)

    def _write(self, pages, k, v, slots, scales, v_dim=None):
        dp, tp = self.dp, kv_heads_axis(self.mesh, pages[0].shape[0])
        new = (k,) if v is None else (k, v)  # a latent cache is one array
        n = len(new)

        if v is None and scales:  # a latent row's two parts, each over its own scale
            (parts,), scales = scales, ()
            new = (k.astype(jnp.float32) / latent_row_scale(parts, k.shape[-1], v_dim),)

        def write(*args):
            pages, rows, slots = args[:n], args[n:2 * n], args[2 * n]
            scale = args[2 * n + 1:] or (None,) * n
            if dp is not None:  # every dp replica of the pages takes every slot's rows
                rows = tuple(jax.lax.all_gather(x, dp, axis=0, tiled=True) for x in rows)
                slots = jax.lax.all_gather(slots, dp, axis=0, tiled=True)
            return write_pages(pages, rows, slots, scale, backend=self.backend)

        page = P(tp, None, None, None)
        row = P(dp, None, tp, None)
        fn = shard_kernel(write, self.mesh, (page,) * n + (row,) * n + (P(dp, None),)
                          + (P(tp),) * len(scales), (page,) * n)
        # Non-finite K/V never enter the cache: a page outlives its request, and a stale
        # NaN seen by a padding row would reach real rows as 0 * NaN. The request that
        # produced it is stopped by the NaN checks on its own hiddens / logits.
        new = tuple(jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x)) for x in new)
        return tuple(fn(*pages, *new, slots, *scales))

    def _attend(self, q, pages, table, kv_lens, window, sm_scale, v_dim, sinks, scales,
                tree_mask=None):
        dp, tp = self.dp, kv_heads_axis(self.mesh, pages[0].shape[0])
        if self.layout.latent:
            if tree_mask is not None:
                raise ValueError("latent attention (paged_mla) takes no tree mask")
            # One latent row per token serves every head: the pages are replicated over
            # tp and the query heads split over it.
            heads = kv_heads_axis(self.mesh, q.shape[2])

            def attn(q, kv, table, kv_lens, *parts):
                return mla_kernel.paged_mla(q, kv[0], table, kv_lens, v_dim=v_dim,
                                            sm_scale=sm_scale, backend=self.backend,
                                            **({"kv_scale": parts[0]} if parts else {}))

            rows = P(dp, None, heads, None)
            fn = shard_kernel(attn, self.mesh, (rows, P(None, None, None, None), P(dp, None),
                                                P(dp)) + (P(None),) * len(scales), rows)
            return fn(q, pages[0], table, kv_lens, *scales)

        has_sinks, has_tree = sinks is not None, tree_mask is not None

        def attn(q, kp, vp, table, kv_lens, *extra):
            tree = extra[0] if has_tree else None
            extra = extra[has_tree:]
            sink = extra[0] if has_sinks else None
            k_scale, v_scale = extra[has_sinks:] or (None, None)
            return paged_attention(q, kp, vp, table, kv_lens, sliding_window=window,
                                   sm_scale=sm_scale, sinks=sink, k_scale=k_scale,
                                   v_scale=v_scale, tree_mask=tree, backend=self.backend)

        page = P(tp, None, None, None)
        rows = P(dp, None, tp, None)
        tree = () if tree_mask is None else (tree_mask,)
        extra = (() if sinks is None else (sinks,)) + tuple(scales)
        fn = shard_kernel(attn, self.mesh, (rows, page, page, P(dp, None), P(dp))
                          + (P(dp, None, None),) * len(tree) + (P(tp),) * len(extra), rows)
        return fn(q, *pages, table, kv_lens, *tree, *extra)

    def attend(self, positions, kv_lens, tree_mask=None):
        """The backend of one forward over positions [b, t] (where its keys are stored).
        tree_mask None: the positions are consecutive and attend causally up to kv_lens - 1;
        [b, t, T] bool: the last T positions before kv_lens hold a draft tree's rows and the
        forward's t queries are its last t; each sees the positions before the tree and the
        tree rows its mask names (paged_attention's tree_mask)."""
        return _Attend(self, positions, kv_lens, tree_mask)

    def compact(self, layers, base, idx, n):
        """Move a draft tree's accepted rows into place in the pages of `layers`: the row
        of node idx[:, d] (stored at base + idx) to base + d for 1 <= d <= n
        (tree.compact_pages; writes outside [0, limit) dropped)."""
        for layer in layers:
            g = self.layout.layer_group[layer]
            self.caches[layer] = compact_pages(self.caches[layer], self.block_tables[g], base,
                                               idx, n, self.layout.page_size, self.limit)

    def _attend_sparse(self, layer, q, kv, index, slots, table, kv_lens, sm_scale, v_dim,
                       selected):
        """A DSA layer: the latent row and (with its own indexer) the index key written, then
        MLA over the tokens the indexer selects per query row (dsa.paged_topk), or over every
        visible token when no row can see more than index_topk of them (the table's width
        bounds that statically), or over the previous layer's selection (a shared layer)."""
        cache = self.caches[layer]
        scales = self._scales(layer)  # fp8 pages: the latent row's (latent, rope) scales
        pages = self._write(cache[:1], kv, None, slots, scales, v_dim)
        if not index.shared:
            k = index.k[:, :, None]
            if scales:  # fp8 index keys, each token over its own scale (amax / 448)
                amax = jnp.max(jnp.abs(k.astype(jnp.float32)), axis=-1, keepdims=True)
                k_scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
                pages += self._write(cache[1:2], k.astype(jnp.float32) / k_scale, None,
                                     slots, (), None)
                pages += self._write(cache[2:], k_scale, None, slots, (), None)
            else:
                pages += self._write(cache[1:], k, None, slots, (), None)
        self.caches[layer] = pages
        if index.topk >= table.shape[1] * self.layout.page_size:
            return self._attend(q, pages[:1], table, kv_lens, None, sm_scale, v_dim, None,
                                scales)
        dp = self.dp
        if index.shared:
            if "last" not in selected:
                raise ValueError("a layer sharing its indexer's selection needs a layer with "
                                 "an indexer before it in the same forward")
            indices = selected["last"]
        else:
            def topk(q_i, w, k_pages, table, kv_lens, *k_scale):
                return paged_topk(dataclasses.replace(index, q=q_i, w=w), k_pages[0], table,
                                  kv_lens, backend=self.backend,
                                  k_scale=k_scale[0][0, :, :, 0] if k_scale else None)

            page = P(None, None, None, None)
            fn = shard_kernel(topk, self.mesh, (P(dp, None, None, None), P(dp, None, None),
                                                page, P(dp, None), P(dp))
                              + (page,) * len(pages[2:]), P(dp, None, None))
            indices = selected["last"] = fn(index.q, index.w, pages[1], table, kv_lens,
                                            *pages[2:])
        heads = kv_heads_axis(self.mesh, q.shape[2])

        def attn(q, kv, table, indices, *kv_scale):
            return paged_sparse_mla(q, kv[0], table, indices, v_dim=v_dim, sm_scale=sm_scale,
                                    backend=self.backend,
                                    kv_scale=kv_scale[0] if kv_scale else None)

        rows = P(dp, None, heads, None)
        fn = shard_kernel(attn, self.mesh, (rows, P(None, None, None, None), P(dp, None),
                                            P(dp, None, None)) + (P(None),) * len(scales),
                          rows)
        return fn(q, pages[0], table, indices, *scales)

    def _states(self, layer):
        """(conv, recurrent) states of this forward's rows for a linear-attention layer."""
        conv, rec = self.caches[layer]
        if self.state_rows is not None:
            conv = conv.at[self.state_rows].get(mode="clip")
            rec = rec.at[self.state_rows].get(mode="clip")
        if self.fresh is not None:
            conv = jnp.where(self.fresh[:, None, None], jnp.zeros_like(conv), conv)
            rec = jnp.where(self.fresh[:, None, None, None], jnp.zeros_like(rec), rec)
        return conv, rec

    def _put_states(self, layer, conv, rec):
        old_conv, old_rec = self.caches[layer]
        conv = conv.astype(old_conv.dtype)
        if self.state_rows is None:
            self.caches[layer] = (conv, rec)
        else:
            self.caches[layer] = (old_conv.at[self.state_rows].set(conv, mode="drop"),
                                  old_rec.at[self.state_rows].set(rec, mode="drop"))

    def gdn(self, layer, mix, positions):
        """A linear-attention layer over this forward's tokens (positions [b, t]): tokens at
        positions >= the write limit are padding and change no state."""
        valid = (positions >= 0) & (positions < self.limit[:, None])
        conv, rec = self._states(layer)
        # Under a mesh the states are split over dp by XLA; the jnp path partitions.
        backend = "reference" if self.mesh is not None else self.backend
        out, conv, rec = mix_tokens(mix, conv, rec, valid, all_states=self.keep_states,
                                    backend=backend)
        if self.keep_states:
            self.pending[layer] = (conv, rec)
        else:
            self._put_states(layer, conv, rec)
        return out

    def commit_states(self, n):
        """Keep, per row, the linear-attention states after token n[r] of the kept forward
        (the last token a verify accepted); the later ones leave no trace."""
        for layer, (conv, rec) in self.pending.items():
            pick = lambda x: jnp.take_along_axis(  # noqa: E731
                x, n.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]
            self._put_states(layer, pick(conv), pick(rec))
        self.pending = {}


class _Attend:
    """The backend (layers.Attend) of one forward over positions [b, t] of a PagedKV: it
    writes the new keys by slot mapping, dropping positions outside [0, limit), then
    attends; `gdn` runs a linear-attention layer over the per-slot states."""

    def __init__(self, kv: PagedKV, positions, kv_lens, tree_mask=None):
        self.kv, self.positions, self.kv_lens = kv, positions, kv_lens
        self.tree_mask = tree_mask
        self.slots = [slot_mapping(bt, positions, kv.layout.page_size, kv.limit)
                      for bt in kv.block_tables]
        self.selected = {}  # DSA: the last layer's selection, for a layer that reuses it

    def __call__(self, layer, q, k, v, window, *, sm_scale=None, v_dim=None, sinks=None,
                 index=None):
        kv = self.kv
        g = kv.layout.layer_group[layer]
        if (v is None) != kv.layout.latent:
            raise ValueError("latent attention needs a latent KV layout, and only it")
        if index is not None:  # DeepSeek Sparse Attention (dsa.py)
            return kv._attend_sparse(layer, q, k, index, self.slots[g], kv.block_tables[g],
                                     self.kv_lens, sm_scale, v_dim, self.selected)
        scales = kv._scales(layer)
        pages = kv._write(kv.caches[layer], k, v, self.slots[g], scales, v_dim)
        kv.caches[layer] = pages
        return kv._attend(q, pages, kv.block_tables[g], self.kv_lens, window, sm_scale,
                          v_dim, sinks, scales, self.tree_mask)

    def gdn(self, layer, mix):
        return self.kv.gdn(layer, mix, self.positions)


__all__ = ["DROP_SLOT", "KVGroup", "KVLayout", "make_layout", "init_caches", "PageAllocator",
           "PagedKV"]
