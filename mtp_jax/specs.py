"""Per-layer specs: what a block is assembled from, derived once from the ModelConfig.

A decoder layer (target or MTP) is an attention spec plus an FFN spec. The block
(model.Block) builds one attention module and one FFN module from them, so a new
architecture adds a spec kind and a module, not a flag threaded through one `Block`:

- `RopeSpec`: theta, scaling and how many of the head dims rotate (partial RoPE,
  rotate-half convention).
- `AttentionSpec`: GQA head counts (per layer), head dim and value head dim, QKV bias,
  q/k norm, sliding window, attention sinks, head-wise output gate, value and softmax
  scales, RoPE (per layer theta and rotary fraction).
- `MLASpec`: multi-head latent attention (DeepSeek-V3): latent dims, softmax scale, RoPE
  on the rope part of each head (mla.py).
- `GDNSpec`: Gated DeltaNet linear attention (Qwen3-Next / Qwen3.5): head counts and dims,
  conv taps; a recurrent state per request instead of a KV cache (gdn.py).
- `DenseFFN` (SwiGLU of `intermediate_size`, optionally clamped) or `MoEConfig`
  (config.py: router, routed and shared experts, their clamps for this layer).

This module sits below config.py: it reads a `ModelConfig` it is handed (config.py's
`ModelConfig.layer_spec` calls `layer_spec` here) and imports nothing from it, so the
per-layer lookup `at_layer` and YaRN's `yarn_mscale` live here.

Layer numbering follows the checkpoints: target layers 0..N-1, then MTP module k is
layer N + k (DeepSeek-V3 / GLM put it at `model.layers.{N + k}`), which is also what
decides dense vs MoE for it (`first_k_dense_replace`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

# `cfg` below is a config.ModelConfig; the config types are named in comments only, since
# config.py imports this module.


def at_layer(values: tuple, i: int, default):
    """values[i], or `default` where the per-layer tuple is empty or holds None there."""
    if not values or values[i] is None:
        return default
    return values[i]


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    theta: float
    rotary_dim: int  # leading dims of each head that rotate (partial RoPE: < head_dim)
    scaling: Optional[Any] = None  # config.RopeScaling


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    kind: str  # "gqa" (MLA comes with its own spec kind)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeSpec
    window: Optional[int] = None  # sliding window, None: full attention
    qkv_bias: bool = False
    qk_norm: bool = False
    v_head_dim: Optional[int] = None  # None: head_dim
    sinks: bool = False  # a learned logit per query head joins the softmax denominator
    gate: Optional[str] = None  # "head": output of head i scaled by sigmoid(x W_g)_i
    value_scale: float = 1.0  # values are v_proj(x) * value_scale
    sm_scale: Optional[float] = None  # None: head_dim ** -0.5

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


@dataclasses.dataclass(frozen=True)
class MLASpec:
    kind: str  # "mla"
    num_heads: int
    mla: Any  # config.MLAConfig
    rope: RopeSpec
    sm_scale: float  # qk_head_dim ** -0.5, times yarn's mscale(all_dim) ** 2 (DeepSeek)
    window: Optional[int] = None
    # DeepSeek Sparse Attention (config.DSAConfig): the layer attends only to the tokens its
    # indexer selects (mtp_jax/dsa.py); `index_shared`: it has no indexer and reuses the
    # selection of the layer before it
    indexer: Optional[Any] = None
    index_shared: bool = False


@dataclasses.dataclass(frozen=True)
class GDNSpec:
    kind: str  # "gdn"
    gdn: Any  # config.GDNConfig
    eps: float  # the gated RMSNorm's


@dataclasses.dataclass(frozen=True)
class DenseFFN:
    intermediate_size: int
    swiglu_limit: Optional[float] = None  # min(silu(gate), L) * clip(up, -L, L)


FFNSpec = Union[DenseFFN, Any]  # DenseFFN or config.MoEConfig


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    attention: Union[AttentionSpec, MLASpec, GDNSpec]
    ffn: FFNSpec
    rms_norm_eps: float
    norm_offset: float = 0.0  # 1.0 for zero-centred norms

    @property
    def is_moe(self) -> bool:
        return not isinstance(self.ffn, DenseFFN)


def rope_spec(cfg, layer: Optional[int] = None) -> RopeSpec:
    """The RoPE of a layer (per-layer theta / rotary fraction), or the config's default."""
    if layer is None:
        return RopeSpec(theta=cfg.rope_theta, rotary_dim=cfg.rotary_dim,
                        scaling=cfg.rope_scaling)
    scaled = at_layer(cfg.layer_rope_scaled, layer, True)
    return RopeSpec(theta=cfg.rope_theta_of(layer), rotary_dim=cfg.rotary_dim_of(layer),
                    scaling=cfg.rope_scaling if scaled else None)


def mla_spec(cfg, window=None) -> MLASpec:
    scale = cfg.mla.qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.kind == "yarn" and rs.mscale_all_dim:
        scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    return MLASpec(kind="mla", num_heads=cfg.num_heads, mla=cfg.mla, rope=rope_spec(cfg),
                   sm_scale=scale, window=window)


def layer_spec(cfg, layer: int) -> LayerSpec:
    if not 0 <= layer < cfg.num_layers_total:
        raise IndexError(f"layer {layer} out of range (0..{cfg.num_layers_total - 1})")
    window = (cfg.sliding_windows[layer] if layer < cfg.num_layers
              else cfg.mtp_sliding_windows[layer - cfg.num_layers])
    if cfg.is_linear(layer):
        attention = GDNSpec(kind="gdn", gdn=cfg.gdn, eps=cfg.rms_norm_eps)
    elif cfg.mla is not None:
        attention = mla_spec(cfg, window)
        if cfg.dsa is not None:
            attention = dataclasses.replace(attention, indexer=cfg.dsa,
                                            index_shared=not cfg.dsa.has_indexer(layer))
    else:
        heads, kv_heads = cfg.heads_of(layer)
        scalar = cfg.query_pre_attn_scalar
        attention = AttentionSpec(
            kind="gqa", num_heads=heads, num_kv_heads=kv_heads, head_dim=cfg.head_dim,
            rope=rope_spec(cfg, layer), window=window, qkv_bias=cfg.attention_bias,
            qk_norm=cfg.qk_norm, v_head_dim=cfg.v_head_dim,
            sinks=bool(at_layer(cfg.layer_sinks, layer, False)),
            gate=cfg.attention_gate, value_scale=cfg.attention_value_scale,
            sm_scale=None if scalar is None else float(scalar) ** -0.5)
    moe = cfg.moe
    # ModelConfig keeps no-clamp entries (0 or null in the hub lists) as None.
    shared_limit = at_layer(cfg.swiglu_limits_shared, layer, None)
    if moe is not None and moe.is_moe_layer(layer):
        ffn = dataclasses.replace(moe, swiglu_limit=at_layer(cfg.swiglu_limits, layer, None),
                                  shared_swiglu_limit=shared_limit)
    else:
        # A dense layer's MLP is clamped by the shared-expert bound (Step-3.5's dense
        # layers are the shared-expert MLP class).
        ffn = DenseFFN(cfg.intermediate_size, swiglu_limit=shared_limit)
    return LayerSpec(attention=attention, ffn=ffn, rms_norm_eps=cfg.rms_norm_eps,
                     norm_offset=cfg.norm_offset)


__all__ = ["RopeSpec", "AttentionSpec", "MLASpec", "GDNSpec", "mla_spec", "DenseFFN", "FFNSpec", "LayerSpec",
           "layer_spec", "rope_spec", "at_layer", "yarn_mscale"]
