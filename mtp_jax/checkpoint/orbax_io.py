"""Orbax save / restore of a model's converted parameters (each shard read directly onto
its device), with config.json, the tokenizer and the KV scales beside them; quantized
parameters are saved and restored quantized."""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from .. import qarray, quant
from ..models import from_hf, to_hf
from .kv_scales import load_kv_scales, save_kv_scales
from .params import (Model, abstract_model, from_params, quantize_model,
                     refuse_run_time_options, to_flat)
from .safetensors_io import CheckpointError
from .tokenizer import (copy_side_files, eos_ids, load_chat, load_generation_config,
                        load_tokenizer)

ORBAX_MARKER = "mtp_jax_orbax.json"


def _str_keys(flat: dict) -> dict:
    """{"a/b/c": array}; a quantized parameter as "a/b/c.values" and "a/b/c.scale"."""
    out = {}
    for k, v in flat.items():
        key = "/".join(map(str, k))
        if qarray.is_quantized(v):
            out[key + ".values"], out[key + ".scale"] = v.values, v.scale
        else:
            out[key] = v
    return out


def save_orbax(model: Model, path: str) -> None:
    """Save converted params with orbax, plus config.json, tokenizer.json and the chat
    template and generation config files of the folder the model came from beside them."""
    refuse_run_time_options(model)
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(path, "params"), _str_keys(to_flat(model.params)), force=True)
    ckptr.wait_until_finished()
    hf = to_hf(model.config)
    if model.eos_token_ids:
        hf["eos_token_id"] = list(model.eos_token_ids)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    quantized = {"/".join(map(str, k)): {"values": str(v.values.dtype),
                                         "scale": list(v.scale.shape)}
                 for k, v in to_flat(model.params).items() if qarray.is_quantized(v)}
    with open(os.path.join(path, ORBAX_MARKER), "w") as f:
        json.dump({"format": "mtp_jax orbax params", "dtype": str(model.dtype),
                   "quantized": quantized}, f)
    if model.tokenizer is not None:
        model.tokenizer.save(os.path.join(path, "tokenizer.json"))
    copy_side_files(model.path, path)
    save_kv_scales(model, path)


def load_orbax(path: str, *, dtype=None, shardings: Optional[Callable] = None,
               quantize: Optional[str] = None) -> Model:
    """Restore params saved by `save_orbax` into `dtype` and, if given, `shardings(path,
    shape) -> jax.sharding.Sharding` (each shard read directly onto its device); quantized
    parameters come back quantized. quantize: quantize an unquantized save after restoring."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    cfg = from_hf(path)
    try:
        with open(os.path.join(path, ORBAX_MARKER)) as f:
            marker = json.load(f)
        saved_dtype = jnp.dtype(marker.get("dtype", "float32"))
        quantized = {k: (jnp.dtype(v["values"]), tuple(v["scale"]))
                     for k, v in marker.get("quantized", {}).items()}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError,
            KeyError) as e:
        raise CheckpointError(f"{path}: unreadable {ORBAX_MARKER}: {type(e).__name__}: "
                              f"{e}") from None
    if not jnp.issubdtype(saved_dtype, jnp.floating):
        raise CheckpointError(f"{path}: {ORBAX_MARKER} names dtype {saved_dtype}, not a "
                              "float type")
    if quantized and quant.check_mode(quantize) is not None:
        raise quant.QuantizationError(f"{path} holds a quantized model: load it without "
                                      "quantize=")
    dtype = jnp.dtype(dtype or saved_dtype)
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    target = {}
    for p, var in state.flat_state():
        shape, pdt = var.get_value().shape, var.get_value().dtype
        sh = shardings(tuple(p), shape) if shardings else jax.sharding.SingleDeviceSharding(
            jax.devices()[0])
        key = "/".join(map(str, p))
        if key in quantized:
            vdt, sshape = quantized[key]
            rep = sh if not shardings else jax.sharding.NamedSharding(
                sh.mesh, jax.sharding.PartitionSpec())
            target[key + ".values"] = jax.ShapeDtypeStruct(shape, vdt, sharding=sh)
            target[key + ".scale"] = jax.ShapeDtypeStruct(sshape, jnp.float32, sharding=rep)
        else:
            target[key] = jax.ShapeDtypeStruct(shape, pdt, sharding=sh)
    params_dir = os.path.join(path, "params")
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"{path}: no orbax params folder")
    try:
        restored = ocp.StandardCheckpointer().restore(params_dir, target)
    except Exception as e:  # orbax raises many types for corrupt folders
        raise CheckpointError(f"{path}: orbax restore failed: {type(e).__name__}: "
                              f"{str(e)[:500]}") from None
    flat = {}
    for p, var in state.flat_state():
        key, pdt = "/".join(map(str, p)), var.get_value().dtype
        if key in quantized:
            flat[tuple(p)] = qarray.QArray(restored[key + ".values"], restored[key + ".scale"])
            continue
        arr = restored[key]
        flat[tuple(p)] = arr if arr.dtype == pdt else arr.astype(pdt)
    model = from_params(cfg, flat, dtype, eos_token_ids=eos_ids(path), path=path,
                        tokenizer=load_tokenizer(path), kv_scales=load_kv_scales(path, cfg),
                        chat_template=load_chat(path),
                        generation=load_generation_config(path))
    return quantize_model(model, quantize) if quantize else model
