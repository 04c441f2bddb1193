"""Model families: one file per family, a registry by config.json `model_type`.

`from_hf(path or dict)` reads an HF config.json into a `ModelConfig` (the family found by
its `model_type`), `to_hf(cfg)` writes one back, `family(layout)` gives the `Family` of a
`ModelConfig.layout`: its config reading and writing, its tensor names both ways
(`Family.entries`) and its MTP wiring. The interface is models/base.py; generic pieces
are parse.py (the config parser), fields.py (config keys several families share) and
tensors.py (tensor entries: GQA, MLA, SwiGLU, MoE).

Families (`ModelConfig.layout`):

- ``mimo``          MiMo (Qwen2 target, QKV bias, ``model.mtp_layers.{i}.*``), hidden first.
- ``deepseek_v3``   DeepSeek-V3 / R1 / V3.1: MLA or GQA, dense or MoE FFNs, FP8 blocks.
- ``glm4_moe``      GLM-4.5 / 4.6 / 4.7: DeepSeek naming, GQA with QKV bias, partial RoPE.
- ``qwen3_next``    Qwen3-Next: Gated DeltaNet + gated attention, MoE, ``mtp.{fc, pre_fc_norm_*,
                    layers.N, norm}``.
- ``qwen3_5``       Qwen3.5 / 3.6 dense and MoE: Qwen3-Next's layers in a multimodal wrapper.
- ``step3p5``       Step-3.5-Flash (``shared_head`` per MTP layer, sliding MTP layers).
- ``mimo_v2_flash`` MiMo-V2-Flash (sinks, own sliding head counts, ``model.mtp.layers``).
- ``deepseek_v32``  DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention (indexer).
- ``glm_moe_dsa``   GLM-5: GLM-4.7-Flash's MLA + MoE with DeepSeek Sparse Attention.

Adding a model family
---------------------
1. One file, ``mtp_jax/models/<model_type>.py``: a `Family` subclass stating how the family
   differs from the defaults in base.py (which are DeepSeek-V3's names): `name`,
   `model_types`, `architecture`, `moe` / `mla` (its configs may hold them), `mtp` (an
   `MTPWiring`: concat order, position-0 zeroing, which hiddens go in and out, hidden
   source, own head / embedding), `config_defaults` / `config_switches`, and where its
   tensors are named otherwise, `mtp_prefix` / `mtp_input` / `mtp_head` /
   `tensor_aliases` / `ffn_entries`. A published key style of its own goes in `translate`
   (read) and `export` (write); facts only the tensor names tell, in `fit_to_checkpoint`.
   Subclass the nearest family to reuse it whole (e.g. GLM's MoE naming with MLA
   attention: subclass `Glm4Moe`, set `mla = True`; MLA and MoE tensors come from the
   layer specs, tensors.py).
2. One registry line below, in `FAMILIES`.
3. One golden fixture, ``tests/golden/<case>/`` (config.json, model.safetensors,
   golden.npz), written from transformers' own class on a tiny random config by a
   ``tests/golden/make_<name>.py`` script committed beside it (shared pieces in
   tests/golden/_golden_common.py; settings and versions in tests/golden/README.md).
   tests/test_golden.py takes every fixture folder as a case and checks logits, MTP
   outputs and greedy tokens (none, chain, eagle) against it without torch.
"""

from __future__ import annotations

from typing import Any, Optional

from ..config import ConfigError, ModelConfig, register_layout
from .base import Family
from .deepseek_v3 import DeepseekV3
from .deepseek_v32 import DeepseekV32
from .glm4_moe import Glm4Moe
from .glm4_moe_lite import Glm4MoeLite
from .glm_moe_dsa import GlmMoeDsa
from .mimo import Mimo
from .mimo_v2_flash import MimoV2Flash
from .parse import read_config
from .qwen3_5 import Qwen3_5
from .qwen3_next import Qwen3Next
from .step3p5 import Step3p5

FAMILIES = (
    Mimo(),
    DeepseekV3(),
    Glm4Moe(),
    Qwen3Next(),
    Step3p5(),
    MimoV2Flash(),
    Glm4MoeLite(),
    Qwen3_5(),
    DeepseekV32(),
    GlmMoeDsa(),
)
BY_MODEL_TYPE = {mt: f for f in FAMILIES for mt in f.model_types}
BY_LAYOUT = {f.name: f for f in FAMILIES}
for _f in FAMILIES:
    register_layout(_f.name, moe=_f.moe, mla=_f.mla, gdn=_f.gdn)


def family(layout: str) -> Family:
    """The family of a `ModelConfig.layout`."""
    return BY_LAYOUT[layout]


def family_of(raw: dict) -> Family:
    """The family of a config.json dict, by its `model_type`."""
    mt = raw.get("model_type")
    if mt not in BY_MODEL_TYPE:
        raise ConfigError(f"model_type={mt!r} is not supported (supported: "
                          f"{', '.join(BY_MODEL_TYPE)})")
    return BY_MODEL_TYPE[mt]


def from_hf(path_or_dict: Any, *, mtp_layers: Optional[int] = None) -> ModelConfig:
    """Read an HF `config.json` (a path to the file or its folder, or the parsed dict).

    mtp_layers: the number of MTP layers where the config does not say (MiMo-V2-Flash
    publishes none; the loader counts them in the checkpoint)."""
    raw = read_config(path_or_dict)
    return family_of(raw).parse(raw, mtp_layers)


def to_hf(cfg: ModelConfig) -> dict:
    """The HF `config.json` dict for this config (used when exporting a checkpoint)."""
    return family(cfg.layout).to_hf(cfg)


__all__ = ["Family", "FAMILIES", "family", "family_of", "from_hf", "to_hf"]
