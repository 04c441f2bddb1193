"""Qwen3-Next (`Qwen3NextForCausalLM`), its dense partial support: q/k norm, zero-centred
norms (y = x_hat * (1 + w)), partial RoPE; gated attention and Gated DeltaNet layers are
refused by the parser (`attn_output_gate`, `linear_*`, `full_attention_interval`).

MTP layers under `mtp.layers.{k}.*` with one input side for all of them (`mtp.fc`,
`mtp.pre_fc_norm_{embedding,hidden}`, `mtp.norm`): concat(embedding, hidden), no zeroing
at position 0, normed hiddens in and out; the target's head.
"""

from __future__ import annotations

from .base import Family, MTPWiring

# What transformers' Qwen3NextConfig writes with its defaults whatever the layers are: inert
# when no layer is linear attention (layer_types) / when no layer has experts.
LINEAR_KEYS = ("linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
               "linear_value_head_dim", "linear_conv_kernel_dim")
MOE_KEYS = ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")


class Qwen3Next(Family):
    name = "qwen3_next"
    model_types = ("qwen3_next",)
    architecture = "Qwen3NextForCausalLM"
    config_defaults = {"qk_norm": True, "norm_offset": 1.0}
    mtp = MTPWiring(concat_order="embed_first", zero_embed_at_pos0=False,
                    hidden_from="post_norm", output_hidden="post_norm", shared_input=True)
    mtp_prefix = "mtp.layers.{k}."
    mtp_input = None
    mtp_shared_input = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                        "mtp.fc.weight", "mtp.norm.weight")

    def translate(self, raw, mtp_layers):
        """Drop the linear-attention and MoE fields transformers >= 5 writes for a model
        that has neither: every layer full attention (layer_types), num_experts 0. Any
        other value stays for the parser to refuse."""
        types = raw.get("layer_types")
        if isinstance(types, list) and "linear_attention" not in types:
            for key in LINEAR_KEYS:
                raw.pop(key, None)
        if raw.get("num_experts", None) == 0:
            raw.pop("num_experts")
            for key in MOE_KEYS:
                raw.pop(key, None)
        return raw, {}
