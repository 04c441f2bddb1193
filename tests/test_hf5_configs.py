"""config.json as transformers >= 5 saves it, for every family transformers has a class
for (tests/fixtures/hf5_configs, written by tests/fixtures/make_hf5_configs.py): each
parses, with the facts its sizes give, and a derived field that disagrees with the rest
is refused naming both values. Step-3.5-Flash's saved form (its golden fixture's config
through transformers' Step3p7TextConfig) reads as the published form does, and the golden
checkpoint loaded with it still matches transformers' logits."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mtp_jax.config import ConfigError
from mtp_jax.models import from_hf

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf5_configs"
STEP_GOLDEN = Path(__file__).resolve().parent / "golden" / "step3p5_flash"
# family -> (head_dim, MLA, MoE, target layers, sliding windows)
FACTS = {
    "deepseek_v3": (16, True, True, 3, (None, None, None)),
    "glm4_moe": (16, False, True, 3, (None, None, None)),
    "glm4_moe_lite": (16, True, True, 3, (None, None, None)),
    "qwen3_next": (16, False, False, 2, (None, None)),
    "mimo_v2_flash": (24, False, True, 3, (None, 32, 32)),
    "mimo": (16, False, False, 2, (None, None)),
    "step3p5": (16, False, True, 4, (None, 4, 4, 4)),
}
# facts apart from the small sizes the rest share (step3p5: the golden fixture's)
OTHER = {"step3p5": dict(vocab_size=150, num_mtp_modules=3)}


def raw(family: str) -> dict:
    return json.loads((FIXTURES / f"{family}.json").read_text())


def test_every_fixture_has_its_facts():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(FACTS)


@pytest.mark.parametrize("family", sorted(FACTS))
def test_transformers5_config_parses(family):
    head_dim, mla, moe, layers, windows = FACTS[family]
    cfg = from_hf(raw(family))
    other = OTHER.get(family, {})
    assert cfg.layout == family and cfg.hidden_size == 64
    assert cfg.vocab_size == other.get("vocab_size", 128)
    assert cfg.head_dim == head_dim and cfg.num_layers == layers
    assert (cfg.mla is not None) == mla and (cfg.moe is not None) == moe
    assert cfg.sliding_windows == windows
    assert cfg.num_mtp_modules == other.get("num_mtp_modules", 1)
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


def test_qwen3_next_inert_fields_count_where_they_matter():
    """The linear-attention / MoE defaults transformers writes are dropped for a model that
    has neither, and read where a layer is linear attention / has experts."""
    assert from_hf(raw("qwen3_next")).gdn is None
    hybrid = raw("qwen3_next")
    hybrid["layer_types"] = ["linear_attention", "full_attention"]
    cfg = from_hf(hybrid)
    assert cfg.linear_layers == (True, False, False)
    assert (cfg.gdn.num_k_heads, cfg.gdn.num_v_heads, cfg.gdn.k_head_dim) == (16, 32, 128)
    bad = raw("qwen3_next")
    bad["num_experts"] = 4  # with transformers' moe_intermediate_size 0
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        from_hf(bad)


def step_hub() -> dict:
    return json.loads((STEP_GOLDEN / "config.json").read_text())


def test_step3p5_saved_form_reads_as_the_published_form():
    saved, hub = from_hf(raw("step3p5")), from_hf(step_hub())
    for f in dataclasses.fields(hub):
        assert getattr(saved, f.name) == getattr(hub, f.name), f.name
    assert saved.layer_num_heads == (None,) + (6,) * 6 and saved.layer_rope_scaled
    assert saved.mtp_sliding_windows == (4, 4, 4) and saved.query_pre_attn_scalar is None


@pytest.mark.parametrize("change, pieces", [
    # the duplicated spellings of one fact
    ({"num_attention_groups": 1}, ["num_attention_groups=1", "num_key_value_heads=2"]),
    ({"moe_num_experts": 4}, ["moe_num_experts=4", "n_routed_experts=8"]),
    ({"moe_layers_enum": "1,2"}, ["moe_layers_enum='1,2'", "[1, 2]", "[1, 2, 3]"]),
    ({"attention_other_setting": {"num_attention_heads": 4}},
     ["num_sliding_attention_heads=6", "num_attention_heads=4"]),
    ({"rope_theta": 10000.0}, ["rope_theta=10000.0", "5000000.0"]),
    # derived fields: per_layer_config from the kinds and head counts, yarn_only_types from
    # the scaled kinds of rope_parameters, the MTP part of a full-length list
    ({"num_sliding_attention_heads": 2}, ["per_layer_config.1.num_attention_heads=6",
                                          "num_sliding_attention_heads=2"]),
    ({"yarn_only_types": ["sliding_attention"]},
     ["yarn_only_types=['sliding_attention']", "['full_attention']"]),
    ({"layer_types": ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]},
     ["'full_attention']", "mtp_layer_types=['sliding_attention'"]),
])
def test_step3p5_saved_form_disagreeing_fields_are_refused_naming_both(change, pieces):
    with pytest.raises(ConfigError) as e:
        from_hf({**raw("step3p5"), **change})
    for piece in pieces:
        assert piece in str(e.value)


@pytest.mark.parametrize("change, field", [
    ({"per_layer_config": {"1": {"num_attention_heads": 6, "num_key_value_heads": 1}}},
     "num_key_value_heads"),
    ({"mtp_mlp_layer_types": ["dense", "moe", "dense"]}, "moe"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"sink": True}, "sink"),
])
def test_step3p5_saved_form_keys_we_do_not_implement_stay_refused(change, field):
    with pytest.raises(ConfigError, match=field):
        from_hf({**raw("step3p5"), **change})


def test_step3p5_saved_form_rope_parameters_one_scaling_only():
    bad = raw("step3p5")
    bad["rope_parameters"] = dict(bad["rope_parameters"], sliding_attention=dict(
        bad["rope_parameters"]["full_attention"], factor=4.0, rope_theta=1e4))
    with pytest.raises(ConfigError, match="one rope_scaling"):
        from_hf(bad)


def test_step3p5_query_pre_attn_scalar_sets_the_softmax_scale():
    from mtp_jax.models import to_hf
    cfg = from_hf({**raw("step3p5"), "query_pre_attn_scalar": 32})
    assert cfg.query_pre_attn_scalar == 32.0
    assert cfg.layer_spec(1).attention.sm_scale == pytest.approx(32 ** -0.5)
    assert from_hf(json.loads(json.dumps(to_hf(cfg)))) == cfg


def test_step3p5_golden_checkpoint_with_the_saved_config_matches_transformers(tmp_path):
    """The golden checkpoint with its config.json swapped for the saved form: the same
    logits as transformers' (tests/test_golden.py's bound)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mtp_jax import load
    from mtp_jax.mtp import forward_train

    for name in ("model.safetensors", "golden.npz"):
        shutil.copy(STEP_GOLDEN / name, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps(raw("step3p5")))
    model = load(str(tmp_path))
    assert model.config == from_hf(step_hub())
    gold = np.load(tmp_path / "golden.npz")
    graphdef, params = nnx.split(model.module())
    run = jax.jit(lambda params, tokens: forward_train(nnx.merge(graphdef, params), tokens))
    logits, outs = run(params, jnp.asarray(gold["prompt"][None], jnp.int32))
    np.testing.assert_allclose(np.asarray(logits[0]), gold["logits"], rtol=1e-4, atol=1e-4)
    assert len(outs) == 3
    for k, out in enumerate(outs):
        np.testing.assert_allclose(np.asarray(out[0]), gold[f"mtp_logits_{k}"], rtol=1e-4,
                                   atol=1e-4)
