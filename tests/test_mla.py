"""MLA (DeepSeek-V3 latent attention) and FP8 block-scaled checkpoints.

The numpy reference below computes MLA in the *expanded* form, straight from the hub
tensors as DeepSeek publishes them (interleaved rope pairs, kv_b_proj rows per head: nope
key, then value), in float64: keys and values per head, softmax with DeepSeek's scale.
mtp_jax computes the absorbed form over a latent cache from permuted, split parameters,
so agreement checks the absorption, the rope permutation and the parameter mapping. The
golden files of test_golden_deepseek_v3.py check whole models against transformers.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from flax import nnx

from mtp_jax.checkpoint import CheckpointError, Model, load, save_hf
from mtp_jax.checkpoint.safetensors_io import (read_safetensors_header, read_tensor,
                                               write_safetensors)
from mtp_jax.config import ConfigError
from mtp_jax.layers import causal_attend
from mtp_jax.models import from_hf, to_hf
from mtp_jax.mtp import init_model


def ds_config(**kw):
    raw = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=48,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
               q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
               v_head_dim=6, num_nextn_predict_layers=1, rms_norm_eps=1e-6,
               max_position_embeddings=256, rope_theta=10000.0, torch_dtype="float32",
               rope_scaling={"type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0})
    raw.update(kw)
    return raw


# ----------------------------------------------------------------- numpy reference
def np_rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def np_yarn(cfg_raw, dim):
    """inv_freq and cos/sin scale as DeepSeek's yarn defines them."""
    rs, base = cfg_raw["rope_scaling"], cfg_raw["rope_theta"]
    inv = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    if not rs:
        return inv, 1.0
    f, orig = rs["factor"], rs["original_max_position_embeddings"]

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    lo, hi = max(math.floor(corr(rs["beta_fast"])), 0), min(math.ceil(corr(rs["beta_slow"])),
                                                             dim - 1)
    ramp = np.clip((np.arange(dim // 2) - lo) / max(hi - lo, 1e-3), 0, 1)
    inv = inv / f * ramp + inv * (1 - ramp)

    def ms(m):
        return 0.1 * m * math.log(f) + 1.0
    return inv, ms(rs["mscale"]) / ms(rs["mscale_all_dim"])


def np_rope(x, pos, inv, scale, interleaved):
    """x [t, heads, e]: pairs (x0, x1), (x2, x3), ... (DeepSeek's interleaved layout) or
    (x_i, x_{i + e/2}) (rope_interleave false) rotated by inv[i]."""
    ang = pos[:, None] * inv[None]                        # [t, e/2]
    c, s = (np.cos(ang) * scale)[:, None], (np.sin(ang) * scale)[:, None]
    e = x.shape[-1]
    first, second = (np.s_[..., 0::2], np.s_[..., 1::2]) if interleaved else (
        np.s_[..., : e // 2], np.s_[..., e // 2:])
    a, b = x[first], x[second]
    out = np.empty_like(x)
    out[first] = a * c - b * s
    out[second] = b * c + a * s
    return out


def np_mla(x, t, prefix, raw):
    """Expanded-form MLA of one layer over a sequence x [T, d] (causal)."""
    n, p, e = raw["num_attention_heads"], raw["qk_nope_head_dim"], raw["qk_rope_head_dim"]
    r, v = raw["kv_lora_rank"], raw["v_head_dim"]
    a = prefix + "self_attn."
    if raw.get("q_lora_rank"):
        q = np_rms(x @ t[a + "q_a_proj.weight"].T, t[a + "q_a_layernorm.weight"], 1e-6)
        q = q @ t[a + "q_b_proj.weight"].T
    else:
        q = x @ t[a + "q_proj.weight"].T
    q = q.reshape(len(x), n, p + e)
    kv = x @ t[a + "kv_a_proj_with_mqa.weight"].T
    c = np_rms(kv[:, :r], t[a + "kv_a_layernorm.weight"], 1e-6)
    pos = np.arange(len(x), dtype=np.float64)
    inv, scale = np_yarn(raw, e)
    inter = raw.get("rope_interleave", True)
    q_pe = np_rope(q[..., p:], pos, inv, scale, inter)
    k_pe = np_rope(kv[:, None, r:], pos, inv, scale, inter)
    kvb = (c @ t[a + "kv_b_proj.weight"].T).reshape(len(x), n, p + v)
    k = np.concatenate([kvb[..., :p], np.broadcast_to(k_pe, (len(x), n, e))], -1)
    vals = kvb[..., p:]
    qq = np.concatenate([q[..., :p], q_pe], -1)
    sm = (p + e) ** -0.5
    rs = raw["rope_scaling"]
    if rs and rs.get("mscale_all_dim"):
        sm *= (0.1 * rs["mscale_all_dim"] * math.log(rs["factor"]) + 1) ** 2
    s = np.einsum("tnh,snh->nts", qq, k) * sm
    s = np.where(np.tril(np.ones((len(x), len(x)), bool))[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("nts,snv->tnv", w, vals).reshape(len(x), n * v)
    return o @ t[a + "o_proj.weight"].T


def np_target(t, raw, tokens):
    """Dense-FFN DeepSeek target (no MoE) in float64: final-normed hidden [T, d]."""
    x = t["model.embed_tokens.weight"][tokens]
    for i in range(raw["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        h = np_rms(x, t[pre + "input_layernorm.weight"], 1e-6)
        x = x + np_mla(h, t, pre, raw)
        h = np_rms(x, t[pre + "post_attention_layernorm.weight"], 1e-6)
        g, u = h @ t[pre + "mlp.gate_proj.weight"].T, h @ t[pre + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ t[pre + "mlp.down_proj.weight"].T
    return np_rms(x, t["model.norm.weight"], 1e-6)


def read_all(folder):
    path = os.path.join(folder, "model.safetensors")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return {k: np.asarray(read_tensor(path, (8 + n, v)), np.float64)
            for k, v in read_safetensors_header(path).items()}


def write_random_checkpoint(folder, raw, seed=0):
    """A hub-layout checkpoint with random tensors (norm weights near 1)."""
    cfg = from_hf(raw)
    graphdef, state = nnx.split(init_model(cfg, seed=seed, dtype=jnp.float32))
    save_hf(Model(cfg, graphdef, state), folder, dtype="float32")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(raw, f)
    rng = np.random.default_rng(seed)
    path = os.path.join(folder, "model.safetensors")
    tensors = read_all(folder)
    out = {}
    for k, a in tensors.items():
        if k.endswith("norm.weight") or "layernorm" in k:
            out[k] = (1 + 0.1 * rng.standard_normal(a.shape)).astype(np.float32)
        else:
            out[k] = (rng.standard_normal(a.shape) * 0.3).astype(np.float32)
    write_safetensors(path, out)
    return out


# ------------------------------------------------------------------------ tests
@pytest.mark.parametrize("q_lora, scaling, interleave", [
    (24, True, True), (None, False, True), (None, True, False)])
def test_absorbed_mla_equals_expanded_numpy(tmp_path, q_lora, scaling, interleave):
    raw = ds_config(q_lora_rank=q_lora, rope_interleave=interleave,
                    **({} if scaling else {"rope_scaling": None}))
    t = write_random_checkpoint(str(tmp_path), raw)
    model = load(str(tmp_path), dtype="float32")
    tokens = np.array([3, 17, 5, 60, 2, 9, 33, 41, 8], np.int64)
    pos = jnp.arange(len(tokens))[None]
    got, _ = model.module().target(jnp.asarray(tokens[None], jnp.int32), pos,
                                   causal_attend(pos))
    t64 = {k: v.astype(np.float64) for k, v in t.items()}
    want = np_target(t64, raw, tokens)
    np.testing.assert_allclose(np.asarray(got[0]), want, atol=2e-4, rtol=2e-4)


def test_config_reads_mla_fields_and_softmax_scale():
    cfg = from_hf(ds_config())
    m = cfg.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_dim, m.qk_rope_dim, m.v_head_dim) == (
        24, 16, 8, 4, 6)
    assert cfg.head_dim == 12 and cfg.rotary_dim == 4 and m.cache_dim == 20
    spec = cfg.layer_spec(0).attention
    assert spec.kind == "mla"
    assert spec.sm_scale == pytest.approx(12 ** -0.5 * (0.1 * math.log(4) + 1) ** 2)
    # transformers writes head_dim = qk_rope_head_dim; both spellings are accepted.
    assert from_hf(ds_config(head_dim=4)).head_dim == 12
    again = from_hf(to_hf(cfg))
    assert again.mla == cfg.mla and again.rope_scaling == cfg.rope_scaling


@pytest.mark.parametrize("extra, field", [
    (dict(head_dim=7), "head_dim"),
    (dict(kv_lora_rank=None), "kv_lora_rank is not"),
    (dict(qk_rope_head_dim=5), "qk_rope_head_dim"),
    (dict(v_head_dim="x"), "v_head_dim"),
    (dict(rope_interleave="yes"), "rope_interleave"),
    (dict(use_mla=False), "use_mla"),
    (dict(quantization_config={"quant_method": "gptq"}), "quant_method"),
    (dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3"}), "weight_block_size"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128],
                               "fmt": "e5m2"}), "fmt"),
])
def test_bad_mla_or_quantization_config_names_the_field(extra, field):
    with pytest.raises(ConfigError, match=field):
        from_hf(ds_config(**extra))


def test_mla_fields_outside_deepseek_are_refused():
    raw = ds_config(model_type="mimo")
    with pytest.raises(ConfigError, match="MLA"):
        from_hf(raw)


# ---------------------------------------------------------------------- FP8
BLOCK = (8, 16)


def quantize_blocks(w, block=BLOCK):
    """DeepSeek's recipe: per (bo, bi) block, scale = amax / 448, fp8 = w / scale."""
    out, inn = w.shape
    so, si = -(-out // block[0]), -(-inn // block[1])
    scale = np.zeros((so, si), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(so):
        for j in range(si):
            blk = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            s = max(float(np.abs(blk).max()) / 448.0, 1e-12)
            scale[i, j] = s
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (
                blk / s).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def dequantize(q, scale, block=BLOCK):
    s = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:q.shape[0], :q.shape[1]]
    return q.astype(np.float32) * s


QUANTIZED = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
             "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """The same model twice: FP8 block-scaled, and its dequantized float32 weights."""
    base = str(tmp_path_factory.mktemp("ds"))
    raw = ds_config()
    t = write_random_checkpoint(base, raw)
    fp8_dir, deq_dir = base + "_fp8", base + "_deq"
    qt, dq = {}, {}
    for k, w in t.items():
        if any(f".{name}.weight" in k for name in QUANTIZED) and "eh_proj" not in k:
            q, s = quantize_blocks(w)
            qt[k], qt[k + "_scale_inv"] = q, s
            dq[k] = dequantize(q, s)
        else:
            qt[k] = dq[k] = w
    for folder, tensors, extra in ((fp8_dir, qt, {"quantization_config": {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(BLOCK)}}), (deq_dir, dq, {})):
        os.makedirs(folder)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(dict(raw, **extra), f)
        write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
    return fp8_dir, deq_dir, qt


def test_fp8_block_scaled_checkpoint_loads_as_its_dequantized_weights(fp8_pair):
    fp8_dir, deq_dir, qt = fp8_pair
    fp8 = [v.shape for v in qt.values() if v.dtype == ml_dtypes.float8_e4m3fn]
    # partial edge blocks along both dims are exercised
    assert any(s[0] % BLOCK[0] for s in fp8) and any(s[1] % BLOCK[1] for s in fp8)
    a, b = load(fp8_dir, dtype="float32"), load(deq_dir, dtype="float32")
    fa = {tuple(p): np.asarray(v.get_value()) for p, v in a.params.flat_state()}
    fb = {tuple(p): np.asarray(v.get_value()) for p, v in b.params.flat_state()}
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=str(k))
    assert a.config.quantization.block == BLOCK


def _rewrite(src, dst, tensors, config_update=None):
    shutil.copytree(src, dst)
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    if config_update is not None:
        with open(os.path.join(dst, "config.json")) as f:
            raw = json.load(f)
        raw.update(config_update)
        raw = {k: v for k, v in raw.items() if v is not None}
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(raw, f)


def test_fp8_errors_name_the_tensors(fp8_pair, tmp_path):
    fp8_dir, _, qt = fp8_pair
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    no_scale = {k: v for k, v in qt.items() if k != name + "_scale_inv"}
    _rewrite(fp8_dir, tmp_path / "a", no_scale)
    with pytest.raises(CheckpointError, match=f"FP8 tensors without scales.*{name}"):
        load(str(tmp_path / "a"))
    bad = dict(qt)
    bad[name + "_scale_inv"] = np.ones((2, 2), np.float32)
    _rewrite(fp8_dir, tmp_path / "b", bad)
    with pytest.raises(CheckpointError, match="scales of the wrong block shape"):
        load(str(tmp_path / "b"))
    _rewrite(fp8_dir, tmp_path / "c", qt, {"quantization_config": None})
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load(str(tmp_path / "c"))


# ----------------------------------------------------------- engine (paged latent KV)
@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    """A dense-FFN MLA model with 2 MTP layers (more than DeepSeek's one, so every
    draft strategy runs) and random hub tensors."""
    folder = str(tmp_path_factory.mktemp("mla_engine"))
    write_random_checkpoint(folder, ds_config(num_nextn_predict_layers=2), seed=4)
    return load(folder, dtype="float32")


def test_paged_latent_cache_greedy_equals_dense_reference_for_every_method(mla_model):
    from mtp_jax.config import EngineConfig, SamplingParams, SpecConfig
    from mtp_jax.engine import Engine, Request
    from mtp_jax.reference import generate_reference

    prompts = [[3, 17, 5, 60, 2, 9, 33, 41, 8, 12, 1], [7, 7, 30, 2], [50] * 19]
    want = [generate_reference(mla_model, p, SamplingParams(max_tokens=14), max_len=64)[0]
            for p in prompts]
    eng_cfg = EngineConfig(max_batch=2, max_model_len=64, page_size=8, prefill_chunk=16,
                           steps_per_dispatch=4)
    # chain and eagle run on the one-MTP-layer golden models (test_golden_deepseek_v3)
    for method, k in (("none", 1), ("window", 2), ("per_step", 2)):
        eng = Engine(mla_model, SpecConfig(method=method, num_speculative_tokens=k), eng_cfg)
        res = eng.generate([Request(str(i), p, SamplingParams(max_tokens=14))
                            for i, p in enumerate(prompts)])
        assert [list(r.token_ids) for r in res] == [list(w) for w in want], method
    assert eng.layout.latent and eng.layout.head_dim == 20


def test_kv_lora_rank_the_tpu_kernel_cannot_tile_is_refused_with_the_reason(mla_model):
    from mtp_jax.config import EngineConfig, SpecConfig
    from mtp_jax.engine import Engine

    # kv_lora_rank 16: the TPU kernel needs the latent on 128-lane tiles.
    with pytest.raises(ConfigError, match="kv_lora_rank=16.*multiple of 128"):
        Engine(mla_model, SpecConfig(method="none"),
               EngineConfig(max_batch=2, max_model_len=64, attention_backend="tpu"))
