"""The Flax (NNX) target decoder: embedding, blocks, final norm, lm_head.

A block is assembled from its layer's spec (specs.py): an attention module
(`attention.Attention`, GQA, `mla.MLAttention`, or the linear attention
`gdn.GatedDeltaNet`) and an FFN module (the SwiGLU
`layers.MLP`, optionally clamped, or `moe.MoE` with its router, routed and shared
experts), pre-norm residual around each. The MTP modules (mtp.py) build their blocks from
the same specs.

Modules hold parameters only, never caches. Attention goes through a backend callable
(`layers.Attend`) supplied by the caller, so one forward serves training (dense causal),
the plain reference generator (`DenseCache`, below) and the engine (paged KV); the caller
reads any updated cache back from its backend object after the forward. Use: split the
module once (`nnx.split`), merge inside `jax.jit`.

Parameter layouts: the embedding [v, d], lm_head [d, v]; the attention and FFN modules
document their own (einsum letters as layers.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import Attention
from .config import ModelConfig
from .delta_rule import mix_tokens, zero_states
from .gdn import GatedDeltaNet
from .dsa import dense_selection, index_dim
from .layers import Attend, MLP, RMSNorm, _param, dense_attention
from .mla import MLAttention
from .moe import MoE
from .qarray import take_rows, value
from .quant import qeinsum
from .specs import LayerSpec


class Block(nnx.Module):
    """Pre-norm residual block assembled from a LayerSpec: attention, then the FFN."""

    def __init__(self, spec: LayerSpec, d: int, *, dtype, rngs: nnx.Rngs):
        norm = dict(eps=spec.rms_norm_eps, offset=spec.norm_offset, dtype=dtype)
        self.input_norm = RMSNorm(d, **norm)
        kind = spec.attention.kind
        if kind == "gdn":
            self.attn = GatedDeltaNet(spec.attention, d, dtype=dtype, rngs=rngs)
        else:
            attn_cls = MLAttention if kind == "mla" else Attention
            self.attn = attn_cls(spec.attention, d, eps=spec.rms_norm_eps,
                                 offset=spec.norm_offset, dtype=dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(d, **norm)
        if spec.is_moe:
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


def cache_entry(cfg: ModelConfig, layer: int = 0) -> tuple[int, int, int, bool]:
    """(kv heads, key dims, value dims, latent) of one token's cache entry in a layer: GQA
    caches k (kv_heads, head_dim) and v (kv_heads, v_head_dim); MLA one latent row of
    kv_lora_rank + rope dims (value dims 0: the values are read from that row)."""
    if cfg.mla is not None:
        return 1, cfg.mla.cache_dim, 0, True
    return cfg.heads_of(layer)[1], cfg.head_dim, cfg.v_dim, False


class DenseCache:
    """A dense (non-paged) KV cache backend: per layer (k, v) [b, S, k, h] and lengths,
    or (kv,) for latent attention, or a linear-attention layer's (conv, recurrent) states
    [b, ...] (delta_rule.py).

    Used by the plain reference generator. Writes the new keys at their positions, then
    attends over the cache; `caches` holds the updated arrays after the forward. `lengths`
    [b]: tokens at positions >= lengths are padding, which the states must not take in
    (None: every token is real). A DSA layer (dsa.py) keeps its index keys [b, S, 1, di] as
    the last array of its entry and attends to the tokens its indexer selects.
    """

    def __init__(self, caches, positions, lengths=None):
        self.caches = list(caches)
        self.positions = positions
        self.lengths = lengths
        self.selected = None  # DSA: the last layer's selection, for a layer that reuses it

    @staticmethod
    def init(cfg: ModelConfig, batch, max_len, dtype, num_layers=None):
        out = []
        for i in range(num_layers or cfg.num_layers):
            if cfg.is_linear(i):
                out.append(zero_states(cfg.layer_spec(i).attention, batch, dtype))
                continue
            heads, dims, v_dims, latent = cache_entry(cfg, i)
            k = jnp.zeros((batch, max_len, heads, dims), dtype)
            out.append((k,) if latent else (k, jnp.zeros((batch, max_len, heads, v_dims), dtype)))
            if index_dim(cfg, i):  # DSA: the layer's index keys beside its latent rows
                out[-1] += (jnp.zeros((batch, max_len, 1, index_dim(cfg, i)), dtype),)
        return out

    def __call__(self, layer, q, k, v, window, *, sm_scale=None, v_dim=None, sinks=None,
                 index=None):
        rows = jnp.arange(k.shape[0])[:, None]
        new = (k,) if v is None else (k, v)
        if index is not None and not index.shared:
            new += (index.k[:, :, None],)
        cache = tuple(c.at[rows, self.positions].set(x.astype(c.dtype), mode="drop")
                      for c, x in zip(self.caches[layer], new))
        self.caches[layer] = cache
        b, s = cache[0].shape[:2]
        k_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
        k_valid = k_pos <= jnp.max(self.positions, axis=1, keepdims=True)
        vc = None if v is None else cache[1]
        select = None
        if index is not None:  # DeepSeek Sparse Attention: the indexer's selection
            visible = (k_pos[:, None, :] <= self.positions[:, :, None]) & k_valid[:, None, :]
            keys = None if index.shared else cache[-1][:, :, 0]
            select = self.selected = dense_selection(index, keys, visible, self.selected)
        return dense_attention(q, cache[0], vc, self.positions, k_pos, k_valid, window,
                               sm_scale, v_dim, sinks, select)

    def gdn(self, layer, mix):
        valid = (jnp.ones(self.positions.shape, bool) if self.lengths is None
                 else self.positions < self.lengths[:, None])
        conv, rec = self.caches[layer]
        out, conv, rec = mix_tokens(mix, conv, rec, valid)
        self.caches[layer] = (conv.astype(self.caches[layer][0].dtype), rec)
        return out
