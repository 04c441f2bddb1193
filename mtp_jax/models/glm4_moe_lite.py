"""GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`, model_type `glm4_moe_lite`): GLM-4.5's MoE and
MTP layer over DeepSeek-V3's multi-head latent attention (interleaved RoPE on the rope
dims, full rotary), `first_k_dense_replace` dense layers.

Configs come as published (DeepSeek-V3 keys) or as transformers >= 5 saves them: the dense
layers as `mlp_layer_types` ("dense" / "sparse" per target layer, dense ones first),
`qk_head_dim` (nope + rope: checked with every MLA family's, fields.parse_mla),
`rope_parameters`. The MTP layer is GLM's: its own embed_tokens / shared_head.head where
the checkpoint has them, else the target's (`Glm4Moe.fit_to_checkpoint`).
"""

from __future__ import annotations

from ..config import ConfigError
from .fields import exact_list
from .glm4_moe import Glm4Moe


class Glm4MoeLite(Glm4Moe):
    name = "glm4_moe_lite"
    model_types = ("glm4_moe_lite",)
    architecture = "Glm4MoeLiteForCausalLM"
    mla = True
    partial_rotary_factor = 1.0

    def translate(self, raw, mtp_layers):
        layers = raw.get("num_hidden_layers")
        mlp_types = raw.pop("mlp_layer_types", None)
        if mlp_types is not None:
            types = exact_list(mlp_types, layers, "mlp_layer_types")
            dense = types.index("sparse") if "sparse" in types else len(types)
            if set(types) - {"dense", "sparse"} or "dense" in types[dense:]:
                raise ConfigError(f"config field mlp_layer_types={list(types)!r}: only dense "
                                  "layers first, then sparse ones, are supported")
            given = raw.get("first_k_dense_replace")
            if given is not None and given != dense:
                raise ConfigError(f"config fields mlp_layer_types ({dense} dense layers) and "
                                  f"first_k_dense_replace={given!r} disagree")
            raw["first_k_dense_replace"] = dense
        return raw, {}
