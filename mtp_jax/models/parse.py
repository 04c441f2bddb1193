"""The generic config.json parser: one family-independent reading of the keys every family
shares, with the family's facts taken from its `Family` object (models/base.py).

`read_config(path_or_dict)` gives the raw dict; `parse_config(raw, family)` turns it into a
`ModelConfig`: first the family translates its own key style (`Family.translate`), then
the common keys are read, the MoE / MLA keys where the family has them, the family's
defaults and switches applied (`Family.config_defaults`, `config_switches`, `mtp`), and
any key left unread that is not in `IGNORED` stops the load (it may change the math).
Keys in `UNSUPPORTED` with a non-trivial value name the feature that is not implemented.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

from ..config import ConfigError, ModelConfig
from .fields import TRIVIAL, parse_mla, parse_moe, parse_quantization, parse_rope_scaling

# Keys that carry no math (metadata, generation defaults, tokenizer ids, training knobs).
IGNORED = {
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
UNSUPPORTED = {
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


def read_config(path_or_dict: Any) -> dict:
    """The config.json dict (a path to the file or its folder, or the parsed dict)."""
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
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
    return raw


def parse_config(raw: dict, family, mtp_layers: Optional[int] = None) -> ModelConfig:
    """`raw` (a config.json dict of `family`'s model_type) as a ModelConfig.

    mtp_layers: the number of MTP layers where the config does not say (MiMo-V2-Flash
    publishes none; the loader counts them in the checkpoint)."""
    model_type = raw.get("model_type")
    # published key styles that name things their own way
    raw, extra = family.translate(dict(raw), mtp_layers)
    used = set()

    def get(key, default=dataclasses.MISSING, *, alias=()):
        for k in (key,) + tuple(alias):
            if k in raw:
                used.add(k)
                return raw[k]
        if default is dataclasses.MISSING:
            raise ConfigError(f"config.json is missing required field {key!r}")
        return default

    moe = parse_moe(raw, family, get) if family.moe else None
    mla = parse_mla(raw, get) if family.mla else None
    quantization = parse_quantization(get("quantization_config", None))
    for key, what in UNSUPPORTED.items():
        if key in used:  # read by the MoE parser
            continue
        if key in raw:
            used.add(key)
            val = raw[key]
            if key == "mlp_bias" and val is False:
                continue
            if key == "attn_output_gate" and val is False:
                continue
            if val not in TRIVIAL:
                where = ("" if what.startswith("MoE") and family.moe else
                         f" for model_type {model_type}")
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
    partial = as_float("partial_rotary_factor", family.partial_rotary_factor)
    if rope_params:  # transformers >= 5 writes theta (and GLM's partial factor) in here
        if not isinstance(rope_params, dict):
            raise ConfigError(f"config field rope_parameters={rope_params!r} must be an object")
        theta = float(rope_params.get("rope_theta", theta))
        partial = float(rope_params.get("partial_rotary_factor", partial))
        if rope_params.get("rope_type", rope_params.get("type", "default")) != "default":
            rs = rs or rope_params
    rope_scaling = parse_rope_scaling(rs, max_pos)

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
        if "use_sliding_window" in raw:  # transformers >= 5 writes both: they must agree
            derived = ["sliding_attention" if use_sw and window and i >= max_window_layers
                       else "full_attention" for i in range(num_layers)]
            if list(layer_types[:num_layers]) != derived:
                raise ConfigError(
                    f"config field layer_types={layer_types!r} disagrees with "
                    f"use_sliding_window={use_sw}, sliding_window={window!r}, "
                    f"max_window_layers={max_window_layers}, which give {derived!r}")
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
        layout=family.name,
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
    # The family's facts (MTP wiring, bias, norms), unless config.json says otherwise.
    per_layout = {**family.config_defaults, **family.mtp.fields()}
    if "attention_bias" in raw:
        per_layout["attention_bias"] = as_bool("attention_bias", False)
    if "qk_norm" in raw:  # our own explicit switch, also written by the exporter
        per_layout["qk_norm"] = as_bool("qk_norm", False)
    for key, field in family.config_switches.items():  # the family's own spellings
        if key in raw:
            per_layout[field] = as_bool(key, False)
    # Explicit MTP facts may be written in config.json (the exporter writes them all).
    for key in ("mtp_hidden_source", "mtp_concat_order", "mtp_hidden_from",
                "mtp_output_hidden"):
        if key in raw:
            per_layout[key] = get(key)
    if "mtp_zero_embed_at_pos0" in raw:
        per_layout["mtp_zero_embed_at_pos0"] = as_bool("mtp_zero_embed_at_pos0", True)

    unknown = sorted(set(raw) - used - IGNORED)
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

