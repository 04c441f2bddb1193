"""Checkpoints: strict HF import for each layout (single file and sharded), HF export and
orbax round trips, and the errors corrupted checkpoints must give.

The checkpoints come from hf_fixtures, written with each real layout's tensor names and
shapes independently of the package's own key map; a numpy forward built directly from
those HF tensors proves the key map and the q/k/v and gate/up fusion.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_fixtures as F
import mtp_jax
from mtp_jax.checkpoint import CheckpointError, default_dtype, load_hf, save_hf, save_orbax, to_flat
from mtp_jax.checkpoint.safetensors_io import read_safetensors_header
from mtp_jax.models import from_hf

T = 9  # tokens per row of the forward checks (the shape test_model compiles too)


def assert_close(got, want, rtol=2e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got))
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6)
    assert err < rtol, f"relative error {err:.2e}"


def assert_same_params(a, b):
    fa, fb = to_flat(a.params), to_flat(b.params)
    assert fa.keys() == fb.keys()
    for key in fa:
        x, y = np.asarray(fa[key]), np.asarray(fb[key])
        assert x.dtype == y.dtype and x.shape == y.shape, key
        np.testing.assert_array_equal(x, y, err_msg=str(key))


@pytest.fixture(scope="session")
def written(tmp_path_factory):
    """{(layout, shards): (path, config, tensors)}, written on first use."""
    cache = {}

    def get(layout, shards=1):
        if (layout, shards) not in cache:
            path = str(tmp_path_factory.mktemp(f"{layout}_{shards}"))
            config, tensors = F.make_checkpoint(path, layout, shards=shards, seed=7)
            cache[layout, shards] = (path, config, tensors)
        return cache[layout, shards]

    return get


@pytest.fixture(scope="session")
def loaded(written):
    cache = {}

    def get(layout, shards=1):
        if (layout, shards) not in cache:
            cache[layout, shards] = mtp_jax.load(written(layout, shards)[0])
        return cache[layout, shards]

    return get


# ------------------------------------------------------------------ import per layout
@pytest.mark.parametrize("layout", F.LAYOUTS)
def test_load_and_forward_matches_numpy_from_hf_tensors(layout, written, loaded):
    path, config, tensors = written(layout)
    model = loaded(layout)
    cfg = model.config
    assert cfg == from_hf(config)
    assert model.dtype == jnp.float32 and model.path == path
    assert model.eos_token_ids == (config["eos_token_id"],)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, T)).astype(np.int32)
    logits, outs = F.forward_train_jit(model.graphdef, model.params, jnp.asarray(tokens))
    assert logits.shape == (2, T, cfg.vocab_size)
    assert [o.shape for o in outs] == [(2, T - k - 1, cfg.vocab_size)
                                       for k in range(cfg.num_mtp_modules)]
    arch = F.arch_of(config)
    weights = [F.mtp_weights(tensors, arch, k) for k in range(arch.num_mtp)]
    for b in range(2):
        want, pre, post = F.np_target(tensors, arch, tokens[b])
        assert_close(logits[b], want)
        for k, want_k in enumerate(F.np_mtp_chain(weights, arch, tokens[b], pre, post)):
            assert_close(outs[k][b], want_k)


@pytest.mark.parametrize("layout", F.LAYOUTS)
def test_sharded_checkpoint_loads_the_same_params(layout, written, loaded):
    path, _, _ = written(layout, shards=3)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) == 3
    assert_same_params(loaded(layout, 3), loaded(layout, 1))


def test_fused_parameters_hold_the_hf_tensors(written, loaded):
    # Spot checks of the documented layouts, independent of any forward.
    _, config, tensors = written("mimo")
    model = loaded("mimo").module()
    d, kv, g, h = 32, 2, 2, 8
    attn = model.target.layers[1].attn
    qkv = np.asarray(attn.qkv[...])  # [d, k, g + 2, h]
    q = tensors["model.layers.1.self_attn.q_proj.weight"].reshape(kv, g, h, d)
    k = tensors["model.layers.1.self_attn.k_proj.weight"].reshape(kv, h, d)
    v = tensors["model.layers.1.self_attn.v_proj.weight"].reshape(kv, h, d)
    np.testing.assert_array_equal(qkv[:, :, :g], q.transpose(3, 0, 1, 2))
    np.testing.assert_array_equal(qkv[:, :, g], k.transpose(2, 0, 1))
    np.testing.assert_array_equal(qkv[:, :, g + 1], v.transpose(2, 0, 1))
    bias = np.asarray(attn.qkv_bias[...])
    np.testing.assert_array_equal(bias[:, g], tensors["model.layers.1.self_attn.k_proj.bias"]
                                  .reshape(kv, h))
    gu = np.asarray(model.mtp[1].block.mlp.gate_up[...])
    np.testing.assert_array_equal(gu[:, 0], tensors["model.mtp_layers.1.mlp.gate_proj.weight"].T)
    np.testing.assert_array_equal(gu[:, 1], tensors["model.mtp_layers.1.mlp.up_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.mtp[0].input.enorm.weight[...]),
                                  tensors["model.mtp_layers.0.token_layernorm.weight"])
    np.testing.assert_array_equal(np.asarray(model.mtp[0].input.hnorm.weight[...]),
                                  tensors["model.mtp_layers.0.hidden_layernorm.weight"])


def test_tied_embeddings_checkpoint_has_no_lm_head(tmp_path):
    config, tensors = F.make_checkpoint(str(tmp_path), "mimo", tie_word_embeddings=True)
    assert "lm_head.weight" not in tensors
    model = mtp_jax.load(str(tmp_path))
    assert model.config.tie_word_embeddings and model.module().target.lm_head is None


def test_bf16_checkpoint_loads_as_bf16_and_converts_on_request(tmp_path):
    config, tensors = F.make_checkpoint(str(tmp_path), "step3p5", dtype=F.BF16,
                                        torch_dtype="bfloat16")
    header = read_safetensors_header(str(tmp_path / "model.safetensors"))
    assert {code for code, _, _ in header.values()} == {"BF16"}
    model = mtp_jax.load(str(tmp_path), dtype="bfloat16")
    assert model.dtype == jnp.bfloat16
    # with no dtype: the checkpoint's on accelerators, float32 on CPU (default_dtype)
    assert mtp_jax.load(str(tmp_path)).dtype == default_dtype("bfloat16")
    emb = np.asarray(model.module().target.embed[...])
    np.testing.assert_array_equal(emb, tensors["model.embed_tokens.weight"].astype(F.BF16))
    as_f32 = mtp_jax.load(str(tmp_path), dtype=jnp.float32)
    assert as_f32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(as_f32.module().target.embed[...]),
                                  emb.astype(np.float32))


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("layout", F.LAYOUTS)
def test_save_hf_round_trip_is_exact(layout, written, loaded, tmp_path):
    _, config, tensors = written(layout)
    model = loaded(layout)
    save_hf(model, str(tmp_path / "one"))
    again = mtp_jax.load(str(tmp_path / "one"))
    assert again.config == model.config
    assert_same_params(again, model)
    # The export writes back exactly the tensors it was loaded from, under the same names.
    header = read_safetensors_header(str(tmp_path / "one" / "model.safetensors"))
    assert set(header) == set(tensors)
    assert all(tuple(header[n][1]) == tensors[n].shape for n in tensors)
    save_hf(model, str(tmp_path / "sharded"), max_shard_bytes=20_000)
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    assert_same_params(mtp_jax.load(str(tmp_path / "sharded")), model)


def test_save_hf_writes_the_original_bytes(written, loaded, tmp_path):
    _, _, tensors = written("qwen3_next")
    save_hf(loaded("qwen3_next"), str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    base = 8 + int.from_bytes(open(path, "rb").read(8), "little")
    raw = open(path, "rb").read()
    for name, (code, shape, (b, e)) in read_safetensors_header(path).items():
        assert code == "F32"
        arr = np.frombuffer(raw[base + b: base + e], np.float32).reshape(shape)
        np.testing.assert_array_equal(arr, tensors[name], err_msg=name)


@pytest.fixture(scope="module")
def orbax_dir(loaded, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("orbax"))
    save_orbax(loaded("deepseek_v3"), path)
    return path


def test_orbax_round_trip_is_bit_exact(orbax_dir, loaded):
    model = loaded("deepseek_v3")
    again = mtp_jax.load(orbax_dir)
    assert again.config == model.config and again.dtype == jnp.float32
    assert again.eos_token_ids == model.eos_token_ids
    assert_same_params(again, model)


def test_orbax_restore_to_bf16(orbax_dir, loaded):
    model = loaded("deepseek_v3")
    again = mtp_jax.load(orbax_dir, dtype=jnp.bfloat16)
    assert again.dtype == jnp.bfloat16
    want, got = to_flat(model.params), to_flat(again.params)
    for key in want:
        assert got[key].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got[key]),
                                      np.asarray(want[key]).astype(F.BF16), err_msg=str(key))


def test_orbax_restore_with_sharding_function(orbax_dir, loaded):
    device = jax.devices()[0]
    seen = []

    def shardings(path, shape):
        seen.append((path, shape))
        return jax.sharding.SingleDeviceSharding(device)

    again = mtp_jax.load(orbax_dir, shardings=shardings)
    assert_same_params(again, loaded("deepseek_v3"))
    flat = to_flat(again.params)
    assert {p for p, _ in seen} == set(flat)
    assert all(tuple(shape) == flat[p].shape for p, shape in seen)
    for arr in flat.values():
        assert arr.sharding == jax.sharding.SingleDeviceSharding(device)


def test_hf_load_with_sharding_function(written, loaded):
    device = jax.devices()[0]
    again = mtp_jax.load(written("mimo")[0],
                         shardings=lambda p, s: jax.sharding.SingleDeviceSharding(device))
    assert_same_params(again, loaded("mimo"))


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "sharding_function"])
def test_loaded_params_do_not_alias_the_files(sharded, tmp_path):
    """Rewriting a checkpoint in place (saving over it, a quantized copy written to the same
    folder) leaves a loaded model as it was: on CPU the runtime may keep a host array's own
    memory as the device buffer, and a view of the memory-mapped file must not be one."""
    config, _ = F.make_checkpoint(str(tmp_path), "mimo", shards=1, seed=5)
    files = [os.path.join(tmp_path, f) for f in os.listdir(tmp_path)
             if f.endswith(".safetensors")]
    for name in files:  # data from a 64-byte boundary: the runtime aliases such arrays
        with open(name, "rb") as f:
            raw = f.read()
        n = int.from_bytes(raw[:8], "little")
        pad = -(8 + n) % 64
        with open(name, "wb") as f:
            f.write((n + pad).to_bytes(8, "little") + raw[8:8 + n] + b" " * pad + raw[8 + n:])
    device = jax.devices()[0]
    model = mtp_jax.load(str(tmp_path), shardings=(
        (lambda p, s: jax.sharding.SingleDeviceSharding(device)) if sharded else None))
    before = {k: np.array(v) for k, v in to_flat(model.params).items()}
    for name in files:  # every data byte set to 0x7f, header kept, same size and inode
        with open(name, "r+b") as f:
            start = 8 + int.from_bytes(f.read(8), "little")
            f.seek(0, os.SEEK_END)
            end = f.tell()
            f.seek(start)
            f.write(b"\x7f" * (end - start))
    assert files
    for key, value in to_flat(model.params).items():
        np.testing.assert_array_equal(np.asarray(value), before[key], err_msg=str(key))


# ------------------------------------------------------------------ corrupted checkpoints
LAYOUT = "deepseek_v3"  # 3 MTP modules with own heads and embeddings: the most names


@pytest.fixture(scope="module")
def base():
    config = F.hf_config(LAYOUT)
    return config, F.hf_tensors(config, seed=3)


def load_error(path) -> str:
    """The error's full text (every tensor of its lists named)."""
    with pytest.raises(CheckpointError) as err:
        mtp_jax.load(str(path))
    return err.value.full


def assert_names(message: str, names):
    for name in names:
        assert re.search(re.escape(name) + r"(?![\w.])", message), f"{name} not named in: " \
            f"{message[:2000]}"


def test_missing_tensors_are_all_named(base, tmp_path):
    config, tensors = base
    gone = ["model.layers.1.mlp.up_proj.weight", "model.layers.3.enorm.weight",
            "model.layers.4.shared_head.head.weight"]
    F.write_checkpoint(str(tmp_path), config, {k: v for k, v in tensors.items()
                                               if k not in gone})
    msg = load_error(tmp_path)
    assert "missing" in msg
    assert_names(msg, gone)


def test_unexpected_tensors_are_all_named(base, tmp_path):
    config, tensors = base
    extra = {"model.layers.0.mlp.experts.0.up_proj.weight": np.zeros((4, 4), np.float32),
             "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": np.zeros((4, 4), np.float32),
             "model.layers.5.enorm.weight": np.ones(32, np.float32)}
    F.write_checkpoint(str(tmp_path), config, {**tensors, **extra})
    msg = load_error(tmp_path)
    assert "unexpected" in msg
    assert_names(msg, extra)


def test_duplicate_tensor_across_two_shards(base, tmp_path):
    config, tensors = base
    names = sorted(tensors)
    first = {n: tensors[n] for n in names[::2]}
    second = {n: tensors[n] for n in names[1::2]}
    dup = names[0]
    second[dup] = tensors[dup]
    F.write_config(str(tmp_path), config)
    files = F.write_shards(str(tmp_path), [first, second])
    msg = load_error(tmp_path)
    assert "duplicate" in msg
    assert_names(msg, [dup] + files)


def test_mis_shaped_tensors_are_all_named(base, tmp_path):
    config, tensors = base
    bad = {"model.layers.3.eh_proj.weight": tensors["model.layers.3.eh_proj.weight"].T,
           "model.layers.0.self_attn.o_proj.weight":
               tensors["model.layers.0.self_attn.o_proj.weight"][:, :16],
           "model.norm.weight": np.ones(31, np.float32)}
    F.write_checkpoint(str(tmp_path), config, {**tensors, **bad})
    msg = load_error(tmp_path)
    assert "shape" in msg
    assert_names(msg, bad)


def test_int_tensor_where_a_weight_is_expected(base, tmp_path):
    config, tensors = base
    name = "model.layers.1.self_attn.k_proj.weight"
    F.write_checkpoint(str(tmp_path), config,
                       {**tensors, name: tensors[name].astype(np.int32)})
    msg = load_error(tmp_path)
    assert "I32" in msg or "int" in msg
    assert_names(msg, [name])


@pytest.mark.parametrize("keep", ["most", "header_only", "eight_bytes", "four_bytes"])
def test_truncated_safetensors_file(base, tmp_path, keep):
    config, tensors = base
    F.write_checkpoint(str(tmp_path), config, tensors)
    path = tmp_path / "model.safetensors"
    raw = path.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    cut = {"most": len(raw) - 1000, "header_only": header_end, "eight_bytes": 8,
           "four_bytes": 4}[keep]
    path.write_bytes(raw[:cut])
    msg = load_error(tmp_path)
    assert "truncated" in msg
    assert "model.safetensors" in msg
    if keep == "most":  # every tensor whose bytes run past the cut is named
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8: 8 + n])
        cut_short = [k for k, v in header.items()
                     if k != "__metadata__" and 8 + n + v["data_offsets"][1] > cut]
        assert cut_short
        assert_names(msg, cut_short)


def test_long_tensor_lists_are_summarised(base, tmp_path, capsys):
    """A truncated file fails on every tensor past the cut: the message names the first
    few and a count; the CLI writes the whole list to a file it names, or prints it under
    --verbose. Nothing compiles."""
    from mtp_jax.checkpoint.safetensors_io import SHOWN
    from mtp_jax.generate import main

    config, tensors = base
    F.write_checkpoint(str(tmp_path / "m"), config, tensors)
    path = tmp_path / "m" / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError) as err:
        mtp_jax.load(str(tmp_path / "m"))
    short, full = str(err.value), err.value.full
    many = full.count("truncated file")
    assert many > SHOWN and short.count("truncated file") == SHOWN
    assert f"and {many - SHOWN} more ({many} in all)" in short and len(short) < 1500
    (tmp_path / "in.jsonl").write_text('{"prompt_ids": [1]}\n')
    args = ["--model", str(tmp_path / "m"), "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out.jsonl")]
    assert main(args) == 1
    msg = capsys.readouterr().err
    listing = re.search(r"the full list: (\S+), or run with --verbose", msg)
    assert listing and f"({many} in all)" in msg and msg.count("truncated file") == SHOWN
    assert Path(listing.group(1)).read_text().count("truncated file") == many
    Path(listing.group(1)).unlink()
    assert main(args + ["--verbose"]) == 1
    msg = capsys.readouterr().err
    assert msg.count("truncated file") == many and "in all" not in msg


def test_nan_weights_are_all_named(base, tmp_path):
    config, tensors = base
    bad = {}
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.4.hnorm.weight"):
        arr = tensors[name].copy()
        arr.flat[3] = np.nan if "down" in name else np.inf
        bad[name] = arr
    F.write_checkpoint(str(tmp_path), config, {**tensors, **bad})
    msg = load_error(tmp_path)
    assert "NaN" in msg
    assert_names(msg, bad)


def test_index_naming_a_missing_shard(base, tmp_path):
    config, tensors = base
    files = F.write_checkpoint(str(tmp_path), config, tensors, shards=3)
    os.remove(tmp_path / files[1])
    msg = load_error(tmp_path)
    assert_names(msg, [files[1]])


def test_tensors_in_the_wrong_shard_or_missing_from_the_index(base, tmp_path):
    config, tensors = base
    names = sorted(tensors)
    parts = [{n: tensors[n] for n in names[::2]}, {n: tensors[n] for n in names[1::2]}]
    F.write_config(str(tmp_path), config)
    files = F.write_shards(str(tmp_path), parts)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    moved, dropped = names[0], names[1]
    index["weight_map"][moved] = files[1]
    del index["weight_map"][dropped]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = load_error(tmp_path)
    assert_names(msg, [moved, dropped])


def test_index_without_a_weight_map_object(base, tmp_path):
    config, tensors = base
    F.write_checkpoint(str(tmp_path), config, tensors, shards=2)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = sorted(index["weight_map"])  # a list of names, not name -> file
    index_path.write_text(json.dumps(index))
    assert "index" in load_error(tmp_path)


def test_overlapping_data_offsets(base, tmp_path):
    # safetensors forbids overlapping byte ranges (and holes): a header pointing two
    # tensors at the same bytes is a corrupt file, not a checkpoint whose norm weight
    # happens to hold the embedding's first values.
    config, tensors = base
    F.write_checkpoint(str(tmp_path), config, tensors)
    path = tmp_path / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8: 8 + n])
    start = header["model.embed_tokens.weight"]["data_offsets"][0]
    header["model.norm.weight"]["data_offsets"] = [start, start + 32 * 4]
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n:])
    assert_names(load_error(tmp_path), ["model.norm.weight"])


def test_shards_without_an_index(base, tmp_path):
    config, tensors = base
    F.write_checkpoint(str(tmp_path), config, tensors, shards=2)
    os.remove(tmp_path / "model.safetensors.index.json")
    assert "index" in load_error(tmp_path)


def test_config_contradicting_weights(base, tmp_path):
    # num_key_value_heads 2 -> 1: every k_proj and v_proj (target and MTP) is mis-shaped.
    config, tensors = base
    F.write_checkpoint(str(tmp_path), dict(config, num_key_value_heads=1), tensors)
    msg = load_error(tmp_path)
    layers = config["num_hidden_layers"] + config["num_nextn_predict_layers"]
    assert_names(msg, [f"model.layers.{i}.self_attn.{p}_proj.weight"
                       for i in range(layers) for p in "kv"])
    assert "model.layers.0.self_attn.q_proj.weight" not in msg


def test_config_with_fewer_mtp_layers_than_the_weights(base, tmp_path):
    config, tensors = base
    F.write_checkpoint(str(tmp_path), dict(config, num_nextn_predict_layers=2), tensors)
    msg = load_error(tmp_path)
    assert "unexpected" in msg
    assert_names(msg, ["model.layers.4.eh_proj.weight", "model.layers.4.embed_tokens.weight"])


def test_every_problem_in_one_error(base, tmp_path):
    config, tensors = base
    broken = {k: v for k, v in tensors.items() if k != "model.layers.2.hnorm.weight"}
    broken["model.layers.0.mlp.gate_proj.weight"] = broken[
        "model.layers.0.mlp.gate_proj.weight"][:10]
    broken["model.layers.2.mlp.experts.3.down_proj.weight"] = np.zeros((2, 2), np.float32)
    broken["model.layers.1.input_layernorm.weight"] = np.ones(32, np.int64)
    F.write_checkpoint(str(tmp_path), config, broken)
    msg = load_error(tmp_path)
    assert_names(msg, ["model.layers.2.hnorm.weight", "model.layers.0.mlp.gate_proj.weight",
                       "model.layers.2.mlp.experts.3.down_proj.weight",
                       "model.layers.1.input_layernorm.weight"])


def test_not_a_checkpoint_folder(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        mtp_jax.load(str(tmp_path / "nowhere"))
    assert "config.json" in load_error(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(F.hf_config("mimo")))
    assert "model.safetensors" in load_error(tmp_path)


def test_garbled_safetensors_header(base, tmp_path):
    config, tensors = base
    F.write_checkpoint(str(tmp_path), config, tensors)
    path = tmp_path / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[8:20] = b"\xff" * 12
    path.write_bytes(bytes(raw))
    assert "header" in load_error(tmp_path)


def test_load_hf_reports_before_reading_data(base, tmp_path):
    # A structural problem is reported from the headers alone: the data of every tensor
    # is garbage here (the wrong byte count would also be caught), yet the error is about
    # the missing tensor, not about NaNs.
    config, tensors = base
    gone = "model.layers.0.post_attention_layernorm.weight"
    nan = {k: np.full_like(v, np.nan) for k, v in tensors.items() if k != gone}
    F.write_checkpoint(str(tmp_path), config, nan)
    with pytest.raises(CheckpointError) as err:
        load_hf(str(tmp_path))
    assert gone in str(err.value) and "NaN" not in str(err.value)


@pytest.mark.parametrize("damage", ["delete_params_file", "garble_params_file",
                                    "truncate_largest_data_file", "delete_params_dir",
                                    "delete_marker"])
def test_corrupted_orbax_folder(orbax_dir, tmp_path, damage):
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(orbax_dir, path)
    params = path / "params"
    files = sorted(p for p in params.rglob("*") if p.is_file())
    assert files
    if damage == "delete_params_file":
        for p in files:
            if p.name in ("manifest.ocdbt", "_METADATA") or p.parent.name == "d":
                p.unlink()
    elif damage == "garble_params_file":
        for p in files:
            if p.parent.name == "d" or p.name == "manifest.ocdbt":
                p.write_bytes(b"\x00garbage" * 8)
    elif damage == "truncate_largest_data_file":
        largest = max(files, key=lambda p: p.stat().st_size)
        largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    elif damage == "delete_params_dir":
        shutil.rmtree(params)
    else:
        os.remove(path / "mtp_jax_orbax.json")
    with pytest.raises(CheckpointError):
        mtp_jax.load(str(path))
