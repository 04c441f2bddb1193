"""Checkpoints: HF safetensors import and export, orbax save / restore, `load`.

- safetensors_io.py: the safetensors reader / writer and an HF folder's file set;
  `CheckpointError`.
- hf.py: strict HF import (`load_hf`) and export (`save_hf`) over the model family's tensor
  map (`hf_key_map`, mtp_jax.models), with block_scaled.py (FP8 / int8 block-scaled
  weights) and placement.py (each parameter onto its devices as it is read).
- orbax_io.py: `save_orbax` / `load_orbax`.
- params.py: `Model` and the transforms on its parameters (`quantize_model`,
  `with_draft_head`, `from_params`, `to_flat`).
- tokenizer.py (tokenizer, eos ids) and kv_scales.py (fp8 KV scales): the files beside the
  weights.
- hub.py: a Hugging Face Hub id `org/name[@revision]` to its snapshot in the hub cache.

`load(path)` reads either kind of folder, or the snapshot of a hub id `org/name[@revision]`
(hub.py). `load(path, quantize="int8" | "fp8" | "fp8-block")` quantizes an
unquantized checkpoint parameter by parameter as it loads; `save_hf` / `save_orbax` write a
quantized model as it is held, so quantizing is done once.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from ..models import from_hf
from .hf import hf_key_map, load_hf, save_hf
from .hub import local_path
from .orbax_io import ORBAX_MARKER, load_orbax, save_orbax
from .params import (Model, abstract_model, from_params, quantize_model, to_flat,
                     with_draft_head, with_params)
from .safetensors_io import CheckpointError


def default_dtype(cfg_dtype) -> str:
    """float32 on CPU (no native bf16 math there: f32 is faster, and bf16 rounding makes
    K+1-token verify and 1-token decode disagree at near-ties), else the checkpoint's."""
    return "float32" if jax.default_backend() == "cpu" else cfg_dtype


def load(path: str, *, dtype=None, shardings=None, quantize: Optional[str] = None,
         dequantize: Optional[bool] = None) -> Model:
    """Load an HF-layout folder, an orbax folder written by `save_orbax`, or a hub id
    `org/name[@revision]` (its snapshot in the hub cache, fetched when missing: hub.py).

    dtype: the compute dtype (and that of unquantized parameters); default
    `default_dtype(checkpoint dtype)`. quantize: "int8", "fp8" or "fp8-block" quantizes
    the matmul weights as they load (`quant.MODES`; an already quantized checkpoint is a
    QuantizationError). dequantize: for a quantized checkpoint (DeepSeek's FP8, or a
    quantized save), True / False / None = by device (`keep_quantized`).
    """
    path = local_path(str(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"model path {path!r} is not a directory")
    if os.path.exists(os.path.join(path, ORBAX_MARKER)):
        if dtype is None and jax.default_backend() == "cpu":
            dtype = "float32"
        return load_orbax(path, dtype=dtype, shardings=shardings, quantize=quantize)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path}: no config.json (not an HF or mtp_jax orbax folder)")
    if dtype is None:
        dtype = default_dtype(from_hf(path).dtype)
    return load_hf(path, dtype=dtype, shardings=shardings, quantize=quantize,
                   dequantize=dequantize)



__all__ = ["CheckpointError", "Model", "load", "load_hf", "save_hf", "load_orbax", "save_orbax",
           "quantize_model", "with_draft_head", "from_params", "with_params", "to_flat",
           "abstract_model", "default_dtype", "hf_key_map"]
