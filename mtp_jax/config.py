"""Frozen configuration dataclasses.

`ModelConfig` is built from an HF `config.json` (`ModelConfig.from_hf`) and holds every
architecture fact the target and the MTP drafting need: the MTP concat order, position-0
embedding zeroing, which hidden the target hands to MTP (before or after its final norm),
which hidden a module hands on, per-module or shared heads and embeddings, the hidden
source (`previous` / `target`), per-layer sliding windows, RoPE scaling and, for MoE
models, the router and experts (`MoEConfig`), for MLA models the latent dims (`MLAConfig`).
Five weight layouts are understood:

- ``mimo``        MiMo (Qwen2 target, QKV bias, ``model.mtp_layers.{i}.*``), hidden first.
- ``deepseek_v3`` DeepSeek-V3 / R1 / V3.1 (``model.layers.{N + k}.*``): multi-head latent
                  attention (`MLAConfig`) or GQA blocks, dense or MoE FFNs; FP8
                  block-scaled checkpoints (`quantization_config`) load quantized or
                  dequantized (checkpoint.py).
- ``glm4_moe``    GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``): DeepSeek naming, GQA with
                  QKV bias, optional q/k norm, partial RoPE, sigmoid-routed MoE after
                  `first_k_dense_replace` dense layers.
- ``qwen3_next``  Qwen3-Next naming (``mtp.{fc, pre_fc_norm_*, layers.N, norm}``), q/k norm.
- ``step3p5``     Step-3.5 naming (``shared_head`` per MTP layer, sliding-window MTP layers).

`ModelConfig.layer_spec(i)` turns the flat fields into the per-layer spec a block is
assembled from (specs.py). Anything in a config that would change the math and that we do
not implement (gated attention, linear attention, an unknown key) raises
`ConfigError` naming the field. Variants are made with `dataclasses.replace`, never by
assignment.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any, Optional, Union

from .strategies import METHODS, Strategy, strategy_for

LAYOUTS = ("mimo", "deepseek_v3", "glm4_moe", "qwen3_next", "step3p5", "mimo_v2_flash")
# layouts whose loaders know expert tensors
MOE_LAYOUTS = ("deepseek_v3", "glm4_moe", "step3p5", "mimo_v2_flash")
ROUTERS = ("sigmoid", "softmax")
AUTO = "auto"  # num_speculative_tokens: adaptive speculation
KV_DTYPES = (None, "fp8")  # EngineConfig.kv_dtype


class ConfigError(ValueError):
    """A config field that is missing, invalid, or describes math we do not implement."""


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


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
    attention_gate: Optional[str] = None  # "head": sigmoid(x W_g) per query head (Step-3.5)
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
    quantization: Optional[WeightQuant] = None  # how the checkpoint's weights are stored
    dtype: str = "bfloat16"  # checkpoint dtype (HF torch_dtype)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout {self.layout!r} not in {LAYOUTS}")
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
        if self.moe is not None and self.layout not in MOE_LAYOUTS:
            raise ConfigError(f"MoE FFNs are implemented for the {MOE_LAYOUTS} layouts, "
                              f"not {self.layout}")
        if self.mla is not None:
            if self.layout != "deepseek_v3":
                raise ConfigError(f"MLA is implemented for the deepseek_v3 layout, not "
                                  f"{self.layout}")
            if self.head_dim != self.mla.qk_head_dim:
                raise ConfigError(f"MLA head_dim={self.head_dim} must equal qk_nope_head_dim "
                                  f"+ qk_rope_head_dim = {self.mla.qk_head_dim}")
            if any(w is not None for w in self.sliding_windows + self.mtp_sliding_windows):
                raise ConfigError("sliding-window layers with MLA are not implemented (the "
                                  "paged MLA kernel attends over the full context)")
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
                factor = _at(self.layer_partial_rotary, i, self.partial_rotary_factor)
                raise ConfigError(f"layer {i}: partial_rotary_factor={factor} gives an invalid "
                                  f"rotary dim {rot} for head_dim {self.head_dim}")
        if self.v_head_dim is not None and self.v_head_dim < 1:
            raise ConfigError(f"v_head_dim={self.v_head_dim} must be >= 1")
        if self.v_head_dim not in (None, self.head_dim) and self.attention_bias:
            raise ConfigError("attention_bias with a v_head_dim apart from head_dim is not "
                              "implemented")
        if self.attention_gate not in (None, "head"):
            raise ConfigError(f"attention_gate={self.attention_gate!r}: only the head-wise "
                              "gate (one sigmoid per query head) is implemented")
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

    def heads_of(self, layer: int) -> tuple[int, int]:
        """(query heads, kv heads) of a layer (target layers, then MTP layers)."""
        return (_at(self.layer_num_heads, layer, self.num_heads),
                _at(self.layer_num_kv_heads, layer, self.num_kv_heads))

    def rope_theta_of(self, layer: int) -> float:
        return float(_at(self.layer_rope_theta, layer, self.rope_theta))

    def rotary_dim_of(self, layer: int) -> int:
        if self.mla is not None:
            return self.mla.qk_rope_dim
        return int(self.head_dim * _at(self.layer_partial_rotary, layer,
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
        from .specs import layer_spec  # specs imports this module
        return layer_spec(self, layer)

    def block_params(self, layer: int) -> int:
        d, hd = self.hidden_size, self.head_dim
        n, kv = self.heads_of(layer)
        if self.mla is not None:
            m = self.mla
            q = d * n * hd if m.q_lora_rank is None else (
                d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * hd)
            attn = q + d * m.cache_dim + m.kv_lora_rank
            attn += m.kv_lora_rank * n * (m.qk_nope_dim + m.v_head_dim) + n * m.v_head_dim * d
        else:
            vd = self.v_dim
            attn = d * ((n + kv) * hd + kv * vd) + n * vd * d
            attn += (n + 2 * kv) * hd if self.attention_bias else 0
            attn += 2 * hd if self.qk_norm else 0
            attn += d * n if self.attention_gate else 0
            attn += n if _at(self.layer_sinks, layer, False) else 0
        moe = self.moe
        if moe is not None and moe.is_moe_layer(layer):
            ffn = moe.num_experts * (3 * d * moe.intermediate_size + 1) + d * moe.num_experts
            ffn += 3 * d * moe.shared_size
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

    # ------------------------------------------------------------------ HF import
    @classmethod
    def from_hf(cls, path_or_dict: Any, *, mtp_layers: Optional[int] = None) -> "ModelConfig":
        """Read an HF `config.json` (a path to the file or its folder, or the parsed dict).

        mtp_layers: the number of MTP layers where the config does not say (MiMo-V2-Flash
        publishes none; the loader counts them in the checkpoint)."""
        if isinstance(path_or_dict, dict):
            raw = dict(path_or_dict)
        else:
            path = str(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.exists(path):
                raise ConfigError(f"no config.json at {path}")
            with open(path) as f:
                try:
                    raw = json.load(f)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
                    raise ConfigError(f"{path} is not valid JSON: {e}") from None
            if not isinstance(raw, dict):
                raise ConfigError(f"{path} does not hold a JSON object")
        return _from_hf_dict(raw, mtp_layers)

    def to_hf(self) -> dict:
        """The HF `config.json` dict for this config (used when exporting a checkpoint)."""
        return _to_hf_dict(self)


# ModelConfig fields that hold one value per layer over target + MTP layers.
PER_LAYER_FIELDS = ("layer_num_heads", "layer_num_kv_heads", "layer_rope_theta",
                    "layer_partial_rotary", "layer_sinks", "layer_rope_scaled",
                    "swiglu_limits", "swiglu_limits_shared")


def _at(values: tuple, i: int, default):
    """values[i], or `default` where the per-layer tuple is empty or holds None there."""
    if not values or values[i] is None:
        return default
    return values[i]


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

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"method {self.method!r} not in {METHODS}")
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
    # chunk alone leaves the matmuls far from peak (docs/BENCHMARKS.md, prefill)
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
        if self.steps_per_dispatch < 1:
            raise ConfigError("steps_per_dispatch must be >= 1")


# ---------------------------------------------------------------------------- HF parsing

# Keys that carry no math (metadata, generation defaults, tokenizer ids, training knobs).
_IGNORED = {
    "architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "attention_dropout", "hidden_dropout", "_name_or_path", "name_or_path", "tokenizer_class",
    "quantization_config_ignored", "output_attentions", "output_hidden_states",
    "return_dict", "is_encoder_decoder", "tie_encoder_decoder", "pretraining_tp",
    "use_return_dict", "_attn_implementation", "_attn_implementation_autoset", "vocab_file",
    "id2label", "label2id", "problem_type", "task_specific_params", "finetuning_task",
    "generation_config", "max_length", "min_length", "do_sample", "num_beams",
    "temperature", "top_k", "top_p", "repetition_penalty", "bad_words_ids",
    "chunk_size_feed_forward", "add_cross_attention", "cross_attention_hidden_size",
    "decoder_start_token_id", "sep_token_id", "prefix", "torchscript", "emb_dropout",
    "mlp_bias_ignored", "mtp_loss_weight", "mtp_training_note", "router_aux_loss_coef",
    "output_router_logits", "use_mtp", "num_hidden_layers_ignored", "hidden_dropout_prob",
    "aux_loss_alpha", "seq_aux", "ep_size",  # MoE training knobs (DeepSeek-V3 configs)
}
# Keys whose non-trivial values mean math we do not implement.
_UNSUPPORTED = {
    "num_experts": "MoE", "n_routed_experts": "MoE", "num_local_experts": "MoE",
    "moe_intermediate_size": "MoE", "n_shared_experts": "MoE",
    "num_experts_per_tok": "MoE", "moe_layer_freq": "MoE", "first_k_dense_replace": "MoE",
    "decoder_sparse_step": "MoE", "shared_expert_intermediate_size": "MoE",
    "kv_lora_rank": "MLA", "q_lora_rank": "MLA", "qk_rope_head_dim": "MLA",
    "qk_nope_head_dim": "MLA", "v_head_dim": "MLA", "use_mla": "MLA",
    "attn_output_gate": "gated attention", "linear_num_value_heads": "linear attention",
    "linear_num_key_heads": "linear attention", "linear_key_head_dim": "linear attention",
    "linear_value_head_dim": "linear attention", "linear_conv_kernel_dim": "linear attention",
    "full_attention_interval": "hybrid linear attention",
    "attention_sink": "attention sinks", "use_head_wise_attn_gate": "gated attention",
    "final_logit_softcapping": "logit soft-capping", "attn_logit_softcapping": "soft-capping",
    "query_pre_attn_scalar": "custom attention scale", "mlp_bias": "MLP bias",
    "sliding_num_attention_heads": "per-kind head counts", "n_group": "MoE routing",
    "topk_group": "MoE routing", "routed_scaling_factor": "MoE routing",
    "scoring_func": "MoE routing", "topk_method": "MoE routing", "norm_topk_prob": "MoE",
    "mrope_section": "multimodal RoPE", "rope_interleave": "interleaved RoPE",
}
_TRIVIAL = (None, False, 0, 0.0, [], {}, "")


def _layout_of(raw: dict) -> str:
    mt = raw.get("model_type")
    if mt not in LAYOUTS:
        raise ConfigError(f"model_type={mt!r} is not supported (supported: "
                          f"{', '.join(LAYOUTS)})")
    return mt


# MoE keys of the DeepSeek-V3 / GLM-4.5 configs, read by `_parse_moe`.
_MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
             "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
             "norm_topk_prob", "first_k_dense_replace", "moe_layer_freq", "scoring_func",
             "topk_method")


def _parse_moe(raw: dict, layout: str, get) -> Optional[MoEConfig]:
    """The MoEConfig of a DeepSeek-V3 / GLM-4.5 config, or None for a dense model.

    `topk_method` (DeepSeek): `noaux_tc` routes with e_score_correction_bias (GLM always
    does); `greedy` without it; `group_limited_greedy` (DeepSeek-V2) is not implemented.
    """
    experts = raw.get("n_routed_experts")
    if experts in _TRIVIAL:
        for key in _MOE_KEYS[1:4]:
            if raw.get(key) not in _TRIVIAL:
                raise ConfigError(f"config field {key}={raw[key]!r} (MoE) is given but "
                                  "n_routed_experts is not")
        return None

    def num(key, default, kind=int):
        val = get(key, default)
        if val is None:
            val = default
        if isinstance(val, bool) or not isinstance(val, (int, float)) or \
                (kind is int and not isinstance(val, int)):
            raise ConfigError(f"config field {key}={val!r} must be a number")
        return kind(val)

    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if raw.get(key) in _TRIVIAL:
            raise ConfigError(f"config field n_routed_experts={experts!r} needs {key}")
    scoring = get("scoring_func", "sigmoid")
    method = get("topk_method", "noaux_tc")
    if layout == "glm4_moe" and method != "noaux_tc":
        raise ConfigError(f"config field topk_method={method!r}: GLM-4.5 routes with "
                          "noaux_tc only")
    if method not in ("noaux_tc", "greedy"):
        raise ConfigError(f"config field topk_method={method!r} is not supported "
                          "(noaux_tc, greedy)")
    norm = get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise ConfigError(f"config field norm_topk_prob={norm!r} must be true or false")
    try:
        return MoEConfig(
            num_experts=num("n_routed_experts", 0), top_k=num("num_experts_per_tok", 0),
            intermediate_size=num("moe_intermediate_size", 0), router=scoring,
            score_bias=method == "noaux_tc", n_group=num("n_group", 1),
            topk_group=num("topk_group", 1), norm_topk_prob=norm,
            routed_scaling_factor=num("routed_scaling_factor", 1.0, float),
            num_shared=num("n_shared_experts", 0), first_dense=num("first_k_dense_replace", 0),
            layer_freq=num("moe_layer_freq", 1))
    except ConfigError as e:
        raise ConfigError(f"config.json MoE fields: {e}") from None


def _from_hf_dict(raw: dict, mtp_layers: Optional[int] = None) -> ModelConfig:
    layout = _layout_of(raw)
    extra: dict = {}
    if layout in _TRANSLATE:  # published key styles that name things their own way
        raw, extra = _TRANSLATE[layout](dict(raw), mtp_layers)
    used = set()

    def get(key, default=dataclasses.MISSING, *, alias=()):
        for k in (key,) + tuple(alias):
            if k in raw:
                used.add(k)
                return raw[k]
        if default is dataclasses.MISSING:
            raise ConfigError(f"config.json is missing required field {key!r}")
        return default

    moe = _parse_moe(raw, layout, get) if layout in MOE_LAYOUTS else None
    mla = _parse_mla(raw, get) if layout == "deepseek_v3" else None
    quantization = _parse_quantization(get("quantization_config", None))
    for key, what in _UNSUPPORTED.items():
        if key in used:  # read by the MoE parser
            continue
        if key in raw:
            used.add(key)
            val = raw[key]
            if key == "mlp_bias" and val is False:
                continue
            if key == "attn_output_gate" and val is False:
                continue
            if val not in _TRIVIAL:
                where = ("" if what.startswith("MoE") and layout in MOE_LAYOUTS else
                         f" for model_type {layout}")
                raise ConfigError(f"config field {key}={val!r} ({what}) is not supported"
                                  f"{where}")

    act = get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"hidden_act={act!r} is not supported (SwiGLU with silu only)")

    def as_int(key, default=dataclasses.MISSING, *, alias=(), minimum=1):
        val = get(key, default, alias=alias)
        if isinstance(val, bool) or not isinstance(val, int) or val < minimum:
            raise ConfigError(f"config field {key}={val!r} must be an integer >= {minimum}")
        return val

    def as_float(key, default):
        val = get(key, default)
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not val > 0 \
                or val != val or val == float("inf"):
            raise ConfigError(f"config field {key}={val!r} must be a positive number")
        return float(val)

    def as_bool(key, default):
        val = get(key, default)
        if not isinstance(val, bool):
            raise ConfigError(f"config field {key}={val!r} must be true or false")
        return val

    hidden = as_int("hidden_size")
    heads = as_int("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else as_int("num_key_value_heads")
    used.add("num_key_value_heads")
    head_dim = raw.get("head_dim")
    if mla is not None:
        # transformers writes MLA's head_dim as the rope dim; the q/k head is nope + rope.
        if head_dim not in (None, mla.qk_rope_dim, mla.qk_head_dim):
            raise ConfigError(f"config field head_dim={head_dim!r} does not match the MLA "
                              f"dims (qk_rope_head_dim {mla.qk_rope_dim}, qk_nope_head_dim + "
                              f"qk_rope_head_dim {mla.qk_head_dim})")
        head_dim = mla.qk_head_dim
    else:
        head_dim = hidden // heads if head_dim is None else as_int("head_dim")
    used.add("head_dim")
    num_layers = as_int("num_hidden_layers")
    num_mtp = as_int("num_nextn_predict_layers", 0, alias=("mtp_num_hidden_layers",),
                     minimum=0)
    max_pos = as_int("max_position_embeddings", 4096)

    rs = get("rope_scaling", None)
    rope_params = get("rope_parameters", None)
    theta = as_float("rope_theta", 10000.0)
    partial = as_float("partial_rotary_factor", 0.5 if layout == "glm4_moe" else 1.0)
    if rope_params:  # transformers >= 5 writes theta (and GLM's partial factor) in here
        if not isinstance(rope_params, dict):
            raise ConfigError(f"config field rope_parameters={rope_params!r} must be an object")
        theta = float(rope_params.get("rope_theta", theta))
        partial = float(rope_params.get("partial_rotary_factor", partial))
        if rope_params.get("rope_type", rope_params.get("type", "default")) != "default":
            rs = rs or rope_params
    rope_scaling = _parse_rope_scaling(rs, max_pos)

    # Sliding windows, per target layer and per MTP module.
    window = get("sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ConfigError(f"config field sliding_window={window!r} must be a positive integer")
    layer_types = get("layer_types", None)
    if layer_types is not None and not (isinstance(layer_types, list) and all(
            isinstance(t, str) for t in layer_types)):
        raise ConfigError("config field layer_types must be a list of strings")
    use_sw = as_bool("use_sliding_window", False)
    max_window_layers = as_int("max_window_layers", 28, minimum=0)  # HF Qwen2 default
    if layer_types is not None:
        bad = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ConfigError(f"layer_types contains {bad}: only full_attention and "
                              "sliding_attention are supported")
        if len(layer_types) not in (num_layers, num_layers + num_mtp):
            raise ConfigError(f"layer_types has {len(layer_types)} entries, expected "
                              f"{num_layers} or {num_layers + num_mtp}")
        if "sliding_attention" in layer_types and not window:
            raise ConfigError("layer_types has sliding_attention but sliding_window is unset")
        kinds = [window if t == "sliding_attention" else None for t in layer_types]
        target_windows = tuple(kinds[:num_layers])
        mtp_windows = tuple(kinds[num_layers:]) or (None,) * num_mtp
    elif use_sw and window:
        start = max_window_layers
        target_windows = tuple(window if i >= start else None for i in range(num_layers))
        mtp_windows = (None,) * num_mtp
    else:
        target_windows = (None,) * num_layers
        mtp_windows = (None,) * num_mtp

    common = dict(
        layout=layout,
        vocab_size=as_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=as_int("intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=as_float("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        partial_rotary_factor=partial,
        max_position_embeddings=max_pos,
        tie_word_embeddings=as_bool("tie_word_embeddings", False),
        sliding_windows=target_windows,
        num_mtp_modules=num_mtp,
        mtp_sliding_windows=mtp_windows,
        moe=moe,
        mla=mla,
        quantization=quantization,
        dtype=str(raw.get("torch_dtype", raw.get("dtype", "bfloat16")) or "bfloat16"),
    )
    per_layout = {
        "mimo": dict(attention_bias=True, mtp_concat_order="hidden_first",
                     mtp_zero_embed_at_pos0=True, mtp_hidden_from="post_norm",
                     mtp_output_hidden="post_norm"),
        "deepseek_v3": dict(mtp_concat_order="embed_first", mtp_zero_embed_at_pos0=True,
                            mtp_hidden_from="post_norm", mtp_output_hidden="pre_norm",
                            mtp_own_head=True, mtp_own_embed=True),
        # GLM-4.5 publishes the MTP layer's own embed_tokens / shared_head.head; GLM-4.6
        # and later leave them out (the loader reads which from the checkpoint).
        "glm4_moe": dict(mtp_concat_order="embed_first", mtp_zero_embed_at_pos0=True,
                         mtp_hidden_from="post_norm", mtp_output_hidden="pre_norm",
                         mtp_own_head=True, mtp_own_embed=True),
        "qwen3_next": dict(qk_norm=True, norm_offset=1.0, mtp_concat_order="embed_first",
                           mtp_zero_embed_at_pos0=False, mtp_hidden_from="post_norm",
                           mtp_output_hidden="post_norm", mtp_shared_input=True),
        # vLLM step3p5_mtp.py: no zeroing at position 0, the target's pre-norm hidden,
        # each layer hands its pre-norm output to the next, a per-layer shared_head.
        "step3p5": dict(mtp_concat_order="embed_first", mtp_zero_embed_at_pos0=False,
                        mtp_hidden_from="pre_norm", mtp_output_hidden="pre_norm",
                        mtp_own_head=True, mtp_hidden_source="previous"),
        # vLLM / SGLang mimo_v2 MTP: the target's normed hidden feeds every layer
        # (non-chain), the layer's final_layernorm feeds the target lm_head.
        "mimo_v2_flash": dict(mtp_concat_order="embed_first", mtp_zero_embed_at_pos0=False,
                              mtp_hidden_from="post_norm", mtp_output_hidden="post_norm",
                              mtp_hidden_source="target"),
    }[layout]
    if "attention_bias" in raw:
        per_layout["attention_bias"] = as_bool("attention_bias", False)
    if "qk_norm" in raw:  # our own explicit switch, also written by the exporter
        per_layout["qk_norm"] = as_bool("qk_norm", False)
    if layout in ("step3p5", "glm4_moe") and "use_qk_norm" in raw:
        per_layout["qk_norm"] = as_bool("use_qk_norm", False)
    # Explicit MTP facts may be written in config.json (the exporter writes them all);
    # they override the per-layout defaults above.
    for key in ("mtp_hidden_source", "mtp_concat_order", "mtp_hidden_from",
                "mtp_output_hidden"):
        if key in raw:
            per_layout[key] = get(key)
    if "mtp_zero_embed_at_pos0" in raw:
        per_layout["mtp_zero_embed_at_pos0"] = as_bool("mtp_zero_embed_at_pos0", True)
    if layout == "glm4_moe":  # written by our exporter; the HF loader reads the tensors
        for key in ("mtp_own_head", "mtp_own_embed"):
            if key in raw:
                per_layout[key] = as_bool(key, True)

    unknown = sorted(set(raw) - used - _IGNORED)
    if unknown:
        raise ConfigError(f"config.json has fields this engine does not understand: {unknown}; "
                          "they may change the model math, so loading stops here")
    moe_updates = extra.pop("moe_updates", None)
    if moe_updates and common["moe"] is not None:
        try:
            common["moe"] = dataclasses.replace(common["moe"], **moe_updates)
        except ConfigError as e:
            raise ConfigError(f"config.json MoE fields: {e}") from None
    return ModelConfig(**{**common, **per_layout, **extra})


# ------------------------------------------------- Step-3.5-Flash and MiMo-V2-Flash keys
#
# Both publish configs whose keys name things their own way and whose facts vary per layer.
# A translator reads those keys (every one it honours or refuses is listed in its
# docstring), leaves the generic keys the common parser reads, and returns the per-layer
# ModelConfig fields. Per-layer lists run over target + MTP layers.


def _flags(values, n, what) -> tuple:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise ConfigError(f"config field {what} must be a list of {n} entries, got {values!r}")
    return tuple(values)


def _per_layer(raw, key, total, target, pad=None):
    """A per-layer list over target + MTP layers (a list over target layers only is padded
    with `pad` for the MTP layers); None when the key is absent."""
    val = raw.pop(key, None)
    if val is None:
        return None
    if not isinstance(val, list) or len(val) not in (total, target):
        raise ConfigError(f"config field {key} must be a list of {total} (target + MTP) or "
                          f"{target} entries, got {val!r}")
    return tuple(val) + (pad,) * (total - len(val))


def _limits(raw, key, total, target):
    vals = _per_layer(raw, key, total, target, pad=0.0)
    if vals is None:
        return ()
    for v in vals:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
            raise ConfigError(f"config field {key} holds {v!r}: bounds are numbers >= 0 "
                              "(0 or null: no clamp)")
    return vals


def _layer_counts(raw: dict, mtp_layers: Optional[int]):
    """(target layers, MTP layers, total) of a raw config, `mtp_layers` (counted by the
    loader) written into it when given; None when they are not integers."""
    if mtp_layers is not None:
        raw["num_nextn_predict_layers"] = mtp_layers
    target = raw.get("num_hidden_layers")
    num_mtp = raw.get("num_nextn_predict_layers", 0)
    if not isinstance(target, int) or not isinstance(num_mtp, int):
        return None
    return target, num_mtp, target + num_mtp


def _translate_step3p5(raw: dict, mtp_layers: Optional[int]):
    """Step-3.5-Flash's published config (stepfun-ai/Step-3.5-Flash, vLLM step3p5.py).

    Honoured: `num_attention_groups` (kv heads), `attention_other_setting` (head counts of
    the sliding layers; its head_dim / true_head_dim must equal head_dim), `layer_types`
    over target + MTP layers, `rope_theta` and `partial_rotary_factors` (one per layer,
    or one value), `rope_scaling` limited to the layer kinds in `yarn_only_types`,
    `use_head_wise_attn_gate`, `use_qk_norm`, `zero_centered` (norms scale by 1 + w),
    `use_moe`, `moe_layers_enum` (or transformers' `mlp_layer_types`), `moe_num_experts`,
    `moe_top_k`, `moe_intermediate_size`, `share_expert_dim`, `moe_router_activation`,
    `moe_router_scaling_factor`, `norm_expert_weight`, `use_moe_router_bias`,
    `swiglu_limits` (routed experts) and `swiglu_limits_shared` (shared expert and dense
    MLP), `max_seq_len`. Accepted at their published values only: `att_impl_type` GQA,
    `use_rope_layers` [] (every layer rotates), `sink` false, `moe_layer_offset` 0,
    `moe_every_n_layer` 1 (the enum names the MoE layers), `need_fp32_gate` (the router
    always runs in float32).
    """
    counts = _layer_counts(raw, mtp_layers)
    if counts is None:
        return raw, {}  # the common parser names the bad field
    target, num_mtp, total = counts
    extra: dict = {}
    if "num_attention_groups" in raw:
        groups = raw.pop("num_attention_groups")
        if raw.setdefault("num_key_value_heads", groups) != groups:
            raise ConfigError(f"num_attention_groups={groups} and num_key_value_heads="
                              f"{raw['num_key_value_heads']} disagree")
    impl = raw.pop("att_impl_type", "GQA")
    if impl != "GQA":
        raise ConfigError(f"config field att_impl_type={impl!r} is not supported (GQA)")
    if raw.pop("use_rope_layers", None) not in _TRIVIAL:
        raise ConfigError("config field use_rope_layers: layers without RoPE are not "
                          "implemented (every layer rotates)")
    if raw.pop("sink", False) not in _TRIVIAL:
        raise ConfigError("config field sink=true (attention sinks in Step-3.5) is not "
                          "implemented")
    raw.pop("need_fp32_gate", None)
    raw.pop("max_seq_len", None)
    zc = raw.pop("zero_centered", True)
    if not isinstance(zc, bool):
        raise ConfigError(f"config field zero_centered={zc!r} must be true or false")
    extra["norm_offset"] = 1.0 if zc else 0.0
    gate = raw.pop("use_head_wise_attn_gate", False)
    if not isinstance(gate, bool):
        raise ConfigError(f"config field use_head_wise_attn_gate={gate!r} must be true or false")
    extra["attention_gate"] = "head" if gate else None

    types = raw.get("layer_types")
    if isinstance(types, list) and len(types) == target:
        types = types + ["full_attention"] * num_mtp
    kinds = types if isinstance(types, list) and len(types) == total else None
    other = raw.pop("attention_other_setting", None)
    if other not in _TRIVIAL:
        if not isinstance(other, dict):
            raise ConfigError("config field attention_other_setting must be an object")
        unknown = sorted(set(other) - {"attention_type", "num_attention_heads",
                                       "num_attention_groups", "head_dim", "true_head_dim"})
        if unknown:
            raise ConfigError(f"attention_other_setting fields not understood: {unknown}")
        kind = other.get("attention_type", "sliding_attention")
        if kind != "sliding_attention":
            raise ConfigError(f"attention_other_setting.attention_type={kind!r}: only the "
                              "sliding layers may have other head counts")
        head_dim = raw.get("head_dim")
        for key in ("head_dim", "true_head_dim"):
            if other.get(key, head_dim) != head_dim:
                raise ConfigError(f"attention_other_setting.{key}={other[key]} differs from "
                                  f"head_dim={head_dim}: not implemented")
        if kinds is not None:
            heads = other.get("num_attention_heads", raw.get("num_attention_heads"))
            groups = other.get("num_attention_groups", raw.get("num_key_value_heads"))
            extra["layer_num_heads"] = tuple(heads if t == kind else None for t in kinds)
            extra["layer_num_kv_heads"] = tuple(groups if t == kind else None for t in kinds)
    theta = raw.get("rope_theta")
    if isinstance(theta, list):
        thetas = _per_layer(raw, "rope_theta", total, target, pad=theta[-1] if theta else None)
        raw["rope_theta"] = thetas[0]
        extra["layer_rope_theta"] = tuple(float(t) for t in thetas)
    partials = raw.get("partial_rotary_factors")
    if partials is not None:
        partials = _per_layer(raw, "partial_rotary_factors", total, target, pad=partials[-1])
        extra["layer_partial_rotary"] = tuple(float(p) for p in partials)
    only = raw.pop("yarn_only_types", None)
    if only is not None and raw.get("rope_scaling") and kinds is not None:
        extra["layer_rope_scaled"] = tuple(t in only for t in kinds)

    # MoE: translated to the DeepSeek-style keys the common MoE parser reads.
    use_moe = raw.pop("use_moe", None)
    enum = raw.pop("moe_layers_enum", None)
    mlp_types = raw.pop("mlp_layer_types", None)
    if use_moe is False or (use_moe is None and raw.get("moe_num_experts") is None):
        if enum not in _TRIVIAL or mlp_types not in _TRIVIAL:
            raise ConfigError("moe_layers_enum / mlp_layer_types given with use_moe false")
        return raw, extra
    if enum not in _TRIVIAL:
        items = enum.split(",") if isinstance(enum, str) else enum
        try:
            moe_set = {int(i) for i in items if str(i).strip()}
        except (TypeError, ValueError):
            raise ConfigError(f"config field moe_layers_enum={enum!r} must list layer "
                              "numbers") from None
        flags = tuple(i in moe_set for i in range(total))
    elif mlp_types is not None:
        flags = _flags(mlp_types, target, "mlp_layer_types")
        flags = tuple(t == "sparse" for t in flags) + (False,) * num_mtp
    else:
        raise ConfigError("use_moe is set but moe_layers_enum (which layers are MoE) is not")
    for key, trivial in (("moe_layer_offset", 0), ("moe_every_n_layer", 1)):
        val = raw.pop(key, trivial)
        if val != trivial:
            raise ConfigError(f"config field {key}={val!r}: only {trivial} is supported "
                              "(moe_layers_enum names the MoE layers)")
    renames = {"moe_num_experts": "n_routed_experts", "moe_top_k": "num_experts_per_tok",
               "norm_expert_weight": "norm_topk_prob",
               "moe_router_scaling_factor": "routed_scaling_factor",
               "moe_router_activation": "scoring_func"}
    for old, new in renames.items():
        if old in raw:
            raw[new] = raw.pop(old)
    bias = raw.pop("use_moe_router_bias", True)
    raw["topk_method"] = "noaux_tc" if bias else "greedy"
    share = raw.pop("share_expert_dim", 0)
    if isinstance(share, bool) or not isinstance(share, int) or share < 0:
        raise ConfigError(f"config field share_expert_dim={share!r} must be an integer >= 0")
    extra["moe_updates"] = dict(layers=flags, shared_intermediate_size=share)
    extra["swiglu_limits"] = _limits(raw, "swiglu_limits", total, target)
    extra["swiglu_limits_shared"] = _limits(raw, "swiglu_limits_shared", total, target)
    return raw, extra


def _translate_mimo_v2(raw: dict, mtp_layers: Optional[int]):
    """MiMo-V2-Flash's published config (XiaomiMiMo/MiMo-V2-Flash, vLLM / SGLang
    mimo_v2_flash.py), and the form transformers' MiMoV2FlashConfig saves.

    Published keys honoured: `hybrid_layer_pattern` (1: sliding layer), `sliding_window` /
    `sliding_window_size`, `swa_num_attention_heads`, `swa_num_key_value_heads`,
    `swa_rope_theta`, `v_head_dim`, `attention_value_scale`, `add_swa_attention_sink_bias`,
    `add_full_attention_sink_bias`, `moe_layer_freq` (one 0/1 per target layer),
    `layernorm_epsilon`; `swa_head_dim` / `swa_v_head_dim` must equal head_dim / v_head_dim;
    `attention_chunk_size` is accepted when it equals the window (it is the window).
    transformers' form: `layer_types`, `mlp_layer_types`, `rope_parameters` per layer type,
    sliding layers with twice `num_key_value_heads` and sinks. The 3 MTP layers are
    sliding layers (their kind's heads, theta and sinks) with a dense FFN; their number is
    `num_nextn_predict_layers`, or, where the config leaves it out, counted from the
    checkpoint's `model.mtp.layers.*` tensors by the loader.
    """
    counts = _layer_counts(raw, mtp_layers)
    if counts is None:
        return raw, {}
    target, num_mtp, total = counts
    extra: dict = {}
    if "layernorm_epsilon" in raw:
        raw.setdefault("rms_norm_eps", raw.pop("layernorm_epsilon"))
    window = raw.pop("sliding_window_size", None)
    if window is not None and raw.setdefault("sliding_window", window) != window:
        raise ConfigError(f"sliding_window={raw['sliding_window']} and sliding_window_size="
                          f"{window} disagree")
    chunk = raw.pop("attention_chunk_size", None)
    if chunk not in (None, raw.get("sliding_window")):
        raise ConfigError(f"config field attention_chunk_size={chunk} differs from the "
                          "sliding window: chunked attention is not implemented")
    pattern = raw.pop("hybrid_layer_pattern", None)
    hf_form = pattern is None
    if pattern is not None:
        pattern = _flags(pattern, target, "hybrid_layer_pattern")
        sliding = tuple(bool(p) for p in pattern)
    else:
        types = raw.get("layer_types")
        if types is None:  # transformers' default: full at layer 0 and every 6th
            types = ["full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention"
                     for i in range(target)]
        sliding = tuple(t == "sliding_attention" for t in _flags(types, target, "layer_types"))
    raw.pop("layer_types", None)
    sliding = sliding + (True,) * num_mtp  # the MTP layers are sliding-window layers
    raw["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    heads = raw.get("num_attention_heads")
    kv = raw.get("num_key_value_heads")
    if hf_form:
        swa_heads, swa_kv = heads, None if kv is None else 2 * kv
    else:
        swa_heads = raw.pop("swa_num_attention_heads", heads)
        swa_kv = raw.pop("swa_num_key_value_heads", kv)
    for key, full in (("swa_head_dim", raw.get("head_dim")),
                      ("swa_v_head_dim", raw.get("v_head_dim"))):
        val = raw.pop(key, full)
        if val != full:
            raise ConfigError(f"config field {key}={val} differs from the full layers' "
                              f"{full}: not implemented")
    extra["layer_num_heads"] = tuple(swa_heads if s else None for s in sliding)
    extra["layer_num_kv_heads"] = tuple(swa_kv if s else None for s in sliding)
    v_dim = raw.pop("v_head_dim", None)
    if v_dim is not None:
        if isinstance(v_dim, bool) or not isinstance(v_dim, int) or v_dim < 1:
            raise ConfigError(f"config field v_head_dim={v_dim!r} must be an integer >= 1")
        extra["v_head_dim"] = v_dim
    scale = raw.pop("attention_value_scale", None)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ConfigError(f"config field attention_value_scale={scale!r} must be > 0")
        extra["attention_value_scale"] = float(scale)
    swa_sinks = raw.pop("add_swa_attention_sink_bias", hf_form)
    full_sinks = raw.pop("add_full_attention_sink_bias", False)
    if not isinstance(swa_sinks, bool) or not isinstance(full_sinks, bool):
        raise ConfigError("add_swa_attention_sink_bias / add_full_attention_sink_bias must be "
                          "true or false")
    extra["layer_sinks"] = tuple(swa_sinks if s else full_sinks for s in sliding)
    # RoPE: theta per layer kind; the rotary fraction is shared.
    theta = raw.get("rope_theta", 10000.0)
    swa_theta = raw.pop("swa_rope_theta", theta)
    params = raw.pop("rope_parameters", None)
    if isinstance(params, dict) and {"full_attention", "sliding_attention"} & set(params):
        per = {}
        for kind in ("full_attention", "sliding_attention"):
            p = params.get(kind) or {}
            if p.get("rope_type", "default") != "default":
                raise ConfigError(f"rope_parameters.{kind}.rope_type={p['rope_type']!r}: "
                                  "only default RoPE is implemented for MiMo-V2-Flash")
            per[kind] = p
        theta = per["full_attention"].get("rope_theta", theta)
        swa_theta = per["sliding_attention"].get("rope_theta", swa_theta)
        factors = {per[k].get("partial_rotary_factor") for k in per} - {None}
        if len(factors) > 1:
            raise ConfigError(f"rope_parameters give different partial_rotary_factor per "
                              f"layer kind {sorted(factors)}: not implemented")
        if factors:
            raw["partial_rotary_factor"] = factors.pop()
    elif params is not None:
        raw["rope_parameters"] = params
    raw["rope_theta"] = theta
    extra["layer_rope_theta"] = tuple(float(swa_theta if s else theta) for s in sliding)
    # MoE layers: one flag per target layer; the MTP layers are dense.
    freq = raw.pop("moe_layer_freq", None)
    mlp_types = raw.pop("mlp_layer_types", None)
    if freq is not None and not isinstance(freq, int):
        flags = tuple(bool(f) for f in _flags(freq, target, "moe_layer_freq"))
    elif mlp_types is not None:
        flags = tuple(t == "sparse" for t in _flags(mlp_types, target, "mlp_layer_types"))
    elif freq is not None:
        raise ConfigError("config field moe_layer_freq must be a list of 0/1 per layer for "
                          "MiMo-V2-Flash")
    else:  # transformers' default: the first layer dense, the rest MoE
        flags = (False,) + (True,) * (target - 1)
    if raw.get("n_routed_experts") not in _TRIVIAL:
        extra["moe_updates"] = dict(layers=flags + (False,) * num_mtp)
    return raw, extra


_TRANSLATE = {"step3p5": _translate_step3p5, "mimo_v2_flash": _translate_mimo_v2}


_MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim", "rope_interleave")


def _parse_mla(raw: dict, get) -> Optional[MLAConfig]:
    """The MLAConfig of a DeepSeek-V3 config, or None when it describes GQA blocks."""
    if raw.get("kv_lora_rank") in _TRIVIAL:
        for key in _MLA_KEYS[1:5]:
            if raw.get(key) not in _TRIVIAL:
                raise ConfigError(f"config field {key}={raw[key]!r} (MLA) is given but "
                                  "kv_lora_rank is not")
        return None

    def dim(key, required=True):
        val = get(key, None)
        if val is None and not required:
            return None
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise ConfigError(f"config field {key}={val!r} (MLA) must be a non-negative integer")
        return val

    interleave = get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise ConfigError(f"config field rope_interleave={interleave!r} must be true or false")
    if raw.get("use_mla") is False:
        raise ConfigError("config field use_mla=false: DeepSeek-V3 with MLA switched off is "
                          "not a published model; not supported")
    get("use_mla", True)
    try:
        return MLAConfig(kv_lora_rank=dim("kv_lora_rank"), qk_nope_dim=dim("qk_nope_head_dim"),
                         qk_rope_dim=dim("qk_rope_head_dim"), v_head_dim=dim("v_head_dim"),
                         q_lora_rank=dim("q_lora_rank", required=False),
                         rope_interleave=interleave)
    except ConfigError as e:
        raise ConfigError(f"config.json MLA fields: {e}") from None


QUANT_METHODS = {"fp8": ("e4m3",), "mtp_jax": ("e4m3", "int8")}


def _parse_quantization(qc) -> Optional[WeightQuant]:
    """Block-scaled `quantization_config`: DeepSeek-V3's `fp8`, or this project's
    `mtp_jax` (fp8 or int8); anything else is refused."""
    if qc in _TRIVIAL:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"config field quantization_config={qc!r} must be an object")
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise ConfigError(f"quantization_config.quant_method={method!r} is not supported "
                          f"(block-scaled {sorted(QUANT_METHODS)} checkpoints only)")
    fmt = qc.get("fmt", "e4m3")
    if fmt not in QUANT_METHODS[method]:
        raise ConfigError(f"quantization_config.fmt={fmt!r} is not supported for "
                          f"{method} ({', '.join(QUANT_METHODS[method])})")
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"quantization_config.weight_block_size={block!r} must be two "
                          "positive integers (per-tensor fp8 is not supported)")
    unknown = sorted(set(qc) - {"quant_method", "fmt", "weight_block_size",
                                "activation_scheme", "modules_to_not_convert"})
    if unknown:
        raise ConfigError(f"quantization_config fields not understood: {unknown}")
    return WeightQuant(block=tuple(block), fmt=fmt)


def _parse_rope_scaling(rs, max_pos) -> Optional[RopeScaling]:
    if not rs:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"rope_scaling must be an object, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    orig = rs.get("original_max_position_embeddings")
    if kind == "dynamic" and not orig:
        orig = max_pos
    known = {"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "attention_factor", "low_freq_factor", "high_freq_factor",
             "rope_theta", "mscale", "mscale_all_dim", "partial_rotary_factor"}
    unknown = sorted(set(rs) - known)
    if unknown:
        raise ConfigError(f"rope_scaling fields not understood: {unknown}")
    for key in ("mscale", "mscale_all_dim"):
        val = rs.get(key)
        if val is not None and (isinstance(val, bool) or not isinstance(val, (int, float))
                                or val < 0):
            raise ConfigError(f"rope_scaling.{key}={val!r} must be a non-negative number")
        if val is not None and kind != "yarn":
            raise ConfigError(f"rope_scaling.{key} is a yarn field, not {kind}")
    return RopeScaling(
        kind=kind, factor=float(rs.get("factor", 1.0)),
        original_max_position=int(orig) if orig else None,
        beta_fast=float(rs.get("beta_fast", 32.0)), beta_slow=float(rs.get("beta_slow", 1.0)),
        attention_factor=(float(rs["attention_factor"]) if rs.get("attention_factor")
                          is not None else None),
        mscale=None if rs.get("mscale") is None else float(rs["mscale"]),
        mscale_all_dim=None if rs.get("mscale_all_dim") is None else float(rs["mscale_all_dim"]),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)))


def _to_hf_dict(cfg: ModelConfig) -> dict:
    arch = {"mimo": "MiMoForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
            "glm4_moe": "Glm4MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
            "step3p5": "Step3p5ForCausalLM",
            "mimo_v2_flash": "MiMoV2FlashForCausalLM"}[cfg.layout]
    out = {
        "architectures": [arch], "model_type": cfg.layout,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "num_nextn_predict_layers": cfg.num_mtp_modules, "torch_dtype": cfg.dtype,
        "attention_bias": cfg.attention_bias, "qk_norm": cfg.qk_norm,
        "mtp_hidden_source": cfg.mtp_hidden_source, "mtp_concat_order": cfg.mtp_concat_order,
        "mtp_hidden_from": cfg.mtp_hidden_from, "mtp_output_hidden": cfg.mtp_output_hidden,
        "mtp_zero_embed_at_pos0": cfg.mtp_zero_embed_at_pos0,
    }
    if cfg.layout == "glm4_moe":
        out.update(mtp_own_head=cfg.mtp_own_head, mtp_own_embed=cfg.mtp_own_embed,
                   use_qk_norm=cfg.qk_norm)
        del out["qk_norm"]
    if cfg.partial_rotary_factor != 1.0 or cfg.layout == "glm4_moe":
        out["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.layout in _EXPORT:
        return _EXPORT[cfg.layout](cfg, out)
    if cfg.moe is not None:
        m = cfg.moe
        out.update(n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k,
                   moe_intermediate_size=m.intermediate_size, n_shared_experts=m.num_shared,
                   n_group=m.n_group, topk_group=m.topk_group, norm_topk_prob=m.norm_topk_prob,
                   routed_scaling_factor=m.routed_scaling_factor,
                   first_k_dense_replace=m.first_dense)
        if cfg.layout == "deepseek_v3":
            out.update(scoring_func=m.router, moe_layer_freq=m.layer_freq,
                       topk_method="noaux_tc" if m.score_bias else "greedy")
    if cfg.mla is not None:
        m = cfg.mla
        out.update(kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank,
                   qk_nope_head_dim=m.qk_nope_dim, qk_rope_head_dim=m.qk_rope_dim,
                   v_head_dim=m.v_head_dim, rope_interleave=m.rope_interleave)
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = _rope_scaling_dict(cfg.rope_scaling)
    windows = list(cfg.sliding_windows) + list(cfg.mtp_sliding_windows)
    if any(w is not None for w in windows):
        sizes = {w for w in windows if w is not None}
        if len(sizes) != 1:
            raise ConfigError("HF configs carry one sliding_window size; got " + str(sizes))
        out["sliding_window"] = sizes.pop()
        out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows]
    return out


def _rope_scaling_dict(rs: RopeScaling) -> dict:
    d = {"rope_type": rs.kind, "factor": rs.factor}
    if rs.original_max_position:
        d["original_max_position_embeddings"] = rs.original_max_position
    if rs.kind == "yarn":
        d.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow)
        if rs.attention_factor is not None:
            d["attention_factor"] = rs.attention_factor
        for key in ("mscale", "mscale_all_dim"):
            if getattr(rs, key) is not None:
                d[key] = getattr(rs, key)
    if rs.kind == "llama3":
        d.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
    return d


def _uniform(values, what):
    vals = {v for v in values if v is not None}
    if len(vals) > 1:
        raise ConfigError(f"{what} differ between layers of one kind {sorted(vals)}: the "
                          "published config cannot say so")
    return vals.pop() if vals else None


def _export_step3p5(cfg: ModelConfig, out: dict) -> dict:
    """Step-3.5-Flash's own key style (what `_translate_step3p5` reads)."""
    total = cfg.num_layers_total
    windows = list(cfg.sliding_windows) + list(cfg.mtp_sliding_windows)
    out["num_attention_groups"] = out.pop("num_key_value_heads")
    out["use_qk_norm"] = out.pop("qk_norm")
    out["zero_centered"] = cfg.norm_offset == 1.0
    out["use_head_wise_attn_gate"] = cfg.attention_gate == "head"
    out["rope_theta"] = [cfg.rope_theta_of(i) for i in range(total)]
    out["partial_rotary_factors"] = [cfg.rotary_dim_of(i) / cfg.head_dim for i in range(total)]
    out.pop("partial_rotary_factor", None)
    sizes = {w for w in windows if w is not None}
    if len(sizes) > 1:
        raise ConfigError("Step-3.5 configs carry one sliding_window size; got " + str(sizes))
    if sizes:
        out["sliding_window"] = sizes.pop()
    out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows]
    sliding = [i for i in range(total) if windows[i]]
    if sliding:
        heads = _uniform([cfg.heads_of(i)[0] for i in sliding], "sliding head counts")
        groups = _uniform([cfg.heads_of(i)[1] for i in sliding], "sliding kv head counts")
        out["attention_other_setting"] = {
            "attention_type": "sliding_attention", "num_attention_heads": heads,
            "num_attention_groups": groups, "head_dim": cfg.head_dim,
            "true_head_dim": cfg.head_dim}
        full = [i for i in range(total) if not windows[i]]
        if full:
            out["num_attention_heads"] = _uniform([cfg.heads_of(i)[0] for i in full],
                                                  "full head counts")
            out["num_attention_groups"] = _uniform([cfg.heads_of(i)[1] for i in full],
                                                   "full kv head counts")
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = _rope_scaling_dict(cfg.rope_scaling)
        if cfg.layer_rope_scaled:
            kinds = {("sliding_attention" if windows[i] else "full_attention"):
                     _at(cfg.layer_rope_scaled, i, True) for i in range(total)}
            out["yarn_only_types"] = sorted(k for k, s in kinds.items() if s)
    m = cfg.moe
    if m is not None:
        out.update(use_moe=True, moe_num_experts=m.num_experts, moe_top_k=m.top_k,
                   moe_intermediate_size=m.intermediate_size, share_expert_dim=m.shared_size,
                   moe_router_activation=m.router, norm_expert_weight=m.norm_topk_prob,
                   moe_router_scaling_factor=m.routed_scaling_factor,
                   use_moe_router_bias=m.score_bias,
                   moe_layers_enum=",".join(str(i) for i in range(total) if m.is_moe_layer(i)))
    for key in ("swiglu_limits", "swiglu_limits_shared"):
        if getattr(cfg, key):
            out[key] = [v or 0.0 for v in getattr(cfg, key)]
    return out


def _export_mimo_v2(cfg: ModelConfig, out: dict) -> dict:
    """MiMo-V2-Flash's published key style (what `_translate_mimo_v2` reads)."""
    n = cfg.num_layers
    sliding = [w is not None for w in cfg.sliding_windows]
    mtp_sliding = [w is not None for w in cfg.mtp_sliding_windows]
    if not all(mtp_sliding):
        raise ConfigError("MiMo-V2-Flash's MTP layers are sliding-window layers")
    total = cfg.num_layers_total
    kinds = sliding + mtp_sliding
    swa = [i for i in range(total) if kinds[i]]
    full = [i for i in range(total) if not kinds[i]]
    sizes = {w for w in cfg.sliding_windows + cfg.mtp_sliding_windows if w is not None}
    if len(sizes) > 1:
        raise ConfigError("MiMo-V2-Flash configs carry one sliding window; got " + str(sizes))
    window = sizes.pop() if sizes else None
    del out["qk_norm"]
    out.update(
        hybrid_layer_pattern=[int(s) for s in sliding],
        sliding_window=window, sliding_window_size=window,
        num_attention_heads=_uniform([cfg.heads_of(i)[0] for i in full], "full head counts")
        or cfg.num_heads,
        num_key_value_heads=_uniform([cfg.heads_of(i)[1] for i in full], "full kv heads")
        or cfg.num_kv_heads,
        swa_num_attention_heads=_uniform([cfg.heads_of(i)[0] for i in swa], "sliding heads"),
        swa_num_key_value_heads=_uniform([cfg.heads_of(i)[1] for i in swa], "sliding kv heads"),
        swa_head_dim=cfg.head_dim, v_head_dim=cfg.v_dim, swa_v_head_dim=cfg.v_dim,
        rope_theta=_uniform([cfg.rope_theta_of(i) for i in full], "full rope theta")
        or cfg.rope_theta,
        swa_rope_theta=_uniform([cfg.rope_theta_of(i) for i in swa], "sliding rope theta"),
        partial_rotary_factor=cfg.partial_rotary_factor,
        attention_value_scale=cfg.attention_value_scale,
        add_swa_attention_sink_bias=bool(_uniform(
            [bool(cfg.layer_sinks and cfg.layer_sinks[i]) for i in swa], "sliding sinks")),
        add_full_attention_sink_bias=bool(_uniform(
            [bool(cfg.layer_sinks and cfg.layer_sinks[i]) for i in full], "full sinks")),
    )
    if cfg.rope_scaling is not None:
        raise ConfigError("MiMo-V2-Flash is published without rope_scaling")
    m = cfg.moe
    if m is not None:
        out.update(n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k,
                   moe_intermediate_size=m.intermediate_size, n_shared_experts=m.num_shared,
                   n_group=m.n_group, topk_group=m.topk_group, norm_topk_prob=m.norm_topk_prob,
                   routed_scaling_factor=m.routed_scaling_factor, scoring_func=m.router,
                   topk_method="noaux_tc" if m.score_bias else "greedy",
                   moe_layer_freq=[int(m.is_moe_layer(i)) for i in range(n)])
    return out


_EXPORT = {"step3p5": _export_step3p5, "mimo_v2_flash": _export_mimo_v2}
