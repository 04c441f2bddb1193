"""GLM-5 (`GlmMoeDsaForCausalLM`, model_type `glm_moe_dsa`): GLM-4.7-Flash's MLA + MoE + MTP
layer (glm4_moe_lite.py) with DeepSeek Sparse Attention (deepseek_v32.py's `DSAFamily`).

As DeepSeek-V3.2 but: the indexer's RoPE rotates interleaved pairs (`indexer_rope_interleave`,
true unless the config says otherwise; the loader permutes them to halves), 32 index heads
by default, and a layer may reuse the previous layer's selection instead of running an
indexer (`indexer_types` "shared", or the `index_topk_pattern` / `index_topk_freq` +
`index_skip_topk_offset` schedule transformers derives it from); such a layer has no
`self_attn.indexer.*` tensors. The MTP layer at `model.layers.{N}` runs its own indexer.
"""

from __future__ import annotations

from .deepseek_v32 import DSAFamily
from .glm4_moe_lite import Glm4MoeLite


class GlmMoeDsa(DSAFamily, Glm4MoeLite):
    name = "glm_moe_dsa"
    model_types = ("glm_moe_dsa",)
    architecture = "GlmMoeDsaForCausalLM"
    index_defaults = {"index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048}
    indexer_rope_interleave = True


__all__ = ["GlmMoeDsa"]
