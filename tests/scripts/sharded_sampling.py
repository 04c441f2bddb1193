"""Run on 2 fake CPU devices (the test sets XLA_FLAGS): top-k / top-p filtering of logits
split over a tp=2 mesh by vocabulary, the way a sharded step holds them, through the sort
path (the accelerators') and the bisection path (the CPU's).

Prints one JSON object: per path, whether the sharded result equals the unsharded one, and
the reduce-windows of the compiled program whose window is longer than the axis it
produces: the quadratic form the partitioner gives a cumulative sum along a split axis
(one such window per output, over the whole row).
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mtp_jax import sampling
from mtp_jax.sharding import make_mesh, use_mesh

assert len(jax.devices()) == 2, jax.devices()
mesh = make_mesh("tp=2")
rows, vocab = 12, 2048
rng = np.random.default_rng(0)
logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 3, jnp.float32)
top_k = jnp.asarray(rng.choice([0, 5, 50], size=rows), jnp.int32)
top_p = jnp.asarray(rng.choice([1.0, 0.9, 0.5], size=rows), jnp.float32)
need = (top_k > 0) | (top_p < 1)
split = jax.device_put(logits, NamedSharding(mesh, P(None, "tp")))


def long_windows(hlo: str) -> list:
    """reduce-window ops that slide (stride 1) a window longer than the output axis."""
    found = []
    for m in re.finditer(r"= \w+\[([\d,]*)\][^\n]*reduce-window\([^\n]*window=\{([^}]*)\}",
                         hlo):
        out = [int(x) for x in m.group(1).split(",") if x]
        spec = dict(kv.split("=") for kv in m.group(2).split())
        win = [int(x) for x in spec["size"].split("x")]
        stride = [int(x) for x in spec.get("stride", "x".join("1" * len(win))).split("x")]
        if any(w > o and st == 1 for w, o, st in zip(win, out, stride)):
            found.append(f"[{m.group(1)}] window {{{m.group(2)}}}")
    return found


result = {}
for sort in (True, False):
    def f(x, sort=sort):
        with use_mesh(mesh):
            return sampling._filter(x, top_k, top_p, need, sort=sort)
    want = np.asarray(jax.jit(lambda x, sort=sort: sampling._filter(
        x, top_k, top_p, need, sort=sort))(logits))
    compiled = jax.jit(f).lower(split).compile()
    got = np.asarray(compiled(split))
    result["sort" if sort else "bisect"] = {
        "equal": bool(np.array_equal(got, want)),
        "kept": int(np.isfinite(got).sum()),
        "long_windows": long_windows(compiled.as_text()),
    }
print("RESULT " + json.dumps(result))
