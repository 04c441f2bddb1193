"""DeepSeek Sparse Attention (DeepSeek-V3.2 `deepseek_v32`, GLM-5 `glm_moe_dsa`): configs as
published and as transformers 5 saves them, the refusals, the sparse paths against the dense
ones where index_topk covers the context, the reference generator and every speculative
strategy one MTP layer allows against `none`, and the checkpoint errors. The numbers
against transformers are test_golden.py's (the deepseek_v32_* / glm_moe_dsa_* fixtures)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.checkpoint import CheckpointError, load
from mtp_jax.checkpoint.params import to_flat, with_params
from mtp_jax.checkpoint.safetensors_io import read_safetensors_header, read_tensor, \
    write_safetensors
from mtp_jax.config import ConfigError, DSAConfig, EngineConfig, SamplingParams, SpecConfig
from mtp_jax.dsa import IndexQuery
from mtp_jax.engine import Engine, Request
from mtp_jax.kv_cache import PagedKV, check_kernels, init_caches, make_layout
from mtp_jax.models import from_hf, to_hf
from mtp_jax.mtp import forward_train
from mtp_jax.reference import generate_reference

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def fixture(case):
    return os.path.join(GOLDEN, case)


def golden(case):
    return dict(np.load(os.path.join(fixture(case), "golden.npz")))


# Published config.json files, trimmed of nothing that carries math.
DEEPSEEK_V32_EXP = {
    "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v32",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.44.2", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280,
}
GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "dtype": "bfloat16", "eos_token_id": [154820, 154827, 154829],
    "ep_size": 1, "first_k_dense_replace": 3, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 6144, "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048,
    "indexer_rope_interleave": True, "initializer_range": 0.02, "intermediate_size": 12288,
    "kv_lora_rank": 512, "max_position_embeddings": 202752, "model_type": "glm_moe_dsa",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 78, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 1, "pad_token_id": 154820, "pretraining_tp": 1,
    "q_lora_rank": 2048, "qk_head_dim": 256, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05, "rope_interleave": True,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "noaux_tc", "transformers_version": "5.0.2.dev0",
    "use_cache": True, "v_head_dim": 256, "vocab_size": 154880,
}


# ------------------------------------------------------------------------------ configs
def test_published_deepseek_v32_config():
    cfg = from_hf(DEEPSEEK_V32_EXP)
    assert cfg.layout == "deepseek_v32" and cfg.num_mtp_modules == 1
    assert cfg.dsa == DSAConfig(index_n_heads=64, index_head_dim=128, index_topk=2048,
                                rope_interleave=False)
    assert cfg.quantization is not None and cfg.quantization.block == (128, 128)
    assert cfg.mla.q_lora_rank == 1536 and cfg.mla.rope_interleave
    att = cfg.layer_spec(cfg.num_layers).attention  # the MTP layer runs its own indexer
    assert att.indexer == cfg.dsa and not att.index_shared
    # the exporter writes quantization_config with the tensors, not from to_hf
    assert from_hf(to_hf(cfg)) == dataclasses.replace(cfg, quantization=None)


def test_published_glm5_config():
    cfg = from_hf(GLM5)
    assert cfg.layout == "glm_moe_dsa" and cfg.num_mtp_modules == 1
    assert cfg.dsa == DSAConfig(index_n_heads=32, index_head_dim=128, index_topk=2048,
                                rope_interleave=True)
    assert cfg.mla.qk_head_dim == 256 and cfg.rope_theta == 1e6
    assert from_hf(to_hf(cfg)) == cfg


@pytest.mark.parametrize("case", ["deepseek_v32_saved", "glm_moe_dsa_shared",
                                  "deepseek_v32_exp", "glm_moe_dsa_glm5"])
def test_fixture_configs_round_trip(case):
    cfg = from_hf(fixture(case))
    assert from_hf(to_hf(cfg)) == cfg


def test_glm_shared_layers_from_every_spelling():
    base = dict(GLM5, num_hidden_layers=4, first_k_dense_replace=1)
    want = (False, True, False, True)
    for extra in ({"indexer_types": ["full", "shared", "full", "shared"]},
                  {"index_topk_pattern": "FSFS"},
                  {"index_topk_freq": 2, "index_skip_topk_offset": 1}):
        cfg = from_hf({**base, **extra})
        assert cfg.dsa.shared == want, extra
        assert [cfg.layer_spec(i).attention.index_shared for i in range(5)] == \
            list(want) + [False]
        assert from_hf(to_hf(cfg)) == cfg
    # transformers' default schedule (freq 1) is every layer full
    assert from_hf({**base, "index_topk_freq": 1}).dsa.shared == ()


@pytest.mark.parametrize("change, pieces", [
    ({"index_topk": 0}, ["index_topk=0"]),
    ({"index_head_dim": 32}, ["index_head_dim=32", "qk_rope_head_dim=64"]),
    ({"index_n_heads": "64"}, ["index_n_heads='64'"]),
    ({"q_lora_rank": None}, ["q_lora_rank"]),
    ({"layer_types": ["full_attention"] * 61}, ["layer_types", "deepseek_sparse_attention"]),
    ({"indexer_rope_interleave": "yes"}, ["indexer_rope_interleave='yes'"]),
    ({"indexer_types": ["shared"] + ["full"] * 60}, ["first layer"]),
    ({"indexer_types": ["full", "sometimes"] + ["full"] * 59}, ["indexer_types", "sometimes"]),
    ({"indexer_types": ["full"] * 3}, ["indexer_types", "61 entries"]),
    ({"index_topk_pattern": "FX"}, ["index_topk_pattern='FX'"]),
    ({"quantization_config": dict(DEEPSEEK_V32_EXP["quantization_config"],
                                  scale_fmt="e8m0x")}, ["scale_fmt='e8m0x'"]),
    ({"index_extra": 1}, ["index_extra"]),
])
def test_bad_dsa_configs_are_refused_naming_the_field(change, pieces):
    with pytest.raises(ConfigError) as err:
        from_hf({**DEEPSEEK_V32_EXP, **change})
    for p in pieces:
        assert p in str(err.value), (p, str(err.value))


# -------------------------------------------------------------------- sparse vs dense
def _load_with_topk(case, topk):
    """The fixture's model with another index_topk (same weights)."""
    model = load(fixture(case))
    cfg = dataclasses.replace(model.config,
                              dsa=dataclasses.replace(model.config.dsa, index_topk=topk))
    return with_params(model, cfg, to_flat(model.params))


@pytest.mark.parametrize("case", ["deepseek_v32_exp", "glm_moe_dsa_shared"])
def test_training_forward_sparse_binds_and_covering_topk_is_dense(case):
    gold = golden(case)
    tokens = jnp.asarray(gold["prompt"][None], jnp.int32)
    t = tokens.shape[1]

    def logits(model):
        return np.asarray(forward_train(model.module(), tokens)[0][0])

    sparse = logits(load(fixture(case)))
    np.testing.assert_allclose(sparse, gold["logits"], rtol=1e-4, atol=1e-4)
    covering = logits(_load_with_topk(case, t))  # every query sees <= t tokens: all of them
    huge = logits(_load_with_topk(case, 10 ** 6))  # statically dense
    np.testing.assert_allclose(covering, huge, rtol=1e-5, atol=1e-5)
    topk = load(fixture(case)).config.dsa.index_topk
    # queries that see at most index_topk tokens are dense already; later ones are not
    np.testing.assert_allclose(sparse[:topk], huge[:topk], rtol=1e-5, atol=1e-5)
    assert np.abs(sparse[topk + 1:] - huge[topk + 1:]).max() > 1e-2


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_paged_sparse_kernel_path_with_covering_topk_equals_dense_path(kv_dtype):
    """PagedKV: index_topk below the table's capacity (the indexer_topk + sparse_mla path) but
    above every row's context selects everything: the same as the static dense path (fp8
    pages too: latent rows over their scales, index keys over per-token ones)."""
    cfg = load(fixture("glm_moe_dsa_glm5")).config
    eng = EngineConfig(max_batch=2, max_model_len=32, page_size=4, prefill_chunk=8,
                       kv_dtype=kv_dtype)
    scales = (((0.01, 0.02), ()),) * cfg.num_layers_total if kv_dtype else None
    layout = make_layout(cfg, eng, 1, jnp.float32, scales=scales)
    capacity = layout.width * layout.page_size
    b, t = 2, 8
    tables = tuple(jnp.asarray(np.arange(1, 1 + b * layout.width).reshape(b, layout.width)
                               % (g.num_pages - 1) + 1, jnp.int32) for g in layout.groups)
    d, m = cfg.dsa, cfg.mla
    outs = {}
    for topk in (capacity - 1, capacity):
        kv = PagedKV(layout, init_caches(layout), tables, jnp.full((b,), 10 ** 6, jnp.int32))
        for start in (0, t):  # two forwards: the second sees the first's rows
            pos = jnp.broadcast_to(start + jnp.arange(t), (b, t)).astype(jnp.int32)
            r = np.random.default_rng(start)
            q = jnp.asarray(r.normal(size=(b, t, cfg.num_heads, m.cache_dim)), jnp.float32)
            kvr = jnp.asarray(r.normal(size=(b, t, 1, m.cache_dim)), jnp.float32)
            index = IndexQuery(jnp.asarray(r.normal(size=(b, t, d.index_n_heads,
                                                          d.index_head_dim)), jnp.float32),
                               jnp.asarray(r.normal(size=(b, t, d.index_n_heads)), jnp.float32),
                               jnp.asarray(r.normal(size=(b, t, d.index_head_dim)), jnp.float32),
                               topk)
            out = kv.attend(pos, jnp.full((b,), start + t, jnp.int32))(
                0, q, kvr, None, None, sm_scale=0.3, v_dim=m.kv_lora_rank, index=index)
        outs[topk] = np.asarray(out)
    np.testing.assert_allclose(outs[capacity - 1], outs[capacity], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ engine, reference
def _run(model, method, k, requests, **eng):
    spec = SpecConfig(method=method, num_speculative_tokens=k)
    conf = dict(max_batch=2, max_model_len=64, page_size=8, prefill_chunk=16,
                steps_per_dispatch=8)
    conf.update(eng)
    return [r.token_ids for r in Engine(model, spec, EngineConfig(**conf)).generate(requests)]


def _requests(gold, sampled=False):
    prompt = gold["prompt"].tolist()
    params = SamplingParams(max_tokens=len(gold["greedy"]))
    other = SamplingParams(max_tokens=12, temperature=0.8 if sampled else 0.0, seed=5)
    return [Request("a", prompt, params), Request("b", prompt[::-1][:30], other)]


def test_reference_generator_reproduces_transformers_greedy():
    for case in ("deepseek_v32_exp", "glm_moe_dsa_shared"):
        model, gold = load(fixture(case)), golden(case)
        out, _ = generate_reference(model, gold["prompt"].tolist(),
                                    SamplingParams(max_tokens=len(gold["greedy"])), max_len=64)
        assert out == gold["greedy"].tolist(), case


def test_every_strategy_of_one_mtp_layer_is_lossless():
    """chain / window / per_step at K = 1, eagle reusing the layer for K = 3, adaptive K
    (a sampled row too: coupled verification keeps it equal to `none`)."""
    case = "glm_moe_dsa_shared"  # a shared-selection layer, the MTP layer's own indexer
    model, gold = load(fixture(case)), golden(case)
    none = _run(model, "none", 1, _requests(gold))
    assert none[0] == gold["greedy"].tolist()
    for method, k in (("window", 1), ("per_step", 1), ("eagle", 3)):
        assert _run(model, method, k, _requests(gold)) == none, method
    sampled_none = _run(model, "none", 1, _requests(gold, sampled=True))
    assert _run(model, "chain", "auto", _requests(gold, sampled=True)) == sampled_none


def test_index_topk_past_max_model_len_runs_dense():
    case = "deepseek_v32_saved"
    model, gold = _load_with_topk(case, 4096), golden(case)
    want, _ = generate_reference(model, gold["prompt"].tolist(),
                                 SamplingParams(max_tokens=len(gold["greedy"])), max_len=64)
    assert _run(model, "none", 1, _requests(gold))[0] == want
    assert _run(model, "eagle", 2, _requests(gold))[0] == want


def test_fp8_kv_cache_index_keys_per_token_scales():
    """kv_dtype fp8: latent rows over their calibrated scales, index keys fp8 over a scale
    per token (float32 [1, pages, page_size, 1] beside them); speculation stays lossless
    against `none` on the same cache, and the greedy tokens stay near transformers'."""
    case = "glm_moe_dsa_shared"
    model, gold = load(fixture(case)), golden(case)
    layout = make_layout(model.config, EngineConfig(max_batch=2, max_model_len=64,
                                                    kv_dtype="fp8"), 1, jnp.float32,
                         scales=(((1.0, 1.0), ()),) * 5)
    assert [len(layout.page_shapes(i)) for i in range(5)] == [3, 1, 3, 1, 3]
    assert layout.page_dtypes(0) == ("float8_e4m3fn", "float8_e4m3fn", "float32")
    caches = init_caches(layout)
    assert caches[0][2].shape[-1] == 1 and caches[0][2].dtype == jnp.float32
    none = _run(model, "none", 1, _requests(gold), kv_dtype="fp8")
    assert _run(model, "chain", 1, _requests(gold), kv_dtype="fp8") == none
    # tiny random models decide greedy tokens by small margins: the first ones agree
    assert none[0][:3] == gold["greedy"].tolist()[:3], (none[0], gold["greedy"])


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_untileable_dsa_shapes_are_a_config_error_before_compiling(backend):
    """The DSA kernels are traced on abstract arguments when the engine starts: an index
    head dim of 12 tiles on neither backend (powers of two >= 16 on GPU, multiples of 128
    on TPU), and the error names the config fields; the published shapes pass."""
    model = load(fixture("deepseek_v32_saved"))
    with pytest.raises(ConfigError) as err:
        Engine(model, SpecConfig(method="none"),
               EngineConfig(max_batch=1, max_model_len=64, attention_backend=backend))
    assert "index_head_dim=12" in str(err.value) and backend in str(err.value)
    for raw in (DEEPSEEK_V32_EXP, GLM5):
        cfg = from_hf(raw)
        eng = EngineConfig(max_batch=8, max_model_len=8192, page_size=64, prefill_chunk=256,
                           attention_backend=backend)
        check_kernels(make_layout(cfg, eng, 1, jnp.bfloat16), eng, cfg)


# --------------------------------------------------------------------------- checkpoint
@pytest.mark.parametrize("name", ["model.layers.1.self_attn.indexer.wk.weight",
                                  "model.layers.2.self_attn.indexer.k_norm.bias"])
def test_missing_indexer_tensor_is_named(tmp_path, name):
    src = fixture("deepseek_v32_saved")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    path = str(dst / "model.safetensors")
    with open(path, "rb") as f:
        base = 8 + int.from_bytes(f.read(8), "little")
    tensors = {k: np.array(read_tensor(path, (base, v)))
               for k, v in read_safetensors_header(path).items()}
    del tensors[name]
    os.remove(path)
    write_safetensors(path, tensors)
    with pytest.raises(CheckpointError) as err:
        load(str(dst))
    assert name in str(err.value) or name in "\n".join(getattr(err.value, "full", []))


def test_sharded_dsa_engines_reproduce_transformers_greedy():
    """Meshes of tp (query heads) and dp (slots) on 8 fake CPU devices, in a subprocess."""
    from test_sharding import run_on_8_devices

    result = run_on_8_devices("sharded_dsa.py")
    assert result and all(result.values()), result


@pytest.mark.parametrize("case", ["glm_moe_dsa_shared", "deepseek_v32_exp"])
def test_save_hf_round_trip_writes_the_published_names(tmp_path, case):
    """save_hf writes the indexer tensors under their hub names (interleaved index RoPE
    permuted back for GLM-5) and the index config keys: the saved files equal the fixture's
    and load to the same model."""
    from mtp_jax.checkpoint import save_hf

    model = load(fixture(case))
    save_hf(model, str(tmp_path))
    again = load(str(tmp_path))
    assert again.config == model.config
    a, b = to_flat(model.params), to_flat(again.params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=str(k))

    def tensors(folder):
        path = os.path.join(folder, "model.safetensors")
        with open(path, "rb") as f:
            base = 8 + int.from_bytes(f.read(8), "little")
        return {k: np.array(read_tensor(path, (base, v)))
                for k, v in read_safetensors_header(path).items()}

    mine, theirs = tensors(str(tmp_path)), tensors(fixture(case))
    for name in theirs:
        if ".indexer." in name:
            np.testing.assert_array_equal(mine[name], theirs[name], err_msg=name)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["index_topk"] == model.config.dsa.index_topk
    assert saved.get("indexer_types") == (["full", "shared", "full", "shared"]
                                          if case == "glm_moe_dsa_shared" else None)


def test_fp8_block_scaled_indexer_weights_load_dequantized(tmp_path):
    """DeepSeek-V3.2's FP8 checkpoint stores the indexer's wq_b / wk in float8_e4m3fn with
    `weight_scale_inv` blocks (weights_proj stays bf16): they load dequantized, the
    permutations applied to the dequantized values."""
    import ml_dtypes

    case = "deepseek_v32_exp"
    dst = tmp_path / "fp8"
    shutil.copytree(fixture(case), dst)
    path = str(dst / "model.safetensors")
    with open(path, "rb") as f:
        base = 8 + int.from_bytes(f.read(8), "little")
    tensors = {k: np.array(read_tensor(path, (base, v)))
               for k, v in read_safetensors_header(path).items()}
    block = (16, 16)
    dequantized = {}
    for name in [k for k in tensors if k.endswith(("indexer.wq_b.weight", "indexer.wk.weight"))]:
        w = tensors[name].astype(np.float32)
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        scale = np.ones((rows, cols), np.float32)
        for i in range(rows):
            for j in range(cols):
                piece = w[i * 16:(i + 1) * 16, j * 16:(j + 1) * 16]
                scale[i, j] = max(np.abs(piece).max() / 448.0, 1e-12)
        full = np.repeat(np.repeat(scale, 16, 0), 16, 1)[:w.shape[0], :w.shape[1]]
        q = (w / full).astype(ml_dtypes.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = q, scale
        dequantized[name] = q.astype(np.float32) * full
    os.remove(path)
    write_safetensors(path, tensors)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                  "quant_method": "fp8", "scale_fmt": "ue8m0",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    model = load(str(dst))
    flat = to_flat(model.params)
    # wk [di, d] -> [d, di] with the (rotate-half: identity) rope order
    np.testing.assert_array_equal(np.asarray(flat[("target", "layers", 0, "attn", "indexer",
                                                   "wk")]),
                                  dequantized["model.layers.0.self_attn.indexer.wk.weight"].T)
    assert len(dequantized) == 2 * (model.config.num_layers_total)


def test_pool_bytes_count_the_index_keys():
    """A page id holds, per layer, the latent row and (on a layer with an indexer) the index
    key, and for fp8 pages one float32 scale per index key."""
    cfg = load(fixture("glm_moe_dsa_shared")).config  # 4 target layers (1, 3 shared) + MTP
    eng = EngineConfig(max_batch=2, max_model_len=64, page_size=8)
    r, di = cfg.mla.cache_dim, cfg.dsa.index_head_dim
    lay = make_layout(cfg, eng, 1, jnp.bfloat16)
    assert lay.index_dims == (di, 0, di, 0, di)
    assert lay.bytes_per_page() == 8 * 2 * (5 * r + 3 * di)
    fp8 = make_layout(cfg, dataclasses.replace(eng, kv_dtype="fp8"), 1, jnp.bfloat16,
                      scales=(((1.0, 1.0), ()),) * 5)
    assert fp8.bytes_per_page() == 8 * (5 * r + 3 * di + 3 * 4)
    assert sum(x.size * x.dtype.itemsize for layer in init_caches(fp8) for x in layer) == \
        fp8.bytes_per_page() * fp8.groups[0].num_pages
