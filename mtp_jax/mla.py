"""Multi-head latent attention (DeepSeek-V2/V3), computed in the absorbed form.

A token's keys and values for every head come from one latent: c = norm(x W_kv_a)[:r]
(r = kv_lora_rank) expanded per head by kv_b into a nope key (qk_nope dims) and a value
(v_head_dim dims), plus one rope key k_pe = RoPE(x W_kv_a[r:]) shared by all heads. So a
token caches r + rope values (576 for DeepSeek-V3) instead of 2 * heads * head_dim.

Absorbed form (used for every forward here, prefill included): with W_uk [n, nope, r]
and W_uv [n, r, v] the two halves of kv_b,

  score(t, s) = q_nope[t] . (W_uk c[s]) + q_pe[t] . k_pe[s]
              = (q_nope[t] W_uk) . c[s] + q_pe[t] . k_pe[s]
  out[t]      = sum_s p(t, s) W_uv^T c[s] = W_uv^T (sum_s p(t, s) c[s])

so attention runs as multi-query attention over the cached [c, k_pe] rows with queries
[q_nope W_uk, q_pe] (r + rope dims, one kv head for all n query heads) and values c (the
first r dims of the same row); the per-head output goes through W_uv, then o_proj. The
backend gets `attend(layer, q, kv, None, window, sm_scale=..., v_dim=r)`: v is None, the
values are the first v_dim dims of the keys, read from the same cache entry. A layer with DeepSeek
Sparse Attention (`MLASpec.indexer`) also hands the backend its indexer's `index`
(dsa.IndexQuery): each query then attends only to the tokens the indexer selects.

Parameter layouts (einsum letters as layers.py, plus r latent, p nope dims, e rope dims,
c q_lora rank): q_a [d, c] + q_a_norm + q_b [c, n, p + e] (or q [d, n, p + e]),
kv_a [d, r + e], kv_a_norm [r], w_uk [n, p, r], w_uv [n, r, v], o [n, v, d]. The rope
dims of q_b / q and kv_a are stored rotate-half ordered; DeepSeek's interleaved pairs
are permuted at load (models/tensors.py, `mla_entries`), which leaves every dot product
unchanged.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from pallas_kernels import invariant

from .dsa import Indexer, IndexQuery
from .layers import RMSNorm, _param, apply_rope, rope_inv_freq
from .quant import qeinsum
from .specs import MLASpec


class MLAttention(nnx.Module):
    """MLA of an `MLASpec`; the latent cache lives in the `attend` backend."""

    # w_uk / w_uv (the absorbed per-head matrices) stay unquantized
    QUANT_AXES = {"q": (0,), "q_a": (0,), "q_b": (0,), "kv_a": (0,), "o": (0, 1)}

    def __init__(self, spec: MLASpec, d: int, *, eps: float, offset: float, dtype,
                 rngs: nnx.Rngs):
        m, n = spec.mla, spec.num_heads
        qk, r, e = m.qk_head_dim, m.kv_lora_rank, m.qk_rope_dim
        if m.q_lora_rank is None:
            self.q = _param(rngs, (d, n, qk), dtype, d ** -0.5)
            self.q_a = self.q_a_norm = self.q_b = None
        else:
            c = m.q_lora_rank
            self.q = None
            self.q_a = _param(rngs, (d, c), dtype, d ** -0.5)
            self.q_a_norm = RMSNorm(c, eps=eps, offset=offset, dtype=dtype)
            self.q_b = _param(rngs, (c, n, qk), dtype, c ** -0.5)
        self.kv_a = _param(rngs, (d, r + e), dtype, d ** -0.5)
        self.kv_a_norm = RMSNorm(r, eps=eps, offset=offset, dtype=dtype)
        self.w_uk = _param(rngs, (n, m.qk_nope_dim, r), dtype, r ** -0.5)
        self.w_uv = _param(rngs, (n, r, m.v_head_dim), dtype, r ** -0.5)
        self.o = _param(rngs, (n, m.v_head_dim, d), dtype, (n * m.v_head_dim) ** -0.5)
        # DeepSeek Sparse Attention: the layer's own indexer (dsa.py), None without DSA or
        # where the layer reuses the previous layer's selection
        own = spec.indexer is not None and not spec.index_shared
        self.indexer = (Indexer(spec.indexer, d, m.q_lora_rank, spec.rope, dtype=dtype,
                                rngs=rngs) if own else None)
        self.spec = spec

    def __call__(self, x, positions, attend, layer):
        m = self.spec.mla
        p, r = m.qk_nope_dim, m.kv_lora_rank
        qa = None
        if self.q is not None:
            q = qeinsum("btd,dnh->btnh", x, self.q)
        else:
            qa = self.q_a_norm(qeinsum("btd,dc->btc", x, self.q_a))
            q = qeinsum("btc,cnh->btnh", qa, self.q_b)
        kv = qeinsum("btd,dr->btr", x, self.kv_a)
        latent = self.kv_a_norm(kv[..., :r])
        inv_freq, scale = rope_inv_freq(self.spec.rope)
        q_pe = apply_rope(q[..., p:], positions, inv_freq, scale)
        k_pe = apply_rope(kv[:, :, None, r:], positions, inv_freq, scale)
        q_lat = invariant.einsum("btnp,npr->btnr", q[..., :p], self.w_uk[...])
        q_all = jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1)
        kv_all = jnp.concatenate([latent[:, :, None], k_pe.astype(latent.dtype)], axis=-1)
        sparse = {}
        if self.spec.indexer is not None:  # DSA: attend to the tokens the indexer selects
            sparse["index"] = (self.indexer(x, qa, positions) if self.indexer is not None
                               else IndexQuery(None, None, None, self.spec.indexer.index_topk))
        out = attend(layer, q_all, kv_all, None, self.spec.window,
                     sm_scale=self.spec.sm_scale, v_dim=r, **sparse)  # [b, t, n, r]
        out = invariant.einsum("btnr,nrv->btnv", out, self.w_uv[...])
        return qeinsum("btnv,nvd->btd", out, self.o)


__all__ = ["MLAttention"]
