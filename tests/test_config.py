"""models.from_hf per layout, RoPE scaling parsing, and the validation errors of every
config dataclass (each error names the offending field)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from hf_fixtures import LAYOUTS, hf_config
from mtp_jax.config import ConfigError, EngineConfig, RopeScaling, SamplingParams, SpecConfig
from mtp_jax.models import from_hf, to_hf


# ------------------------------------------------------------------ layout facts
EXPECTED = {
    "mimo": dict(mtp_concat_order="hidden_first", mtp_zero_embed_at_pos0=True,
                 mtp_hidden_from="post_norm", mtp_output_hidden="post_norm",
                 mtp_own_head=False, mtp_own_embed=False, mtp_shared_input=False,
                 attention_bias=True, qk_norm=False, norm_offset=0.0, num_mtp_modules=2,
                 head_dim=8, partial_rotary_factor=1.0),
    "deepseek_v3": dict(mtp_concat_order="embed_first", mtp_zero_embed_at_pos0=True,
                        mtp_hidden_from="post_norm", mtp_output_hidden="pre_norm",
                        mtp_own_head=True, mtp_own_embed=True, mtp_shared_input=False,
                        attention_bias=False, qk_norm=False, norm_offset=0.0,
                        num_mtp_modules=3, head_dim=8, mtp_hidden_source="previous"),
    "qwen3_next": dict(mtp_concat_order="embed_first", mtp_zero_embed_at_pos0=False,
                       mtp_hidden_from="post_norm", mtp_output_hidden="post_norm",
                       mtp_own_head=False, mtp_own_embed=False, mtp_shared_input=True,
                       attention_bias=False, qk_norm=True, norm_offset=1.0,
                       num_mtp_modules=2, head_dim=16, partial_rotary_factor=0.25),
    "step3p5": dict(mtp_concat_order="embed_first", mtp_zero_embed_at_pos0=False,
                    mtp_hidden_from="pre_norm", mtp_output_hidden="pre_norm",
                    mtp_own_head=True, mtp_own_embed=False, mtp_shared_input=False,
                    qk_norm=True, norm_offset=1.0, num_mtp_modules=3, head_dim=16,
                    mtp_hidden_source="previous"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_from_hf_layout_facts(layout):
    cfg = from_hf(hf_config(layout))
    assert cfg.layout == layout
    got = {k: getattr(cfg, k) for k in EXPECTED[layout]}
    assert got == EXPECTED[layout]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (96, 32, 64)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.group_size) == (2, 4, 2, 2)
    assert cfg.dtype == "float32"
    assert len(cfg.sliding_windows) == cfg.num_layers
    assert len(cfg.mtp_sliding_windows) == cfg.num_mtp_modules


@pytest.mark.parametrize("layout", LAYOUTS)
def test_from_hf_reads_a_file_or_folder(layout, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config(layout)))
    want = from_hf(hf_config(layout))
    assert from_hf(str(tmp_path)) == want
    assert from_hf(str(tmp_path / "config.json")) == want


@pytest.mark.parametrize("layout", LAYOUTS)
def test_to_hf_round_trip(layout):
    cfg = from_hf(hf_config(layout))
    again = from_hf(json.loads(json.dumps(to_hf(cfg))))
    assert again == cfg


def test_step3p5_layer_types_cover_target_and_mtp_layers():
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention",
             "sliding_attention"]
    cfg = from_hf(hf_config("step3p5", layers=2, num_mtp=3, layer_types=types,
                                        sliding_window=5))
    assert cfg.sliding_windows == (5, None)
    assert cfg.mtp_sliding_windows == (5, None, 5)
    # The fixture's default: target alternates, every MTP layer slides.
    cfg = from_hf(hf_config("step3p5"))
    assert cfg.sliding_windows == (4, None)
    assert cfg.mtp_sliding_windows == (4, 4, 4)


def test_layer_types_over_target_only_leave_mtp_full():
    cfg = from_hf(hf_config(
        "step3p5", layer_types=["full_attention", "sliding_attention"], sliding_window=6))
    assert cfg.sliding_windows == (None, 6)
    assert cfg.mtp_sliding_windows == (None, None, None)


def test_layer_types_of_wrong_length_is_an_error():
    with pytest.raises(ConfigError, match="layer_types"):
        from_hf(hf_config("step3p5", layer_types=["full_attention"] * 3))


def test_sliding_attention_without_window_is_an_error():
    raw = hf_config("step3p5")
    del raw["sliding_window"]
    with pytest.raises(ConfigError, match="sliding_window"):
        from_hf(raw)


def test_qwen2_use_sliding_window_and_max_window_layers():
    # MiMo / Qwen2 style: layers with index >= max_window_layers slide, only when
    # use_sliding_window is on; the sliding_window value alone does nothing.
    cfg = from_hf(hf_config("mimo", layers=3, use_sliding_window=True,
                                        sliding_window=8, max_window_layers=1))
    assert cfg.sliding_windows == (None, 8, 8)
    assert cfg.mtp_sliding_windows == (None, None)
    cfg = from_hf(hf_config("mimo", layers=3, use_sliding_window=False,
                                        sliding_window=8, max_window_layers=1))
    assert cfg.sliding_windows == (None, None, None)
    cfg = from_hf(hf_config("mimo", layers=3, use_sliding_window=True,
                                        sliding_window=8, max_window_layers=3))
    assert cfg.sliding_windows == (None, None, None)


def test_explicit_mtp_facts_override_layout_defaults():
    cfg = from_hf(hf_config(
        "deepseek_v3", mtp_hidden_source="target", mtp_concat_order="hidden_first",
        mtp_hidden_from="pre_norm", mtp_output_hidden="post_norm",
        mtp_zero_embed_at_pos0=False))
    assert (cfg.mtp_hidden_source, cfg.mtp_concat_order, cfg.mtp_hidden_from,
            cfg.mtp_output_hidden, cfg.mtp_zero_embed_at_pos0) == (
        "target", "hidden_first", "pre_norm", "post_norm", False)
    with pytest.raises(ConfigError, match="mtp_hidden_source"):
        from_hf(hf_config("mimo", mtp_hidden_source="sideways"))


def test_attention_bias_and_qk_norm_switches():
    assert not from_hf(hf_config("mimo", attention_bias=False)).attention_bias
    assert from_hf(hf_config("deepseek_v3", attention_bias=True)).attention_bias
    assert not from_hf(hf_config("step3p5", use_qk_norm=False)).qk_norm


def test_head_dim_defaults_to_hidden_over_heads_and_tied_embeddings():
    raw = hf_config("qwen3_next", head_dim=None, tie_word_embeddings=True)
    cfg = from_hf(raw)
    assert cfg.head_dim == 8 and cfg.tie_word_embeddings


def test_frozen_variants_by_replace():
    cfg = from_hf(hf_config("mimo"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3  # type: ignore[misc]
    other = dataclasses.replace(cfg, mtp_concat_order="embed_first")
    assert other.mtp_concat_order == "embed_first" and cfg.mtp_concat_order == "hidden_first"


# ------------------------------------------------------------------ RoPE scaling
@pytest.mark.parametrize("rope_scaling, want", [
    ({"type": "linear", "factor": 2.0}, RopeScaling("linear", 2.0)),
    ({"rope_type": "dynamic", "factor": 3.0}, RopeScaling("dynamic", 3.0, 256)),
    ({"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 128},
     RopeScaling("dynamic", 2.0, 128)),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
      "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.25},
     RopeScaling("yarn", 4.0, 64, beta_fast=16.0, beta_slow=2.0, attention_factor=1.25)),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
     RopeScaling("yarn", 4.0, 64)),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192},
     RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)),
    ({"rope_type": "default"}, None),
    (None, None),
])
def test_rope_scaling_parsing(rope_scaling, want):
    cfg = from_hf(hf_config("mimo", rope_scaling=rope_scaling))
    assert cfg.rope_scaling == want


def test_rope_parameters_style_config():
    raw = hf_config("mimo", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                             "rope_theta": 5000.0})
    del raw["rope_theta"], raw["rope_scaling"]
    cfg = from_hf(raw)
    assert cfg.rope_theta == 5000.0
    assert cfg.rope_scaling == RopeScaling("linear", 2.0)


@pytest.mark.parametrize("rope_scaling, field", [
    ({"type": "longrope", "factor": 2.0}, "longrope"),
    ({"type": "linear", "factor": 0.0}, "factor"),
    ({"type": "linear", "factor": 2.0, "short_factor": [1.0]}, "short_factor"),
    ({"type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
      "mscale": -1.0, "mscale_all_dim": 0.707}, "mscale"),
    ({"type": "linear", "factor": 4.0, "mscale_all_dim": 1.0}, "mscale_all_dim"),
    ("linear", "rope_scaling"),
])
def test_bad_rope_scaling_names_the_field(rope_scaling, field):
    with pytest.raises(ConfigError, match=field):
        from_hf(hf_config("mimo", rope_scaling=rope_scaling))


# ------------------------------------------------------------------ unsupported math
@pytest.mark.parametrize("layout, extra, field", [
    ("qwen3_next", {"num_experts": 8}, "num_experts"),
    ("deepseek_v3", {"n_routed_experts": 16}, "n_routed_experts"),
    ("deepseek_v3", {"moe_intermediate_size": 32}, "moe_intermediate_size"),
    ("deepseek_v3", {"kv_lora_rank": 16}, "MLA fields.*qk_nope_head_dim"),  # incomplete MLA
    ("deepseek_v3", {"q_lora_rank": 24}, "q_lora_rank.*kv_lora_rank is not"),
    ("mimo", {"kv_lora_rank": 16}, "kv_lora_rank"),
    ("qwen3_next", {"attn_output_gate": "yes"}, "attn_output_gate"),
    # linear-attention layers without their dims, an unknown layer kind, every layer linear
    ("qwen3_next", {"layer_types": ["linear_attention", "full_attention"]},
     "linear-attention layers but not.*linear_num_key_heads"),
    ("qwen3_next", {"layer_types": ["mamba", "full_attention"]}, "layer_types.*mamba"),
    ("qwen3_next", {"layer_types": ["linear_attention"] * 2, "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4},
     "every target layer is linear"),
    ("qwen3_next", {"layer_types": ["linear_attention", "full_attention"],
                    "linear_num_key_heads": 3, "linear_num_value_heads": 4,
                    "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                    "linear_conv_kernel_dim": 4},
     "linear_num_value_heads=4 is not a multiple of linear_num_key_heads=3"),
    ("qwen3_next", {"full_attention_interval": 2, "layer_types": ["full_attention"] * 2},
     "disagree"),
    ("qwen3_next", {"mtp_use_dedicated_embeddings": True}, "mtp_use_dedicated_embeddings"),
    ("mimo", {"some_new_field": 3}, "some_new_field"),
    ("mimo", {"hidden_act": "gelu"}, "gelu"),
    ("step3p5", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
])
def test_unsupported_config_names_the_field(layout, extra, field):
    with pytest.raises(ConfigError, match=field):
        from_hf(hf_config(layout, **extra))


@pytest.mark.parametrize("extra", [{"num_experts": 0}, {"attn_output_gate": False},
                                   {"n_routed_experts": None}, {"mlp_bias": False}])
def test_trivial_values_of_unsupported_fields_are_accepted(extra):
    from_hf(hf_config("qwen3_next", **extra))


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "vocab_size",
                                   "num_hidden_layers", "intermediate_size"])
def test_missing_required_field_is_named(field):
    raw = hf_config("mimo")
    del raw[field]
    with pytest.raises(ConfigError, match=field):
        from_hf(raw)


def test_null_num_key_value_heads_means_multi_head_attention():
    # HF's convention: num_key_value_heads None (null in config.json) is one kv head per
    # query head.
    cfg = from_hf(hf_config("mimo", num_key_value_heads=None))
    assert cfg.num_kv_heads == cfg.num_heads == 4


@pytest.mark.parametrize("layout, field, value", [
    ("mimo", "hidden_size", None),
    ("mimo", "hidden_size", "32x"),
    ("mimo", "vocab_size", 96.5),
    ("mimo", "num_attention_heads", 0),
    ("mimo", "rms_norm_eps", "small"),
    ("mimo", "rope_theta", None),
    ("mimo", "tie_word_embeddings", "no"),
    ("step3p5", "sliding_window", "big"),
])
def test_malformed_value_names_the_field(layout, field, value):
    # A value of the wrong type must not crash with a bare TypeError / ValueError /
    # ZeroDivisionError, nor be silently coerced into different math.
    with pytest.raises(ConfigError, match=field):
        from_hf(hf_config(layout, **{field: value}))


def test_unknown_model_type_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="model_type"):
        from_hf(hf_config("mimo", model_type="llama"))
    with pytest.raises(ConfigError, match="config.json"):
        from_hf(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        from_hf(str(tmp_path))


def test_model_config_validation():
    base = from_hf(hf_config("mimo"))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        dataclasses.replace(base, num_heads=4, num_kv_heads=3)
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        dataclasses.replace(base, partial_rotary_factor=0.1)
    with pytest.raises(ConfigError, match="mtp_concat_order"):
        dataclasses.replace(base, mtp_concat_order="middle")
    with pytest.raises(ConfigError, match="hidden_size"):
        dataclasses.replace(base, hidden_size=0)
    with pytest.raises(ConfigError, match="sliding_windows"):
        dataclasses.replace(base, sliding_windows=(4,))


# ------------------------------------------------------------------ spec / sampling
def test_spec_config_validation():
    assert SpecConfig(method="none", num_speculative_tokens=0).k == 0
    assert SpecConfig(method="chain", num_speculative_tokens=2).k == 2
    with pytest.raises(ConfigError, match="method"):
        SpecConfig(method="medusa")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpecConfig(method="eagle", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="relaxed"):
        SpecConfig(relaxed_acceptance=True, relaxed_delta=1.5)
    cfg = from_hf(hf_config("mimo"))  # 2 MTP modules
    for method in ("chain", "window", "per_step"):
        SpecConfig(method=method, num_speculative_tokens=2).validate_for(cfg)
        with pytest.raises(ConfigError, match="num_speculative_tokens"):
            SpecConfig(method=method, num_speculative_tokens=3).validate_for(cfg)
    SpecConfig(method="eagle", num_speculative_tokens=5).validate_for(cfg)
    no_mtp = dataclasses.replace(cfg, num_mtp_modules=0, mtp_sliding_windows=())
    with pytest.raises(ConfigError, match="eagle"):
        SpecConfig(method="eagle").validate_for(no_mtp)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=("",)), "stop"),
    (dict(stop_token_ids=(-3,)), "stop_token_ids"),
])
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_reports_every_bad_field_at_once():
    with pytest.raises(ConfigError) as err:
        SamplingParams(temperature=-1.0, top_p=2.0, max_tokens=0)
    for field in ("temperature", "top_p", "max_tokens"):
        assert field in str(err.value)


def test_sampling_params_defaults_are_greedy_and_valid():
    sp = SamplingParams()
    assert sp.temperature == 0.0 and sp.top_k == 0 and sp.top_p == 1.0
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=2**63 - 1, max_tokens=1,
                   stop=("\n",), stop_token_ids=(0, 5))


def test_engine_config_validation():
    EngineConfig(max_batch=1, max_model_len=64, page_size=4, prefill_chunk=8)
    with pytest.raises(ConfigError, match="prefill_chunk"):
        EngineConfig(prefill_chunk=12)
    with pytest.raises(ConfigError, match="steps_per_dispatch"):
        EngineConfig(steps_per_dispatch=0)
    assert EngineConfig(prefill_batch=4).prefill_batch == 4
    for bad in (0, 3, -2, True, 2.0):
        with pytest.raises(ConfigError, match="prefill_batch must be a power of two"):
            EngineConfig(prefill_batch=bad)
    with pytest.raises(ConfigError, match="max_batch"):
        EngineConfig(max_batch=0)
    with pytest.raises(ConfigError, match="step_gemms='cutlass'"):
        EngineConfig(step_gemms="cutlass")
    with pytest.raises(ConfigError, match="greedy_steps='yes'"):
        EngineConfig(greedy_steps="yes")


def test_step_gemms_by_rows_per_device():
    """A decode step's matmuls take cuBLAS from CUBLAS_FROM_ROWS rows per device on (slots
    per device x the verify's kind + 1 tokens), XLA's Triton GEMMs below (a GPU choice; the
    rule itself is plain arithmetic)."""
    from types import SimpleNamespace

    from mtp_jax.step import CUBLAS_FROM_ROWS, step_gemms

    def pick(max_batch, kind=0, dp=1, quantized=False, **kw):
        mesh = None if dp == 1 else SimpleNamespace(shape={"dp": dp, "tp": 1})
        return step_gemms(SimpleNamespace(eng=EngineConfig(max_batch=max_batch, **kw),
                                          mesh=mesh, weights_quantized=quantized), kind)

    assert pick(1) == pick(CUBLAS_FROM_ROWS - 1) == pick(1, kind=3) == "triton"
    assert pick(CUBLAS_FROM_ROWS) == pick(CUBLAS_FROM_ROWS // 4, kind=3) == "cublas"
    assert pick(CUBLAS_FROM_ROWS // 4, kind=2) == "triton"
    assert pick(4 * CUBLAS_FROM_ROWS, dp=8) == "triton"  # half the rows per device
    assert pick(2 * CUBLAS_FROM_ROWS, dp=2) == "cublas"
    assert pick(1, step_gemms="cublas") == "cublas" and pick(64, step_gemms="triton") == "triton"
    # quantized weights: XLA fuses their conversion only into its own Triton GEMMs
    assert pick(4 * CUBLAS_FROM_ROWS, kind=3, quantized=True) == "triton"
    assert pick(CUBLAS_FROM_ROWS, quantized=True, step_gemms="cublas") == "cublas"


def test_the_engine_tells_the_programs_its_weights_are_quantized():
    from mtp_jax.checkpoint import quantize_model, with_draft_head
    from mtp_jax.engine import Engine

    from spec_models import random_model

    base = random_model("mimo", seed=2)
    eng = EngineConfig(max_batch=2, max_model_len=32, page_size=8, prefill_chunk=16)
    spec = SpecConfig("chain", num_speculative_tokens=1)
    flags = [Engine(m, spec, eng).static.weights_quantized
             for m in (base, quantize_model(base, "int8"), with_draft_head(base, "int8"))]
    assert flags == [False, True, False]  # the draft head's copy is not the weights


def _golden_config(case):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", case,
                        "config.json")
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("case,change,field", [
    ("step3p5_flash", {"sink": True}, "sink"),
    ("step3p5_flash", {"use_rope_layers": [0, 1]}, "use_rope_layers"),
    ("step3p5_flash", {"att_impl_type": "MLA"}, "att_impl_type"),
    ("step3p5_flash", {"moe_every_n_layer": 2}, "moe_every_n_layer"),
    ("step3p5_flash", {"attention_other_setting": {"attention_type": "sliding_attention",
                                                   "num_attention_heads": 6,
                                                   "head_dim": 32}}, "head_dim"),
    ("step3p5_flash", {"swiglu_limits": [0, -1, 0, 0, 0, 0, 0]}, "swiglu_limits"),
    ("step3p5_flash", {"moe_layers_enum": None, "use_moe": True}, "moe_layers_enum"),
    ("mimo_v2_flash_hub", {"swa_head_dim": 32}, "swa_head_dim"),
    ("mimo_v2_flash_hub", {"swa_v_head_dim": 8}, "swa_v_head_dim"),
    ("mimo_v2_flash_hub", {"attention_chunk_size": 64}, "attention_chunk_size"),
    ("mimo_v2_flash_hub", {"hybrid_layer_pattern": [0, 1]}, "hybrid_layer_pattern"),
    ("mimo_v2_flash_hub", {"attention_bias": True}, "attention_bias"),
    ("mimo_v2_flash_hf", {"rope_parameters": {
        "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "rope_type"),
])
def test_step3p5_and_mimo_v2_keys_we_do_not_implement_are_refused(case, change, field):
    raw = dict(_golden_config(case), **change)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=field):
        from_hf(raw)


@pytest.mark.parametrize("case", ["step3p5_flash", "mimo_v2_flash_hub", "mimo_v2_flash_hf"])
def test_step3p5_and_mimo_v2_configs_round_trip_through_their_own_key_style(case):
    raw = _golden_config(case)
    cfg = from_hf(raw, mtp_layers=None if "num_nextn_predict_layers" in raw
                              or case.startswith("step") else 3)
    again = from_hf(json.loads(json.dumps(to_hf(cfg))))
    assert again == cfg
