"""DeepSeek-V3 / R1 / V3.1 (`DeepseekV3ForCausalLM`): multi-head latent attention
(`MLAConfig`) or GQA blocks, dense or MoE FFNs (sigmoid router with score-correction bias,
group-limited top-k, routed scaling, shared experts, `first_k_dense_replace` dense layers);
FP8 block-scaled checkpoints (`quantization_config`).

MTP layer k is `model.layers.{N + k}.*` (`enorm`, `hnorm`, `eh_proj`, its own
`embed_tokens` and `shared_head.{norm,head}`): concat(embedding, hidden), the embedding
zeroed at position 0, the target's normed hidden in, each layer hands on its block output
before the final norm. The tensor names are the `Family` defaults.
"""

from __future__ import annotations

from .base import Family, MTPWiring
from .fields import router_fields

# DeepSeek-style MTP layers: also GLM-4.5's
DEEPSEEK_MTP = MTPWiring(concat_order="embed_first", zero_embed_at_pos0=True,
                         hidden_from="post_norm", output_hidden="pre_norm", own_head=True,
                         own_embed=True)


class DeepseekV3(Family):
    name = "deepseek_v3"
    model_types = ("deepseek_v3",)
    architecture = "DeepseekV3ForCausalLM"
    moe = True
    mla = True
    mtp = DEEPSEEK_MTP

    def export(self, cfg, out):
        out = super().export(cfg, out)
        if cfg.moe is not None:
            out.update(router_fields(cfg.moe), moe_layer_freq=cfg.moe.layer_freq)
        return out
