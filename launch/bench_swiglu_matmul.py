"""The prefill gate+up product with its SwiGLU: our fused kernel against XLA's paths.

  PYTHONPATH=. python launch/bench_swiglu_matmul.py [--rows 256,512,1024,2048,4096]
      [--sweep] [--reps 5]
  PYTHONPATH=. python launch/bench_swiglu_matmul.py --tiny      # CPU: interpret mode

x [M, 4096] bf16 @ gate_up [4096, 2, 11008] (Llama-2-7B's and MiMo-7B's MLP), M rows of a
prefill forward (the batch job's is 8 x 256 = 2048). Candidates, each timed in the same
run:
  xla einsum + swiglu   the model's path where the kernel does not run: the einsum in bf16, then
                        swiglu (silu(g) * u in bf16 ops), a kernel of its own
  xla reference         pallas_kernels.swiglu_matmul.reference: the einsum, then silu(g) * u
                        in f32 rounded once (the kernel's numerics)
  xla einsum alone      the [M, 2F] product only: the rate a fused kernel has to keep
  kernel bm x bn x bk / stages [mma+1]
                        pallas_kernels.swiglu_matmul_gpu (Mosaic GPU: TMA, wgmma,
                        warp-specialised, persistent; mma+1: one wgmma group left in
                        flight between K chunks); --sweep adds tilings to the default

Timing: launch/bench_quant_matmul.py's loop, calls chained in one jitted fori_loop with a
static trip count (one element of each output feeds the next call's x, an optimization
barrier keeps the whole output live); per call = loop time / calls; best and median of
--reps loops after a warm-up, compile apart. The limit is the card's dense bf16 peak
(H100 / H200 SXM: 989 TFLOP/s) for the product's 2 M K 2F FLOPs. Each candidate's result
is compared with `xla reference`: the largest difference and the share of equal elements. JSON goes to $OUT/bench_swiglu_matmul.json, or
--json PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_batch_job import PEAK_BF16  # noqa: E402
from bench_quant_matmul import time_per_call  # noqa: E402

from pallas_kernels.common import swiglu  # noqa: E402
from pallas_kernels.swiglu_matmul import reference  # noqa: E402
from pallas_kernels.swiglu_matmul_gpu import BlockConfig, smem_bytes, swiglu_matmul_gpu  # noqa: E402

SMEM_LIMIT = 227 * 1024  # a Hopper CTA's shared memory
SWEEP = [BlockConfig(128, 128, 64, 4, 1), BlockConfig(128, 128, 64, 3, 1),
         BlockConfig(128, 128, 64, 3), BlockConfig(128, 128, 64, 2),
         BlockConfig(128, 64, 64, 4), BlockConfig(256, 64, 64, 3),
         BlockConfig(128, 128, 32, 4), BlockConfig(128, 192, 64, 3)]


def model_path(x, gu, limit=None):
  y = jnp.einsum("mk,kcf->mcf", x, gu)
  return swiglu(y[:, 0], y[:, 1], limit)


def einsum_only(x, gu):
  """The [M, 2F] product (the [M, 2, F] einsum's rows flattened: no data moves)."""
  return jnp.einsum("mk,kcf->mcf", x, gu).reshape(x.shape[0], -1)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", default="256,512,1024,2048,4096")
  ap.add_argument("--k", type=int, default=4096)
  ap.add_argument("--f", type=int, default=11008)
  ap.add_argument("--sweep", action="store_true", help="tilings beside the default")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--tiny", action="store_true", help="M 256, K 128, F 256, interpreted")
  ap.add_argument("--json", help="where the JSON goes (default $OUT/bench_swiglu_matmul.json)")
  args = ap.parse_args(argv)

  dev = jax.devices()[0]
  interpret = None
  if args.tiny:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    interpret, rows, k, f, reps = InterpretGPUParams(), [256], 128, 256, 1
  else:
    rows, k, f, reps = [int(r) for r in args.rows.split(",")], args.k, args.f, args.reps
  peak = next((v for name, v in PEAK_BF16.items() if name in dev.device_kind), None)
  print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
  blocks = [BlockConfig()] + (SWEEP if args.sweep else [])
  kx, kw = jax.random.split(jax.random.key(0))
  gu = (jax.random.normal(kw, (k, 2, f), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  results = []
  for m in rows:
    x = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.bfloat16)
    want = np.asarray(jax.jit(reference)(x, gu), np.float32)
    cands = [("xla einsum + swiglu", model_path), ("xla reference", reference),
             ("xla einsum alone", einsum_only)]
    for b in blocks:
      if m % b.block_m or f % b.block_n or k % b.block_k or smem_bytes(b, 2) > SMEM_LIMIT:
        continue
      cands.append((f"kernel {b.block_m}x{b.block_n}x{b.block_k}/{b.stages}"
                    + (f" mma+{b.mma_in_flight}" if b.mma_in_flight else ""),
                    lambda x, gu, b=b: swiglu_matmul_gpu(
                        x, gu.reshape(k, 2 * f), block=b, interpret=interpret,
                        num_sms=4 if interpret is not None else None)))
    flops = 2 * m * k * 2 * f
    est = flops / (peak or 1e12)
    for name, fn in cands:
      row = {"m": m, "k": k, "f": f, "candidate": name}
      try:
        got = np.asarray(jax.jit(fn)(x, gu), np.float32)
        if got.shape == want.shape:
          row["max_diff"] = float(np.abs(got - want).max())
          row["equal"] = float((got == want).mean())
        row["best_s"], row["median_s"], _ = time_per_call(
            lambda x, w, _scale, fn=fn: fn(x, w), x, [(gu, None)], est, reps, 0.05,
            2 if args.tiny else 200)
      except Exception as e:  # noqa: BLE001 - a tiling that fails is reported, not fatal
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      results.append(row)
      print(json.dumps(row), flush=True)

  lines = [f"device {dev.device_kind}, jax {jax.__version__}; K {k}, F {f}", "",
           "| M | candidate | us best / median | TFLOP/s | % of peak | vs xla einsum + swiglu "
           "| max diff / equal vs reference |", "|---|---|---|---|---|---|---|"]
  for m in rows:
    mine = [r for r in results if r["m"] == m]
    base = next((r.get("best_s") for r in mine if r["candidate"] == "xla einsum + swiglu"),
                None)
    for r in mine:
      if "best_s" not in r:
        lines.append(f"| {m} | {r['candidate']} | FAILED: {r.get('error', '')[:100]} "
                     "| | | | |")
        continue
      rate = 2 * m * k * 2 * f / r["best_s"]
      pct = f"{100 * rate / peak:.0f} %" if peak else "-"
      ratio = f"{r['best_s'] / base:.3f}" if base else "-"
      diff = (f"{r['max_diff']:.3g} / {100 * r['equal']:.2f} %" if "max_diff" in r else "-")
      lines.append(f"| {m} | {r['candidate']} | {1e6 * r['best_s']:.1f} / "
                   f"{1e6 * r['median_s']:.1f} | {rate / 1e12:.0f} | {pct} | {ratio} "
                   f"| {diff} |")
  print("\n".join(lines), flush=True)
  path = args.json or (os.environ.get("OUT") and
                       os.path.join(os.environ["OUT"], "bench_swiglu_matmul.json"))
  if path:
    with open(path, "w") as fh:
      json.dump({"device": dev.device_kind, "jax": jax.__version__, "results": results},
                fh, indent=1)


if __name__ == "__main__":
  main()
