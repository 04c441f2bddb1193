"""MoE FFN: routers and experts against float64 numpy, configs, loading and its errors.

The numpy router below is written from the published routing rules (DeepSeek-V3 /
GLM-4.5 `noaux_tc`: sigmoid scores, bias for the choice only, groups scored by their two
best experts; softmax top-k) independently of mtp_jax.moe. The golden files of
test_golden_glm4_moe.py check the whole model against HF transformers' own classes.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.checkpoint import CheckpointError, load, save_hf, to_flat
from mtp_jax.config import ConfigError, MoEConfig
from mtp_jax.models import from_hf, to_hf
from mtp_jax.moe import MoE, route
from mtp_jax.mtp import init_model
from mtp_jax.specs import DenseFFN
from spec_models import small_config

from flax import nnx


# ----------------------------------------------------------------- numpy reference
def np_route(x, w_router, bias, m: MoEConfig):
    logits = x.astype(np.float64) @ w_router.astype(np.float64)  # [n, e]
    ids, weights = [], []
    for row in logits:
        if m.router == "softmax":
            scores = np.exp(row - row.max())
            scores /= scores.sum()
            choice = scores.copy()
        else:
            scores = 1 / (1 + np.exp(-row))
            choice = scores + (bias if bias is not None else 0)
            if m.n_group > 1:
                per = m.num_experts // m.n_group
                g = choice.reshape(m.n_group, per)
                gscore = np.sort(g, axis=1)[:, ::-1][:, :min(2, per)].sum(1)
                keep = np.argsort(-gscore, kind="stable")[:m.topk_group]
                mask = np.zeros(m.num_experts, bool)
                for k in keep:
                    mask[k * per:(k + 1) * per] = True
                choice = np.where(mask, choice, -np.inf)
        top = np.argsort(-choice, kind="stable")[:m.top_k]
        wt = scores[top]
        if m.norm_topk_prob:
            wt = wt / (wt.sum() + 1e-20)
        ids.append(top)
        weights.append(wt * m.routed_scaling_factor)
    return np.array(ids), np.array(weights)


def np_silu(x):
    return x / (1 + np.exp(-x))


def np_moe(x, p, m: MoEConfig):
    """p: {router [d,e], router_bias, experts_gate_up [e,d,2,f], experts_down [e,f,d], shared}."""
    ids, w = np_route(x, p["router"], p.get("router_bias"), m)
    out = np.zeros_like(x, dtype=np.float64)
    for n in range(x.shape[0]):
        for j, e in enumerate(ids[n]):
            gu = x[n] @ p["experts_gate_up"][e].reshape(x.shape[1], -1)
            f = gu.shape[0] // 2
            out[n] += w[n, j] * ((np_silu(gu[:f]) * gu[f:]) @ p["experts_down"][e])
    if "shared" in p:
        gu = np.einsum("nd,dcf->ncf", x, p["shared"]["gate_up"])
        out += (np_silu(gu[:, 0]) * gu[:, 1]) @ p["shared"]["down"]
    return out


MOES = {
    "sigmoid_groups_bias": MoEConfig(num_experts=16, top_k=4, intermediate_size=32, n_group=4,
                                     topk_group=2, routed_scaling_factor=2.5, num_shared=2),
    "sigmoid_nonorm": MoEConfig(num_experts=8, top_k=2, intermediate_size=16,
                                norm_topk_prob=False, routed_scaling_factor=1.5, num_shared=1),
    "sigmoid_no_bias": MoEConfig(num_experts=8, top_k=3, intermediate_size=16, score_bias=False),
    "softmax_norm": MoEConfig(num_experts=8, top_k=2, intermediate_size=16, router="softmax",
                              score_bias=False),
    "softmax_raw": MoEConfig(num_experts=6, top_k=3, intermediate_size=16, router="softmax",
                             score_bias=False, norm_topk_prob=False),
}


def _moe_params(mod: MoE, rng):
    """Give every parameter fresh random values (biases too) and return them as numpy."""
    graphdef, state = nnx.split(mod)
    out = {}
    for path, var in state.flat_state():
        val = rng.standard_normal(var.get_value().shape) * (0.3 if path[-1] != "router_bias"
                                                            else 0.2)
        var.set_value(jnp.asarray(val, var.get_value().dtype))
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = val
    return nnx.merge(graphdef, state), out


@pytest.mark.parametrize("name, backend", [(n, "reference") for n in sorted(MOES)]
                         + [("sigmoid_groups_bias", "gpu"), ("softmax_norm", "tpu"),
                            ("sigmoid_nonorm", "ragged_dot")])
def test_moe_ffn_matches_numpy(name, backend, monkeypatch):
    """Every expert-compute backend (GPU / TPU kernels in interpret mode on CPU, natively
    on their own device)."""
    if backend in ("gpu", "tpu") and jax.default_backend() not in ("cpu", backend):
        pytest.skip(f"the {backend} kernel runs in interpret mode on CPU or natively on a "
                    f"{backend}, not on {jax.default_backend()}")
    monkeypatch.setenv("MTP_JAX_MOE_BACKEND", backend)
    m = MOES[name]
    rng = np.random.default_rng(len(name))
    mod, p = _moe_params(MoE(m, 32, dtype=jnp.float32, rngs=nnx.Rngs(params=0)), rng)
    x = rng.standard_normal((3, 7, 32))
    got = jax.jit(lambda x: mod(x))(jnp.asarray(x, jnp.float32))
    want = np_moe(x.reshape(-1, 32), p, m).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    ids, w = route(jnp.asarray(x, jnp.float32), mod.router[...],
                   None if mod.router_bias is None else mod.router_bias[...], m)
    wids, ww = np_route(x.reshape(-1, 32), p["router"], p.get("router_bias"), m)
    np.testing.assert_array_equal(np.asarray(ids).reshape(-1, m.top_k), wids)
    np.testing.assert_allclose(np.asarray(w).reshape(-1, m.top_k), ww, rtol=1e-5, atol=1e-6)


def test_bias_steers_the_choice_but_not_the_weights():
    m = MoEConfig(num_experts=4, top_k=1, intermediate_size=8)
    x = jnp.ones((1, 4))
    router = jnp.asarray(np.diag([1.0, 0.5, 0.0, -1.0]))  # expert 0 scores best
    ids, w = route(x, router, jnp.asarray([0.0, 0.0, 0.0, 5.0]), m)
    assert int(ids[0, 0]) == 3  # the bias picks expert 3 ...
    # ... whose weight is its own unbiased score (normalised over the one chosen: 1).
    np.testing.assert_allclose(np.asarray(w), [[1.0]])
    m2 = dataclasses.replace(m, norm_topk_prob=False)
    _, w2 = route(x, router, jnp.asarray([0.0, 0.0, 0.0, 5.0]), m2)
    np.testing.assert_allclose(np.asarray(w2), [[1 / (1 + np.e)]], rtol=1e-6)


def test_group_limit_excludes_experts_outside_the_best_groups():
    # 4 groups of 2; the single best expert sits in a group whose partner is terrible.
    m = MoEConfig(num_experts=8, top_k=2, intermediate_size=8, n_group=4, topk_group=1,
                  score_bias=False)
    logits = np.array([[5.0, -9.0, 2.0, 2.0, 0, 0, -1, -1]])
    ids, _ = route(jnp.ones((1, 8)), jnp.asarray(np.diag(logits[0])), None, m)
    assert sorted(np.asarray(ids)[0].tolist()) == [2, 3]


def test_softmax_router_matches_hf_qwen3_moe_block():
    """The softmax top-k router + experts against transformers' Qwen3MoeSparseMoeBlock."""
    data = np.load(os.path.join(os.path.dirname(__file__), "golden", "qwen3_moe_block.npz"))
    e, d = data["gate.weight"].shape
    k = int(data["num_experts_per_tok"])
    f = data["experts.0.gate_proj.weight"].shape[0]
    for norm in (True, False):
        m = MoEConfig(num_experts=e, top_k=k, intermediate_size=f, router="softmax",
                      score_bias=False, norm_topk_prob=norm)
        mod = MoE(m, d, dtype=jnp.float32, rngs=nnx.Rngs(params=0))
        mod.router.set_value(jnp.asarray(data["gate.weight"].T))
        mod.experts_gate_up.set_value(jnp.asarray(np.stack([np.stack(
            [data[f"experts.{i}.gate_proj.weight"].T, data[f"experts.{i}.up_proj.weight"].T], 1)
            for i in range(e)])))
        mod.experts_down.set_value(jnp.asarray(np.stack(
            [data[f"experts.{i}.down_proj.weight"].T for i in range(e)])))
        x = jnp.asarray(data["x"])
        ids, _ = route(x, mod.router[...], None, m)
        np.testing.assert_array_equal(np.sort(np.asarray(ids), -1),
                                      np.sort(data["topk_indices"], -1))
        np.testing.assert_allclose(np.asarray(mod(x)),
                                   data[f"y_norm_topk_prob_{str(norm).lower()}"],
                                   rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------- configs
def glm_config(**kw):
    raw = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
           "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 16, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
           "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
           "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5,
           "num_nextn_predict_layers": 1, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
           "torch_dtype": "float32", "max_position_embeddings": 128}
    raw.update(kw)
    return raw


def test_glm_config_reads_every_moe_and_attention_field():
    cfg = from_hf(glm_config())
    assert cfg.layout == "glm4_moe" and cfg.qk_norm and cfg.attention_bias
    assert cfg.rotary_dim == 8 and cfg.rope_theta == 1e6
    assert cfg.moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=16, n_group=2,
                                topk_group=1, routed_scaling_factor=2.5, num_shared=1,
                                first_dense=1)
    assert [cfg.layer_spec(i).ffn for i in range(3)] == [DenseFFN(48), cfg.moe, cfg.moe]
    # transformers >= 5 writes theta and GLM's partial factor into rope_parameters.
    new = glm_config(rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                      "partial_rotary_factor": 0.25})
    del new["rope_theta"], new["partial_rotary_factor"]
    cfg2 = from_hf(new)
    assert cfg2.rope_theta == 5e5 and cfg2.rotary_dim == 4
    # transformers' default partial factor for GLM-4-MoE is 0.5.
    bare = glm_config()
    del bare["partial_rotary_factor"]
    assert from_hf(bare).rotary_dim == 8
    assert from_hf(to_hf(cfg)) == cfg


@pytest.mark.parametrize("extra, field", [
    ({"scoring_func": "sparsemixer"}, "sparsemixer"),
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 3}, "topk_group"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ({"moe_intermediate_size": "big"}, "moe_intermediate_size"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"n_routed_experts": None}, "is given but n_routed_experts is not"),
])
def test_bad_moe_config_names_the_field(extra, field):
    with pytest.raises(ConfigError, match=field):
        from_hf(glm_config(**extra))


def test_deepseek_softmax_router_config():
    raw = glm_config(model_type="deepseek_v3", scoring_func="softmax", topk_method="greedy",
                     n_group=1)
    del raw["use_qk_norm"], raw["partial_rotary_factor"]
    cfg = from_hf(raw)
    assert cfg.moe.router == "softmax" and not cfg.moe.score_bias
    with pytest.raises(ConfigError, match="softmax"):
        from_hf(dict(raw, n_group=2))


def test_moe_outside_the_moe_layouts_is_refused():
    with pytest.raises(ConfigError, match="MoE"):
        small_config("mimo", moe=MOES["sigmoid_nonorm"])


# -------------------------------------------------------------------- checkpoints
def moe_model(**kw):
    cfg = from_hf(glm_config(**kw))
    model = init_model(cfg, seed=3)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(5)
    for path, var in state.flat_state():  # random biases and norms too
        v = var.get_value()
        if path[-1] in ("router_bias", "qkv_bias", "weight"):
            var.set_value(jnp.asarray(rng.standard_normal(v.shape) * 0.1 + (
                1.0 if path[-1] == "weight" else 0.0), v.dtype))
    from mtp_jax.checkpoint import Model
    return Model(cfg, graphdef, state)


@pytest.fixture(scope="module")
def glm_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm")
    model = moe_model()
    save_hf(model, str(path), dtype="float32", max_shard_bytes=60_000)
    return path, model


def test_hub_names_round_trip(glm_folder):
    path, model = glm_folder
    with open(path / "model.safetensors.index.json") as f:
        names = set(json.load(f)["weight_map"])
    for want in ("model.layers.1.mlp.experts.7.gate_proj.weight",
                 "model.layers.1.mlp.experts.0.down_proj.weight",
                 "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.layers.1.mlp.shared_experts.up_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "model.layers.2.eh_proj.weight",
                 "model.layers.2.mlp.experts.3.up_proj.weight",
                 "model.layers.2.shared_head.head.weight", "model.layers.2.embed_tokens.weight"):
        assert want in names
    again = load(str(path))
    a, b = to_flat(again.params), to_flat(model.params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
    assert again.params["target"]["layers"][1]["mlp"]["router"][...].dtype == jnp.float32


def _rewrite(path, dst, drop=(), reshape=None):
    """Copy a sharded checkpoint folder, dropping or re-shaping named tensors."""
    from mtp_jax.checkpoint.safetensors_io import (read_safetensors_header, read_tensor,
                                                   write_safetensors)
    import shutil
    import struct

    shutil.copytree(path, dst)
    for fn in os.listdir(dst):
        if not fn.endswith(".safetensors"):
            continue
        fp = os.path.join(dst, fn)
        with open(fp, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        tensors = {k: np.array(read_tensor(fp, (8 + n, v)))
                   for k, v in read_safetensors_header(fp).items() if k not in drop}
        if reshape:
            for k in list(tensors):
                if k == reshape:
                    tensors[k] = tensors[k][:-1]
        write_safetensors(fp, tensors)
    index = os.path.join(dst, "model.safetensors.index.json")
    with open(index) as f:
        idx = json.load(f)
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if k not in drop}
    with open(index, "w") as f:
        json.dump(idx, f)


def test_missing_and_misshaped_experts_are_named(glm_folder, tmp_path):
    path, _ = glm_folder
    gone = "model.layers.1.mlp.experts.5.up_proj.weight"
    _rewrite(path, tmp_path / "a", drop=(gone,))
    with pytest.raises(CheckpointError, match=r"missing tensors: \['model.layers.1.mlp.experts"
                                              r".5.up_proj.weight'\]"):
        load(str(tmp_path / "a"))
    bad = "model.layers.2.mlp.experts.2.down_proj.weight"
    _rewrite(path, tmp_path / "b", reshape=bad)
    with pytest.raises(CheckpointError, match=f"{bad} has shape"):
        load(str(tmp_path / "b"))
    # A config that says 16 experts against a checkpoint holding 8.
    _rewrite(path, tmp_path / "c")
    with open(tmp_path / "c" / "config.json") as f:
        raw = json.load(f)
    raw["n_routed_experts"] = 16
    with open(tmp_path / "c" / "config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(CheckpointError) as err:  # the message summarises; .full names all
        load(str(tmp_path / "c"))
    assert "experts.15.gate_proj.weight" in err.value.full


def test_glm46_style_mtp_without_own_embedding_and_head(glm_folder, tmp_path):
    path, model = glm_folder
    drop = ("model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight")
    _rewrite(path, tmp_path / "g", drop=drop)
    loaded = load(str(tmp_path / "g"))
    assert not loaded.config.mtp_own_embed and not loaded.config.mtp_own_head
    assert loaded.params["mtp"][0].get("head") is None or \
        loaded.params["mtp"][0]["head"] is None


def test_loading_streams_one_parameter_at_a_time(tmp_path):
    """Peak host memory while loading stays near the largest parameter, not the model."""
    model = moe_model(hidden_size=128, moe_intermediate_size=256, n_routed_experts=16,
                      num_hidden_layers=6, vocab_size=64, intermediate_size=64)
    save_hf(model, str(tmp_path), dtype="float32", max_shard_bytes=4_000_000)
    total = sum(os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path)
                if f.endswith(".safetensors"))
    largest = max(np.asarray(v).nbytes for v in to_flat(model.params).values())
    assert total > 8 * largest  # the experts are spread over many parameters
    gc.collect()
    tracemalloc.start()
    try:
        loaded = load(str(tmp_path))
        gc.collect()
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # On CPU the runtime keeps some host arrays (those on a 64-byte boundary) as the device
    # buffers themselves: that memory is the loaded model's, still held at the end (0.2x
    # to 2.3x the largest parameter from run to run). What loading needs on top of the model
    # is the peak less that: one parameter being built, the previous one's host array behind
    # its copy, and the finiteness check (1.68x-1.76x in 12 runs, whatever was aliased); the
    # model is 9.8x. A loader that read all before placing any would show here every
    # parameter the runtime copied rather than kept (most of them).
    assert peak - kept < 3 * largest, (peak, kept, largest, total)
    assert to_flat(loaded.params).keys() == to_flat(model.params).keys()
