"""Qwen3.5 / Qwen3.6, dense and MoE (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`, and their text models): Qwen3-Next's hybrid of
Gated DeltaNet and gated full attention with its MTP layer, published as a multimodal
model.

What differs from Qwen3-Next (qwen3_next.py, which this subclasses):
- config.json wraps the language model in `text_config` (the vision tower's
  `vision_config` and the image / video token ids are not the language model's);
- tensors under `model.language_model.*` (the text model saved alone: `model.*`), the
  vision tower's `model.visual.*` left unread;
- the GDN projections apart: `in_proj_qkv` (q, k, v of all heads), `in_proj_z`,
  `in_proj_b`, `in_proj_a`;
- MoE experts stacked (`mlp.experts.gate_up_proj` [e, 2f, d], `mlp.experts.down_proj`)
  and always renormalised;
- M-RoPE (`mrope_section`): with text-only prompts the three position components are one
  1-D position, so it is the plain partial RoPE; the sections must cover its rotary dims.
"""

from __future__ import annotations

import re

from ..config import ConfigError
from .base import aliases
from .qwen3_next import Qwen3Next

# keys of the multimodal wrapper that are not the language model's math
WRAPPER_KEYS = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                "vision_end_token_id", "text_config")


class Qwen3_5(Qwen3Next):
    name = "qwen3_5"
    model_types = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
    architecture = "Qwen3_5ForCausalLM"
    fused_qkvz = False
    stacked_experts = True
    tensor_aliases = aliases((r"^model\.language_model\.", "model."))
    ignored_tensors = (re.compile(r"^model\.visual\."),)

    def translate(self, raw, mtp_layers):
        text = raw.get("text_config")
        if text is not None:
            if not isinstance(text, dict):
                raise ConfigError(f"config field text_config={text!r} must be an object")
            top_tie = raw.get("tie_word_embeddings")
            raw = {k: v for k, v in raw.items() if k not in WRAPPER_KEYS}
            raw.update(text)
            if top_tie is not None and text.get("tie_word_embeddings", top_tie) != top_tie:
                raise ConfigError("tie_word_embeddings differs between config.json and its "
                                  "text_config")
        dtype = raw.pop("mamba_ssm_dtype", "float32")
        if dtype not in ("float32", "auto", None):
            raise ConfigError(f"config field mamba_ssm_dtype={dtype!r}: the recurrent state is "
                              "kept in float32 (the kernels take f32 states only)")
        _text_only_rope(raw)
        if "intermediate_size" not in raw and raw.get("num_experts"):
            # Qwen3.5-MoE has no dense layer and publishes no dense width: the field is
            # unused, given the expert width so the config stays whole
            raw["intermediate_size"] = raw.get("moe_intermediate_size")
        return super().translate(raw, mtp_layers)

    def to_hf(self, cfg):
        out = super().to_hf(cfg)
        moe = cfg.moe is not None
        out["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
        out["architectures"] = ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"]
        return out


def _text_only_rope(raw: dict) -> None:
    """Drop M-RoPE's sections from `rope_parameters` (text-only prompts: one 1-D position
    for every section) once they are seen to cover the rotary dims."""
    rp = raw.get("rope_parameters")
    if not isinstance(rp, dict) or "mrope_section" not in rp:
        return
    rp = dict(rp)
    section = rp.pop("mrope_section")
    rp.pop("mrope_interleaved", None)
    head_dim = raw.get("head_dim")
    partial = rp.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    if not (isinstance(section, list) and all(isinstance(x, int) for x in section)):
        raise ConfigError(f"rope_parameters.mrope_section={section!r} must be a list of "
                          "integers")
    if isinstance(head_dim, int) and isinstance(partial, (int, float)):
        rotary = int(head_dim * partial)
        if 2 * sum(section) != rotary:
            raise ConfigError(f"rope_parameters.mrope_section={section} covers "
                              f"{2 * sum(section)} rotary dims, not head_dim * "
                              f"partial_rotary_factor = {rotary}")
    raw["rope_parameters"] = rp
