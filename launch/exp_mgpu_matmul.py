"""Experiment: JAX's bundled Mosaic GPU Hopper matmul
(jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu) against XLA's dot at the batch job's
prefill gate+up shape (2048 x 4096 x 22016, bf16): can a Mosaic GPU GEMM, the base for a
SwiGLU epilogue, match XLA's? A grid of its tilings; us a call (best of 3 loops of 30) and
TFLOP/s. Hopper GPUs only (jax 0.11.2).

    python launch/exp_mgpu_matmul.py
"""
import time, itertools, traceback
import jax, jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
print(jax.__version__, jax.devices()[0].device_kind, flush=True)
M, K, N = 2048, 4096, 22016
a = jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16)
b = (jax.random.normal(jax.random.key(1), (K, N), jnp.float32) / 64).astype(jnp.bfloat16)
ref = jnp.dot(a, b)
def timeit(f, reps=30):
  f(a, b).block_until_ready()
  best = 1e9
  for _ in range(3):
    t = time.perf_counter()
    for _ in range(reps):
      y = f(a, b)
    y.block_until_ready()
    best = min(best, (time.perf_counter() - t) / reps)
  return best
fl = 2 * M * N * K
t = timeit(jax.jit(jnp.dot)); print(f"xla dot {t*1e6:.1f} us {fl/t/1e12:.0f} TFLOP/s", flush=True)
D = hm.MatmulDimension
for tm, tn, gmd, gtw, wgd in itertools.product((128, 256), (128, 256), (D.N, D.M), (4, 8), (D.N, D.M)):
  cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=4, epi_tile_n=64, epi_tile_m=64,
                        grid_minor_dim=gmd, grid_tile_width=gtw, wg_dimension=wgd)
  try:
    f = jax.jit(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg))
    err = float(jnp.abs(f(a, b).astype(jnp.float32) - ref.astype(jnp.float32)).max())
    t = timeit(f)
    print(f"mgpu tm{tm} tn{tn} {gmd} w{gtw} wg{wgd}: {t*1e6:.1f} us {fl/t/1e12:.0f} TFLOP/s err {err:.3g}", flush=True)
  except Exception as e:
    print(f"mgpu tm{tm} tn{tn} {gmd} w{gtw} wg{wgd}: FAILED {type(e).__name__}: {str(e)[:150]}", flush=True)
