"""Frozen configuration dataclasses.

`ModelConfig` holds every architecture fact the target and the MTP drafting need: the MTP
concat order, position-0 embedding zeroing, which hidden the target hands to MTP (before or
after its final norm), which hidden a module hands on, per-module or shared heads and
embeddings, the hidden source (`previous` / `target`), per-layer sliding windows, RoPE
scaling and, for MoE models, the router and experts (`MoEConfig`), for MLA models the
latent dims (`MLAConfig`). It is read from an HF `config.json` by the model family of its
`model_type` (`mtp_jax.models.from_hf`) and written back by it (`models.to_hf`);
`ModelConfig.layout` names that family. This module knows no family: the families
register their layout names and what their tensor maps implement (`register_layout`).

`ModelConfig.layer_spec(i)` turns the flat fields into the per-layer spec a block is
assembled from (specs.py). Variants are made with `dataclasses.replace`, never by
assignment.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Union

from .specs import at_layer, layer_spec

from .strategies import METHODS, Strategy, strategy_for

ROUTERS = ("sigmoid", "softmax")
AUTO = "auto"  # num_speculative_tokens: adaptive speculation
KV_DTYPES = (None, "fp8")  # EngineConfig.kv_dtype


class ConfigError(ValueError):
    """A config field that is missing, invalid, or describes math we do not implement."""


# Layout name -> the features its family's tensor map implements ("moe", "mla"), in
# registration order. Filled by mtp_jax.models (the families import this module, so it
# cannot import them); ModelConfig checks its layout against it.
LAYOUT_FEATURES: dict[str, frozenset] = {}


def register_layout(name: str, *, moe: bool, mla: bool, gdn: bool = False) -> None:
    LAYOUT_FEATURES[name] = frozenset(f for f, on in (("moe", moe), ("mla", mla), ("gdn", gdn))
                                      if on)


def _layouts_with(feature: str) -> tuple:
    return tuple(name for name, fs in LAYOUT_FEATURES.items() if feature in fs)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling`. `kind` in linear | dynamic | yarn | llama3."""

    kind: str
    factor: float
    original_max_position: Optional[int] = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None
    # yarn, DeepSeek form: cos/sin scale mscale(factor, mscale) / mscale(factor, all_dim);
    # MLA also multiplies its softmax scale by mscale(factor, mscale_all_dim) ** 2
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self):
        if self.kind not in ("linear", "dynamic", "yarn", "llama3"):
            raise ConfigError(f"rope_scaling.type={self.kind!r} is not supported "
                              "(supported: linear, dynamic, yarn, llama3)")
        if not self.factor or self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.kind in ("yarn", "llama3", "dynamic") and not self.original_max_position:
            raise ConfigError(f"rope_scaling {self.kind} needs original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routed experts of an MoE FFN (DeepSeek-V3 / GLM-4.5 / Qwen3-MoE routers).

    router `sigmoid` (DeepSeek-V3, GLM): scores = sigmoid(x W); with `score_bias` the
    per-expert `e_score_correction_bias` is added for the choice only; experts are chosen
    within the `topk_group` best of `n_group` groups (a group scores the sum of its two
    best biased scores); the weights are the unbiased scores of the chosen experts.
    router `softmax` (Qwen3-MoE, Mixtral): scores = softmax(x W), top-k of them.
    Then weights /= their sum if `norm_topk_prob`, and *= `routed_scaling_factor`.
    `num_shared` shared experts (one SwiGLU of `num_shared * intermediate_size`) see every
    token. Layers below `first_dense` (and layers off the `layer_freq` pattern) are dense.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str = "sigmoid"
    score_bias: bool = True
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_shared: int = 0
    first_dense: int = 0
    layer_freq: int = 1
    shared_intermediate_size: Optional[int] = None  # None: num_shared * intermediate_size
    # the shared expert's output scaled by sigmoid(x . w) per token (Qwen3-Next / Qwen3.5's
    # `shared_expert_gate`)
    shared_gate: bool = False
    layers: tuple = ()  # explicit MoE flag per layer (target + MTP), overrides the pattern
    # clamped SwiGLU (Step-3.5): min(silu(gate), L) * clip(up, -L, L); set per layer by
    # specs.layer_spec from ModelConfig.swiglu_limits / swiglu_limits_shared
    swiglu_limit: Optional[float] = None
    shared_swiglu_limit: Optional[float] = None

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ConfigError(f"MoE router {self.router!r} is not supported (scoring_func "
                              f"must be one of {ROUTERS})")
        for name in ("num_experts", "top_k", "intermediate_size", "n_group", "topk_group",
                     "layer_freq"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"MoE {name} must be >= 1, got {getattr(self, name)}")
        if self.num_experts % self.n_group:
            raise ConfigError(f"n_routed_experts={self.num_experts} is not a multiple of "
                              f"n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} > n_group={self.n_group}")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ConfigError(f"num_experts_per_tok={self.top_k} is more than the "
                              f"{self.topk_group} selected groups hold")
        if self.router == "softmax" and (self.n_group > 1 or self.score_bias):
            raise ConfigError("the softmax router is implemented without groups and without "
                              "e_score_correction_bias")
        if self.shared_intermediate_size is not None and self.shared_intermediate_size < 0:
            raise ConfigError("share_expert_dim must be >= 0")
        if not self.routed_scaling_factor > 0 or self.num_shared < 0 or self.first_dense < 0:
            raise ConfigError("routed_scaling_factor must be > 0, n_shared_experts and "
                              "first_k_dense_replace >= 0")

    def is_moe_layer(self, layer: int) -> bool:
        if self.layers:
            return layer < len(self.layers) and bool(self.layers[layer])
        return layer >= self.first_dense and layer % self.layer_freq == 0

    @property
    def shared_size(self) -> int:
        """FFN width of the shared expert(s), 0 for none."""
        if self.shared_intermediate_size is not None:
            return self.shared_intermediate_size
        return self.num_shared * self.intermediate_size


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one latent.

    q = q_b(norm(q_a x)) (or q_proj x when `q_lora_rank` is None), per head `qk_nope_dim`
    + `qk_rope_dim`; the latent c = norm(kv_a x)[:kv_lora_rank] and one shared rope key
    k_pe = kv_a x[kv_lora_rank:] are all a token caches (kv_lora_rank + qk_rope_dim values);
    kv_b expands c into each head's nope key and value (`v_head_dim`). RoPE rotates only
    the rope part, on interleaved pairs when `rope_interleave` (DeepSeek's layout).
    """

    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int] = None
    rope_interleave: bool = True

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_rope_dim", "v_head_dim"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"MLA {name} must be >= 1, got {getattr(self, name)}")
        if self.qk_nope_dim < 0 or (self.q_lora_rank is not None and self.q_lora_rank < 1):
            raise ConfigError(f"MLA qk_nope_head_dim={self.qk_nope_dim} must be >= 0 and "
                              f"q_lora_rank={self.q_lora_rank} >= 1 or null")
        if self.qk_rope_dim % 2:
            raise ConfigError(f"MLA qk_rope_head_dim={self.qk_rope_dim} must be even (RoPE "
                              "rotates pairs)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def cache_dim(self) -> int:
        """Values cached per token and layer: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_dim


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    """Gated DeltaNet, the linear attention of Qwen3-Next / Qwen3.5 (`linear_*` keys).

    Per token: in_proj gives q, k [num_k_heads, k_head_dim], v and the output gate z
    [num_v_heads, v_head_dim], and per value head b, a; q, k, v go through a causal
    depthwise conv of `conv_kernel` taps (silu), then the gated delta rule updates a
    per-request state S [num_v_heads, k_head_dim, v_head_dim] (f32):
    S = exp(g) S + k (beta (v - S^T k))^T with beta = sigmoid(b), g = -exp(A_log) *
    softplus(a + dt_bias), q and k L2-normalised; out = S^T q / sqrt(k_head_dim), then a
    gated RMSNorm (norm(out) * w * silu(z)) and out_proj. Value head h reads key head
    h // (num_v_heads // num_k_heads).
    """

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4

    def __post_init__(self):
        for name in ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim", "conv_kernel"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ConfigError(f"linear attention {name} must be a positive integer, got "
                                  f"{val!r}")
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(f"linear_num_value_heads={self.num_v_heads} is not a multiple of "
                              f"linear_num_key_heads={self.num_k_heads}")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v of every head."""
        return 2 * self.key_dim + self.value_dim


@dataclasses.dataclass(frozen=True)
class DSAConfig:
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer scores every
    cached token for each query and MLA attends only to the `index_topk` best (mtp_jax/dsa.py).

    Index queries wq_b(q latent) [index_n_heads, index_head_dim] and one index key per token
    LayerNorm(wk x) [index_head_dim], both with RoPE on their first qk_rope_head_dim dims
    (rotate-half, or interleaved pairs when `rope_interleave`: GLM-5); the score of key s
    for query t is sum_h w_h(t) relu(q_h(t) . k(s)), w = weights_proj(x) * heads**-0.5 *
    head_dim**-0.5. `shared`: per layer (target + MTP; empty: none), the layer has no
    indexer and reuses the selection of the layer before it (GLM's `indexer_types`
    "shared").
    """

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_interleave: bool = False
    shared: tuple = ()

    def __post_init__(self):
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ConfigError(f"config field {name}={val!r} (DSA) must be an integer >= 1")
        object.__setattr__(self, "shared", tuple(bool(x) for x in self.shared))
        if self.shared and self.shared[0]:
            raise ConfigError("indexer_types: the first layer must run its own indexer "
                              "(\"full\"); a \"shared\" layer reuses the one before it")
        if not any(self.shared):
            object.__setattr__(self, "shared", ())

    def has_indexer(self, layer: int) -> bool:
        """The layer runs its own indexer (else it reuses the previous layer's selection)."""
        return not (self.shared and layer < len(self.shared) and self.shared[layer])


# Weight quantization modes (quant.py): per-channel int8 / fp8, 128 x 128-block fp8.
QUANT_MODES = ("int8", "fp8", "fp8-block")


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """`quantization_config` of a block-scaled checkpoint: each quantized weight [out, in]
    is stored in `fmt` (float8_e4m3fn, or int8) with `weight_scale_inv` [ceil(out / bo),
    ceil(in / bi)]; the real weight is the stored value * the scale of its (bo, bi) block.
    DeepSeek-V3 publishes quant_method `fp8` with [128, 128] blocks; this project exports
    fp8 the same way and int8 under quant_method `mtp_jax`, both with [1, bi] blocks (one
    scale per output channel and bi input rows)."""

    block: tuple  # (bo, bi) = weight_block_size
    fmt: str = "e4m3"  # e4m3 | int8


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    layout: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    norm_offset: float = 0.0  # 1.0 for zero-centred norms, y = x_hat * (1 + w) (Qwen3-Next)
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # q/k/v projection bias (Qwen2 / MiMo)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    tie_word_embeddings: bool = False
    sliding_windows: tuple = ()  # per target layer: None or window size
    # --- attention details (MiMo-V2-Flash, Step-3.5-Flash) ---
    v_head_dim: Optional[int] = None  # value head dim when it differs from head_dim
    attention_value_scale: float = 1.0  # values are v_proj(x) * this (MiMo-V2)
    query_pre_attn_scalar: Optional[float] = None  # softmax scale is this ** -0.5
    # "head": sigmoid(x W_g) per query head (Step-3.5); "element": per output element, the
    # gate emitted by q_proj beside each head's query (Qwen3-Next / Qwen3.5)
    attention_gate: Optional[str] = None
    # --- per-layer facts over target + MTP layers (empty: the uniform value above) ---
    layer_num_heads: tuple = ()
    layer_num_kv_heads: tuple = ()
    layer_rope_theta: tuple = ()
    layer_partial_rotary: tuple = ()
    layer_sinks: tuple = ()  # bool: the layer has per-head attention sink logits
    layer_rope_scaled: tuple = ()  # bool: rope_scaling applies here (empty: every layer)
    swiglu_limits: tuple = ()  # clamp of the routed experts' SwiGLU (None / 0: none)
    swiglu_limits_shared: tuple = ()  # clamp of the shared expert's / dense MLP's SwiGLU
    # --- MTP ---
    num_mtp_modules: int = 0
    mtp_concat_order: str = "hidden_first"  # or "embed_first"
    mtp_zero_embed_at_pos0: bool = True
    mtp_hidden_from: str = "post_norm"  # target hidden handed to MTP: before/after final norm
    mtp_output_hidden: str = "post_norm"  # hidden a module hands on: block output, normed or not
    mtp_hidden_source: str = "previous"  # module k consumes module k-1's hidden, or the target's
    mtp_own_head: bool = False  # per-module `shared_head.head` instead of the target lm_head
    mtp_own_embed: bool = False  # per-module `embed_tokens` instead of the target embedding
    mtp_shared_input: bool = False  # one fc / pre-norms / final norm for all modules (Qwen3-Next)
    mtp_sliding_windows: tuple = ()  # per MTP module: None or window size
    draft_vocab_size: int = 0  # MTP heads score only this many tokens (0: all; draft_vocab.py)
    draft_head: Optional[str] = None  # the draft's quantized head copy (checkpoint.with_draft_head)
    moe: Optional[MoEConfig] = None  # routed experts (None: every FFN dense)
    mla: Optional[MLAConfig] = None  # latent attention (None: GQA)
    gdn: Optional[GDNConfig] = None  # the linear-attention layers' dims (Gated DeltaNet)
    # per target + MTP layer: True where the layer is Gated DeltaNet linear attention
    # (empty: none is)
    linear_layers: tuple = ()
    dsa: Optional[DSAConfig] = None  # sparse attention over the MLA layers (None: dense)
    quantization: Optional[WeightQuant] = None  # how the checkpoint's weights are stored
    dtype: str = "bfloat16"  # checkpoint dtype (HF torch_dtype)

    def __post_init__(self):
        features = LAYOUT_FEATURES.get(self.layout)
        if features is None:
            raise ConfigError(f"layout {self.layout!r} not in {tuple(LAYOUT_FEATURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_kv_heads}")
        if len(self.sliding_windows) != self.num_layers:
            object.__setattr__(self, "sliding_windows",
                               _fill(self.sliding_windows, self.num_layers, "sliding_windows"))
        if len(self.mtp_sliding_windows) != self.num_mtp_modules:
            object.__setattr__(self, "mtp_sliding_windows",
                               _fill(self.mtp_sliding_windows, self.num_mtp_modules,
                                     "mtp_sliding_windows"))
        if not 0 <= int(self.draft_vocab_size) <= int(self.vocab_size):
            raise ConfigError(f"draft_vocab_size={self.draft_vocab_size} must be in "
                              f"[0, vocab_size={self.vocab_size}]")
        if self.draft_head is not None and self.draft_head not in QUANT_MODES:
            raise ConfigError(f"draft_head={self.draft_head!r} not in {QUANT_MODES}")
        checks = {"mtp_concat_order": ("hidden_first", "embed_first"),
                  "mtp_hidden_from": ("pre_norm", "post_norm"),
                  "mtp_output_hidden": ("pre_norm", "post_norm"),
                  "mtp_hidden_source": ("previous", "target")}
        for name, allowed in checks.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} not in {allowed}")
        if self.moe is not None and "moe" not in features:
            raise ConfigError(f"MoE FFNs are implemented for the {_layouts_with('moe')} "
                              f"layouts, not {self.layout}")
        if self.mla is not None:
            if "mla" not in features:
                raise ConfigError(f"MLA is implemented for the "
                                  f"{' / '.join(_layouts_with('mla'))} layout, not "
                                  f"{self.layout}")
            if self.head_dim != self.mla.qk_head_dim:
                raise ConfigError(f"MLA head_dim={self.head_dim} must equal qk_nope_head_dim "
                                  f"+ qk_rope_head_dim = {self.mla.qk_head_dim}")
            if any(w is not None for w in self.sliding_windows + self.mtp_sliding_windows):
                raise ConfigError("sliding-window layers with MLA are not implemented (the "
                                  "paged MLA kernel attends over the full context)")
        if self.dsa is not None:
            _check_dsa(self)
        total = self.num_layers_total
        defaults = {"layer_num_heads": self.num_heads, "layer_num_kv_heads": self.num_kv_heads,
                    "layer_rope_theta": self.rope_theta,
                    "layer_partial_rotary": self.partial_rotary_factor, "layer_sinks": False,
                    "layer_rope_scaled": True, "swiglu_limits": 0, "swiglu_limits_shared": 0}
        for name in PER_LAYER_FIELDS:
            val = tuple(getattr(self, name))
            if val and len(val) != total:
                raise ConfigError(f"{name} has {len(val)} entries, expected {total} (target "
                                  "+ MTP layers)")
            # One spelling per model: entries equal to the uniform value are None, and a
            # list of only those is empty (so configs compare equal however they were read).
            val = tuple(None if v is None or v == defaults[name] else v for v in val)
            object.__setattr__(self, name, () if all(v is None for v in val) else val)
        for i in range(total):
            heads, kv = self.heads_of(i)
            if heads < 1 or kv < 1 or heads % kv:
                raise ConfigError(f"layer {i}: {heads} attention heads are not a multiple of "
                                  f"{kv} kv heads")
            rot = self.rotary_dim_of(i)
            if rot % 2 or rot <= 0 or rot > self.head_dim:
                factor = at_layer(self.layer_partial_rotary, i, self.partial_rotary_factor)
                raise ConfigError(f"layer {i}: partial_rotary_factor={factor} gives an invalid "
                                  f"rotary dim {rot} for head_dim {self.head_dim}")
        if self.v_head_dim is not None and self.v_head_dim < 1:
            raise ConfigError(f"v_head_dim={self.v_head_dim} must be >= 1")
        if self.v_head_dim not in (None, self.head_dim) and self.attention_bias:
            raise ConfigError("attention_bias with a v_head_dim apart from head_dim is not "
                              "implemented")
        if self.attention_gate not in (None, "head", "element"):
            raise ConfigError(f"attention_gate={self.attention_gate!r}: only the head-wise "
                              "gate (one sigmoid per query head) and the element-wise one "
                              "(q_proj emits the gate) are implemented")
        if self.attention_gate == "element" and self.attention_bias:
            raise ConfigError("attention_bias with the element-wise output gate is not "
                              "implemented")
        linear = tuple(bool(x) for x in self.linear_layers)
        object.__setattr__(self, "linear_layers", linear if any(linear) else ())
        if self.linear_layers:
            if len(self.linear_layers) != total:
                raise ConfigError(f"linear_layers has {len(self.linear_layers)} entries, "
                                  f"expected {total} (target + MTP layers)")
            if self.gdn is None:
                raise ConfigError("linear-attention layers need the linear_* dims (GDNConfig)")
            if "gdn" not in features:
                raise ConfigError(f"Gated DeltaNet layers are implemented for the "
                                  f"{_layouts_with('gdn')} layouts, not {self.layout}")
            if any(self.linear_layers[self.num_layers:]):
                raise ConfigError("MTP layers are full attention in every published model; a "
                                  "linear-attention MTP layer is not implemented")
            if all(self.linear_layers[: self.num_layers]):
                raise ConfigError("every target layer is linear attention: the engine needs "
                                  "at least one full-attention layer (its paged KV pages)")
            if self.mla is not None or any(w is not None for w in self.sliding_windows):
                raise ConfigError("linear-attention layers with MLA or sliding windows are not "
                                  "implemented")
        if self.mla is not None and (self.v_head_dim is not None or any(self.layer_sinks)
                                     or self.attention_gate):
            raise ConfigError("sinks, gates and a separate v_head_dim are GQA features; "
                              "MLA has its own value dim")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        if self.mla is not None:
            return self.mla.qk_rope_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear(self, layer: int) -> bool:
        """Whether layer (target, then MTP) is a Gated DeltaNet linear-attention layer."""
        return bool(self.linear_layers) and self.linear_layers[layer]

    @property
    def attention_layers(self) -> tuple:
        """The layers (target, then MTP) with a KV cache: all but the linear ones."""
        return tuple(i for i in range(self.num_layers_total) if not self.is_linear(i))

    def heads_of(self, layer: int) -> tuple[int, int]:
        """(query heads, kv heads) of a layer (target layers, then MTP layers)."""
        return (at_layer(self.layer_num_heads, layer, self.num_heads),
                at_layer(self.layer_num_kv_heads, layer, self.num_kv_heads))

    def rope_theta_of(self, layer: int) -> float:
        return float(at_layer(self.layer_rope_theta, layer, self.rope_theta))

    def rotary_dim_of(self, layer: int) -> int:
        if self.mla is not None:
            return self.mla.qk_rope_dim
        return int(self.head_dim * at_layer(self.layer_partial_rotary, layer,
                                       self.partial_rotary_factor))

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def num_layers_total(self) -> int:
        """Target layers plus MTP layers (the index space of `layer_spec`)."""
        return self.num_layers + self.num_mtp_modules

    def layer_spec(self, layer: int):
        """The per-layer spec (attention, FFN) of target layer `layer`, or of MTP module
        `layer - num_layers` (MTP layers follow the target's layer numbering, as in the
        DeepSeek / GLM checkpoints)."""
        return layer_spec(self, layer)

    def block_params(self, layer: int) -> int:
        d, hd = self.hidden_size, self.head_dim
        n, kv = self.heads_of(layer)
        if self.is_linear(layer):
            g = self.gdn
            h = g.num_v_heads
            attn = d * (g.conv_dim + g.value_dim + 2 * h) + g.conv_kernel * g.conv_dim
            attn += 2 * h + g.v_head_dim + g.value_dim * d
        elif self.mla is not None:
            m = self.mla
            q = d * n * hd if m.q_lora_rank is None else (
                d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * hd)
            attn = q + d * m.cache_dim + m.kv_lora_rank
            attn += m.kv_lora_rank * n * (m.qk_nope_dim + m.v_head_dim) + n * m.v_head_dim * d
            if self.dsa is not None and self.dsa.has_indexer(layer):  # wq_b, wk, k_norm, weights
                hi, di = self.dsa.index_n_heads, self.dsa.index_head_dim
                attn += m.q_lora_rank * hi * di + d * di + 2 * di + d * hi
        else:
            vd = self.v_dim
            attn = d * ((n + kv) * hd + kv * vd) + n * vd * d
            attn += (n + 2 * kv) * hd if self.attention_bias else 0
            attn += 2 * hd if self.qk_norm else 0
            attn += {None: 0, "head": d * n, "element": d * n * hd}[self.attention_gate]
            attn += n if at_layer(self.layer_sinks, layer, False) else 0
        moe = self.moe
        if moe is not None and moe.is_moe_layer(layer):
            ffn = moe.num_experts * (3 * d * moe.intermediate_size + 1) + d * moe.num_experts
            ffn += 3 * d * moe.shared_size + (d if moe.shared_gate else 0)
        else:
            ffn = 3 * d * self.intermediate_size
        return attn + ffn + 2 * d

    @property
    def num_params(self) -> int:
        """Parameter count of target + MTP modules (embeddings counted once per table)."""
        d = self.hidden_size
        emb = self.vocab_size * d
        target = emb + sum(self.block_params(i) for i in range(self.num_layers)) + d
        target += 0 if self.tie_word_embeddings else emb
        mtp_in = 2 * d * d + 3 * d
        mtp = 0
        for k in range(self.num_mtp_modules):
            mtp += self.block_params(self.num_layers + k)
            mtp += 0 if self.mtp_shared_input else mtp_in
            mtp += emb if self.mtp_own_head else 0
            mtp += emb if self.mtp_own_embed else 0
        return target + mtp + (mtp_in if self.mtp_shared_input and self.num_mtp_modules else 0)


def _check_dsa(cfg: "ModelConfig") -> None:
    """DSA needs MLA with a q latent (the index queries are read from it) and index heads
    that hold the rope dims."""
    d = cfg.dsa
    if cfg.mla is None or cfg.mla.q_lora_rank is None:
        raise ConfigError("DeepSeek Sparse Attention (index_topk) needs MLA with q_lora_rank: "
                          "the indexer's queries are read from the q latent")
    if d.index_head_dim < cfg.mla.qk_rope_dim:
        raise ConfigError(f"index_head_dim={d.index_head_dim} is smaller than "
                          f"qk_rope_head_dim={cfg.mla.qk_rope_dim} (the indexer's RoPE dims)")
    if d.shared and len(d.shared) not in (cfg.num_layers, cfg.num_layers_total):
        raise ConfigError(f"indexer_types has {len(d.shared)} entries, expected "
                          f"{cfg.num_layers}")
    if any(d.shared[cfg.num_layers:]):
        raise ConfigError("an MTP layer runs its own indexer (indexer_types \"full\")")


# ModelConfig fields that hold one value per layer over target + MTP layers.
PER_LAYER_FIELDS = ("layer_num_heads", "layer_num_kv_heads", "layer_rope_theta",
                    "layer_partial_rotary", "layer_sinks", "layer_rope_scaled",
                    "swiglu_limits", "swiglu_limits_shared")


def _fill(values, n, name):
    values = tuple(values)
    if not values:
        return (None,) * n
    if len(values) != n:
        raise ConfigError(f"{name} has {len(values)} entries, expected {n}")
    return values


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: the draft strategy and its knobs.

    method: none | eagle | per_step | window | chain (see DESIGN.md, Draft strategies).
    num_speculative_tokens: K, or "auto" (the default): adaptive speculation up to the
    model's MTP module count (3 for eagle), see `adaptive`. `resolve(model config)` turns
    "auto" into that K with `adaptive=True`.
    adaptive: the engine picks, for every dispatch, how many of the K drafts to verify
    (0..K) from the acceptance per depth and the measured cost of each step kind
    (mtp_jax.adaptive). Sampled rows then verify by coupled sampling (a draft is accepted
    when it equals the target's own seeded sample at its position), so sampled output is
    the same whatever K each dispatch chose; with a fixed K, rejection sampling.
    draft_tree: None (a chain of K drafts), or a draft tree (`--draft-tree`, mtp_jax/tree.py):
    per-depth branching such as "2,2,1", or "budget:N[,depth:D][,topk:W]"; all its nodes are
    verified in one target pass. K is the tree's depth (a static tree's branching count, a
    dynamic one's D, else K); the speculation is fixed (not adaptive). Methods `chain` and
    `eagle` only, and neither relaxed acceptance nor a latent-attention (MLA / DSA) or
    linear-attention (Gated DeltaNet) model.
    `relaxed_*`: TensorRT-LLM style relaxed acceptance for thinking phases, off by default;
    when on, a request in a thinking phase (between `think_begin_id` and `think_end_id`)
    accepts a greedy draft that is among the target's top `relaxed_topk` tokens and within
    `relaxed_delta` of the top-1 probability.
    """

    method: str = "chain"
    num_speculative_tokens: Union[int, str] = AUTO
    relaxed_acceptance: bool = False
    relaxed_topk: int = 3
    relaxed_delta: float = 0.3
    think_begin_id: int = -1
    think_end_id: int = -1
    adaptive: bool = False
    draft_tree: Optional[str] = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"method {self.method!r} not in {METHODS}")
        if self.draft_tree is not None:
            self._check_tree()
        k = self.num_speculative_tokens
        if isinstance(k, str):
            if k.strip().lower() != AUTO:
                raise ConfigError(f"num_speculative_tokens must be an integer or {AUTO!r}, "
                                  f"got {k!r}")
            object.__setattr__(self, "num_speculative_tokens", AUTO)
        elif isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise ConfigError(f"num_speculative_tokens must be an integer or {AUTO!r}, "
                              f"got {k!r}")
        elif self.strategy.speculative and k < 1:
            raise ConfigError("num_speculative_tokens must be >= 1")
        if not self.strategy.speculative and self.adaptive:
            object.__setattr__(self, "adaptive", False)
        if self.relaxed_acceptance and (self.relaxed_topk < 1 or not 0 <= self.relaxed_delta <= 1):
            raise ConfigError("relaxed_topk must be >= 1 and relaxed_delta in [0, 1]")

    def _check_tree(self) -> None:
        """ConfigError for a draft tree this spec cannot draft; a static tree's depth is K
        (set when K is "auto"), and a tree's speculation is fixed."""
        from .tree_spec import TreeSpecError, check_tree_method, parse_tree_spec
        try:
            tree = parse_tree_spec(self.draft_tree)
        except TreeSpecError as e:
            raise ConfigError(str(e)) from None
        err = check_tree_method(self.method)
        if err:
            raise ConfigError(err)
        if self.relaxed_acceptance:
            raise ConfigError("--draft-tree does not combine with relaxed acceptance (it "
                              "accepts a chain's drafts by the target's top-k)")
        k = self.num_speculative_tokens
        depth = tree.max_depth
        if depth is not None and not self.auto and k != depth:
            raise ConfigError(f"draft tree {self.draft_tree!r} is {depth} deep but "
                              f"num_speculative_tokens is {k}: give the same or 'auto'")
        if depth is not None and self.auto:
            object.__setattr__(self, "num_speculative_tokens", depth)
        object.__setattr__(self, "adaptive", False)

    @property
    def tree(self):
        """The draft tree (tree_spec.TreeSpec, a dynamic one's depth set to K), or None."""
        if self.draft_tree is None:
            return None
        from .tree_spec import parse_tree_spec
        return parse_tree_spec(self.draft_tree).with_depth(self.k)

    @property
    def write_ahead(self) -> int:
        """KV positions past the committed length L the steps can write: K for a chain; a
        tree's verify writes L - 1 .. L + N - 2 and its drafting, after a step that
        committed up to L', its expanded nodes from L' - 2 on (`tree_draft_nodes`)."""
        tree = self.tree
        if tree is None:
            return self.k
        return max(self.k, tree.num_nodes - 1, tree_draft_nodes(tree))

    @property
    def strategy(self) -> Strategy:
        """The drafting method's strategy (mtp_jax.strategies): what the method decides."""
        return strategy_for(self.method)

    @property
    def auto(self) -> bool:
        """K not chosen yet ("auto" before `resolve`)."""
        return self.num_speculative_tokens == AUTO

    @property
    def k(self) -> int:
        """Drafts per step (0 for plain decoding); the largest K when adaptive."""
        if not self.strategy.speculative:
            return 0
        if self.auto:
            raise ConfigError("num_speculative_tokens='auto' is resolved against a model: "
                              "SpecConfig.resolve(model.config)")
        return int(self.num_speculative_tokens)

    def resolve(self, cfg: ModelConfig) -> "SpecConfig":
        """"auto" -> adaptive with K = the module count (eagle: 3); checked for the model."""
        spec = self
        if self.auto:
            strategy = self.strategy
            if self.draft_tree is not None:  # a dynamic tree of the method's K, fixed
                return dataclasses.replace(
                    self, num_speculative_tokens=strategy.auto_k(cfg.num_mtp_modules)
                ).resolve(cfg)
            spec = dataclasses.replace(self, adaptive=strategy.speculative,
                                       num_speculative_tokens=strategy.auto_k(
                                           cfg.num_mtp_modules))
        spec.validate_for(cfg)
        return spec

    def validate_for(self, cfg: ModelConfig) -> None:
        if self.auto:
            self.resolve(cfg)
            return
        err = self.strategy.check_k(self.num_speculative_tokens, cfg.num_mtp_modules)
        if err:
            raise ConfigError(err)
        if self.draft_tree is not None:
            if cfg.mla is not None:
                raise ConfigError("--draft-tree needs GQA attention: latent attention (MLA, "
                                  "DSA) has no tree-masked paged kernel")
            if any(cfg.is_linear(i) for i in range(cfg.num_layers_total)):
                raise ConfigError("--draft-tree does not run on linear-attention (Gated "
                                  "DeltaNet) layers: their state follows one token sequence")
            from .tree_spec import TreeSpecError
            try:
                self.tree
            except TreeSpecError as e:
                raise ConfigError(str(e)) from None


def tree_draft_nodes(tree) -> int:
    """Nodes a tree's drafting runs its modules over (those it expands, depths 0..D-1):
    a static tree's levels but its last, a dynamic one's root and `topk` nodes a depth."""
    if tree.dynamic:
        return 1 + tree.topk * (tree.max_depth - 1)
    return tree.num_nodes - math.prod(tree.branching)


def parse_num_speculative_tokens(text: str):
    """A CLI value of num_speculative_tokens: "auto" or an integer >= 1."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"expected {AUTO!r} or an integer >= 1, got {text!r}")
    return k


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy (and ignores the seed)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 128
    stop: tuple = ()  # strings (need a tokenizer)
    stop_token_ids: tuple = ()
    relaxed: bool = True  # allow relaxed acceptance for this request when the engine enables it

    def __post_init__(self):
        import math
        errs = []
        stop, ids = self.stop, self.stop_token_ids
        if isinstance(stop, str):  # one stop string, not its characters
            stop = (stop,)
        if not isinstance(stop, (tuple, list)):
            errs.append(f"stop must be a list of strings, got {stop!r}")
            stop = ()
        if not isinstance(ids, (tuple, list)):
            errs.append(f"stop_token_ids must be a list of integers, got {ids!r}")
            ids = ()
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) \
                or t < 0 or t > 100:
            errs.append(f"temperature must be a finite number in [0, 100], got {t!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or \
                not 0 <= self.top_k < 2**31:
            errs.append(f"top_k must be an integer in [0, 2**31), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not math.isfinite(p) \
                or not 0 < p <= 1:
            errs.append(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not \
                0 <= self.seed < 2**63:
            errs.append(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) \
                or self.max_tokens < 1:
            errs.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            errs.append("stop must be a list of non-empty strings")
        if not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**31
                   for s in self.stop_token_ids):
            errs.append("stop_token_ids must be integers in [0, 2**31)")
        if errs:
            raise ConfigError("; ".join(errs))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Fixed shapes of the engine: they key the compiled programs."""

    max_batch: int = 8
    max_model_len: int = 2048
    page_size: int = 16
    num_pages: Optional[int] = None  # None: sized from kv_memory_gb, else enough for all slots
    kv_memory_gb: Optional[float] = None
    steps_per_dispatch: int = 32
    prefill_chunk: int = 256  # largest prefill chunk; smaller chunks are powers of two
    # requests prefilled together, a row each of one forward (a power of two; fewer rows
    # run in the next power of two). None: 1 on CPU, 8 on GPU and TPU, where a 256-token
    # chunk alone leaves the matmuls far from peak (docs/DECISIONS.md, "Several prompts
    # per prefill forward")
    prefill_batch: Optional[int] = None
    max_stop_ids: int = 8
    attention_backend: Optional[str] = None  # None: by jax.default_backend()
    kv_dtype: Optional[str] = None  # None: the model's dtype; "fp8": float8_e4m3fn pages
    # XLA's dense matmuls in the decode steps on a GPU: "triton" (XLA's Triton GEMMs,
    # split-K for a few rows) or "cublas". None: by rows per device (step.step_gemms)
    step_gemms: Optional[str] = None
    # Dispatches whose running rows are all greedy take step programs without the sampled
    # rows' paths: smaller to compile, no draft log-probs written, and on a GPU none of
    # their conditionals, which read a predicate back to the host (several round trips a
    # step). None: on (step.greedy_steps); False: the full programs only.
    greedy_steps: Optional[bool] = None
    # share the KV of full prompt blocks between requests whose prompts start with the same
    # tokens (prefix_cache.py); off by itself where the layout cannot (sliding windows,
    # linear attention: `Engine.prefix_cache_off` says why)
    prefix_cache: bool = True
    # every contraction that takes rows runs in fixed row tiles and attention and MoE take
    # their jnp paths, so a token's logits do not depend on the rows beside it (decode,
    # verify, prefill, batch): greedy speculative output equals plain decoding bitwise in
    # bf16 too, at some speed (pallas_kernels/invariant.py)
    deterministic: bool = False

    def __post_init__(self):
        if not (self.greedy_steps is None or isinstance(self.greedy_steps, bool)):
            raise ConfigError(f"greedy_steps={self.greedy_steps!r} is not supported (None for "
                              "the default, on; True or False)")
        if self.step_gemms not in (None, "triton", "cublas"):
            raise ConfigError(f"step_gemms={self.step_gemms!r} is not supported (None to "
                              "choose by rows, 'triton' or 'cublas')")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype={self.kv_dtype!r} is not supported (None for the "
                              "model's dtype, or 'fp8')")
        if self.max_batch < 1 or self.max_model_len < 2 or self.page_size < 1:
            raise ConfigError("max_batch >= 1, max_model_len >= 2, page_size >= 1 required")
        if self.prefill_chunk & (self.prefill_chunk - 1) or self.prefill_chunk < 8:
            raise ConfigError("prefill_chunk must be a power of two >= 8")
        r = self.prefill_batch
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 1
                              or r & (r - 1)):
            raise ConfigError(f"prefill_batch must be a power of two >= 1 (or None), got {r!r}")
        if not isinstance(self.deterministic, bool):
            raise ConfigError(f"deterministic={self.deterministic!r} must be True or False")
        if self.steps_per_dispatch < 1:
            raise ConfigError("steps_per_dispatch must be >= 1")
