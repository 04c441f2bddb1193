"""Gated DeltaNet: the linear-attention layer of Qwen3-Next / Qwen3.5 (spec `GDNSpec`).

    p        = x in_proj                      -> q, k [Hk, dk], v, z [Hv, dv], b, a [Hv]
    q, k, v  = silu(causal depthwise conv over the last `conv_kernel` tokens of (q, k, v))
    beta     = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)       (f32)
    S        = exp(g) S + k (beta (v - S^T k))^T;  o = S^T q               (gated delta rule)
    out      = out_proj(rmsnorm(o) * w * silu(z))

The layer keeps no KV cache: a request's memory is its conv state (the last conv_kernel - 1
inputs of the conv) and its recurrent state S [Hv, dk, dv] (f32). Like attention, the state
lives in the caller's backend (layers.Attend), here its `gdn` method: `attend.gdn(layer,
mix) -> o` where `mix` (a delta_rule.Mix) holds the token inputs and the conv weight; the
backend brings the states in, runs delta_rule.mix_tokens and keeps the new ones.

Parameter layouts: in_proj [d, conv_dim + Hv * dv + 2 * Hv], columns q (Hk * dk), k, v
(Hv * dv), z, b, a: one matmul per token, whatever layout the checkpoint publishes
(models/qwen3_next.py joins it); conv [conv_kernel, conv_dim]; dt_bias, A_log [Hv] (f32);
norm [dv]; out_proj [Hv, dv, d].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .delta_rule import Mix
from .layers import Attend, _param
from .quant import qeinsum
from .specs import GDNSpec

# Kept in float32 whatever the model dtype: the decay's log-parameters.
FLOAT32_PARAMS = ("dt_bias", "A_log")


class GatedDeltaNet(nnx.Module):
    """The linear-attention module of a `GDNSpec`; its states live in the backend."""

    QUANT_AXES = {"in_proj": (0,), "out_proj": (0, 1)}

    def __init__(self, spec: GDNSpec, d: int, *, dtype, rngs: nnx.Rngs):
        c = spec.gdn
        h = c.num_v_heads
        self.spec = spec
        self.in_proj = _param(rngs, (d, c.conv_dim + c.value_dim + 2 * h), dtype, d ** -0.5)
        self.conv = _param(rngs, (c.conv_kernel, c.conv_dim), dtype, c.conv_kernel ** -0.5)
        self.dt_bias = nnx.Param(jnp.ones((h,), jnp.float32))
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, h, dtype=jnp.float32)))
        self.norm = nnx.Param(jnp.ones((c.v_head_dim,), dtype))
        self.out_proj = _param(rngs, (h, c.v_head_dim, d), dtype, c.value_dim ** -0.5)

    def __call__(self, x, positions, attend: Attend, layer):
        c = self.spec.gdn
        b, t, _ = x.shape
        h = c.num_v_heads
        p = qeinsum("btd,dc->btc", x, self.in_proj)
        qkv, z = p[..., : c.conv_dim], p[..., c.conv_dim: c.conv_dim + c.value_dim]
        ba = p[..., c.conv_dim + c.value_dim:].astype(jnp.float32)
        beta = jax.nn.sigmoid(ba[..., :h])
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(ba[..., h:] + self.dt_bias[...])
        o = attend.gdn(layer, Mix(qkv, g, beta, self.conv[...], self.spec))  # [b, t, Hv, dv]
        # gated RMSNorm: normed in f32, scaled in the model dtype, gated by silu(z) in f32
        o32 = o.astype(jnp.float32)
        o32 = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + self.spec.eps)
        normed = self.norm[...] * o32.astype(x.dtype)
        gate = jax.nn.silu(z.reshape(b, t, h, c.v_head_dim).astype(jnp.float32))
        o = (normed.astype(jnp.float32) * gate).astype(x.dtype)
        return qeinsum("btnu,nud->btd", o, self.out_proj)


__all__ = ["GatedDeltaNet", "FLOAT32_PARAMS"]
