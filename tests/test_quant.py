"""Weight-only quantization: the QArray math against numpy, loading / saving quantized
models, the errors, and the engine on quantized weights (speculative == plain decoding).

The numpy oracle dequantizes (values * scale over its blocks, in float64) and multiplies;
qeinsum must agree with it for every einsum form the models use.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import hf_fixtures as F
from mtp_jax import calibration, quant
from mtp_jax.checkpoint import load, quantize_model, save_hf, save_orbax, to_flat
from mtp_jax.config import EngineConfig, SamplingParams, SpecConfig
from mtp_jax.qarray import QArray, expand_scale, is_quantized
from mtp_jax.quant import QuantizationError, compress_scale, qeinsum, quantize

from spec_models import markov_model

# (einsum, weight shape, contraction axes, x shape): every form attention.py / layers.py / model.py / mla.py / mtp.py use
FORMS = [
    ("btd,dkgh->btkgh", (32, 2, 3, 8), (0,), (2, 3, 32)),   # fused q/k/v
    ("btnu,nud->btd", (4, 48, 16), (0, 1), (2, 3, 4, 48)),  # o_proj over (heads, dims)
    ("btf,fd->btd", (40, 16), (0,), (1, 5, 40)),             # down
    ("...d,dv->...v", (32, 50), (0,), (7, 32)),              # lm_head, leading ellipsis
]


@pytest.fixture(autouse=True)
def full_f32_products():
    """The f32 checks here hold on every backend: a GPU's default f32 dot rounds its
    inputs to TF32 (about 1e-3 relative), so f32 products run at full precision."""
    with jax.default_matmul_precision("float32"):
        yield


def numpy_dequantized(q: QArray) -> np.ndarray:
    return np.asarray(q.values).astype(np.float64) * expand_scale(
        np.asarray(q.scale, np.float64), q.shape)


@pytest.mark.parametrize("mode", quant.MODES)
@pytest.mark.parametrize("form", range(len(FORMS)))
def test_qeinsum_equals_the_dequantized_numpy_product(mode, form):
    spec, shape, contract, xshape = FORMS[form]
    rng = np.random.default_rng(form)
    w = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal(xshape).astype(np.float32)
    q = quantize(w, contract, mode, block=16)
    want = np.einsum(spec, x.astype(np.float64), numpy_dequantized(q))
    got = np.asarray(qeinsum(spec, jnp.asarray(x), q), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # and the quantized weight is close to the original (int8: half a step per element)
    err = np.abs(numpy_dequantized(q) - w)
    step = expand_scale(np.asarray(q.scale, np.float64), shape)
    assert np.all(err <= (0.5 if mode == "int8" else 2.0 ** -4 * 448) * step + 1e-7)


@pytest.mark.parametrize("mode", ["int8", "fp8-block"])
def test_qeinsum_through_the_kernel_lays_every_form_out_as_a_matrix(mode, monkeypatch):
    """The decode path: the einsum flattened to x [M, K] @ values [K, N] with scales
    [S, N] for the Pallas kernel (GPU kernel in interpret mode here)."""
    import pallas_kernels.quant_matmul as qm

    real = qm.quant_matmul
    calls = []

    def interpreted(x, values, scale, **kw):
        calls.append((x.shape, values.shape, scale.shape))
        return real(x, values, scale, backend="gpu", interpret=True)

    monkeypatch.setattr(qm, "quant_matmul", interpreted)
    monkeypatch.setattr(quant, "_use_kernel",
                        lambda mkn, s, per_channel, values_dtype=None, limit=None: True)
    for spec, shape, contract, xshape in FORMS:
        rng = np.random.default_rng(1)
        w = rng.standard_normal([n * 4 if a < len(contract) else -(-n // 4) * 16
                                 for a, n in enumerate(shape)]).astype(np.float32)
        x = rng.standard_normal(xshape[:-len(contract)] + w.shape[:len(contract)]).astype(
            np.float32)
        q = quantize(w, contract, mode, block=32)
        want = np.einsum(spec, x.astype(np.float64), numpy_dequantized(q))
        got = np.asarray(qeinsum(spec, jnp.asarray(x), q), np.float64)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert len(calls) == len(FORMS)


def test_scale_shapes_per_channel_and_per_block():
    w = np.ones((8, 64, 32), np.float32)  # o: 8 heads of 64 dims
    assert quantize(w, (0, 1), "int8").scale.shape == (1, 1, 32)
    assert quantize(w, (0, 1), "fp8").scale.shape == (1, 1, 32)
    # blocks of 128 rows of the flattened (heads, dims) contraction: two heads per block
    assert quantize(w, (0, 1), "fp8-block").scale.shape == (4, 1, 32)
    assert quantize(np.ones((2, 256, 32)), (0, 1), "fp8-block").scale.shape == (2, 2, 32)
    assert quantize(np.ones((300, 6)), (0,), "fp8-block").scale.shape == (75, 6)  # gcd 4
    assert quantize(np.zeros((16, 4)), (0,), "int8").scale.tolist() == [[1.0] * 4]


def test_compress_scale_finds_the_blocks():
    full = np.repeat(np.repeat(np.arange(6, dtype=np.float32).reshape(3, 2), 4, 0), 5, 1)
    assert compress_scale(full, (0,)).shape == (3, 10)
    assert compress_scale(full, (1,)).shape == (12, 2)
    assert compress_scale(np.ones((12, 10)), (0, 1)).shape == (1, 1)
    odd = np.ones((12, 3))
    odd[8:] = 2.0  # a block edge at row 8: blocks of gcd(12, 8) = 4 rows
    assert compress_scale(odd, (0,)).shape == (3, 3)


def test_tied_embedding_rows_and_head():
    rng = np.random.default_rng(0)
    e = rng.standard_normal((50, 32)).astype(np.float32)
    q = quantize(e, (1,), "int8")
    ids = jnp.asarray([[3, 7, 49]])
    np.testing.assert_allclose(np.asarray(q.rows(ids, jnp.float32)),
                               numpy_dequantized(q)[np.asarray(ids)], rtol=1e-6)
    h = rng.standard_normal((2, 32)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(qeinsum("...d,dv->...v", jnp.asarray(h), q.T)),
                               h @ numpy_dequantized(q).T, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ load and save
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("quant_ckpt"))
    F.make_checkpoint(path, "mimo", seed=3)
    return path


def _flat(model):
    return {k: v for k, v in to_flat(model.params).items()}


@pytest.mark.parametrize("mode", quant.MODES)
def test_quantized_saves_load_back_as_they_were_held(ckpt, tmp_path, mode):
    model = load(ckpt, quantize=mode)
    assert quant.mode_of(model.params) == mode[:4].replace("fp8-", "fp8")
    held = _flat(model)
    assert held[("target", "layers", 0, "mlp", "gate_up")].values.dtype == (
        jnp.int8 if mode == "int8" else jnp.float8_e4m3fn)
    assert not is_quantized(held[("target", "layers", 0, "input_norm", "weight")])
    save_hf(model, str(tmp_path / "hf"))
    qc = json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]
    assert qc["weight_block_size"][0] == 1
    assert qc["quant_method"] == ("mtp_jax" if mode == "int8" else "fp8")
    save_orbax(model, str(tmp_path / "orbax"))
    kept = load(str(tmp_path / "hf"), dequantize=False)
    restored = load(str(tmp_path / "orbax"))
    dequantized = load(str(tmp_path / "hf"), dequantize=True)
    # the default: dequantized on CPU (float32 is fastest there), kept on GPU / TPU
    default = load(str(tmp_path / "hf"))
    assert (quant.mode_of(default.params) is None) == (jax.default_backend() == "cpu")
    for other in (kept, restored):
        got = _flat(other)
        for key, want in held.items():
            if is_quantized(want):
                assert is_quantized(got[key]), key
                np.testing.assert_array_equal(numpy_dequantized(got[key]),
                                              numpy_dequantized(want), err_msg=str(key))
            else:
                np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want))
    assert quant.mode_of(dequantized.params) is None
    tol = 1e-6 if dequantized.dtype == jnp.float32 else 1e-2  # dequantized to bf16 off CPU
    for key, want in held.items():
        if is_quantized(want):
            np.testing.assert_allclose(np.asarray(_flat(dequantized)[key], np.float64),
                                       numpy_dequantized(want), rtol=tol, atol=tol * 1e-1)


def test_fp8_checkpoint_kept_quantized_matches_transformers():
    """DeepSeek-V3's published form (MLA, MoE experts, [16, 16] blocks with partial edge
    blocks in the golden twin): kept FP8 against the dequantized load and transformers."""
    import test_golden as G

    case = "deepseek_v3_fp8"
    kept = load(G.folder(case), dtype="float32", dequantize=False)
    held = _flat(kept)
    assert held[("target", "layers", 2, "mlp", "experts_gate_up")].values.dtype == \
        jnp.float8_e4m3fn
    assert not is_quantized(held[("target", "layers", 0, "attn", "w_uk")])
    gold = dict(np.load(os.path.join(G.folder(case), "golden.npz")))
    from flax import nnx
    from mtp_jax.mtp import forward_train

    logits, _ = jax.jit(lambda p, t: forward_train(nnx.merge(kept.graphdef, p), t))(
        kept.params, jnp.asarray(gold["prompt"][None], jnp.int32))
    np.testing.assert_allclose(np.asarray(logits[0]), gold["logits"], rtol=1e-4, atol=1e-4)


def test_errors_name_the_problem(ckpt, tmp_path):
    with pytest.raises(QuantizationError, match="int8.*fp8.*fp8-block"):
        load(ckpt, quantize="int4")
    model = load(ckpt, quantize="int8")
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_model(model, "fp8")
    save_hf(model, str(tmp_path / "q"))
    with pytest.raises(QuantizationError, match="already quantized"):
        load(str(tmp_path / "q"), quantize="int8")
    save_orbax(model, str(tmp_path / "o"))
    with pytest.raises(QuantizationError, match="quantized model"):
        load(str(tmp_path / "o"), quantize="fp8")


def test_fp8_on_a_gpu_without_fp8_names_the_fallback(monkeypatch):
    class OldGpu:
        compute_capability = "8.0"

    monkeypatch.setattr(jax, "devices", lambda *a: [OldGpu()])
    with pytest.raises(QuantizationError, match="8.9.*--quantize int8"):
        quant.check_backend("fp8", platform="gpu")
    quant.check_backend("int8", platform="gpu")  # int8 runs anywhere


def test_safetensors_int8_and_scales_are_what_the_config_says(ckpt, tmp_path):
    from mtp_jax.checkpoint.safetensors_io import read_safetensors_header

    save_hf(load(ckpt, quantize="int8"), str(tmp_path / "q"))
    head = read_safetensors_header(str(tmp_path / "q" / "model.safetensors"))
    w = "model.layers.0.mlp.down_proj.weight"
    assert head[w][0] == "I8" and head[w + "_scale_inv"][0] == "F32"
    out, inn = head[w][1]
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert head[w + "_scale_inv"][1] == (out, -(-inn // qc["weight_block_size"][1]))
    assert "model.layers.0.input_layernorm.weight_scale_inv" not in head


# ---------------------------------------------------------------------- the engine
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_speculative_greedy_equals_plain_decoding_of_the_same_quantized_model(mode):
    from mtp_jax.engine import Engine, Request
    from mtp_jax.reference import generate_reference

    base = markov_model("deepseek_v3", target_noise=0.5, mtp_noise=0.2, seed=2)
    model = quantize_model(base, mode)
    eng_cfg = EngineConfig(max_batch=2, max_model_len=64, page_size=8, prefill_chunk=16,
                           steps_per_dispatch=4)
    prompts = [[3, 17, 5, 40, 2, 9, 33], [7, 7, 30, 2, 11, 12, 13, 14, 15, 16, 17]]
    sp = SamplingParams(max_tokens=20)
    want = [generate_reference(model, p, sp, max_len=64)[0] for p in prompts]
    outs = {}
    for method, k in (("none", 1), ("chain", 2)):
        eng = Engine(model, SpecConfig(method=method, num_speculative_tokens=k), eng_cfg)
        res = eng.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
        outs[method] = [list(r.token_ids) for r in res]
        if method == "chain":
            assert sum(sum(r.accepted_per_depth) for r in res) > 0  # drafts were accepted
    assert outs["none"] == [list(w) for w in want]
    assert outs["chain"] == outs["none"]
    # the engine ran the quantized weights: the unquantized model's logits differ
    from flax import nnx
    from mtp_jax.mtp import forward_train

    tok = jnp.asarray([prompts[0]], jnp.int32)
    la, lb = (np.asarray(forward_train(nnx.merge(m.graphdef, m.params), tok)[0])
              for m in (model, base))
    assert np.abs(la - lb).max() > 1e-3


# ---------------------------------------------------------------------- fp8 KV cache
def test_fp8_kv_cache_speculative_equals_plain_and_scales_round_trip(tmp_path):
    from mtp_jax.config import ConfigError
    from mtp_jax.engine import Engine, Request

    model = markov_model("deepseek_v3", target_noise=0.5, mtp_noise=0.2, seed=4)
    scales = calibration.calibrate_kv_scales(model, [list(range(40))])
    cfg = model.config
    assert len(scales) == cfg.num_layers + cfg.num_mtp_modules
    assert all(len(k) == len(v) == cfg.num_kv_heads and min(k + v) > 0 for k, v in scales)
    eng_cfg = EngineConfig(max_batch=2, max_model_len=64, page_size=8, prefill_chunk=16,
                           steps_per_dispatch=4, kv_dtype="fp8")
    prompts = [[3, 17, 5, 40, 2, 9, 33], [7, 7, 30, 2, 11, 12, 13, 14, 15, 16, 17]]
    sp = SamplingParams(max_tokens=20)
    outs = {}
    for method, k in (("none", 1), ("chain", 2)):
        eng = Engine(model, SpecConfig(method=method, num_speculative_tokens=k), eng_cfg)
        assert all(c.dtype == jnp.float8_e4m3fn for layer in eng.state.caches for c in layer)
        outs[method] = [list(r.token_ids) for r in eng.generate(
            [Request(i, p, sp) for i, p in enumerate(prompts)])]
    assert outs["chain"] == outs["none"]
    assert model.kv_scales is not None  # calibrated by the first engine, kept
    plain = Engine(model, SpecConfig("chain", 2), dataclasses_replace(eng_cfg, kv_dtype=None))
    assert plain.layout.bytes_per_page() == (eng.layout.bytes_per_page()
                                             * jnp.dtype(model.dtype).itemsize)
    # saved beside the weights and read back
    from mtp_jax.checkpoint import CheckpointError
    from mtp_jax.checkpoint.kv_scales import KV_SCALES_FILE

    save_hf(model, str(tmp_path / "m"))
    assert load(str(tmp_path / "m")).kv_scales == model.kv_scales
    (tmp_path / "m" / KV_SCALES_FILE).write_text('{"scales": [[[1.0], [1.0]]]}')
    with pytest.raises(CheckpointError, match="layers of scales"):
        load(str(tmp_path / "m"))
    with pytest.raises(ConfigError, match="kv_dtype"):
        EngineConfig(kv_dtype="int4")


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_fp8_latent_cache_for_mla():
    """DeepSeek's latent cache in fp8: one scale for the latent part and one for the rope
    part of every row; speculative greedy output equals plain decoding's, and the
    engine's first greedy tokens equal a teacher-forced forward over fp8-rounded keys."""
    import test_golden as G
    from mtp_jax.engine import Engine, Request
    from mtp_jax.mtp import forward_train
    from flax import nnx

    model, gold = G.case_data("deepseek_v3_lite")
    model = dataclasses_replace(model, kv_scales=None)
    scales = calibration.calibrate_kv_scales(model, [gold["prompt"].tolist()])
    assert all(len(k) == 2 and v == () and min(k) > 0 for k, v in scales)
    model = dataclasses_replace(model, kv_scales=scales)
    cfg = EngineConfig(max_batch=2, max_model_len=64, page_size=8, prefill_chunk=16,
                       steps_per_dispatch=4, kv_dtype="fp8")
    prompt = gold["prompt"].tolist()
    outs = {}
    for method in ("none", "chain"):
        eng = Engine(model, SpecConfig(method, num_speculative_tokens=1), cfg)
        assert eng.state.caches[0][0].dtype == jnp.float8_e4m3fn
        outs[method] = eng.generate([Request(0, prompt, SamplingParams(max_tokens=6))])[0]
    assert outs["chain"].token_ids == outs["none"].token_ids
    # the engine's first token: the argmax of a forward over the same fp8-rounded cache
    logits, _ = forward_train(nnx.merge(model.graphdef, model.params),
                              jnp.asarray([prompt], jnp.int32), num_modules=0,
                              attend_for=calibration.fp8_kv_attend(scales))
    assert outs["none"].token_ids[0] == int(jnp.argmax(logits[0, -1]))
