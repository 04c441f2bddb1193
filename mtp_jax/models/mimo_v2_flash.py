"""MiMo-V2-Flash (`MiMoV2FlashForCausalLM`, XiaomiMiMo/MiMo-V2-Flash): MoE, sliding layers
with attention sinks and their own head counts and RoPE theta, a value head dim apart from
the q/k one, values scaled by `attention_value_scale`.

Its config.json is read in the published style and in the one transformers saves
(`translate`) and written in the published style (`export`). MTP layers under
`model.mtp.layers.{k}.*` (sliding layers, dense FFN, `pre_mlp_layernorm` after attention),
their number counted from the checkpoint where config.json leaves it out
(`fit_to_checkpoint`). vLLM / SGLang mimo_v2 MTP: the target's normed hidden feeds every
layer (non-chain), the layer's final_layernorm feeds the target lm_head.
"""

from __future__ import annotations

import json
import os
import re

from ..config import ConfigError
from .base import Family, MTPWiring, aliases
from .fields import TRIVIAL, exact_list, layer_counts, moe_fields, router_fields, uniform

_MTP_LAYER = re.compile(r"^model\.mtp\.layers\.(\d+)\.")


class MimoV2Flash(Family):
    name = "mimo_v2_flash"
    model_types = ("mimo_v2_flash",)
    architecture = "MiMoV2FlashForCausalLM"
    moe = True
    mtp = MTPWiring(concat_order="embed_first", zero_embed_at_pos0=False,
                    hidden_from="post_norm", output_hidden="post_norm",
                    hidden_source="target")
    mtp_prefix = "model.mtp.layers.{k}."
    mtp_input = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight")
    mtp_post_attn_norm = "pre_mlp_layernorm"
    # the sinks under transformers' name
    tensor_aliases = aliases((r"\.self_attn\.sinks$", ".self_attn.attention_sink_bias"))

    def translate(self, raw, mtp_layers):
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
        counts = layer_counts(raw, mtp_layers)
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
            pattern = exact_list(pattern, target, "hybrid_layer_pattern")
            sliding = tuple(bool(p) for p in pattern)
        else:
            types = raw.get("layer_types")
            if types is None:  # transformers' default: full at layer 0 and every 6th
                types = ["full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention"
                         for i in range(target)]
            types = exact_list(types, target, "layer_types")
            sliding = tuple(t == "sliding_attention" for t in types)
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
            flags = tuple(bool(f) for f in exact_list(freq, target, "moe_layer_freq"))
        elif mlp_types is not None:
            flags = tuple(t == "sparse" for t in exact_list(mlp_types, target, "mlp_layer_types"))
        elif freq is not None:
            raise ConfigError("config field moe_layer_freq must be a list of 0/1 per layer for "
                              "MiMo-V2-Flash")
        else:  # transformers' default: the first layer dense, the rest MoE
            flags = (False,) + (True,) * (target - 1)
        if raw.get("n_routed_experts") not in TRIVIAL:
            extra["moe_updates"] = dict(layers=flags + (False,) * num_mtp)
        return raw, extra

    def export(self, cfg, out):
        """MiMo-V2-Flash's published key style (what `translate` reads)."""
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
            num_attention_heads=uniform([cfg.heads_of(i)[0] for i in full], "full head counts")
            or cfg.num_heads,
            num_key_value_heads=uniform([cfg.heads_of(i)[1] for i in full], "full kv heads")
            or cfg.num_kv_heads,
            swa_num_attention_heads=uniform([cfg.heads_of(i)[0] for i in swa], "sliding heads"),
            swa_num_key_value_heads=uniform([cfg.heads_of(i)[1] for i in swa], "sliding kv heads"),
            swa_head_dim=cfg.head_dim, v_head_dim=cfg.v_dim, swa_v_head_dim=cfg.v_dim,
            rope_theta=uniform([cfg.rope_theta_of(i) for i in full], "full rope theta")
            or cfg.rope_theta,
            swa_rope_theta=uniform([cfg.rope_theta_of(i) for i in swa], "sliding rope theta"),
            partial_rotary_factor=cfg.partial_rotary_factor,
            attention_value_scale=cfg.attention_value_scale,
            add_swa_attention_sink_bias=bool(uniform(
                [bool(cfg.layer_sinks and cfg.layer_sinks[i]) for i in swa], "sliding sinks")),
            add_full_attention_sink_bias=bool(uniform(
                [bool(cfg.layer_sinks and cfg.layer_sinks[i]) for i in full], "full sinks")),
        )
        if cfg.rope_scaling is not None:
            raise ConfigError("MiMo-V2-Flash is published without rope_scaling")
        m = cfg.moe
        if m is not None:
            out.update(moe_fields(m), **router_fields(m),
                       moe_layer_freq=[int(m.is_moe_layer(i)) for i in range(n)])
        return out

    def fit_to_checkpoint(self, cfg, names, path):
        """config.json does not say how many MTP layers the checkpoint holds: count the
        `model.mtp.layers.{k}.` prefixes (the strict check then wants each whole)."""
        if cfg.num_mtp_modules:
            return cfg
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        if "num_nextn_predict_layers" in raw:
            return cfg
        ks = {int(m.group(1)) for m in map(_MTP_LAYER.match, names) if m}
        if not ks:
            return cfg
        return self.parse(raw, mtp_layers=max(ks) + 1)
