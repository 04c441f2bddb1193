"""GQA attention: the attention module of a layer whose spec is an `AttentionSpec`.

RoPE of the spec's scaling and partial rotary, optional QKV bias, q/k norm, sliding
window, attention sinks, a value head dim apart from the key's, and a head-wise sigmoid
output gate. The cache lives in the `attend` backend (layers.Attend), never here.

Parameter layouts (einsum letters as layers.py) are chosen for one fused matmul per
projection and for tensor parallelism over kv heads: `qkv` is [d, k, g + 2, h] (per kv
head: its g query heads, then its key and value head), or, when the value head dim u
differs, `qk` [d, k, g + 1, h] and `v` [d, k, u]; `o` is [n, u, d], the head gate `gate`
[d, k, g], sink logits `sinks` [k, g]. An element-wise output gate (Qwen3-Next: q_proj
emits each head's query and its gate) sits in `qkv` / `qk` as g more entries after the g
queries of each kv head: [d, k, 2g + 2, h].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .layers import Attend, RMSNorm, _param, apply_rope, rope_inv_freq
from .quant import qeinsum
from .specs import AttentionSpec


class Attention(nnx.Module):
    """GQA attention of an `AttentionSpec`; the cache lives in the `attend` backend."""

    QUANT_AXES = {"qkv": (0,), "qk": (0,), "v": (0,), "o": (0, 1), "gate": (0,)}

    def __init__(self, spec: AttentionSpec, d: int, *, eps: float, offset: float, dtype,
                 rngs: nnx.Rngs):
        k, g, h, u = spec.num_kv_heads, spec.group_size, spec.head_dim, spec.v_dim
        self.k, self.g, self.h = k, g, h
        # an element-wise gate is emitted beside the queries: g gate heads after the g
        # query heads of each kv head
        self.qg = 2 * g if spec.gate == "element" else g
        if u == h:  # one fused projection
            self.qkv = _param(rngs, (d, k, self.qg + 2, h), dtype, d ** -0.5)
            self.qk = self.v = None
        else:
            self.qkv = None
            self.qk = _param(rngs, (d, k, self.qg + 1, h), dtype, d ** -0.5)
            self.v = _param(rngs, (d, k, u), dtype, d ** -0.5)
        self.qkv_bias = nnx.Param(jnp.zeros((k, g + 2, h), dtype)) if spec.qkv_bias else None
        self.o = _param(rngs, (k * g, u, d), dtype, (k * g * u) ** -0.5)
        if spec.qk_norm:
            self.q_norm = RMSNorm(h, eps=eps, offset=offset, dtype=dtype)
            self.k_norm = RMSNorm(h, eps=eps, offset=offset, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.gate = _param(rngs, (d, k, g), dtype, d ** -0.5) if spec.gate == "head" else None
        self.sinks = _param(rngs, (k, g), dtype, 1.0) if spec.sinks else None
        self.spec = spec

    def __call__(self, x, positions, attend: Attend, layer):
        b, t, _ = x.shape
        n = self.k * self.g
        if self.qkv is not None:
            qkv = qeinsum("btd,dkgh->btkgh", x, self.qkv)
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias[...]
            v = qkv[:, :, :, self.qg + 1]
        else:
            qkv = qeinsum("btd,dkgh->btkgh", x, self.qk)
            v = qeinsum("btd,dku->btku", x, self.v)
        q = qkv[:, :, :, : self.g].reshape(b, t, n, self.h)
        k = qkv[:, :, :, self.qg]
        if self.spec.value_scale != 1.0:
            v = v * jnp.asarray(self.spec.value_scale, v.dtype)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq, scale = rope_inv_freq(self.spec.rope)
        q = apply_rope(q, positions, inv_freq, scale)
        k = apply_rope(k, positions, inv_freq, scale)
        sinks = None if self.sinks is None else self.sinks[...].reshape(n).astype(jnp.float32)
        out = attend(layer, q, k, v, self.spec.window, sm_scale=self.spec.sm_scale,
                     sinks=sinks)
        if self.gate is not None:  # head-wise gate on each head's output, before o_proj
            gate = qeinsum("btd,dkg->btkg", x, self.gate).reshape(b, t, n)
            out = out * jax.nn.sigmoid(gate)[..., None].astype(out.dtype)
        elif self.qg != self.g:  # element-wise gate, emitted by the query projection
            gate = qkv[:, :, :, self.g: self.qg].reshape(b, t, n, self.h)
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        return qeinsum("btnu,nud->btd", out, self.o)


__all__ = ["Attention"]
