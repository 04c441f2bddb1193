"""Experiment: int8 weight conversion by byte permutes (inline PTX) in the quantized matmul.

  PYTHONPATH=. python launch/exp_int8_convert.py [--ms 1,4,32] [--shapes ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_paged_attention as paged_attention_bench  # noqa: E402
import bench_quant_matmul as qb  # noqa: E402

from pallas_kernels.quant_matmul import default_block_config, quant_matmul  # noqa: E402
from pallas_kernels.quant_matmul_gpu import quant_matmul_gpu  # noqa: E402


def log(*a):
  print(*a, flush=True)


def exactness():
  """Every int8 value through both asm paths, x one-hot: out == value exactly."""
  k, n = 256, 128
  vals = ((np.arange(k)[:, None] + np.arange(n)[None, :]) % 256 - 128).astype(np.int8)
  v = jnp.asarray(vals)
  s = jnp.ones((1, n), jnp.float32)
  x = jnp.eye(k, dtype=jnp.bfloat16)
  out = {}
  for name, m, block in (
      ("tc asm", k, qb.default_block_config(k, k, n, 1, "gpu")),
      ("tc asm m16", 16, dataclasses.replace(default_block_config(16, k, n, 1, "gpu"),
                                             num_splits=1)),
  ):
    got = jax.jit(functools.partial(quant_matmul_gpu, block=block, interpret=False,
                                    int8_asm=True))(x[:m], v, s)
    out[name] = bool(np.array_equal(np.asarray(got, np.float32), vals[:m].astype(np.float32)))
  blk = default_block_config(1, k, n, 1, "gpu", values_dtype=jnp.int8)
  ok = True
  for r in range(0, k, 37):
    got = jax.jit(functools.partial(quant_matmul_gpu, block=blk, interpret=False,
                                    int8_asm=True))(x[r:r + 1], v, s)
    ok &= bool(np.array_equal(np.asarray(got, np.float32)[0], vals[r].astype(np.float32)))
  out["gemv asm"] = ok
  return out


def variants(m, k, n):
  d = default_block_config(m, k, n, 1, "gpu", values_dtype=jnp.int8)
  tc = d if d.block_m >= 16 else default_block_config(16, k, n, 1, "gpu",
                                                      values_dtype=jnp.int8)
  out = [("default", d, False)]
  if d.block_m < 16:
    out.append(("gemv asm", d, True))
    out.append(("tc cvt", tc, False))
  out.append(("tc asm", tc, True))
  alts = [dataclasses.replace(tc, num_splits=max(1, tc.num_splits * 2)),
          dataclasses.replace(tc, num_splits=max(1, tc.num_splits // 2)),
          dataclasses.replace(tc, num_stages=3), dataclasses.replace(tc, num_stages=5),
          dataclasses.replace(tc, num_warps=8),
          dataclasses.replace(tc, block_k=64), dataclasses.replace(tc, block_k=256)]
  if n % 256 == 0:
    alts.append(dataclasses.replace(tc, block_n=256))
  if n % 64 == 0:
    alts.append(dataclasses.replace(tc, block_n=64, num_splits=max(1, tc.num_splits // 2)))
  for c in alts:
    if c != tc and k % c.block_k == 0:
      out.append((f"tc asm {qb.config_label(c)}", c, True))
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--ms", default="1,4,32")
  ap.add_argument("--shapes", default="qkv MiMo,o_proj,gate_up,down,lm_head")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--no-sweep", action="store_true")
  opts = ap.parse_args()
  p = qb.FULL
  log(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
  log(f"exactness: {exactness()}")
  copy_bw, how = paged_attention_bench.best_copy_bandwidth(p["copy_bytes"])
  log(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s ({how})")
  shapes = [sh for sh in p["shapes"] if any(sh[0].startswith(w) for w in opts.shapes.split(","))]
  key = jax.random.key(0)
  rows = []
  for m in [int(v) for v in opts.ms.split(",")]:
    for name, k, n in shapes:
      nsets = qb.sets_for(k, n, p)
      key, kx = jax.random.split(key)
      x = jax.random.normal(kx, (m, k), jnp.bfloat16)
      sets = []
      for _ in range(nsets):
        key, kw = jax.random.split(key)
        sets.append(qb.make_weights(kw, k, n, "int8 channel", p["block"]))
      sets = tuple(sets)
      w0, s0 = sets[0]
      want = qb.truth(x, w0, s0)
      nbytes = k * n + n * 4 + m * k * 2 + m * n * 2
      cands = [("bf16 XLA dot (bf16 weights)", None, None)]
      vs = variants(m, k, n)
      if opts.no_sweep:
        vs = [v for v in vs if v[0] in ("default", "gemv asm", "tc cvt", "tc asm")]
      cands += vs
      for label, cfg, asm in cands:
        if cfg is None:
          bsets = tuple(qb.make_weights(jax.random.key(i), k, n, "bf16", p["block"])
                        for i in range(max(2, nsets // 2)))
          fn = qb.bf16_dot
          use, nb = bsets, 2 * k * n + m * k * 2 + m * n * 2
          err = qb.rel_err(jax.jit(fn)(x, *bsets[0]), qb.truth(x, *bsets[0]))
        else:
          fn = (lambda xx, w, sc, c=cfg, a=asm: quant_matmul_gpu(
              xx, w, sc, block=c, interpret=False, int8_asm=a))
          use, nb = sets, nbytes
          try:
            err = qb.rel_err(jax.jit(fn)(x, w0, s0), want)
          except Exception as e:  # noqa: BLE001
            log(f"{name} M={m} {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
            continue
        best, med, _ = qb.time_per_call(fn, x, use, nb / (0.7 * copy_bw) + 3e-6, opts.reps,
                                        p["target_s"], p["max_steps"])
        tbs = nb / best / 1e12
        r = dict(shape=name, m=m, label=label, us=best * 1e6, med=med * 1e6, tbs=tbs,
                 copy=tbs * 1e12 / copy_bw, err=err,
                 cfg=qb.config_label(cfg) if cfg else "")
        rows.append(r)
        log(f"{name} M={m} {label}: {best * 1e6:.1f} / {med * 1e6:.1f} us {tbs:.2f} TB/s "
            f"({100 * r['copy']:.0f} %) err {err:.1e} {r['cfg']}")
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "exp_int8_convert.json"), "w") as f:
      json.dump(dict(copy_bw=copy_bw, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
