"""HF-layout checkpoints: strict import (`load_hf`) and export (`save_hf`), written once
over the model family's tensor map (`hf_key_map`: `mtp_jax.models` `Family.entries`).

Import is strict: a missing, unexpected, duplicate (in two shards), mis-shaped or
non-float tensor is an error naming every offending tensor, raised from the file headers
before any data is read or anything is compiled. Import streams: tensors are
memory-mapped, each parameter is built, converted to its dtype and placed on its devices
before the next one is read (placement.py), so a model larger than host memory loads onto
a mesh.

Block-scaled checkpoints (block_scaled.py): on a GPU or TPU the weights stay quantized on
the device (a `qarray.QArray` per parameter, scales expanded per output channel, the
contraction blocks kept), so a model published in FP8 takes FP8 bytes; on CPU, or with
`dequantize=True`, they are dequantized as they are read (`BlockScaled`) to the load
dtype. `quantize=` quantizes an unquantized checkpoint parameter by parameter as it loads;
`save_hf` writes a quantized model as it is held, so quantizing is done once.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from .. import qarray, quant
from ..config import ModelConfig
from ..models import family, from_hf, to_hf
from ..models.tensors import Entry
from .block_scaled import BlockScaled, block_scales, check_quantized, keep_quantized
from .kv_scales import load_kv_scales, save_kv_scales
from .params import Model, abstract_model, from_params, refuse_run_time_options, to_flat
from .placement import place, place_quantized
from .safetensors_io import (FLOAT_CODES, CheckpointError, hf_files, listed, problems_error,
                             read_safetensors_header, read_tensor, write_safetensors)
from .tokenizer import (copy_side_files, eos_ids, load_chat, load_generation_config,
                        load_tokenizer)


def hf_key_map(cfg: ModelConfig) -> list[Entry]:
    """Every parameter of the model with the HF tensors it is built from."""
    return family(cfg.layout).entries(cfg)


def load_hf(path: str, *, dtype=None, config: Optional[ModelConfig] = None,
            shardings: Optional[Callable] = None, quantize: Optional[str] = None,
            dequantize: Optional[bool] = None) -> Model:
    """Strict import of an HF-layout folder (config.json + safetensors, single or sharded).

    shardings: `shardings(param path, shape) -> jax.sharding.Sharding`, or None for the
    first device. Parameters are streamed onto their devices one at a time (module doc).
    quantize: None, or a `quant.MODES` mode: each matmul weight is quantized on its
    devices as soon as it is placed. dequantize: for a block-scaled checkpoint, True
    dequantizes to `dtype`, False keeps the weights quantized, None decides by device
    (`keep_quantized`).
    """
    mode = quant.check_mode(quantize)
    cfg = config or from_hf(path)
    if mode is not None and cfg.quantization is not None:
        raise quant.QuantizationError(
            f"{path} is already quantized ({cfg.quantization.fmt} in "
            f"{list(cfg.quantization.block)} blocks): load it without quantize=, or quantize "
            "its unquantized checkpoint")
    quant.check_backend(mode)
    dtype = jnp.dtype(dtype or cfg.dtype)
    files, weight_map = hf_files(path)
    found: dict[str, tuple] = {}
    dup: dict[str, list] = {}
    for fpath in files:
        with open(fpath, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8)) if os.path.getsize(fpath) >= 8 else (0,)
        for name, entry in read_safetensors_header(fpath).items():
            if name in found:
                dup.setdefault(name, [found[name][0]]).append(fpath)
            found[name] = (fpath, 8 + n, entry)
    fam = family(cfg.layout)
    found = {k: v for k, v in found.items()
             if not any(p.match(k) for p in fam.ignored_tensors)}
    found = canonical_names(fam.tensor_aliases, found)
    if config is None:  # facts config.json leaves out, read from the tensor names
        cfg = fam.fit_to_checkpoint(cfg, found, path)
    fp8, problems = check_quantized(cfg, found)
    scale_of = {w: found.pop(sc) for w, sc in fp8.items()}
    entries = hf_key_map(cfg)
    expected = {nm: shp for e in entries for nm, shp in zip(e.names, e.shapes)}
    if dup:
        twice = [f"{k} in {[os.path.basename(x) for x in v]}" for k, v in sorted(dup.items())]
        problems.append(lambda n: "duplicate tensors (in several files): "
                        + listed(twice, n, ", "))
    missing = sorted(set(expected) - set(found))
    if missing:
        problems.append(lambda n: f"missing tensors: {listed(missing, n)}")
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        problems.append(lambda n: f"unexpected tensors: {listed(unexpected, n)}")
    shaped = sorted(f"{k} has shape {list(found[k][2][1])}, expected {list(expected[k])}"
                    for k in set(found) & set(expected) if found[k][2][1] != tuple(expected[k]))
    if shaped:
        problems.append(lambda n: "mis-shaped tensors: " + listed(shaped, n, "; "))
    typed = sorted(f"{k} has dtype {found[k][2][0]}" for k in set(found) & set(expected)
                   if found[k][2][0] not in FLOAT_CODES and k not in fp8)
    if typed:
        problems.append(lambda n: "non-float tensors where weights are expected: "
                        + listed(typed, n, "; "))
    if weight_map is not None:
        wrong = sorted(k for k, (fp, _, _) in found.items()
                       if k in weight_map and os.path.basename(fp) != weight_map[k])
        unindexed = sorted(k for k in found if k not in weight_map)
        if wrong:
            problems.append(lambda n: "tensors stored in a different shard than the index "
                            f"says: {listed(wrong, n)}")
        if unindexed:
            problems.append(lambda n: f"tensors missing from the index: {listed(unindexed, n)}")
    if problems:
        raise problems_error(f"{path}: checkpoint does not match its config ({cfg.layout}): ",
                             problems, " | ")
    abstract = abstract_model(cfg, dtype)
    axes = quant.quant_axes(abstract)
    _, state = nnx.split(abstract)
    want = {tuple(p): v.get_value() for p, v in state.flat_state()}
    keep = bool(scale_of) and keep_quantized(cfg.quantization, dequantize)
    flat, nonfinite, inflight = {}, [], []
    for e in entries:
        # device_put is asynchronous and holds its host array until the copy is done: at
        # most one parameter's copy runs behind this read, else a disk faster than the
        # copies would pile up host arrays (host memory stays near one parameter)
        while len(inflight) > 1:
            jax.block_until_ready(flat[inflight.pop(0)])
        inflight.append(e.path)
        raw = [read_tensor(found[name][0], found[name][1:]) for name in e.names]
        if keep and e.path in axes and all(nm in scale_of for nm in e.names):
            scales = [BlockScaled(a, read_tensor(scale_of[nm][0], scale_of[nm][1:]),
                                  cfg.quantization.block, scales_only=True)
                      for nm, a in zip(e.names, raw)]
            flat[e.path] = place_quantized(e, raw, scales, axes[e.path],
                                            cfg.quantization.block[1], want[e.path],
                                            shardings, nonfinite)
            continue
        arrs = [BlockScaled(a, read_tensor(scale_of[nm][0], scale_of[nm][1:]),
                            cfg.quantization.block) if nm in scale_of else a
                for nm, a in zip(e.names, raw)]
        flat[e.path] = place(e, arrs, want[e.path], shardings, nonfinite)
        if mode is not None and e.path in axes:
            flat[e.path] = quant.quantize_array(flat[e.path], axes[e.path], mode)
        del arrs, raw
    if nonfinite:
        raise problems_error(f"{path}: tensors holding NaN or Inf: ",
                             [lambda n: listed(sorted(nonfinite), n)], "")
    return from_params(cfg, flat, dtype, eos_token_ids=eos_ids(path), path=path,
                       tokenizer=load_tokenizer(path), kv_scales=load_kv_scales(path, cfg),
                       chat_template=load_chat(path),
                       generation=load_generation_config(path))



def canonical_names(aliases: tuple, found: dict) -> dict:
    """`found` with other spellings of tensor names (a family's `tensor_aliases`) rewritten
    to the one its tensor map uses."""
    if not aliases:
        return found
    out = {}
    for name, where in found.items():
        for pattern, repl in aliases:
            name = pattern.sub(repl, name)
        if name in out:
            raise CheckpointError(f"tensor {name} is stored twice (under two spellings)")
        out[name] = where
    return out


def save_hf(model: Model, path: str, *, dtype=None, max_shard_bytes: Optional[int] = None,
            extra_config: Optional[dict] = None) -> None:
    """Export in the HF layout of `model.config.layout` (sharded if max_shard_bytes is set),
    with the chat template and generation config files of the folder the model came from."""
    refuse_run_time_options(model)
    os.makedirs(path, exist_ok=True)
    cfg = model.config
    dt = np.dtype(ml_dtypes.bfloat16) if (dtype or cfg.dtype) == "bfloat16" else np.dtype(
        dtype or cfg.dtype)
    flat = to_flat(model.params)
    tensors, scales = {}, {}
    for e in hf_key_map(cfg):
        # The router bias is published in float32 whatever the weights' dtype.
        if not e.exported:
            continue
        v = flat[e.path]
        if qarray.is_quantized(v):  # stored as held: values and per-element scales
            vals = np.asarray(v.values)
            full = qarray.expand_scale(np.asarray(v.scale), vals.shape)
            for name, arr, sc in zip(e.names, e.split(vals), e.split(full)):
                tensors[name], scales[name] = np.asarray(arr), np.asarray(sc, np.float32)
            continue
        to = np.float32 if e.path[-1] == "router_bias" else dt
        arrays = (e.export(flat) if e.export is not None
                  else e.split(np.asarray(v, np.float32)))
        for name, arr in zip(e.names, arrays):
            tensors[name] = np.asarray(arr).astype(to)
    quant_config = block_scales(tensors, scales)
    hf = to_hf(cfg)
    hf["torch_dtype"] = str(dt) if dt != np.dtype(ml_dtypes.bfloat16) else "bfloat16"
    if model.eos_token_ids:
        hf["eos_token_id"] = list(model.eos_token_ids)
    if quant_config:
        hf["quantization_config"] = quant_config
    hf.update(extra_config or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    save_kv_scales(model, path)
    copy_side_files(model.path, path)  # chat template, generation config, tokenizer config
    if not max_shard_bytes:
        write_safetensors(os.path.join(path, "model.safetensors"), tensors)
        return
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        nb = tensors[name].nbytes
        if cur and size + nb > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += nb
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(path, fname), shard)
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                   "weight_map": weight_map}, f, indent=2)
