"""GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`): DeepSeek naming, GQA with QKV bias, optional
q/k norm (`use_qk_norm`), partial RoPE (default factor 0.5), sigmoid-routed MoE after
`first_k_dense_replace` dense layers (noaux_tc routing only).

MTP layers as DeepSeek-V3's. GLM-4.5 publishes each MTP layer's own embed_tokens and
shared_head.head; GLM-4.6 and later leave them out and share the target's: which one a
checkpoint is comes from its tensor names (`fit_to_checkpoint`); our exporter writes
`mtp_own_head` / `mtp_own_embed` in config.json.
"""

from __future__ import annotations

import dataclasses

from ..config import ConfigError
from .base import Family
from .deepseek_v3 import DEEPSEEK_MTP


class Glm4Moe(Family):
    name = "glm4_moe"
    model_types = ("glm4_moe",)
    architecture = "Glm4MoeForCausalLM"
    moe = True
    partial_rotary_factor = 0.5
    config_switches = {"use_qk_norm": "qk_norm", "mtp_own_head": "mtp_own_head",
                       "mtp_own_embed": "mtp_own_embed"}
    mtp = DEEPSEEK_MTP

    def check_topk_method(self, method):
        if method != "noaux_tc":
            raise ConfigError(f"config field topk_method={method!r}: GLM-4.5 routes with "
                              "noaux_tc only")

    def export(self, cfg, out):
        del out["qk_norm"]
        out.update(mtp_own_head=cfg.mtp_own_head, mtp_own_embed=cfg.mtp_own_embed,
                   use_qk_norm=cfg.qk_norm)
        return super().export(cfg, out)

    def fit_to_checkpoint(self, cfg, names, path):
        """Own MTP embed_tokens / shared_head.head where every MTP layer has them (else the
        strict check names the odd ones)."""
        if not cfg.num_mtp_modules:
            return cfg
        layers = [self.mtp_prefix.format(k=k, layer=cfg.num_layers + k)
                  for k in range(cfg.num_mtp_modules)]
        return dataclasses.replace(
            cfg, mtp_own_embed=all(p + "embed_tokens.weight" in names for p in layers),
            mtp_own_head=all(p + self.mtp_head in names for p in layers))
