"""The layer pieces every attention, FFN and block module builds on.

Parameters (`_param`), RMSNorm (with the zero-centred offset), RoPE (default, linear,
dynamic, yarn and llama3 scaling; partial rotary), the SwiGLU `MLP`, and the plain
attention math: `dense_attention` over dense keys and the `causal_attend` backend of a
full-sequence forward with no cache (training, calibration, tests). The MLP's `gate_up`
is [d, 2, f], its `down` [f, d].

Attention modules call a backend `attend(layer, q, k, v, window, *, sm_scale, v_dim,
sinks) -> out` supplied by the caller (`Attend` below), so one forward serves training
(dense causal), the plain reference generator (model.DenseCache) and the engine (paged KV).

Einsum letters, used in every module of the package:
  b batch, t tokens, s kv positions, d model dim, k kv heads, g query heads per kv head,
  n query heads (= k * g), h head dim, f MLP dim, v vocabulary, e experts.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import invariant
from pallas_kernels.common import swiglu
from pallas_kernels.swiglu_matmul import swiglu_matmul
from pallas_kernels.swiglu_matmul import use_kernel as use_swiglu_kernel

from .config import ModelConfig
from .delta_rule import mix_tokens, zero_states
from .qarray import is_quantized, value
from .quant import qeinsum
from .sharding import one_device
from .specs import RopeSpec, rope_spec, yarn_mscale

# attend(layer, q[b,t,n,h], k[b,t,k,h], v[b,t,k,u], window, *, sm_scale=None, v_dim=None,
#        sinks=None) -> [b,t,n,u]:
# sm_scale None is h ** -0.5; v None (latent attention, mla.py) means the values are the
# first v_dim dims of the keys, cached once; sinks [n] (f32) are per-head logits that join
# the softmax denominator (gpt-oss / MiMo-V2 attention sinks).
# A backend of a model with linear-attention layers also has `gdn(layer, mix) -> o`
# (gdn.py): the layer's states are the backend's, as a KV cache is.
Attend = Callable[..., jax.Array]


def _param(rngs: nnx.Rngs, shape, dtype, std):
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, offset: float = 0.0, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype))
        self.eps, self.offset = eps, offset

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)


# ----------------------------------------------------------------------------- RoPE
def rope_inv_freq(rope) -> tuple[np.ndarray, float]:
    """Inverse frequencies [rotary_dim // 2] and the cos/sin scale (yarn attention factor)
    of a RopeSpec (or of a ModelConfig's RoPE)."""
    return _rope_inv_freq(rope_spec(rope) if isinstance(rope, ModelConfig) else rope)


@functools.lru_cache(maxsize=64)
def _rope_inv_freq(rope: RopeSpec) -> tuple[np.ndarray, float]:
    dim, base = rope.rotary_dim, rope.theta
    rs = rope.scaling
    if rs is not None and rs.kind == "dynamic":
        # Static NTK form (as vLLM): the base for the full scaled context, so cached keys
        # never change frequency mid-sequence.
        max_len = rs.original_max_position * rs.factor
        base = base * ((rs.factor * max_len / rs.original_max_position) - (rs.factor - 1)) ** (
            dim / (dim - 2))
    inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scale = 1.0
    if rs is None or rs.kind == "dynamic":
        pass
    elif rs.kind == "linear":
        inv = inv / rs.factor
    elif rs.kind == "llama3":
        old = rs.original_max_position
        low_wl, high_wl = old / rs.low_freq_factor, old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wl, inv / rs.factor, inv)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = np.where(medium, smoothed, scaled)
    elif rs.kind == "yarn":
        def corr_dim(rot):
            return dim * math.log(rs.original_max_position / (rot * 2 * math.pi)) / (
                2 * math.log(base))
        low = max(math.floor(corr_dim(rs.beta_fast)), 0)
        high = min(math.ceil(corr_dim(rs.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrap = 1 - ramp
        inv = (inv / rs.factor) * (1 - extrap) + inv * extrap
        if rs.attention_factor is not None:
            scale = rs.attention_factor
        elif rs.mscale and rs.mscale_all_dim:  # DeepSeek's form (as transformers reads it)
            scale = yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
        else:
            scale = yarn_mscale(rs.factor)
    return inv.astype(np.float32), float(scale)


def apply_rope(x, positions, inv_freq, scale):
    """x [b, t, heads, h], positions [b, t]; rotates the first 2 * len(inv_freq) dims."""
    rot = 2 * inv_freq.shape[0]
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [b, t, rot/2]
    cos = (jnp.cos(ang) * scale)[:, :, None, :]
    sin = (jnp.sin(ang) * scale)[:, :, None, :]
    xr = x[..., :rot].astype(jnp.float32)
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return out if rot == x.shape[-1] else jnp.concatenate([out, x[..., rot:]], axis=-1)


# ---------------------------------------------------------------------------- SwiGLU
class MLP(nnx.Module):
    """SwiGLU: down(silu(x W_gate) * x W_up); with `limit` L (Step-3.5's clamped SwiGLU)
    down(min(silu(x W_gate), L) * clip(x W_up, -L, L)). Prefill-sized row counts on a
    Hopper GPU compute the SwiGLU in the gate+up kernel's epilogue, in f32 from the
    products rounded to x.dtype (pallas_kernels/swiglu_matmul.py); other rows run the
    einsum, then the SwiGLU in x.dtype."""

    QUANT_AXES = {"gate_up": (0,), "down": (0,)}

    def __init__(self, d: int, f: int, *, dtype, rngs: nnx.Rngs, limit=None):
        self.gate_up = _param(rngs, (d, 2, f), dtype, d ** -0.5)
        self.down = _param(rngs, (f, d), dtype, f ** -0.5)
        self.limit = limit

    def __call__(self, x):
        w = value(self.gate_up)
        b, t, d = x.shape
        if (not is_quantized(w) and w.dtype == x.dtype and one_device()
                and not invariant.enabled()  # its tiles differ from the einsum's
                and use_swiglu_kernel(b * t, d, w.shape[2], x.dtype)):
            # prefill-sized rows on a Hopper GPU: one kernel, the [rows, 2f] product never
            # written (pallas_kernels/swiglu_matmul.py)
            h = swiglu_matmul(x.reshape(b * t, d), w, limit=self.limit, backend="gpu")
            h = h.reshape(b, t, -1)
        else:
            gu = qeinsum("btd,dcf->btcf", x, w)
            h = swiglu(gu[:, :, 0], gu[:, :, 1], self.limit)
        return qeinsum("btf,fd->btd", h, self.down)


# ----------------------------------------------------------------- plain attention
def dense_attention(q, k, v, q_pos, k_pos, k_valid, window, sm_scale=None, v_dim=None,
                    sinks=None, select=None):
    """Reference attention on dense keys: q [b,t,n,h], k [b,s,k,h], v [b,s,k,u].

    Query at position p sees keys with k_pos <= p (and > p - window), where k_valid.
    v None: the values are k[..., :v_dim] (latent attention). sinks [n]: a per-head logit
    in the softmax denominator that carries no value. select [b, t, s] bool: the keys each
    query may see at all (DeepSeek Sparse Attention's selection, dsa.py); None: every key.
    """
    if v is None:
        v = k[..., :v_dim]
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    sm_scale = h ** -0.5 if sm_scale is None else sm_scale
    qg = q.reshape(b, t, kh, g, h).astype(jnp.float32)
    s = invariant.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32), rows="t") * sm_scale
    mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
    if window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
    if select is not None:
        mask &= select
    mask = mask[:, None, None]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, kh, g, 1, 1)
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        den = den + jnp.where(jnp.any(mask, axis=-1, keepdims=True), jnp.exp(sink - m), 0.0)
    p = p / jnp.maximum(den, 1e-30)
    o = invariant.einsum("bkgts,bskh->btkgh", p, v.astype(jnp.float32), rows="t")
    return o.reshape(b, t, n, v.shape[-1]).astype(q.dtype)


class causal_attend:
    """Backend for a full-sequence forward with no cache (training, tests): dense causal
    attention (DeepSeek Sparse Attention's selection where a layer passes its indexer's
    query), and linear-attention layers from zeroed states (`gdn`)."""

    def __init__(self, positions):
        self.positions = positions
        self.valid = jnp.ones(positions.shape, bool)
        self.selected = {}  # DSA: the last selection, for a layer that reuses it

    def __call__(self, layer, q, k, v, window, *, sm_scale=None, v_dim=None, sinks=None,
                 index=None):
        select = None
        if index is not None:  # DeepSeek Sparse Attention (dsa.IndexQuery)
            pos = self.positions
            visible = pos[:, None, :] <= pos[:, :, None]
            select = self.selected["last"] = index.select(index.k, visible,
                                                          self.selected.get("last"))
        return dense_attention(q, k, v, self.positions, self.positions, self.valid, window,
                               sm_scale, v_dim, sinks, select)

    def gdn(self, layer, mix):
        conv, rec = zero_states(mix.spec, mix.qkv.shape[0], mix.qkv.dtype)
        return mix_tokens(mix, conv, rec, self.valid)[0]
