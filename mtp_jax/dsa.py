"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the lightning indexer and token selection.

An MLA layer with an indexer (`MLASpec.indexer`, a config.DSAConfig) attends, for each
query, only to the `index_topk` cached tokens its indexer scores highest:

  q_i(t) = RoPE(wq_b(c_q(t)))        [Hi, di]  c_q: the MLA q latent (q_a_layernorm output)
  k_i(s) = RoPE(LayerNorm(wk x(s)))  [di]      one index key per token, cached
  w(t)   = weights_proj(x(t)) * Hi**-0.5 * di**-0.5                          [Hi], f32
  score(t, s) = sum_h w_h(t) relu(q_i(t)_h . k_i(s)),   over s <= position(t)

RoPE rotates the first qk_rope_head_dim dims of index queries and keys with the layer's
frequencies, rotate-half; GLM-5 publishes interleaved pairs, which the loader permutes to
halves (`models.tensors.indexer_entries`, as MLA's rope dims), leaving every score unchanged. A query that
sees at most `index_topk` tokens attends to all of them (the dense path); where that holds
for every row a program can run, the selection is skipped statically.

The indexer hands the attention backend an `IndexQuery` (`attend(..., index=...)`): the
dense backends (training, `model.DenseCache`) turn it into a mask of the selected tokens
(`dense_selection`); the paged backend (kv_cache.PagedKV) caches the index keys in an array
of their own beside the latent row (same pages, same block tables) and runs
`pallas_kernels.dsa.indexer_topk` + `sparse_mla`. A layer without an indexer of its own
(GLM's `indexer_types` "shared") passes an IndexQuery with no query: the backend reuses the
selection of the layer before it in the same forward.

Parameter layouts (einsum letters as layers.py, plus c q latent, i index head dims, h index
heads): wq_b [c, h, i], wk [d, i], k_norm LayerNorm weight and bias [i], weights_proj [d, h].
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import dsa as dsa_kernel
from pallas_kernels import invariant
from pallas_kernels.common import resolve_backend

from .config import ConfigError
from .layers import _param, apply_rope, rope_inv_freq


@dataclasses.dataclass(frozen=True)
class IndexQuery:
    """What the indexer of one layer hands its attention backend for one forward.

    q [b, t, Hi, di] roped index queries, w [b, t, Hi] f32 head weights (every positive scale
    folded in), k [b, t, di] the new tokens' roped index keys; all None for a layer that
    reuses the previous layer's selection. `topk`: tokens each query attends to."""

    q: Optional[jax.Array]
    w: Optional[jax.Array]
    k: Optional[jax.Array]
    topk: int

    @property
    def shared(self) -> bool:
        return self.q is None

    def select(self, keys, visible, previous=None):
        """`dense_selection` of this query (what the dense backends call, so they need not
        import this module)."""
        return dense_selection(self, keys, visible, previous)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias (the index key norm; eps 1e-6 as published)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class Indexer(nnx.Module):
    """The lightning indexer of one MLA layer (module docstring). Its weights stay
    unquantized (no QUANT_AXES): the selection is sensitive to small score changes."""

    def __init__(self, dsa, d: int, q_lora_rank: int, rope, *, dtype, rngs: nnx.Rngs):
        h, i = dsa.index_n_heads, dsa.index_head_dim
        self.wq_b = _param(rngs, (q_lora_rank, h, i), dtype, q_lora_rank ** -0.5)
        self.wk = _param(rngs, (d, i), dtype, d ** -0.5)
        self.k_norm = LayerNorm(i, dtype=dtype)
        self.weights_proj = _param(rngs, (d, h), dtype, d ** -0.5)
        self.rope, self.topk = rope, dsa.index_topk
        self.scale = float(h ** -0.5 * i ** -0.5)

    def __call__(self, x, q_latent, positions) -> IndexQuery:
        inv_freq, scale = rope_inv_freq(self.rope)
        q = invariant.einsum("btc,chi->bthi", q_latent, self.wq_b[...])
        k = self.k_norm(invariant.einsum("btd,di->bti", x, self.wk[...]))
        q = apply_rope(q, positions, inv_freq, scale)
        k = apply_rope(k[:, :, None], positions, inv_freq, scale)[:, :, 0]
        w = invariant.einsum("btd,dh->bth", x.astype(jnp.float32),  # f32, as published
                             self.weights_proj[...].astype(jnp.float32),
                             precision=jax.lax.Precision.HIGHEST) * self.scale
        return IndexQuery(q, w, k, self.topk)


# ------------------------------------------------------------------- dense selection
def index_scores(q, w, keys):
    """score [b, t, s] (f32) of keys [b, s, di] for index queries q [b, t, Hi, di] with head
    weights w [b, t, Hi]. Full f32 precision (TPU's default would round to bf16 passes),
    as the kernels' reference scores: the selection turns on small score gaps."""
    hi = jax.lax.Precision.HIGHEST
    dots = jnp.einsum("bthi,bsi->bths", q.astype(jnp.float32), keys.astype(jnp.float32),
                      precision=hi)
    return jnp.einsum("bth,bths->bts", w.astype(jnp.float32), jax.nn.relu(dots), precision=hi)


def dense_selection(index: IndexQuery, keys, visible, previous=None):
    """[b, t, s] bool: the tokens each query attends to, among `visible` [b, t, s]: the
    `index.topk` best by index score (all of them where fewer are visible), or `previous`
    (the selection of the layer before) when `index` carries no query. keys [b, s, di]."""
    if index.shared:
        if previous is None:
            raise ValueError("a layer sharing its indexer's selection needs a layer with an "
                             "indexer before it in the same forward")
        return previous
    s = visible.shape[-1]
    if index.topk >= s:  # every query sees at most topk tokens: dense
        return visible
    scores = jnp.where(visible, index_scores(index.q, index.w, keys), -jnp.inf)
    _, top = jax.lax.top_k(scores, index.topk)  # [b, t, topk]
    b, t = top.shape[:2]
    chosen = jnp.zeros(scores.shape, bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], top].set(True)
    return chosen & visible


# ------------------------------------------------------------------- paged selection
def paged_topk(index: IndexQuery, k_pages, block_table, kv_lens, *, backend=None,
               k_scale=None):
    """[B, T, topk] int32 token positions (-1 padded) per query row, from the index-key
    pages k_pages [num_pages, page_size, di] (fp8 with per-token k_scale [num_pages,
    page_size]); row t of request b sits at position kv_lens[b] - T + t and sees
    positions <= it."""
    return dsa_kernel.indexer_topk(index.q, index.w, k_pages, block_table, kv_lens,
                                   topk=index.topk, k_scale=k_scale, backend=backend)


def paged_sparse_mla(q, kv_pages, block_table, indices, *, v_dim, sm_scale, backend=None,
                     kv_scale=None):
    """MLA over the latent pages kv_pages [num_pages, page_size, D] (fp8 with the row's
    (latent, rope) kv_scale [2]), each query attending only to its `indices` [B, T, topk]
    (-1: none)."""
    return dsa_kernel.sparse_mla(q, kv_pages, block_table, indices, v_dim=v_dim,
                                 sm_scale=sm_scale, kv_scale=kv_scale, backend=backend)


def check_kernels(layout, eng, cfg) -> None:
    """ConfigError, before anything compiles, for DSA shapes the chosen kernels cannot tile:
    both ops are traced (not compiled) on abstract arguments of the engine's query lengths,
    and a kernel's ValueError naming the dimension becomes the error. Nothing to check for
    the reference backend, nor where every row attends densely (index_topk covers the
    table)."""
    backend = resolve_backend(eng.attention_backend, dsa_kernel.BACKEND_ENV_VAR, "DSA")
    d, m = cfg.dsa, cfg.mla
    if backend == "reference" or d.index_topk >= layout.width * layout.page_size:
        return
    b, dtype = eng.max_batch, jnp.dtype(layout.dtype)
    fp8 = layout.scales is not None
    q_dtype = jnp.dtype(jnp.bfloat16) if fp8 else dtype  # the narrowest q fp8 pages take
    pages = layout.groups[0].num_pages
    spec = jax.ShapeDtypeStruct
    k_scale = spec((pages, layout.page_size), jnp.float32) if fp8 else None
    kv_scale = spec((2,), jnp.float32) if fp8 else None
    for t in sorted({1, eng.prefill_chunk}):
        table, lens = spec((b, layout.width), jnp.int32), spec((b,), jnp.int32)
        try:
            jax.eval_shape(lambda q, w, k, bt, kl, ks: dsa_kernel.indexer_topk(
                q, w, k, bt, kl, topk=d.index_topk, k_scale=ks, backend=backend),
                spec((b, t, d.index_n_heads, d.index_head_dim), q_dtype),
                spec((b, t, d.index_n_heads), jnp.float32),
                spec((pages, layout.page_size, d.index_head_dim), dtype), table, lens,
                k_scale)
            jax.eval_shape(lambda q, kv, bt, idx, ks: dsa_kernel.sparse_mla(
                q, kv, bt, idx, v_dim=m.kv_lora_rank, sm_scale=1.0, kv_scale=ks,
                backend=backend),
                spec((b, t, cfg.num_heads, m.cache_dim), q_dtype),
                spec((pages, layout.page_size, m.cache_dim), dtype), table,
                spec((b, t, d.index_topk), jnp.int32), kv_scale)
        except ValueError as e:
            raise ConfigError(f"index_n_heads={d.index_n_heads}, index_head_dim="
                              f"{d.index_head_dim}, index_topk={d.index_topk}, kv_lora_rank="
                              f"{m.kv_lora_rank}, page_size={layout.page_size} ({backend} DSA "
                              f"kernels): {e}") from None


# ------------------------------------------------------------------------- checkpoint
def index_dim(cfg, layer: int) -> int:
    """Index-key dims one token caches in `layer` (0: the layer keeps no index keys)."""
    d = cfg.dsa
    if d is None or cfg.mla is None or not d.has_indexer(layer):
        return 0
    return d.index_head_dim


__all__ = ["IndexQuery", "Indexer", "LayerNorm", "index_scores", "dense_selection",
           "paged_topk", "paged_sparse_mla", "check_kernels", "index_dim"]
