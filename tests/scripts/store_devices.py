"""Saved executables on a process of several (fake CPU) devices, run by
tests/test_warm_start_devices.py: the key and the load carry the device an executable was
compiled for, and an executable whose first call is refused is compiled afresh.

Usage: store_devices.py FOLDER (the process must see at least 2 devices)."""

from __future__ import annotations

import os
import pickle
import sys

import jax
import numpy as np

from mtp_jax import compile_cache
from mtp_jax.compile_cache import CacheStats, ExecutableStore
from mtp_jax.step import Program


def double(x):
    return x * 2 + 1


def main(folder: str) -> None:
    d0, d1 = jax.devices()[:2]
    x0 = jax.device_put(np.arange(4, dtype=np.float32), d0)
    x1 = jax.device_put(np.arange(4, dtype=np.float32), d1)
    want = np.arange(4, dtype=np.float32) * 2 + 1
    compile_cache.enable(os.path.join(folder, "jax"))  # the summary line names a folder
    store = ExecutableStore(folder)
    # one program, two placements: two keys, two executables, each bound to its device
    assert store.key("double", "ctx", (x0,)) != store.key("double", "ctx", (x1,))
    stats = CacheStats()
    for x in (x0, x1):
        out = Program(jax.jit(double), "double", store, "ctx")(x)
        np.testing.assert_array_equal(out, want)
    assert (stats.loaded, stats.saved) == (0, 2), (stats.loaded, stats.saved)
    for x, dev in ((x0, d0), (x1, d1)):  # a new store (a later process) loads both
        out = Program(jax.jit(double), "double", ExecutableStore(folder), "ctx")(x)
        np.testing.assert_array_equal(out, want)
        assert out.devices() == {dev}, (out.devices(), dev)
    assert (stats.loaded, stats.saved, stats.replaced) == (2, 2, 0)

    # A file bound to every device the process sees (what the store wrote before it kept
    # the executable's devices): its first call is refused, so it is compiled afresh, the
    # file replaced, and the next process loads the good one.
    path = os.path.join(folder, store.key("double", "ctx", (x0,)) + ".bin")
    with open(path, "rb") as f:
        blob, in_tree, out_tree, ids = pickle.load(f)
    assert ids == [d0.id], ids
    with open(path, "wb") as f:
        pickle.dump((blob, in_tree, out_tree, [d.id for d in jax.local_devices()]), f)
    stats = CacheStats()
    out = Program(jax.jit(double), "double", ExecutableStore(folder), "ctx")(x0)
    np.testing.assert_array_equal(out, want)
    assert (stats.loaded, stats.replaced) == (1, 1), (stats.loaded, stats.replaced)
    assert "could not run here" in str(stats)
    with open(path, "rb") as f:
        assert pickle.load(f)[3] == [d0.id]
    out = Program(jax.jit(double), "double", ExecutableStore(folder), "ctx")(x0)
    np.testing.assert_array_equal(out, want)
    assert (stats.loaded, stats.replaced) == (2, 1)

    # a file naming a device this process lacks is not loaded: compiled afresh, replaced
    with open(path, "wb") as f:
        pickle.dump((blob, in_tree, out_tree, [max(d.id for d in jax.devices()) + 1]), f)
    out = Program(jax.jit(double), "double", ExecutableStore(folder), "ctx")(x0)
    np.testing.assert_array_equal(out, want)
    assert (stats.loaded, stats.replaced) == (2, 2)
    print("store_devices ok")


if __name__ == "__main__":
    main(sys.argv[1])
