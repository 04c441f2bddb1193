"""Gated DeltaNet (linear-attention) layers in the engine: the per-slot states under
speculation, padding, chunked and batched prefill, preemption; greedy and seeded sampled
output equal to plain decoding for every strategy one MTP layer allows.

The models are hybrid Qwen3-Next-shaped ones (three linear layers, one gated full-attention
layer, a shared-input MTP layer) built from real weights; the golden fixtures
(tests/test_golden.py, qwen3_next_* / qwen3_5_*) check the math against transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import (ConfigError, EngineConfig, GDNConfig, MoEConfig, SamplingParams,
                            SpecConfig)
from mtp_jax.delta_rule import Mix, mix_tokens
from mtp_jax.engine import Engine
from mtp_jax.kv_cache import PagedKV, init_caches, make_layout
from mtp_jax.model import DenseCache
from mtp_jax.models import from_hf
from mtp_jax.reference import generate_reference
from mtp_jax.requests import Request

from spec_models import markov_model, small_config


@pytest.fixture(autouse=True)
def _f32_matmuls():
    """float32 matmuls at full precision on every backend (a GPU's default is TF32), as the
    CPU computes them: the greedy comparisons below assume float32 arithmetic."""
    with jax.default_matmul_precision("highest"):
        yield

GOLDEN = Path(__file__).resolve().parent / "golden"
GDN = GDNConfig(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=16, conv_kernel=4)
HYBRID = dict(layers=4, mtp=1, gdn=GDN, linear_layers=(True, True, True, False, False),
              qk_norm=True, norm_offset=1.0, attention_gate="element",
              partial_rotary_factor=0.25, head_dim=32, mtp_concat_order="embed_first",
              mtp_zero_embed_at_pos0=False, mtp_shared_input=True)
MOE = MoEConfig(num_experts=8, top_k=2, intermediate_size=32, router="softmax",
                score_bias=False, shared_intermediate_size=48, shared_gate=True)
ENGINE = EngineConfig(max_batch=3, max_model_len=96, page_size=8, prefill_chunk=16,
                      prefill_batch=2, steps_per_dispatch=4)


def _mix(rng, rows, t, spec):
    c = spec.gdn
    return Mix(qkv=jnp.asarray(rng.normal(size=(rows, t, c.conv_dim)), jnp.float32),
               g=-jnp.asarray(rng.uniform(0.01, 2.0, (rows, t, c.num_v_heads)), jnp.float32),
               beta=jnp.asarray(rng.uniform(0.05, 0.95, (rows, t, c.num_v_heads)), jnp.float32),
               conv=jnp.asarray(rng.normal(size=(c.conv_kernel, c.conv_dim)), jnp.float32),
               spec=spec)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verify_carries_exactly_the_accepted_tokens_state(seed):
    """For random drafts and a random accepted count per row, the state a verify carries on
    (kept after each token, one picked by `commit_states`) is the state of running only the
    accepted tokens; a row past its write limit (not running) keeps its state."""
    rng = np.random.default_rng(seed)
    cfg = small_config("qwen3_next", **HYBRID)
    k = 3
    eng = EngineConfig(max_batch=4, max_model_len=64, page_size=8, prefill_chunk=16)
    layout = make_layout(cfg, eng, k, jnp.float32)
    spec = cfg.layer_spec(0).attention
    caches = list(init_caches(layout))
    conv0 = jnp.asarray(rng.normal(size=caches[0][0].shape), jnp.float32)
    rec0 = jnp.asarray(rng.normal(size=caches[0][1].shape), jnp.float32)
    caches[0] = (conv0, rec0)
    tables = tuple(jnp.zeros((4, layout.width), jnp.int32) for _ in layout.groups)
    length = jnp.asarray(rng.integers(5, 40, 4), jnp.int32)
    pos = length[:, None] - 1 + jnp.arange(k + 1)
    limit = jnp.asarray([64, 64, 64, 0], jnp.int32)  # row 3 is not running
    mix = _mix(rng, 4, k + 1, spec)
    kv = PagedKV(layout, caches, tables, limit, keep_states=True)
    out = kv.gdn(0, mix, pos)
    n = jnp.asarray(rng.integers(0, k + 1, 4), jnp.int32)
    kv.commit_states(n)
    conv, rec = kv.caches[0]
    for r in range(3):
        m = int(n[r]) + 1
        part = Mix(mix.qkv[r:r + 1, :m], mix.g[r:r + 1, :m], mix.beta[r:r + 1, :m], mix.conv,
                   spec)
        o, c_ref, s_ref = mix_tokens(part, conv0[r:r + 1], rec0[r:r + 1],
                                     jnp.ones((1, m), bool))
        np.testing.assert_allclose(conv[r], c_ref[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(rec[r], s_ref[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[r, :m], o[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(conv[3], conv0[3])
    np.testing.assert_array_equal(rec[3], rec0[3])
    assert not kv.pending


def test_prefill_chunks_and_padding_leave_the_states_of_one_pass():
    """States after a prompt in chunks (the engine's prefill rows, padded) equal those of
    one pass, and the reference generator's padded prefill leaves the same states."""
    rng = np.random.default_rng(4)
    spec = small_config("qwen3_next", **HYBRID).layer_spec(0).attention
    mix = _mix(rng, 1, 23, spec)
    conv = jnp.zeros((1, 3, spec.gdn.conv_dim), jnp.float32)
    rec = jnp.zeros((1, 4, 16, 16), jnp.float32)
    want_o, want_c, want_s = mix_tokens(mix, conv, rec, jnp.ones((1, 23), bool))
    c, s, outs = conv, rec, []
    for start in range(0, 23, 8):  # chunks of 8, the last one padded to 8
        sl = slice(start, start + 8)
        pad = 8 - mix.qkv[:, sl].shape[1]
        part = Mix(*(jnp.pad(x[:, sl], ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
                     for x in (mix.qkv, mix.g, mix.beta)), mix.conv, spec)
        valid = jnp.arange(8)[None] < 8 - pad
        o, c, s = mix_tokens(part, c, s, valid)
        outs.append(o[:, : 8 - pad])
    np.testing.assert_allclose(jnp.concatenate(outs, 1), want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(c, want_c, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-5)
    # the reference generator's backend: positions >= lengths are padding
    cache = DenseCache([(conv, rec)], jnp.arange(32)[None], jnp.asarray([23]))
    padded = Mix(*(jnp.pad(x, ((0, 0), (0, 9)) + ((0, 0),) * (x.ndim - 2))
                   for x in (mix.qkv, mix.g, mix.beta)), mix.conv, spec)
    cache.gdn(0, padded)
    np.testing.assert_allclose(cache.caches[0][1], want_s, rtol=1e-5, atol=1e-5)


_hybrids: dict = {}


def hybrid_case(ffn: str):
    """(model, prompts, reference greedy tokens) of the dense or MoE hybrid, built once."""
    if ffn not in _hybrids:
        extra = {"moe": MOE} if ffn == "moe" else {}
        model = markov_model("qwen3_next", target_noise=0.5, mtp_noise=0.2, seed=1, **HYBRID,
                             **extra)
        rng = np.random.default_rng(3)
        prompts = [rng.integers(0, 61, size=n).tolist() for n in (3, 9, 30, 50, 17)]
        refs = [generate_reference(model, p, SamplingParams(max_tokens=24), max_len=96)[0]
                for p in prompts]
        _hybrids[ffn] = model, prompts, refs
    return _hybrids[ffn]


@pytest.mark.parametrize("ffn, method, k", [
    ("dense", "none", 0), ("dense", "chain", 1), ("dense", "eagle", 3),
    ("dense", "eagle", "auto"), ("moe", "chain", 1), ("moe", "eagle", 3)])
def test_hybrid_greedy_equals_plain_decoding(ffn, method, k):
    model, prompts, refs = hybrid_case(ffn)
    eng = Engine(model, SpecConfig(method=method, num_speculative_tokens=k), ENGINE)
    res = eng.generate([Request(i, p, SamplingParams(max_tokens=24))
                        for i, p in enumerate(prompts)])
    assert [r.token_ids for r in res] == refs
    if k not in (0, "auto"):
        assert sum(sum(r.accepted_per_depth) for r in res) > 0  # real rollbacks happened


def test_hybrid_preemption_rebuilds_states_and_sampling_is_coupled():
    """A pool too small for every request at once preempts some; their states are rebuilt
    from their tokens on resume. Seeded sampled requests give the tokens of plain
    decoding (adaptive speculation verifies them by coupled sampling)."""
    model, prompts, _ = hybrid_case("dense")
    sps = [SamplingParams(max_tokens=30, seed=100 + i,
                          temperature=0.8 if i % 2 == 0 else 0.0) for i in range(len(prompts))]
    small = EngineConfig(**{**ENGINE.__dict__, "num_pages": 14})
    eng = Engine(model, SpecConfig(method="eagle", num_speculative_tokens="auto"), small)
    res = eng.generate([Request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))])
    assert eng.stats["preemptions"] > 0
    plain = Engine(model, SpecConfig(method="none", num_speculative_tokens=0),
                   EngineConfig(**{**ENGINE.__dict__, "max_batch": 1, "prefill_batch": 1}))
    want = plain.generate([Request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))])
    assert [r.token_ids for r in res] == [r.token_ids for r in want]


def test_hybrid_layout_holds_states_not_pages():
    cfg = small_config("qwen3_next", **HYBRID)
    layout = make_layout(cfg, ENGINE, 1, jnp.bfloat16)
    assert [layout.is_linear(i) for i in range(5)] == [True, True, True, False, False]
    caches = init_caches(layout)
    assert caches[0][0].shape == (3, 3, GDN.conv_dim) and caches[0][0].dtype == jnp.bfloat16
    assert caches[0][1].shape == (3, 4, 16, 16) and caches[0][1].dtype == jnp.float32
    # one page id holds the two attention layers' keys and values only
    assert layout.bytes_per_page(0) == 8 * 2 * 2 * 2 * 32 * 2
    assert layout.head_dim == 32


def test_linear_mtp_layers_and_mla_hybrids_are_refused():
    with pytest.raises(ConfigError, match="MTP layers are full attention"):
        small_config("qwen3_next", **{**HYBRID, "linear_layers": (True, True, True, False,
                                                                 True)})
    with pytest.raises(ConfigError, match="linear_layers has 4 entries"):
        small_config("qwen3_next", **{**HYBRID, "linear_layers": (True, True, True, False)})
    with pytest.raises(ConfigError, match="not mimo"):
        small_config("mimo", **{**HYBRID, "attention_bias": False})


def test_deterministic_mode_refuses_linear_attention_layers():
    model = markov_model("qwen3_next", seed=1, **HYBRID)
    with pytest.raises(ConfigError, match="deterministic.*Gated DeltaNet"):
        Engine(model, SpecConfig("chain", num_speculative_tokens=1),
               EngineConfig(max_batch=2, max_model_len=64, deterministic=True))


def test_state_dtype_and_rope_sections_are_checked():
    raw = json.loads((GOLDEN / "qwen3_5_dense" / "config.json").read_text())
    assert from_hf(raw).gdn.num_v_heads == 4
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["mamba_ssm_dtype"] = "bfloat16"
    with pytest.raises(ConfigError, match="mamba_ssm_dtype"):
        from_hf(bad)
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    with pytest.raises(ConfigError, match="mrope_section"):
        from_hf(bad)


def test_missing_linear_attention_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file
    from mtp_jax.checkpoint import load
    from mtp_jax.checkpoint.safetensors_io import CheckpointError
    src = GOLDEN / "qwen3_next_moe"
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.linear_attn.A_log"]
    del tensors["mtp.fc.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load(str(tmp_path))
    assert "model.layers.1.linear_attn.A_log" in e.value.full and "mtp.fc.weight" in e.value.full
