"""Step-3.5-Flash (`Step3p5ForCausalLM`, stepfun-ai/Step-3.5-Flash): MoE with experts stacked
per layer, 3:1 sliding / full layers with their own head counts, a head-wise attention
gate, zero-centred norms, per-layer RoPE theta and rotary fraction, clamped SwiGLU.

Its config.json names things its own way (`translate` reads it, `export` writes it); its
MoE tensors are stacked (`stacked_moe_entries`). MTP layer k is `model.layers.{N + k}.*`
with a per-layer head under `transformer.shared_head` (published with or without the
`transformer.` level); vLLM step3p5_mtp.py: no zeroing at position 0, the target's pre-norm
hidden, each layer hands its pre-norm output to the next.
"""

from __future__ import annotations

import numpy as np

from ..config import ConfigError
from ..specs import at_layer
from .base import Family, MTPWiring, aliases
from .fields import TRIVIAL, exact_list, layer_counts, limits, per_layer, rope_scaling_dict, uniform
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
        """
        counts = layer_counts(raw, mtp_layers)
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
        if use_moe is False or (use_moe is None and raw.get("moe_num_experts") is None):
            if enum not in TRIVIAL or mlp_types not in TRIVIAL:
                raise ConfigError("moe_layers_enum / mlp_layer_types given with use_moe false")
            return raw, extra
        if enum not in TRIVIAL:
            items = enum.split(",") if isinstance(enum, str) else enum
            try:
                moe_set = {int(i) for i in items if str(i).strip()}
            except (TypeError, ValueError):
                raise ConfigError(f"config field moe_layers_enum={enum!r} must list layer "
                                  "numbers") from None
            flags = tuple(i in moe_set for i in range(total))
        elif mlp_types is not None:
            flags = exact_list(mlp_types, target, "mlp_layer_types")
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
        for key in ("swiglu_limits", "swiglu_limits_shared"):
            if getattr(cfg, key):
                out[key] = [v or 0.0 for v in getattr(cfg, key)]
        return out

    def ffn_entries(self, spec, d, path, prefix):
        if spec.is_moe:
            return stacked_moe_entries(spec.ffn, d, path + ("mlp",), prefix)
        return super().ffn_entries(spec, d, path, prefix)


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

