"""The Flax (NNX) target decoder: embedding, blocks, final norm, lm_head.

A block is assembled from its layer's spec (specs.py): an attention module (GQA with RoPE
of default, linear, dynamic, yarn or llama3 scaling, partial rotary, optional QKV bias,
q/k norm, sliding window, attention sinks, a value head dim apart from the key's, a
head-wise sigmoid output gate) and an FFN module (SwiGLU `MLP`, optionally clamped, or
`moe.MoE` with its router, routed and shared experts), pre-norm residual around each. The MTP modules
(mtp.py) build their blocks from the same specs.

Modules hold parameters only, never caches. Attention goes through a backend callable
`attend(layer, q, k, v, window, *, sm_scale, v_dim, sinks) -> out` supplied by the caller, so one forward serves
training (dense causal), the plain reference generator (dense cache) and the engine
(paged KV); the caller reads any updated cache back from its backend object after the
forward. Use: split the module once (`nnx.split`), merge inside `jax.jit`.

Parameter layouts are chosen for one fused matmul per projection and for tensor
parallelism over kv heads: `qkv` is [d, k, g + 2, h] (per kv head: its g query heads, then
its key and value head), or, when the value head dim u differs, `qk` [d, k, g + 1, h] and
`v` [d, k, u]; `o` is [n, u, d], the head gate `gate` [d, k, g], sink logits `sinks`
[k, g]; `gate_up` is [d, 2, f].

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

from pallas_kernels.swiglu_matmul import swiglu, swiglu_matmul
from pallas_kernels.swiglu_matmul import use_kernel as use_swiglu_kernel

from .config import ModelConfig
from .quant import is_quantized, qeinsum, take_rows, value
from .sharding import one_device
from .specs import AttentionSpec, LayerSpec, RopeSpec, rope_spec, yarn_mscale

# attend(layer, q[b,t,n,h], k[b,t,k,h], v[b,t,k,u], window, *, sm_scale=None, v_dim=None,
#        sinks=None) -> [b,t,n,u]:
# sm_scale None is h ** -0.5; v None (latent attention, mla.py) means the values are the
# first v_dim dims of the keys, cached once; sinks [n] (f32) are per-head logits that join
# the softmax denominator (gpt-oss / MiMo-V2 attention sinks).
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


# ---------------------------------------------------------------------------- blocks
class Attention(nnx.Module):
    """GQA attention of an `AttentionSpec`; the cache lives in the `attend` backend."""

    QUANT_AXES = {"qkv": (0,), "qk": (0,), "v": (0,), "o": (0, 1), "gate": (0,)}

    def __init__(self, spec: AttentionSpec, d: int, *, eps: float, offset: float, dtype,
                 rngs: nnx.Rngs):
        k, g, h, u = spec.num_kv_heads, spec.group_size, spec.head_dim, spec.v_dim
        self.k, self.g, self.h = k, g, h
        if u == h:  # one fused projection
            self.qkv = _param(rngs, (d, k, g + 2, h), dtype, d ** -0.5)
            self.qk = self.v = None
        else:
            self.qkv = None
            self.qk = _param(rngs, (d, k, g + 1, h), dtype, d ** -0.5)
            self.v = _param(rngs, (d, k, u), dtype, d ** -0.5)
        self.qkv_bias = nnx.Param(jnp.zeros((k, g + 2, h), dtype)) if spec.qkv_bias else None
        self.o = _param(rngs, (k * g, u, d), dtype, (k * g * u) ** -0.5)
        if spec.qk_norm:
            self.q_norm = RMSNorm(h, eps=eps, offset=offset, dtype=dtype)
            self.k_norm = RMSNorm(h, eps=eps, offset=offset, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.gate = _param(rngs, (d, k, g), dtype, d ** -0.5) if spec.gate else None
        self.sinks = _param(rngs, (k, g), dtype, 1.0) if spec.sinks else None
        self.spec = spec

    def __call__(self, x, positions, attend: Attend, layer):
        b, t, _ = x.shape
        n = self.k * self.g
        if self.qkv is not None:
            qkv = qeinsum("btd,dkgh->btkgh", x, self.qkv)
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias[...]
            v = qkv[:, :, :, self.g + 1]
        else:
            qkv = qeinsum("btd,dkgh->btkgh", x, self.qk)
            v = qeinsum("btd,dku->btku", x, self.v)
        q = qkv[:, :, :, : self.g].reshape(b, t, n, self.h)
        k = qkv[:, :, :, self.g]
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
        return qeinsum("btnu,nud->btd", out, self.o)


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
                and use_swiglu_kernel(b * t, d, w.shape[2], x.dtype)):
            # prefill-sized rows on a Hopper GPU: one kernel, the [rows, 2f] product never
            # written (pallas_kernels/swiglu_matmul.py)
            h = swiglu_matmul(x.reshape(b * t, d), w, limit=self.limit, backend="gpu")
            h = h.reshape(b, t, -1)
        else:
            gu = qeinsum("btd,dcf->btcf", x, w)
            h = swiglu(gu[:, :, 0], gu[:, :, 1], self.limit)
        return qeinsum("btf,fd->btd", h, self.down)


class Block(nnx.Module):
    """Pre-norm residual block assembled from a LayerSpec: attention, then the FFN."""

    def __init__(self, spec: LayerSpec, d: int, *, dtype, rngs: nnx.Rngs):
        norm = dict(eps=spec.rms_norm_eps, offset=spec.norm_offset, dtype=dtype)
        self.input_norm = RMSNorm(d, **norm)
        if spec.attention.kind == "mla":
            from .mla import MLAttention  # mla.py builds on this module's RoPE and norm

            attn_cls = MLAttention
        else:
            attn_cls = Attention
        self.attn = attn_cls(spec.attention, d, eps=spec.rms_norm_eps,
                             offset=spec.norm_offset, dtype=dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(d, **norm)
        if spec.is_moe:
            from .moe import MoE  # moe.py builds on this module's MLP

            self.mlp = MoE(spec.ffn, d, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(d, spec.ffn.intermediate_size, dtype=dtype, rngs=rngs,
                           limit=spec.ffn.swiglu_limit)

    def __call__(self, x, positions, attend: Attend, layer):
        with jax.named_scope("attention"):
            x = x + self.attn(self.input_norm(x), positions, attend, layer)
        with jax.named_scope("mlp" if isinstance(self.mlp, MLP) else "moe"):
            return x + self.mlp(self.post_attn_norm(x))


class Decoder(nnx.Module):
    """The target model. `__call__` returns (final-normed hidden, pre-norm hidden)."""

    # the embedding is a matmul weight only when it is also the lm_head
    QUANT_AXES = {"lm_head": (0,), "embed": lambda m: (1,) if m.lm_head is None else None}

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        d, v = cfg.hidden_size, cfg.vocab_size
        self.embed = _param(rngs, (v, d), dtype, 1.0)
        self.layers = nnx.List([Block(cfg.layer_spec(i), d, dtype=dtype, rngs=rngs)
                                for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(d, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _param(rngs, (d, v), dtype, d ** -0.5)

    def __call__(self, tokens, positions, attend: Attend):
        x = take_rows(self.embed, tokens, self.final_norm.weight[...].dtype)
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer{i}"):
                x = layer(x, positions, attend, i)
        return self.final_norm(x), x

    def head(self, normed):
        """Logits in f32 for final-normed hidden states [..., d]."""
        w = value(self.embed).T if self.lm_head is None else self.lm_head
        return qeinsum("...d,dv->...v", normed, w, preferred_element_type=jnp.float32)

    def mtp_hidden(self, normed, pre_norm):
        """The hidden the architecture hands to MTP module 1."""
        return normed if self.cfg.mtp_hidden_from == "post_norm" else pre_norm


# ------------------------------------------------------------ dense attention backends
def dense_attention(q, k, v, q_pos, k_pos, k_valid, window, sm_scale=None, v_dim=None,
                    sinks=None):
    """Reference attention on dense keys: q [b,t,n,h], k [b,s,k,h], v [b,s,k,u].

    Query at position p sees keys with k_pos <= p (and > p - window), where k_valid.
    v None: the values are k[..., :v_dim] (latent attention). sinks [n]: a per-head logit
    in the softmax denominator that carries no value.
    """
    if v is None:
        v = k[..., :v_dim]
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    sm_scale = h ** -0.5 if sm_scale is None else sm_scale
    qg = q.reshape(b, t, kh, g, h).astype(jnp.float32)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32)) * sm_scale
    mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
    if window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
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
    o = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(jnp.float32))
    return o.reshape(b, t, n, v.shape[-1]).astype(q.dtype)


def causal_attend(positions):
    """Backend for a full-sequence forward with no cache (training, tests)."""
    valid = jnp.ones(positions.shape, bool)

    def attend(layer, q, k, v, window, *, sm_scale=None, v_dim=None, sinks=None):
        return dense_attention(q, k, v, positions, positions, valid, window, sm_scale, v_dim,
                               sinks)

    return attend


def cache_entry(cfg: ModelConfig, layer: int = 0) -> tuple[int, int, int, bool]:
    """(kv heads, key dims, value dims, latent) of one token's cache entry in a layer: GQA
    caches k (kv_heads, head_dim) and v (kv_heads, v_head_dim); MLA one latent row of
    kv_lora_rank + rope dims (value dims 0: the values are read from that row)."""
    if cfg.mla is not None:
        return 1, cfg.mla.cache_dim, 0, True
    return cfg.heads_of(layer)[1], cfg.head_dim, cfg.v_dim, False


class DenseCache:
    """A dense (non-paged) KV cache backend: per layer (k, v) [b, S, k, h] and lengths,
    or (kv,) for latent attention.

    Used by the plain reference generator. Writes the new keys at their positions, then
    attends over the cache; `caches` holds the updated arrays after the forward.
    """

    def __init__(self, caches, positions):
        self.caches = list(caches)
        self.positions = positions

    @staticmethod
    def init(cfg: ModelConfig, batch, max_len, dtype, num_layers=None):
        out = []
        for i in range(num_layers or cfg.num_layers):
            heads, dims, v_dims, latent = cache_entry(cfg, i)
            k = jnp.zeros((batch, max_len, heads, dims), dtype)
            out.append((k,) if latent else (k, jnp.zeros((batch, max_len, heads, v_dims), dtype)))
        return out

    def __call__(self, layer, q, k, v, window, *, sm_scale=None, v_dim=None, sinks=None):
        rows = jnp.arange(k.shape[0])[:, None]
        new = (k,) if v is None else (k, v)
        cache = tuple(c.at[rows, self.positions].set(x.astype(c.dtype), mode="drop")
                      for c, x in zip(self.caches[layer], new))
        self.caches[layer] = cache
        b, s = cache[0].shape[:2]
        k_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
        k_valid = k_pos <= jnp.max(self.positions, axis=1, keepdims=True)
        vc = None if v is None else cache[1]
        return dense_attention(q, cache[0], vc, self.positions, k_pos, k_valid, window,
                               sm_scale, v_dim, sinks)
