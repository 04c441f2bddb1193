"""Qwen3-Next (`Qwen3NextForCausalLM`), its dense partial support: q/k norm, zero-centred
norms (y = x_hat * (1 + w)), partial RoPE; gated attention and Gated DeltaNet layers are
refused by the parser (`attn_output_gate`, `linear_*`, `full_attention_interval`).

MTP layers under `mtp.layers.{k}.*` with one input side for all of them (`mtp.fc`,
`mtp.pre_fc_norm_{embedding,hidden}`, `mtp.norm`): concat(embedding, hidden), no zeroing
at position 0, normed hiddens in and out; the target's head.
"""

from __future__ import annotations

from .base import Family, MTPWiring


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
