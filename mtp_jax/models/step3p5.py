"""Step-3.5-Flash (`Step3p5ForCausalLM`, stepfun-ai/Step-3.5-Flash): MoE with experts stacked
per layer, 3:1 sliding / full layers with their own head counts, a head-wise attention
gate, zero-centred norms, per-layer RoPE theta and rotary fraction, clamped SwiGLU.

Its config.json names things its own way (`translate` reads it, and the form transformers'
`Step3p7TextConfig` saves; `export` writes the published one); its
MoE tensors are stacked (`stacked_moe_entries`). MTP layer k is `model.layers.{N + k}.*`
with a per-layer head under `transformer.shared_head` (published with or without the
`transformer.` level); vLLM step3p5_mtp.py: no zeroing at position 0, the target's pre-norm
hidden, each layer hands its pre-norm output to the next.
"""

from __future__ import annotations

import json

import numpy as np

from ..config import ConfigError
from ..specs import at_layer
from .base import Family, MTPWiring, aliases
from .fields import (TRIVIAL, exact_list, layer_counts, limits, parse_rope_scaling, per_layer,
                     rope_scaling_dict, uniform)
from .tensors import Entry, linear, swiglu_entries, vector


class Step3p5(Family):
    name = "step3p5"
    model_types = ("step3p5",)
    architecture = "Step3p5ForCausalLM"
    moe = True
    config_switches = {"use_qk_norm": "qk_norm"}
    mtp = MTPWiring(concat_order="embed_first", zero_embed_at_pos0=False,
                    hidden_from="pre_norm", output_hidden="pre_norm", own_head=True,
                    hidden_source="previous")
    mtp_input = ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                 "transformer.shared_head.norm.weight")
    mtp_head = "transformer.shared_head.output.weight"
    # the MTP head published with or without the `transformer.` level (vLLM reads both)
    tensor_aliases = aliases((r"^(model\.layers\.\d+\.)shared_head\.",
                              r"\1transformer.shared_head."))

    def translate(self, raw, mtp_layers):
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

        The form transformers' `Step3p7TextConfig` saves (model_type step3p5) parses into the
        same ModelConfig: `layer_types` / `mlp_layer_types` over the target layers with the
        MTP layers' kinds in `mtp_layer_types` / `mtp_mlp_layer_types`,
        `num_sliding_attention_heads` (the sliding layers' head count; their kv heads are
        `num_key_value_heads`) and `per_layer_config` (per target layer `num_attention_heads`,
        which must be what those give), `rope_parameters` per layer kind (theta, rotary
        fraction, and the scaling of the kinds whose `rope_type` is not default: one scaling
        for all of them, agreeing with `yarn_only_types` where that is kept),
        `n_routed_experts` / `num_experts_per_tok`, `num_key_value_heads`,
        `query_pre_attn_scalar` (softmax scale scalar ** -0.5; head_dim is the standard
        scale), `swiglu_limits*` over the target layers only (the MTP layers: no clamp).
        A key given in both spellings, or a derived one, that disagrees with the rest is
        refused naming both values.
        """
        counts = layer_counts(raw, mtp_layers)
        if counts is None:
            return raw, {}  # the common parser names the bad field
        target, num_mtp, total = counts
        extra: dict = {}
        _hf5_layer_types(raw, target, num_mtp)
        _hf5_rope_parameters(raw, target, num_mtp)
        scalar = raw.pop("query_pre_attn_scalar", None)
        if scalar is not None:
            if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or \
                    not scalar > 0:
                raise ConfigError(f"config field query_pre_attn_scalar={scalar!r} must be a "
                                  "positive number")
            hd, hidden, heads = (raw.get(k) for k in ("head_dim", "hidden_size",
                                                       "num_attention_heads"))
            if hd is None and isinstance(hidden, int) and isinstance(heads, int) and heads:
                hd = hidden // heads
            if scalar != hd:  # head_dim: the standard head_dim ** -0.5 scale
                extra["query_pre_attn_scalar"] = float(scalar)
        if "num_attention_groups" in raw:
            groups = raw.pop("num_attention_groups")
            if raw.setdefault("num_key_value_heads", groups) != groups:
                raise ConfigError(f"num_attention_groups={groups} and num_key_value_heads="
                                  f"{raw['num_key_value_heads']} disagree")
        impl = raw.pop("att_impl_type", "GQA")
        if impl != "GQA":
            raise ConfigError(f"config field att_impl_type={impl!r} is not supported (GQA)")
        if raw.pop("use_rope_layers", None) not in TRIVIAL:
            raise ConfigError("config field use_rope_layers: layers without RoPE are not "
                              "implemented (every layer rotates)")
        if raw.pop("sink", False) not in TRIVIAL:
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
            raise ConfigError(f"config field use_head_wise_attn_gate={gate!r} must be true or "
                              "false")
        extra["attention_gate"] = "head" if gate else None

        types = raw.get("layer_types")
        if isinstance(types, list) and len(types) == target:
            types = types + ["full_attention"] * num_mtp
        kinds = types if isinstance(types, list) and len(types) == total else None
        other = raw.pop("attention_other_setting", None)
        sliding_heads = raw.pop("num_sliding_attention_heads", None)
        overrides = raw.pop("per_layer_config", None)
        if sliding_heads is not None:
            if isinstance(sliding_heads, bool) or not isinstance(sliding_heads, int) or \
                    sliding_heads < 1:
                raise ConfigError(f"config field num_sliding_attention_heads={sliding_heads!r} "
                                  "must be an integer >= 1")
            if other in TRIVIAL:
                other = {"num_attention_heads": sliding_heads}
            elif isinstance(other, dict) and \
                    other.get("num_attention_heads", sliding_heads) != sliding_heads:
                raise ConfigError(f"num_sliding_attention_heads={sliding_heads} and "
                                  "attention_other_setting.num_attention_heads="
                                  f"{other['num_attention_heads']} disagree")
        if overrides not in TRIVIAL:
            sw = other.get("num_attention_heads") if isinstance(other, dict) else None
            _check_per_layer_config(overrides, kinds, target, raw.get("num_attention_heads"), sw)
        if other not in TRIVIAL:
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
            thetas = per_layer(raw, "rope_theta", total, target, pad=theta[-1] if theta else None)
            raw["rope_theta"] = thetas[0]
            extra["layer_rope_theta"] = tuple(float(t) for t in thetas)
        partials = raw.get("partial_rotary_factors")
        if partials is not None:
            partials = per_layer(raw, "partial_rotary_factors", total, target, pad=partials[-1])
            extra["layer_partial_rotary"] = tuple(float(p) for p in partials)
        only = raw.pop("yarn_only_types", None)
        if only is not None and raw.get("rope_scaling") and kinds is not None:
            extra["layer_rope_scaled"] = tuple(t in only for t in kinds)

        # MoE: translated to the DeepSeek-style keys the common MoE parser reads.
        use_moe = raw.pop("use_moe", None)
        enum = raw.pop("moe_layers_enum", None)
        mlp_types = raw.pop("mlp_layer_types", None)
        mtp_mlp_types = raw.pop("mtp_mlp_layer_types", None)
        type_flags = None
        if mlp_types is not None or mtp_mlp_types is not None:
            type_flags = _mlp_flags(mlp_types, mtp_mlp_types, target, num_mtp)
        if use_moe is False or (use_moe is None and raw.get("moe_num_experts") is None
                                and raw.get("n_routed_experts") is None):
            if enum not in TRIVIAL or any(type_flags or ()):
                raise ConfigError("moe_layers_enum / mlp_layer_types name MoE layers with "
                                  "use_moe false")
            return raw, extra
        if enum not in TRIVIAL:
            items = enum.split(",") if isinstance(enum, str) else enum
            try:
                moe_set = {int(i) for i in items if str(i).strip()}
            except (TypeError, ValueError):
                raise ConfigError(f"config field moe_layers_enum={enum!r} must list layer "
                                  "numbers") from None
            flags = tuple(i in moe_set for i in range(total))
            if type_flags is not None and type_flags != flags:
                raise ConfigError(
                    f"config field moe_layers_enum={enum!r} (MoE layers "
                    f"{[i for i in range(total) if flags[i]]}) and mlp_layer_types + "
                    f"mtp_mlp_layer_types (sparse layers "
                    f"{[i for i in range(total) if type_flags[i]]}) disagree")
        elif type_flags is not None:
            flags = type_flags
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
                val = raw.pop(old)
                if raw.setdefault(new, val) != val:
                    raise ConfigError(f"config fields {old}={val!r} and {new}={raw[new]!r} "
                                      "disagree")
        bias = raw.pop("use_moe_router_bias", True)
        raw["topk_method"] = "noaux_tc" if bias else "greedy"
        share = raw.pop("share_expert_dim", 0)
        if isinstance(share, bool) or not isinstance(share, int) or share < 0:
            raise ConfigError(f"config field share_expert_dim={share!r} must be an integer >= 0")
        extra["moe_updates"] = dict(layers=flags, shared_intermediate_size=share)
        extra["swiglu_limits"] = limits(raw, "swiglu_limits", total, target)
        extra["swiglu_limits_shared"] = limits(raw, "swiglu_limits_shared", total, target)
        return raw, extra

    def export(self, cfg, out):
        """Step-3.5-Flash's own key style (what `translate` reads)."""
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
            heads = uniform([cfg.heads_of(i)[0] for i in sliding], "sliding head counts")
            groups = uniform([cfg.heads_of(i)[1] for i in sliding], "sliding kv head counts")
            out["attention_other_setting"] = {
                "attention_type": "sliding_attention", "num_attention_heads": heads,
                "num_attention_groups": groups, "head_dim": cfg.head_dim,
                "true_head_dim": cfg.head_dim}
            full = [i for i in range(total) if not windows[i]]
            if full:
                out["num_attention_heads"] = uniform([cfg.heads_of(i)[0] for i in full],
                                                      "full head counts")
                out["num_attention_groups"] = uniform([cfg.heads_of(i)[1] for i in full],
                                                       "full kv head counts")
        if cfg.rope_scaling is not None:
            out["rope_scaling"] = rope_scaling_dict(cfg.rope_scaling)
            if cfg.layer_rope_scaled:
                kinds = {("sliding_attention" if windows[i] else "full_attention"):
                         at_layer(cfg.layer_rope_scaled, i, True) for i in range(total)}
                out["yarn_only_types"] = sorted(k for k, s in kinds.items() if s)
        m = cfg.moe
        if m is not None:
            out.update(use_moe=True, moe_num_experts=m.num_experts, moe_top_k=m.top_k,
                       moe_intermediate_size=m.intermediate_size, share_expert_dim=m.shared_size,
                       moe_router_activation=m.router, norm_expert_weight=m.norm_topk_prob,
                       moe_router_scaling_factor=m.routed_scaling_factor,
                       use_moe_router_bias=m.score_bias,
                       moe_layers_enum=",".join(str(i) for i in range(total) if m.is_moe_layer(i)))
        if cfg.query_pre_attn_scalar is not None:
            out["query_pre_attn_scalar"] = cfg.query_pre_attn_scalar
        for key in ("swiglu_limits", "swiglu_limits_shared"):
            if getattr(cfg, key):
                out[key] = [v or 0.0 for v in getattr(cfg, key)]
        return out

    def ffn_entries(self, spec, d, path, prefix):
        if spec.is_moe:
            return stacked_moe_entries(spec.ffn, d, path + ("mlp",), prefix)
        return super().ffn_entries(spec, d, path, prefix)


KINDS = ("full_attention", "sliding_attention")


def _hf5_layer_types(raw: dict, target: int, num_mtp: int) -> None:
    """transformers' `layer_types` (target layers) + `mtp_layer_types` as one list over
    target + MTP layers in `raw["layer_types"]`, the published form."""
    mtp_types = raw.pop("mtp_layer_types", None)
    if mtp_types is None:
        return
    mtp_types = list(exact_list(mtp_types, num_mtp, "mtp_layer_types"))
    types = raw.get("layer_types")
    if not isinstance(types, list) or len(types) not in (target, target + num_mtp):
        raise ConfigError(f"config field mtp_layer_types is given with layer_types={types!r} "
                          f"(expected a list of the {target} target layers' kinds)")
    if len(types) == target + num_mtp and types[target:] != mtp_types:
        raise ConfigError(f"config field layer_types gives the MTP layers {types[target:]!r} "
                          f"and mtp_layer_types={mtp_types!r}: they disagree")
    raw["layer_types"] = list(types[:target]) + mtp_types


def _expand(val, total: int, target: int):
    """A scalar or a per-layer list (target or target + MTP layers, the MTP layers padded
    with the last value) as a tuple over every layer; None where it is neither."""
    if isinstance(val, (int, float)) and not isinstance(val, bool):
        return (float(val),) * total
    if isinstance(val, list) and val and len(val) in (total, target):
        return tuple(val) + (val[-1],) * (total - len(val))
    return None


def _hf5_rope_parameters(raw: dict, target: int, num_mtp: int) -> None:
    """transformers' `rope_parameters` per layer kind rewritten to the published keys:
    `rope_theta` and `partial_rotary_factors` per layer, `rope_scaling` and
    `yarn_only_types` (the kinds it scales); the published keys, where also given, must
    agree. A `rope_parameters` without layer kinds is left to the common parser."""
    params = raw.get("rope_parameters")
    if not (isinstance(params, dict) and set(params) & set(KINDS)):
        return
    raw.pop("rope_parameters")
    total = target + num_mtp
    kinds = raw.get("layer_types")
    kinds = list(kinds) if isinstance(kinds, list) else []
    if len(kinds) == target:  # the MTP layers are full layers then (as `translate` reads it)
        kinds += ["full_attention"] * num_mtp
    if len(kinds) != total:
        kinds = ["full_attention"] * total  # a bad layer_types is named by the common parser
    bad = sorted(set(params) - set(KINDS))
    if bad or not all(isinstance(p, dict) for p in params.values()):
        raise ConfigError(f"config field rope_parameters={params!r} must map layer kinds "
                          f"{list(KINDS)} to objects")
    missing = sorted(set(kinds) - set(params))
    if missing:
        raise ConfigError(f"config field rope_parameters has no entry for the layer kinds "
                          f"{missing}")
    scaled = {}
    for kind, p in params.items():
        rest = {k: v for k, v in p.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if rest.get("rope_type", rest.get("type", "default")) != "default":
            scaled[kind] = rest
        elif set(rest) - {"rope_type", "type"}:
            raise ConfigError(f"rope_parameters.{kind} fields not understood with default "
                              f"RoPE: {sorted(set(rest) - {'rope_type', 'type'})}")
    if len({json.dumps(v, sort_keys=True) for v in scaled.values()}) > 1:
        raise ConfigError(f"rope_parameters scale the layer kinds differently {scaled}: one "
                          "rope_scaling for every scaled kind is implemented")
    theta = [params[k].get("rope_theta", 10000.0) for k in kinds]
    partial = [params[k].get("partial_rotary_factor", 1.0) for k in kinds]
    has_partial = any("partial_rotary_factor" in params[k] for k in set(kinds))
    for key, val, given in (("rope_theta", theta, True),
                            ("partial_rotary_factors", partial, has_partial)):
        if key in raw:
            old = _expand(raw[key], total, target)
            if old is not None and [float(v) for v in old] != [float(v) for v in val]:
                raise ConfigError(f"config field {key}={raw[key]!r} disagrees with "
                                  f"rope_parameters, which give {val!r} (per layer)")
        if given:
            raw[key] = val
    scaled_kinds = sorted(k for k in scaled if k in kinds)
    if not scaled_kinds:
        rs = raw.get("rope_scaling")
        if rs not in TRIVIAL and parse_rope_scaling(rs, raw.get("max_position_embeddings")):
            raise ConfigError(f"config field rope_scaling={rs!r} disagrees with "
                              "rope_parameters, which scale no layer kind")
        return
    rs = next(iter(scaled.values()))
    if raw.get("rope_scaling") not in TRIVIAL:
        max_pos = raw.get("max_position_embeddings")
        if parse_rope_scaling(raw["rope_scaling"], max_pos) != parse_rope_scaling(rs, max_pos):
            raise ConfigError(f"config field rope_scaling={raw['rope_scaling']!r} disagrees "
                              f"with rope_parameters, which scale {scaled_kinds} by {rs!r}")
    raw["rope_scaling"] = rs
    only = raw.get("yarn_only_types")
    if only is not None:
        named = sorted(k for k in set(kinds) if isinstance(only, list) and k in only)
        if named != scaled_kinds:
            raise ConfigError(f"config field yarn_only_types={only!r} disagrees with "
                              f"rope_parameters, which scale {scaled_kinds}")
    raw["yarn_only_types"] = scaled_kinds


def _check_per_layer_config(overrides, kinds, target: int, heads, sliding_heads) -> None:
    """transformers' `per_layer_config` (per target layer `num_attention_heads`) must be
    what the layer kinds and the sliding layers' head count give."""
    if not isinstance(overrides, dict):
        raise ConfigError(f"config field per_layer_config={overrides!r} must be an object")
    given = {}
    for key, val in overrides.items():
        try:
            i = int(key)
        except (TypeError, ValueError):
            i = -1
        if not 0 <= i < target or not isinstance(val, dict):
            raise ConfigError(f"config field per_layer_config has {key!r}: {val!r} (target "
                              f"layers 0 .. {target - 1} to objects)")
        unknown = sorted(set(val) - {"num_attention_heads"})
        if unknown:
            raise ConfigError(f"per_layer_config.{key} fields not understood: {unknown}")
        if "num_attention_heads" in val:
            given[i] = val["num_attention_heads"]
    kinds = kinds or ["full_attention"] * target
    sw = heads if sliding_heads is None else sliding_heads
    for i in range(target):
        want = sw if kinds[i] == "sliding_attention" else heads
        got = given.get(i, heads)
        if got != want:
            raise ConfigError(f"per_layer_config.{i}.num_attention_heads={got!r} disagrees with "
                              f"the {kinds[i]} layer's head count {want!r} (num_attention_heads"
                              f"={heads!r}, num_sliding_attention_heads={sliding_heads!r})")


def _mlp_flags(mlp_types, mtp_types, target: int, num_mtp: int) -> tuple:
    """MoE flags over target + MTP layers from transformers' `mlp_layer_types` (target
    layers, or every layer) and `mtp_mlp_layer_types` (the MTP layers; dense if absent)."""
    total = target + num_mtp
    if mlp_types is None:
        raise ConfigError("config field mtp_mlp_layer_types is given without mlp_layer_types")
    if not isinstance(mlp_types, list) or len(mlp_types) not in (target, total):
        raise ConfigError(f"config field mlp_layer_types must be a list of {target} entries, "
                          f"got {mlp_types!r}")
    if mtp_types is not None:
        mtp_types = list(exact_list(mtp_types, num_mtp, "mtp_mlp_layer_types"))
        if len(mlp_types) == total and mlp_types[target:] != mtp_types:
            raise ConfigError(f"config field mlp_layer_types gives the MTP layers "
                              f"{mlp_types[target:]!r} and mtp_mlp_layer_types={mtp_types!r}: "
                              "they disagree")
    elif len(mlp_types) == target:
        mtp_types = ["dense"] * num_mtp
    types = list(mlp_types[:target]) + list(mtp_types if mtp_types is not None
                                            else mlp_types[target:])
    bad = sorted({t for t in types if t not in ("dense", "sparse")}, key=str)
    if bad:
        raise ConfigError(f"mlp_layer_types / mtp_mlp_layer_types hold {bad}: dense or sparse")
    return tuple(t == "sparse" for t in types)


def stacked_moe_entries(moe, d: int, path: tuple, prefix: str) -> list[Entry]:
    """Step-3.5's MoE tensors: the experts stacked per layer, `moe.{gate,up}_proj.weight`
    [e, f, d] and `moe.down_proj.weight` [e, d, f], the router `moe.gate.weight` and its
    `moe.router_bias`, the shared expert `share_expert.*` beside `moe.` (not inside)."""
    e_n, f = moe.num_experts, moe.intermediate_size
    m = prefix + "moe."

    def gate_up_slice(arrs, index, dtype=None):  # parameter [e, d, 2, f]
        esl, dsl, csl, fsl = index
        parts = [np.asarray(arrs[c][esl, fsl, dsl]) for c in (0, 1)[csl]]
        out = np.stack([p.transpose(0, 2, 1) for p in parts], axis=2)
        return out if dtype is None else out.astype(dtype, copy=False)

    def down_slice(arrs, index, dtype=None):  # parameter [e, f, d] from [e, d, f]
        esl, fsl, dsl = index
        out = np.asarray(arrs[0][esl, dsl, fsl]).transpose(0, 2, 1)
        return out if dtype is None else out.astype(dtype, copy=False)

    full4, full3 = (slice(None),) * 4, (slice(None),) * 3
    es = [
        linear(path + ("router",), m + "gate.weight", e_n, d),
        Entry(path + ("experts_gate_up",), (m + "gate_proj.weight", m + "up_proj.weight"),
              ((e_n, f, d), (e_n, f, d)), lambda arrs: gate_up_slice(arrs, full4),
              lambda p: [np.ascontiguousarray(np.asarray(p)[:, :, c].transpose(0, 2, 1))
                         for c in (0, 1)], gate_up_slice),
        Entry(path + ("experts_down",), (m + "down_proj.weight",), ((e_n, d, f),),
              lambda arrs: down_slice(arrs, full3),
              lambda p: [np.ascontiguousarray(np.asarray(p).transpose(0, 2, 1))], down_slice),
    ]
    if moe.score_bias:
        es.append(vector(path + ("router_bias",), m + "router_bias", e_n))
    if moe.shared_size:
        es += swiglu_entries(d, moe.shared_size, path + ("shared",), prefix + "share_expert.")
    return es

