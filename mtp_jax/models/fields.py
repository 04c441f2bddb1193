"""Config fields shared by the model families: readers and writers of the groups of
config.json keys that several families publish alike.

Readers (config.json -> config dataclasses, `ConfigError` naming the field): `parse_moe`
(DeepSeek-style MoE keys), `parse_mla` (MLA dims), `parse_quantization` (block-scaled
`quantization_config`), `parse_rope_scaling`; per-layer lists over target + MTP layers
(`exact_list`, `per_layer`, `limits`, `layer_counts`) for the families whose facts vary per
layer. Writers (config dataclasses -> config.json keys): `rope_scaling_dict`, `moe_fields`,
`router_fields`, `uniform` (one value of several layers, or an error).
"""

from __future__ import annotations

from typing import Optional

from ..config import ConfigError, MLAConfig, MoEConfig, RopeScaling, WeightQuant

TRIVIAL = (None, False, 0, 0.0, [], {}, "")  # values that switch a feature off

# MoE keys of the DeepSeek-V3 / GLM-4.5 configs, read by `parse_moe`.
MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
             "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
             "norm_topk_prob", "first_k_dense_replace", "moe_layer_freq", "scoring_func",
             "topk_method")


def parse_moe(raw: dict, family, get) -> Optional[MoEConfig]:
    """The MoEConfig of a DeepSeek-V3 / GLM-4.5 config, or None for a dense model.

    `topk_method` (DeepSeek): `noaux_tc` routes with e_score_correction_bias (GLM always
    does); `greedy` without it; `group_limited_greedy` (DeepSeek-V2) is not implemented.
    """
    experts = raw.get("n_routed_experts")
    if experts in TRIVIAL:
        for key in MOE_KEYS[1:4]:
            if raw.get(key) not in TRIVIAL:
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
        if raw.get(key) in TRIVIAL:
            raise ConfigError(f"config field n_routed_experts={experts!r} needs {key}")
    scoring = get("scoring_func", "sigmoid")
    method = get("topk_method", "noaux_tc")
    family.check_topk_method(method)
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


def exact_list(values, n, what) -> tuple:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise ConfigError(f"config field {what} must be a list of {n} entries, got {values!r}")
    return tuple(values)


def per_layer(raw, key, total, target, pad=None):
    """A per-layer list over target + MTP layers (a list over target layers only is padded
    with `pad` for the MTP layers); None when the key is absent."""
    val = raw.pop(key, None)
    if val is None:
        return None
    if not isinstance(val, list) or len(val) not in (total, target):
        raise ConfigError(f"config field {key} must be a list of {total} (target + MTP) or "
                          f"{target} entries, got {val!r}")
    return tuple(val) + (pad,) * (total - len(val))


def limits(raw, key, total, target):
    vals = per_layer(raw, key, total, target, pad=0.0)
    if vals is None:
        return ()
    for v in vals:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
            raise ConfigError(f"config field {key} holds {v!r}: bounds are numbers >= 0 "
                              "(0 or null: no clamp)")
    return vals


def layer_counts(raw: dict, mtp_layers: Optional[int]):
    """(target layers, MTP layers, total) of a raw config, `mtp_layers` (counted by the
    loader) written into it when given; None when they are not integers."""
    if mtp_layers is not None:
        raw["num_nextn_predict_layers"] = mtp_layers
    target = raw.get("num_hidden_layers")
    num_mtp = raw.get("num_nextn_predict_layers", 0)
    if not isinstance(target, int) or not isinstance(num_mtp, int):
        return None
    return target, num_mtp, target + num_mtp



MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim", "rope_interleave", "qk_head_dim")


def parse_mla(raw: dict, get) -> Optional[MLAConfig]:
    """The MLAConfig of a DeepSeek-V3 config, or None when it describes GQA blocks."""
    if raw.get("kv_lora_rank") in TRIVIAL:
        for key in MLA_KEYS[1:5]:
            if raw.get(key) not in TRIVIAL:
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
    # transformers >= 5 writes the q/k head size derived from the two parts
    derived = get("qk_head_dim", None)
    nope, rope = raw.get("qk_nope_head_dim"), raw.get("qk_rope_head_dim")
    if derived is not None and isinstance(nope, int) and isinstance(rope, int) \
            and derived != nope + rope:
        raise ConfigError(f"config field qk_head_dim={derived!r} disagrees with "
                          f"qk_nope_head_dim + qk_rope_head_dim = {nope} + {rope} = "
                          f"{nope + rope}")
    try:
        return MLAConfig(kv_lora_rank=dim("kv_lora_rank"), qk_nope_dim=dim("qk_nope_head_dim"),
                         qk_rope_dim=dim("qk_rope_head_dim"), v_head_dim=dim("v_head_dim"),
                         q_lora_rank=dim("q_lora_rank", required=False),
                         rope_interleave=interleave)
    except ConfigError as e:
        raise ConfigError(f"config.json MLA fields: {e}") from None


QUANT_METHODS = {"fp8": ("e4m3",), "mtp_jax": ("e4m3", "int8")}


def parse_quantization(qc) -> Optional[WeightQuant]:
    """Block-scaled `quantization_config`: DeepSeek-V3's `fp8`, or this project's
    `mtp_jax` (fp8 or int8); anything else is refused."""
    if qc in TRIVIAL:
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
    # DeepSeek-V3.1 / V3.2 publish scale_fmt "ue8m0": power-of-two scales, stored as the
    # same f32 weight_scale_inv tensors
    if qc.get("scale_fmt") not in (None, "ue8m0"):
        raise ConfigError(f"quantization_config.scale_fmt={qc['scale_fmt']!r} is not "
                          "supported (ue8m0)")
    unknown = sorted(set(qc) - {"quant_method", "fmt", "weight_block_size",
                                "activation_scheme", "modules_to_not_convert", "scale_fmt"})
    if unknown:
        raise ConfigError(f"quantization_config fields not understood: {unknown}")
    return WeightQuant(block=tuple(block), fmt=fmt)


def parse_rope_scaling(rs, max_pos) -> Optional[RopeScaling]:
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



def rope_scaling_dict(rs: RopeScaling) -> dict:
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


def uniform(values, what):
    vals = {v for v in values if v is not None}
    if len(vals) > 1:
        raise ConfigError(f"{what} differ between layers of one kind {sorted(vals)}: the "
                          "published config cannot say so")
    return vals.pop() if vals else None



def moe_fields(m: MoEConfig) -> dict:
    """The DeepSeek-style MoE keys every MoE family writes."""
    return dict(n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k,
                moe_intermediate_size=m.intermediate_size, n_shared_experts=m.num_shared,
                n_group=m.n_group, topk_group=m.topk_group, norm_topk_prob=m.norm_topk_prob,
                routed_scaling_factor=m.routed_scaling_factor)


def router_fields(m: MoEConfig) -> dict:
    """The router keys: scoring function, and whether the score bias routes."""
    return dict(scoring_func=m.router, topk_method="noaux_tc" if m.score_bias else "greedy")
