"""config.json as transformers >= 5 saves it, for every family transformers has a class
for (tests/fixtures/hf5_configs, written by tests/fixtures/make_hf5_configs.py): each
parses, with the facts its sizes give, and a derived field that disagrees with the rest
is refused naming both values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtp_jax.config import ConfigError
from mtp_jax.models import from_hf

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf5_configs"
# family -> (head_dim, MLA, MoE, target layers, sliding windows)
FACTS = {
    "deepseek_v3": (16, True, True, 3, (None, None, None)),
    "glm4_moe": (16, False, True, 3, (None, None, None)),
    "glm4_moe_lite": (16, True, True, 3, (None, None, None)),
    "qwen3_next": (16, False, False, 2, (None, None)),
    "mimo_v2_flash": (24, False, True, 3, (None, 32, 32)),
    "mimo": (16, False, False, 2, (None, None)),
}


def raw(family: str) -> dict:
    return json.loads((FIXTURES / f"{family}.json").read_text())


def test_every_fixture_has_its_facts():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(FACTS)


@pytest.mark.parametrize("family", sorted(FACTS))
def test_transformers5_config_parses(family):
    head_dim, mla, moe, layers, windows = FACTS[family]
    cfg = from_hf(raw(family))
    assert cfg.layout == family and cfg.hidden_size == 64 and cfg.vocab_size == 128
    assert cfg.head_dim == head_dim and cfg.num_layers == layers
    assert (cfg.mla is not None) == mla and (cfg.moe is not None) == moe
    assert cfg.sliding_windows == windows and cfg.num_mtp_modules == 1
    if mla:
        assert cfg.mla.qk_head_dim == 16 and cfg.mla.rope_interleave


@pytest.mark.parametrize("family, field, value, pieces", [
    # qk_head_dim must be qk_nope_head_dim + qk_rope_head_dim, for every MLA family
    ("deepseek_v3", "qk_head_dim", 20, ["qk_head_dim=20", "8 + 8 = 16"]),
    ("glm4_moe_lite", "qk_head_dim", 12, ["qk_head_dim=12", "8 + 8 = 16"]),
    ("deepseek_v3", "head_dim", 12, ["head_dim=12", "qk_rope_head_dim 8", "16"]),
    ("glm4_moe_lite", "mlp_layer_types", ["dense", "dense", "sparse"],
     ["2 dense layers", "first_k_dense_replace=1"]),
    # layer_types must be what use_sliding_window / max_window_layers give
    ("mimo", "layer_types", ["full_attention", "sliding_attention"],
     ["sliding_attention", "use_sliding_window=False", "full_attention"]),
])
def test_disagreeing_derived_field_is_refused_naming_both(family, field, value, pieces):
    bad = raw(family)
    bad[field] = value
    if field == "mlp_layer_types":
        bad["first_k_dense_replace"] = 1
    if field == "layer_types":
        bad["sliding_window"] = 32
    with pytest.raises(ConfigError) as e:
        from_hf(bad)
    for piece in pieces:
        assert piece in str(e.value)


def test_qwen3_next_inert_fields_stay_refused_where_they_matter():
    """The linear-attention / MoE defaults transformers writes are dropped only for a model
    that has neither."""
    bad = raw("qwen3_next")
    bad["layer_types"] = ["linear_attention", "full_attention"]
    with pytest.raises(ConfigError, match="linear"):
        from_hf(bad)
    bad = raw("qwen3_next")
    bad["num_experts"] = 4
    with pytest.raises(ConfigError, match="MoE"):
        from_hf(bad)
