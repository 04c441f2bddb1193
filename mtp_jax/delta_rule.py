"""The token mixing of a Gated DeltaNet layer over its per-request states (gdn.py is the
layer): the causal depthwise conv with its conv state and the gated delta rule with its
recurrent state, run by every backend that holds such states (layers.causal_attend, the
reference generator's model.DenseCache, the engine's kv_cache.PagedKV).

A request's states: conv [conv_kernel - 1, conv_dim] (the conv's last inputs, in the model
dtype) and recurrent S [Hv, dk, dv] (f32). Tokens marked invalid change neither (their
decay is 1 and their write strength 0; the conv state is taken at the last valid token), so
padded rows and chunks need no other care. A speculative verify asks for the states after
every token (`all_states`) and keeps the one of the last accepted token.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta import gated_delta

from .specs import GDNSpec


@dataclasses.dataclass(frozen=True)
class Mix:
    """What a linear-attention layer hands its backend for t tokens of b rows."""

    qkv: jax.Array  # [b, t, conv_dim] the conv's input (q, k, v of every head)
    g: jax.Array  # [b, t, Hv] f32 log decay
    beta: jax.Array  # [b, t, Hv] f32
    conv: jax.Array  # [conv_kernel, conv_dim]
    spec: GDNSpec


def state_shapes(spec: GDNSpec) -> tuple:
    """(conv state, recurrent state) shapes of one request."""
    c = spec.gdn
    return (c.conv_kernel - 1, c.conv_dim), (c.num_v_heads, c.k_head_dim, c.v_head_dim)


def zero_states(spec: GDNSpec, rows: int, dtype) -> tuple:
    """Zeroed (conv [rows, kernel - 1, conv_dim] in `dtype`, recurrent [rows, Hv, dk, dv]
    f32) states: a request before its first token."""
    conv, rec = state_shapes(spec)
    return jnp.zeros((rows,) + conv, dtype), jnp.zeros((rows,) + rec, jnp.float32)


def mix_tokens(mix: Mix, conv_state, rec_state, valid, *, all_states: bool = False,
               backend: Optional[str] = None):
    """Conv and delta rule over t tokens of b rows from their states.

    conv_state [b, kernel - 1, conv_dim], rec_state [b, Hv, dk, dv] f32; valid [b, t] bool:
    tokens that are real (a row's valid tokens come first; the others change no state: their
    decay is 1 and their write strength 0, and the conv state is taken at the last valid
    one). Returns (o [b, t, Hv, dv], new conv state, new recurrent state); with
    `all_states` the states after every token instead ([b, t, ...]: what a speculative
    verify keeps until it knows how many tokens it accepts).
    """
    c = mix.spec.gdn
    b, t, _ = mix.qkv.shape
    kern = c.conv_kernel
    x = jnp.concatenate([conv_state.astype(mix.qkv.dtype), mix.qkv], axis=1)  # [b, kern-1+t, C]
    w = mix.conv.astype(jnp.float32)
    y = sum(x[:, j: j + t].astype(jnp.float32) * w[j] for j in range(kern))
    y = jax.nn.silu(y).astype(mix.qkv.dtype)
    q = y[..., : c.key_dim].reshape(b, t, c.num_k_heads, c.k_head_dim)
    k = y[..., c.key_dim: 2 * c.key_dim].reshape(b, t, c.num_k_heads, c.k_head_dim)
    v = y[..., 2 * c.key_dim:].reshape(b, t, c.num_v_heads, c.v_head_dim)
    g = jnp.where(valid[..., None], mix.g, 0.0)
    beta = jnp.where(valid[..., None], mix.beta, 0.0)
    o, rec = gated_delta(q, k, v, g, beta, rec_state.astype(jnp.float32),
                         all_states=all_states, backend=backend)
    if all_states:
        # after token i the conv state is x[i + 1: i + kern]; an invalid token keeps the
        # state of the last valid one before it
        n_valid = jnp.sum(valid, axis=1)
        starts = jnp.minimum(jnp.arange(t), n_valid[:, None] - 1) + 1  # [b, t]
        win = jnp.arange(kern - 1)
        conv = jax.vmap(lambda xr, sr: xr[sr[:, None] + win[None]])(x, starts)
        return o, conv, rec
    n_valid = jnp.sum(valid, axis=1)
    conv = jax.vmap(lambda xr, n: jax.lax.dynamic_slice_in_dim(xr, n, kern - 1, 0))(x, n_valid)
    return o, conv, rec


__all__ = ["Mix", "mix_tokens", "state_shapes", "zero_states"]
