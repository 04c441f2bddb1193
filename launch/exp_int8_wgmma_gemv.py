"""Experiment: does a TMA + wgmma pipeline stream int8 weights at the copy rate at one row?

  PYTHONPATH=. python launch/exp_int8_wgmma_gemv.py [--shapes gate_up,lm_head_mimo]

The one-row int8 products stream at 48-87 % of copy bandwidth through our Pallas (Triton)
kernel, where XLA's bf16 GEMV reaches 69-99 %. JAX's bundled Hopper mixed-type matmul
(`jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu`) takes an int8 LHS
through TMA into shared memory, then into registers, converts it to bf16 there and feeds
wgmma from registers. Used transposed, y^T [N, 64] = W^T [N, K] (int8) @ x^T [K, 64]
(x's row padded to 64 columns, wgmma's smallest efficient N here), it is a GEMV over
weights stored [N, K]. It has no K splits, so shapes with few 128-row blocks of N leave
SMs idle. Timed in the loop of launch/bench_quant_matmul.py (several weight copies, over
twice the L2; about 3.5 us a call of its own) beside XLA's bf16 dot and our int8 kernel
at one row; bytes = int8 weights (+ the f32 scale row for ours). The per-channel scale is
not applied by the bundled kernel (a multiply of [N] outputs). Prints a table; JSON to
$OUT/exp_int8_wgmma_gemv.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_paged_attention as paged_attention_bench  # noqa: E402
from bench_quant_matmul import make_weights, null_call, time_per_call  # noqa: E402

from pallas_kernels.quant_matmul import quant_matmul  # noqa: E402

SHAPES = {"qkv_mimo": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 22016),
          "down": (11008, 4096), "lm_head_llama": (4096, 32000),
          "lm_head_mimo": (4096, 151680)}
FLUSH = 160 << 20


def mixed(config):
  from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mm

  cfg = mm.TuningConfig(**config)

  def fn(x, wt, scale):
    del scale
    b = jnp.zeros((x.shape[1], 64), x.dtype).at[:, 0].set(x[0])
    return mm.mixed_matmul_kernel(wt, b, out_dtype=x.dtype, config=cfg)[:, :1].T
  return fn


def ours(x, w, scale):
  return quant_matmul(x, w, scale)


def bf16(x, w, scale):
  del scale
  return jnp.dot(x, w)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default=",".join(SHAPES))
  ap.add_argument("--reps", type=int, default=5)
  args = ap.parse_args(argv)
  from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mm

  dev = jax.devices()[0]
  copy_bw, how = paged_attention_bench.best_copy_bandwidth(4 << 30)
  print(f"device {dev.device_kind}, jax {jax.__version__}, copy {copy_bw / 1e12:.2f} TB/s "
        f"({how})", flush=True)
  M = mm.MatmulDimension
  configs = {
      "m64 k128 st4": dict(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=4,
                           epi_tile_m=64, epi_tile_n=64, wg_dimension=M.M),
      "m64 k128 st8": dict(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=8,
                           epi_tile_m=64, epi_tile_n=64, wg_dimension=M.M),
      "m64 k256 st4": dict(tile_m=64, tile_n=64, tile_k=256, max_concurrent_steps=4,
                           epi_tile_m=64, epi_tile_n=64, wg_dimension=M.M),
      "m128 k128 st4": dict(tile_m=128, tile_n=64, tile_k=128, max_concurrent_steps=4,
                            epi_tile_m=64, epi_tile_n=64, wg_dimension=M.M),
  }
  rows, key = [], jax.random.key(0)
  x = jax.random.normal(key, (1, 4096), jnp.bfloat16)
  for name in args.shapes.split(","):
    k, n = SHAPES[name]
    x = jax.random.normal(jax.random.fold_in(key, k), (1, k), jnp.bfloat16)
    copies = int(max(2, -(-FLUSH // (k * n))))
    keys = jax.random.split(jax.random.fold_in(key, n), copies)
    q = [make_weights(kk, k, n, "int8 channel", 128) for kk in keys]
    b = [make_weights(kk, k, n, "bf16", 128) for kk in keys[:max(2, copies // 2)]]
    qt = [(jnp.asarray(v.T), s) for v, s in q]  # [N, K] int8
    want = np.asarray(jnp.dot(x.astype(jnp.float32), q[0][0].astype(jnp.float32)))
    cands = [("loop alone", null_call, q, 0), ("XLA bf16 dot", bf16, b, 2 * k * n),
             ("ours int8 [K, N]", ours, q, k * n + 4 * n)]
    cands += [(f"bundled mixed {c} [N, K]", mixed(cfg), qt, k * n)
              for c, cfg in configs.items()]
    for cname, fn, sets, nbytes in cands:
      r = {"shape": name, "k": k, "n": n, "candidate": cname, "bytes": nbytes}
      try:
        if cname.startswith("bundled"):
          got = np.asarray(jax.jit(fn)(x, *sets[0]), np.float32)
          r["rel_err_unscaled"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        best, med, calls = time_per_call(fn, x, sets, 30e-6, args.reps, 0.05, 4000)
        r.update(us_best=best * 1e6, us_median=med * 1e6,
                 pct_copy=(100 * nbytes / best / copy_bw) if nbytes else None)
      except Exception as e:  # noqa: BLE001 - report and go on
        r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
      rows.append(r)
      print(json.dumps(r), flush=True)
  print("\n| shape | candidate | us best / median | % of copy | rel err |\n|---|---|---|---|---|")
  for r in rows:
    if "error" in r:
      print(f"| {r['shape']} | {r['candidate']} | FAILED {r['error'][:120]} | | |")
      continue
    pct = f"{r['pct_copy']:.0f} %" if r["pct_copy"] else "-"
    err = f"{r['rel_err_unscaled']:.1e}" if "rel_err_unscaled" in r else ""
    print(f"| {r['shape']} | {r['candidate']} | {r['us_best']:.1f} / {r['us_median']:.1f} "
          f"| {pct} | {err} |")
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "exp_int8_wgmma_gemv.json"), "w") as fh:
      json.dump({"device": dev.device_kind, "copy_bw": copy_bw, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
  main()
