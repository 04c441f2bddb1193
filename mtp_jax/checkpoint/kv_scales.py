"""fp8 KV-cache scales saved beside a model's weights (`kv_scales.json`): per layer (target,
then MTP), the k and v scales of each kv head."""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from ..config import ModelConfig
from .params import Model
from .safetensors_io import CheckpointError

KV_SCALES_FILE = "kv_scales.json"


def save_kv_scales(model: Model, path: str) -> None:
    if model.kv_scales is not None:
        with open(os.path.join(path, KV_SCALES_FILE), "w") as f:
            json.dump({"format": "per layer (target, then MTP): [k scales, v scales] per "
                                 "kv head", "scales": [list(map(list, x))
                                                       for x in model.kv_scales]}, f)


def load_kv_scales(path: str, cfg: ModelConfig) -> Optional[tuple]:
    """fp8 KV scales saved beside a model (CheckpointError if they do not fit it)."""
    f = os.path.join(path, KV_SCALES_FILE)
    if not os.path.exists(f):
        return None
    try:
        with open(f) as fh:
            raw = json.load(fh)["scales"]
        scales = tuple((tuple(float(x) for x in k), tuple(float(x) for x in v))
                       for k, v in raw)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{f}: unreadable: {type(e).__name__}: {e}") from None
    want = cfg.num_layers + cfg.num_mtp_modules
    # per layer (k, v) scale counts: a latent (MLA) row has two parts and no v
    shape = [(2, 0) if cfg.mla is not None else (cfg.heads_of(i)[1],) * 2
             for i in range(want)]
    if len(scales) != want or any((len(k), len(v)) != s for (k, v), s in zip(scales, shape)):
        raise CheckpointError(f"{f}: {len(scales)} layers of scales, the model has {want} "
                              f"layers with (k, v) scale counts {shape}")
    if not all(x > 0 and np.isfinite(x) for kv in scales for s in kv for x in s):
        raise CheckpointError(f"{f}: scales must be positive and finite")
    return scales
