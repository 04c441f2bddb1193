"""Block-scaled weights (`quantization_config`: DeepSeek-V3's FP8, or this project's fp8 /
int8 exports): every quantized weight comes with its `<name>_scale_inv` of the config's
block shape.

`check_quantized` pairs weights and scales in a checkpoint's headers (and names what does
not fit); `BlockScaled` reads a weight dequantized (or its per-element scales);
`keep_quantized` decides whether a checkpoint stays quantized on the device;
`block_scales` writes the scales of a quantized model on export.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import numpy as np

from .. import quant
from ..config import ModelConfig
from .safetensors_io import FLOAT_CODES, FP8_CODES

_QUANT_CODES = {"e4m3": "F8_E4M3", "int8": "I8"}  # quantization_config.fmt -> stored dtype
SCALE_SUFFIX = "_scale_inv"  # DeepSeek's name for a weight's per-block dequantization scale


class BlockScaled:
    """A quantized weight [out, in] (fp8 or int8) with its per-block scales, read as
    float32 (dequantized).

    weight_scale_inv [ceil(out / bo), ceil(in / bi)]: the real weight is the stored value
    * the scale of its (bo, bi) block (edge blocks partial). Indexing with slices
    dequantizes only that piece, so an expert-sharded parameter still reads only its own
    experts. `scales_only`: the per-element scales of the piece instead (for weights kept
    quantized: the same joins that lay the weight out lay its scales out).
    """

    dtype = np.dtype(np.float32)

    def __init__(self, weight, scale, block, scales_only: bool = False):
        self.weight, self.scale, self.block = weight, scale, block
        self.shape = weight.shape
        self.scales_only = scales_only

    def __getitem__(self, index):
        index = tuple(index) + (slice(None),) * (2 - len(tuple(index)))
        rows, cols = (np.arange(n)[i] for n, i in zip(self.shape, index))
        s = np.asarray(self.scale, np.float32)[np.ix_(np.atleast_1d(rows) // self.block[0],
                                                      np.atleast_1d(cols) // self.block[1])]
        s = s.reshape(np.shape(rows) + np.shape(cols))
        return s if self.scales_only else np.asarray(self.weight[index], np.float32) * s

    def __array__(self, dtype=None, copy=None):
        out = self[:, :]
        return out if dtype is None else out.astype(dtype)


def check_quantized(cfg: ModelConfig, found: dict) -> tuple[dict, list[str]]:
    """Quantized weights and their scales in a checkpoint's headers: ({weight name: scale
    name}, problems). found: {name: (file, base, (code, shape, offsets))}."""
    q = cfg.quantization
    code = _QUANT_CODES[q.fmt] if q is not None else None
    fp8 = sorted(k for k, v in found.items() if v[2][0] in FP8_CODES or v[2][0] == code)
    scales = sorted(k for k in found if k.endswith(SCALE_SUFFIX))
    if not fp8 and not scales:
        return {}, []
    if q is None:
        return {}, [f"FP8 tensors or scales but config.json has no quantization_config: "
                    f"{(fp8 + scales)[:8]}{' ...' if len(fp8) + len(scales) > 8 else ''}"]
    pairs, problems = {}, []
    no_scale, bad_shape, not_2d, e5m2 = [], [], [], []
    for name in fp8:
        shape = found[name][2][1]
        scale = name + SCALE_SUFFIX
        if found[name][2][0] != code:
            e5m2.append(name)
        if len(shape) != 2:
            not_2d.append(f"{name} {list(shape)}")
        elif scale not in found:
            no_scale.append(name)
        else:
            want = tuple(-(-x // b) for x, b in zip(shape, q.block))
            got = found[scale][2][1]
            if got != want or found[scale][2][0] not in FLOAT_CODES:
                bad_shape.append(f"{scale} is {list(got)} {found[scale][2][0]}, expected "
                                 f"{list(want)} float for {list(shape)} in {list(q.block)} "
                                 "blocks")
            pairs[name] = scale
    orphan = [s for s in scales if s[:-len(SCALE_SUFFIX)] not in fp8]
    what = "FP8" if q.fmt == "e4m3" else "int8"
    for msg, items in ((f"{what} tensors without scales", no_scale),
                       ("scales of the wrong block shape", bad_shape),
                       (f"scales without an {what} tensor", orphan),
                       (f"{what} tensors that are not 2-D weights", not_2d),
                       (f"quantized tensors not stored as {code} (quantization_config.fmt is "
                        f"{q.fmt})", e5m2)):
        if items:
            problems.append(f"{msg}: {items}")
    return pairs, problems


def keep_quantized(q, dequantize: Optional[bool]) -> bool:
    """Whether a quantized checkpoint stays quantized on the device: as asked, else on a
    GPU (fp8: compute capability 8.9 or newer) or TPU, never on CPU (float32 math there is
    fastest)."""
    if dequantize is not None:
        return not dequantize
    if q is None or jax.default_backend() == "cpu":
        return False
    try:
        quant.check_backend("fp8" if q.fmt == "e4m3" else "int8")
    except quant.QuantizationError:
        return False  # dequantized to the load dtype: the fallback
    return True



def block_scales(tensors: dict, scales: dict) -> Optional[dict]:
    """Add `<name>_scale_inv` [out, in / B] beside every quantized tensor of `tensors`
    (scales: their per-element [out, in] scales) and return the quantization_config: one
    block [1, B] for the whole checkpoint, B the largest input block every tensor's
    scales are constant over (per-channel tensors: any divisor of their input dim)."""
    if not scales:
        return None
    blocks = [sc.shape[1] // quant.compress_scale(sc, (1,)).shape[1] for sc in scales.values()]
    b = math.gcd(*blocks)
    for name, sc in scales.items():
        tensors[name + SCALE_SUFFIX] = np.ascontiguousarray(sc[:, ::b])
    if all(tensors[n].dtype == np.int8 for n in scales):
        return {"quant_method": "mtp_jax", "fmt": "int8", "weight_block_size": [1, b]}
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [1, b]}

