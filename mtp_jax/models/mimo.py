"""MiMo (Xiaomi MiMo-7B): a Qwen2-style dense target (QKV bias, GQA, RoPE) with MTP layers
under `model.mtp_layers.{k}.*`. The dense Llama / Qwen2 decoder of every other family is
this one's target.

MTP wiring: concat(hidden, embedding), the embedding zeroed at position 0, the target's
normed hidden in, each layer hands on its final_layernorm output; the target's head.
"""

from __future__ import annotations

from .base import Family, MTPWiring


class Mimo(Family):
    name = "mimo"
    model_types = ("mimo",)
    architecture = "MiMoForCausalLM"
    config_defaults = {"attention_bias": True}
    mtp = MTPWiring(concat_order="hidden_first", zero_embed_at_pos0=True,
                    hidden_from="post_norm", output_hidden="post_norm")
    mtp_prefix = "model.mtp_layers.{k}."
    mtp_input = ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
                 "final_layernorm.weight")
