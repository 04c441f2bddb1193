"""Qwen3-Next (`Qwen3NextForCausalLM`): hybrid Gated DeltaNet / gated full attention, MoE
with a gated shared expert, one MTP layer.

- Layers: `layer_types` ("linear_attention" / "full_attention" per target layer) or
  `full_attention_interval` (every n-th layer full, transformers' default 4). Linear
  layers are Gated DeltaNet (gdn.py) with the `linear_*` dims; full ones are GQA with q/k
  norm, partial RoPE and an element-wise output gate emitted by q_proj
  (`attn_output_gate`, on unless a config says false).
- Norms are zero-centred (y = x_hat * (1 + w)); the GDN's gated norm is not.
- MoE (`num_experts` > 0): softmax router, top `num_experts_per_tok`, `norm_topk_prob`, a
  shared expert of `shared_expert_intermediate_size` scaled by sigmoid(`shared_expert_gate`);
  layer i is MoE unless in `mlp_only_layers` or off the `decoder_sparse_step` pattern.
- MTP (`mtp_num_hidden_layers`) under `mtp.layers.{k}.*` (full attention) with one input
  side for all of them (`mtp.fc`, `mtp.pre_fc_norm_{embedding,hidden}`, `mtp.norm`):
  concat(embedding, hidden), no zeroing at position 0, normed hiddens in and out, the
  target's embedding and head (vLLM qwen3_next_mtp.py).

Tensor names: `linear_attn.in_proj_qkvz` / `in_proj_ba` (grouped per key head) here;
Qwen3.5 (qwen3_5.py) differs in those and in its multimodal wrapper.
"""

from __future__ import annotations

import dataclasses
import re

from ..config import ConfigError, GDNConfig, MoEConfig
from .base import Family, MTPWiring
from .fields import TRIVIAL
from .parse import read_config
from .tensors import gdn_entries, qwen_moe_entries, vector

LINEAR_KEYS = ("linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
               "linear_value_head_dim", "linear_conv_kernel_dim")
MOE_KEYS = ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")
LAYER_KINDS = ("linear_attention", "full_attention")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def _int(raw, key, default=None, minimum=1):
    val = raw.pop(key, default)
    if isinstance(val, bool) or not isinstance(val, int) or val < minimum:
        raise ConfigError(f"config field {key}={val!r} must be an integer >= {minimum}")
    return val


def linear_layer_flags(raw: dict, target: int) -> tuple:
    """Per target layer, whether it is linear attention: from `layer_types`, else
    `full_attention_interval`, else (with `linear_*` dims given) transformers' default
    interval 4, else none. Both keys given must agree."""
    types = raw.pop("layer_types", None)
    interval = raw.pop("full_attention_interval", None)
    if interval is not None:
        interval = _int({"full_attention_interval": interval}, "full_attention_interval")
    if types is None:
        if interval is None and not any(k in raw for k in LINEAR_KEYS):
            return (False,) * target
        n = 4 if interval is None else interval
        return tuple((i + 1) % n != 0 for i in range(target))
    if not isinstance(types, list) or len(types) != target:
        raise ConfigError(f"config field layer_types must be a list of {target} entries "
                          f"(one per target layer), got {types!r}")
    bad = sorted({t for t in types if t not in LAYER_KINDS}, key=str)
    if bad:
        raise ConfigError(f"config field layer_types holds {bad}: only {list(LAYER_KINDS)} "
                          "are layer kinds of this family")
    flags = tuple(t == "linear_attention" for t in types)
    if interval is not None and flags != tuple((i + 1) % interval != 0 for i in range(target)):
        raise ConfigError(f"config fields layer_types={types!r} and full_attention_interval="
                          f"{interval} disagree")
    return flags


def gdn_config(raw: dict) -> GDNConfig:
    missing = [k for k in LINEAR_KEYS if k not in raw]
    if missing:
        raise ConfigError(f"config.json has linear-attention layers but not {missing}")
    return GDNConfig(num_k_heads=_int(raw, "linear_num_key_heads"),
                     num_v_heads=_int(raw, "linear_num_value_heads"),
                     k_head_dim=_int(raw, "linear_key_head_dim"),
                     v_head_dim=_int(raw, "linear_value_head_dim"),
                     conv_kernel=_int(raw, "linear_conv_kernel_dim"))


def qwen_moe(raw: dict, target: int, num_mtp: int):
    """The MoEConfig of a Qwen3-Next / Qwen3.5 MoE config (None when num_experts is 0):
    per-layer flags over target + MTP layers (MTP layer k is numbered k, as vLLM builds it;
    `fit_to_checkpoint` corrects it from the tensor names)."""
    experts = raw.pop("num_experts", 0)
    if experts in TRIVIAL:
        for key in MOE_KEYS:
            raw.pop(key, None)
        return None
    experts = _int({"num_experts": experts}, "num_experts")
    step = _int(raw, "decoder_sparse_step", 1)
    only = raw.pop("mlp_only_layers", []) or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ConfigError(f"config field mlp_only_layers={only!r} must be a list of layer "
                          "indices")
    norm = raw.pop("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise ConfigError(f"config field norm_topk_prob={norm!r} must be true or false")

    def is_moe(i):
        return i not in only and (i + 1) % step == 0

    shared = _int(raw, "shared_expert_intermediate_size", 0, minimum=0)
    return MoEConfig(num_experts=experts, top_k=_int(raw, "num_experts_per_tok"),
                     intermediate_size=_int(raw, "moe_intermediate_size"), router="softmax",
                     score_bias=False, norm_topk_prob=norm, shared_intermediate_size=shared,
                     shared_gate=shared > 0,
                     layers=tuple(is_moe(i) for i in range(target))
                     + tuple(is_moe(k) for k in range(num_mtp)))


class Qwen3Next(Family):
    name = "qwen3_next"
    model_types = ("qwen3_next",)
    architecture = "Qwen3NextForCausalLM"
    moe = True
    gdn = True
    partial_rotary_factor = 0.25
    config_defaults = {"qk_norm": True, "norm_offset": 1.0}
    mtp = MTPWiring(concat_order="embed_first", zero_embed_at_pos0=False,
                    hidden_from="post_norm", output_hidden="post_norm", shared_input=True)
    mtp_prefix = "mtp.layers.{k}."
    mtp_input = None
    mtp_shared_input = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                        "mtp.fc.weight", "mtp.norm.weight")
    fused_qkvz = True  # in_proj_qkvz / in_proj_ba (Qwen3.5: in_proj_qkv, _z, _b, _a)
    stacked_experts = False  # mlp.experts.{e}.* (Qwen3.5-MoE: experts.gate_up_proj)

    def translate(self, raw, mtp_layers):
        target = raw.get("num_hidden_layers")
        if not isinstance(target, int) or target < 1:
            return raw, {}  # the common parser names the bad field
        if mtp_layers is not None:  # counted by the loader (config.json does not say)
            raw.pop("mtp_num_hidden_layers", None)
            raw["num_nextn_predict_layers"] = mtp_layers
        num_mtp = raw.get("mtp_num_hidden_layers", raw.get("num_nextn_predict_layers", 0))
        num_mtp = num_mtp if isinstance(num_mtp, int) and num_mtp >= 0 else 0
        extra: dict = {}
        flags = linear_layer_flags(raw, target)
        if any(flags):
            extra["gdn"] = gdn_config(raw)
            extra["linear_layers"] = flags + (False,) * num_mtp
        else:
            for key in LINEAR_KEYS:  # transformers writes its defaults whatever the layers
                raw.pop(key, None)
        gate = raw.pop("attn_output_gate", True)
        if not isinstance(gate, bool):
            raise ConfigError(f"config field attn_output_gate={gate!r} must be true or false")
        extra["attention_gate"] = "element" if gate else None
        dedicated = raw.pop("mtp_use_dedicated_embeddings", False)
        if dedicated not in (False, None):
            raise ConfigError("config field mtp_use_dedicated_embeddings=true (an MTP "
                              "embedding of its own) is not implemented")
        moe = qwen_moe(raw, target, num_mtp)
        if moe is not None:
            extra["moe"] = moe
        return raw, extra

    def export(self, cfg, out):
        out = super().export(dataclasses.replace(cfg, moe=None), out)
        out["mtp_num_hidden_layers"] = out.pop("num_nextn_predict_layers")
        out["attn_output_gate"] = cfg.attention_gate == "element"
        if cfg.linear_layers:
            g = cfg.gdn
            out["layer_types"] = [LAYER_KINDS[0] if cfg.is_linear(i) else LAYER_KINDS[1]
                                  for i in range(cfg.num_layers)]
            out.update(linear_num_key_heads=g.num_k_heads, linear_num_value_heads=g.num_v_heads,
                       linear_key_head_dim=g.k_head_dim, linear_value_head_dim=g.v_head_dim,
                       linear_conv_kernel_dim=g.conv_kernel)
        if cfg.moe is not None:
            m = cfg.moe
            dense = [i for i in range(cfg.num_layers) if not m.is_moe_layer(i)]
            out.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k,
                       moe_intermediate_size=m.intermediate_size,
                       shared_expert_intermediate_size=m.shared_size,
                       norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=1,
                       mlp_only_layers=dense)
        return out

    def layer_entries(self, cfg, layer, path, prefix, *, post_attn_norm="post_attention_layernorm"):
        if not cfg.is_linear(layer):
            return super().layer_entries(cfg, layer, path, prefix, post_attn_norm=post_attn_norm)
        spec = cfg.layer_spec(layer)
        d = cfg.hidden_size
        es = [vector(path + ("input_norm", "weight"), prefix + "input_layernorm.weight", d),
              vector(path + ("post_attn_norm", "weight"), prefix + post_attn_norm + ".weight",
                     d)]
        es += gdn_entries(spec.attention, d, path + ("attn",), prefix + "linear_attn.",
                          fused_qkvz=self.fused_qkvz)
        return es + self.ffn_entries(spec, d, path, prefix)

    def ffn_entries(self, spec, d, path, prefix):
        if spec.is_moe:
            return qwen_moe_entries(spec.ffn, d, path + ("mlp",), prefix + "mlp.",
                                    stacked=self.stacked_experts)
        return super().ffn_entries(spec, d, path, prefix)

    def fit_to_checkpoint(self, cfg, names, path):
        """The MTP layer count where config.json leaves it out (the published Qwen3-Next
        does): the `mtp.layers.{k}.` prefixes; and whether each MTP layer is MoE, as its
        tensors say (vLLM and transformers number the MTP layer differently for
        `mlp_only_layers` / `decoder_sparse_step`)."""
        if not cfg.num_mtp_modules:
            ks = {int(m.group(1)) for m in map(_MTP_LAYER.match, names) if m}
            raw = read_config(path)
            said = any(k in raw or k in (raw.get("text_config") or {})
                       for k in ("mtp_num_hidden_layers", "num_nextn_predict_layers"))
            if ks and not said:
                cfg = self.parse(raw, mtp_layers=max(ks) + 1)
        m = cfg.moe
        if m is None or not cfg.num_mtp_modules:
            return cfg
        flags = list(m.layers)
        for k in range(cfg.num_mtp_modules):
            router = self.mtp_prefix.format(k=k, layer=cfg.num_layers + k) + "mlp.gate.weight"
            flags[cfg.num_layers + k] = router in names
        return dataclasses.replace(cfg, moe=dataclasses.replace(m, layers=tuple(flags)))
