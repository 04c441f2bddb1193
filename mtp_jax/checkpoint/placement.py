"""Placing a parameter on its devices as it is read from the files: converted to its dtype,
cut per device where it is sharded (an expert-sharded parameter reads only its experts),
checked for NaN / Inf, never aliasing the memory-mapped file; a quantized parameter is
laid out with its scales (`qarray.QArray`)."""

from __future__ import annotations

import mmap

import jax
import numpy as np

from .. import qarray, quant
from ..models.tensors import Entry
from .safetensors_io import CheckpointError


def place(e: Entry, arrs, want, shardings, nonfinite: list):
    """One parameter from its (memory-mapped) HF arrays, converted and on its devices."""
    def finite(piece):
        if not np.all(np.isfinite(piece)):  # name the tensors that hold them
            nonfinite.extend(n for n, a in zip(e.names, arrs)
                             if n not in nonfinite and not np.all(np.isfinite(np.asarray(a))))
        return piece

    sh = shardings(e.path, want.shape) if shardings else None
    if e.slice_join is not None:  # each device reads only its own piece from the files
        def piece(idx):
            return finite(e.slice_join(arrs, _full_index(idx, want.shape), want.dtype))
        if sh is None:  # uncommitted, on the default device, like every jnp array
            return _to_device(piece(()))
        return jax.make_array_from_callback(want.shape, sh, lambda idx: _owned(piece(idx)))
    full = finite(e.join(arrs).astype(want.dtype, copy=False))
    if sh is None:
        return _to_device(full)
    return jax.make_array_from_callback(want.shape, sh, lambda idx: _owned(full[idx]))


def place_quantized(e: Entry, values, scales, contract, block_in: int, want, shardings,
                     nonfinite: list):
    """One parameter kept quantized: its stored values laid out by the entry's join, and
    its per-element scales laid out the same way, then compressed to blocks along the
    contraction axes (`quant.compress_scale`). An entry that reads experts piecewise
    (slice_join) takes every `block_in`-th scale along its contraction axis directly, so
    the per-element scales of a whole expert stack are never built."""
    full = (slice(None),) * len(want.shape)
    if e.slice_join is not None:
        vals = e.slice_join(values, full, None)
        c = contract[0]
        step = tuple(slice(None, None, block_in) if a == c else slice(None)
                     for a in range(len(want.shape)))
        scale = quant.compress_scale(e.slice_join(scales, step, np.float32), contract)
    else:
        vals = e.join(values)
        scale = quant.compress_scale(e.join(scales), contract)
    if vals.shape != want.shape:
        raise CheckpointError(f"{'/'.join(map(str, e.path))}: quantized values laid out as "
                              f"{vals.shape}, expected {want.shape}")
    if not (np.all(np.isfinite(scale)) and np.all(np.isfinite(vals.astype(np.float32)))):
        nonfinite.extend(n for n in e.names if n not in nonfinite)
    sh = shardings(e.path, want.shape) if shardings else None
    if sh is None:
        return qarray.QArray(_to_device(vals), _to_device(scale))
    # the scale is small: replicated on the value's devices until the engine places the
    # parameter by the sharding table (sharding.param_value_sharding)
    rep = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec())
    return qarray.QArray(jax.make_array_from_callback(vals.shape, sh, lambda i: _owned(vals[i])),
                        jax.device_put(scale, rep))


def _to_device(host):
    """A device copy of a host array (never an alias of the memory-mapped file), made
    without compiling anything: a broken checkpoint fails before any XLA compile."""
    return jax.device_put(_owned(host), may_alias=False)


def _owned(host: np.ndarray) -> np.ndarray:
    """`host`, or a copy of it where it is a view of a memory-mapped checkpoint file.
    On CPU the runtime may keep a host array's memory as the device buffer instead of
    copying it, `may_alias=False` notwithstanding (jaxlib 0.10), and a loaded parameter
    must neither change nor fault when its file is rewritten."""
    base = host
    while base is not None:
        if isinstance(base, (np.memmap, mmap.mmap)):
            return np.array(host)
        base = getattr(base, "base", None)
    return host


def _full_index(index, shape) -> tuple:
    """A device's index as one slice per dimension."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
    return tuple(x if isinstance(x, slice) else slice(x, x + 1) for x in index)
