"""DeepSeek-V3.2 / V3.2-Exp (`DeepseekV32ForCausalLM`, model_type `deepseek_v32`): DeepSeek-V3
(MLA, sigmoid-routed MoE, FP8 blocks, its MTP layer) with DeepSeek Sparse Attention on every
MLA layer: a lightning indexer per layer picks the `index_topk` tokens each query attends to
(config.DSAConfig, mtp_jax/dsa.py).

Configs come as published (DeepSeek-V3 keys plus `index_n_heads`, `index_head_dim`,
`index_topk`; `quantization_config.scale_fmt` "ue8m0" reads as the plain block scales it
stores) or as transformers >= 5 saves them (`layer_types` all "deepseek_sparse_attention",
`mlp_layer_types`, `rope_parameters`, `qk_head_dim`). The indexer's RoPE is rotate-half
(`indexer_rope_interleave` false), MLA's interleaved as in DeepSeek-V3.

Tensors: DeepSeek-V3's, plus per MLA layer (the MTP layer at `model.layers.{N}` too)
`self_attn.indexer.{wq_b, wk, weights_proj}.weight` and `self_attn.indexer.k_norm.{weight,
bias}` (a LayerNorm). `DSAFamily` is the part GLM-5 (glm_moe_dsa.py) shares.
"""

from __future__ import annotations

from ..config import ConfigError, DSAConfig
from .deepseek_v3 import DeepseekV3
from .fields import exact_list
from .glm4_moe_lite import Glm4MoeLite
from .tensors import indexer_entries

# config.json keys of the indexer, read here (the generic parser never sees them)
DSA_KEYS = ("index_n_heads", "index_head_dim", "index_topk", "indexer_rope_interleave",
            "indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")


class DSAFamily:
    """Mixin for a family whose MLA layers carry DeepSeek Sparse Attention: reads and writes
    the indexer keys, names the indexer's tensors. Put it before the family it extends."""

    # transformers' defaults for configs that leave a key out
    index_defaults = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
    indexer_rope_interleave = False

    def translate(self, raw, mtp_layers):
        layers = raw.get("num_hidden_layers")
        types = raw.pop("layer_types", None)
        if types is not None:
            if not isinstance(types, list) or set(types) != {"deepseek_sparse_attention"}:
                raise ConfigError(f"config field layer_types={types!r}: every layer of "
                                  f"model_type {raw.get('model_type')} is "
                                  "deepseek_sparse_attention")
            if isinstance(layers, int) and len(types) < layers:
                exact_list(types, layers, "layer_types")
        # transformers >= 5: mlp_layer_types ("dense" first, then "sparse")
        raw, extra = Glm4MoeLite.translate(self, raw, mtp_layers)
        raw, more = super().translate(raw, mtp_layers)
        extra = {**extra, **more, "dsa": self.parse_dsa(raw, layers)}
        return raw, extra

    def parse_dsa(self, raw: dict, layers) -> DSAConfig:
        vals = {k: raw.pop(k) for k in DSA_KEYS if k in raw}
        if "index_topk" in vals and vals["index_topk"] in (None, 0, False):
            raise ConfigError(f"config field index_topk={vals['index_topk']!r} must be an "
                              "integer >= 1 (the tokens each query attends to)")
        interleave = vals.get("indexer_rope_interleave", self.indexer_rope_interleave)
        if not isinstance(interleave, bool):
            raise ConfigError(f"config field indexer_rope_interleave={interleave!r} must be "
                              "true or false")
        return DSAConfig(
            index_n_heads=vals.get("index_n_heads", self.index_defaults["index_n_heads"]),
            index_head_dim=vals.get("index_head_dim", self.index_defaults["index_head_dim"]),
            index_topk=vals.get("index_topk", self.index_defaults["index_topk"]),
            rope_interleave=interleave, shared=shared_layers(vals, layers))

    def export(self, cfg, out):
        out = super().export(cfg, out)
        d = cfg.dsa
        if d is not None:
            out.update(index_n_heads=d.index_n_heads, index_head_dim=d.index_head_dim,
                       index_topk=d.index_topk, indexer_rope_interleave=d.rope_interleave)
            if d.shared:
                out["indexer_types"] = ["shared" if s else "full"
                                        for s in d.shared[:cfg.num_layers]]
        return out

    def layer_entries(self, cfg, layer, path, prefix, **kw):
        es = super().layer_entries(cfg, layer, path, prefix, **kw)
        att = cfg.layer_spec(layer).attention
        if getattr(att, "indexer", None) is not None and not att.index_shared:
            es += indexer_entries(att, cfg.hidden_size, path + ("attn", "indexer"),
                                  prefix + "self_attn.indexer.")
        return es


def shared_layers(vals: dict, layers) -> tuple:
    """Per target layer, whether it reuses the previous layer's selection (GLM's
    `indexer_types` "shared"), from `indexer_types`, `index_topk_pattern` ("F" / "S" per
    layer) or the `index_topk_freq` / `index_skip_topk_offset` schedule, as transformers
    derives them; () when every layer runs its own indexer."""
    types = vals.get("indexer_types")
    pattern = vals.get("index_topk_pattern")
    if types is None and pattern is not None:
        if isinstance(pattern, str):
            bad = set(pattern) - {"F", "S"}
            if bad:
                raise ConfigError(f"config field index_topk_pattern={pattern!r}: only F "
                                  "(full) and S (shared) per layer")
            types = ["full" if c == "F" else "shared" for c in pattern]
        else:
            types = pattern
    if types is None and isinstance(layers, int) and (
            "index_topk_freq" in vals or "index_skip_topk_offset" in vals):
        freq, offset = vals.get("index_topk_freq", 1), vals.get("index_skip_topk_offset", 2)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (freq, offset)):
            raise ConfigError(f"config fields index_topk_freq={freq!r} and "
                              f"index_skip_topk_offset={offset!r} must be integers")
        freq = max(freq, 1)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                 for i in range(layers)]
    if types is None:
        return ()
    if isinstance(layers, int):
        types = exact_list(types, layers, "indexer_types")
    if not isinstance(types, (list, tuple)) or set(types) - {"full", "shared"}:
        raise ConfigError(f"config field indexer_types={types!r}: only \"full\" and "
                          "\"shared\" per layer")
    return tuple(t == "shared" for t in types)


class DeepseekV32(DSAFamily, DeepseekV3):
    name = "deepseek_v32"
    model_types = ("deepseek_v32",)
    architecture = "DeepseekV32ForCausalLM"


__all__ = ["DSAFamily", "DeepseekV32", "shared_layers"]
