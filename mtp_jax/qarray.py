"""Quantized arrays: `QArray(values, scale)`, the representation of a quantized weight.

`values` are in the parameter's own layout as int8 or float8_e4m3fn, `scale` float32 of
the same rank, each of its dims dividing the value's. Along a contraction axis of the
weight the scale holds one entry per block of `values.shape[a] // scale.shape[a]`
elements (size 1: the whole axis, i.e. one scale per output channel); along every other
axis one entry per element. The weight is `values * scale`, the scale broadcast over its
blocks. How weights are quantized and multiplied is quant.py's business; this module is
the data type and the accessors that read a parameter whether it is quantized or not.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class QArray:
    values: jax.Array  # int8 / float8_e4m3fn, the parameter's layout
    scale: jax.Array  # float32, same rank; every dim divides the value's

    @property
    def shape(self) -> tuple:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def blocks(self) -> tuple:
        """Elements per scale along each axis."""
        return tuple(v // s for v, s in zip(self.values.shape, self.scale.shape))

    @property
    def nbytes(self) -> int:
        return int(self.values.size * self.values.dtype.itemsize + self.scale.size * 4)

    @property
    def T(self) -> "QArray":
        return QArray(self.values.T, self.scale.T)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (expand_scale(self.scale, self.values.shape) * self.values.astype(jnp.float32)
                ).astype(dtype)

    def rows(self, ids, dtype) -> jax.Array:
        """Rows `ids` of a 2-D table (an embedding), dequantized: [..., d]."""
        return QArray(self.values[ids], self.scale[ids]).dequantize(dtype)


def expand_scale(scale, shape):
    """scale broadcast over its blocks to `shape` (jnp or numpy arrays)."""
    xp = np if isinstance(scale, np.ndarray) else jnp
    for a, (v, s) in enumerate(zip(shape, scale.shape)):
        if v != s:
            scale = xp.repeat(scale, v // s, axis=a)
    return scale


def take_rows(param, ids, dtype):
    """Rows `ids` of an embedding table (plain or quantized) in `dtype`: [..., d]."""
    w = value(param)
    return w.rows(ids, dtype) if is_quantized(w) else w[ids]


def is_quantized(x) -> bool:
    return isinstance(x, QArray)


def value(param):
    """A parameter's array, or its QArray (nnx.Param or a plain array / QArray)."""
    return param.get_value() if hasattr(param, "get_value") else param


__all__ = ["QArray", "expand_scale", "take_rows", "is_quantized", "value"]
