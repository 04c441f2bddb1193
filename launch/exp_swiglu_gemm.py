"""Experiment (measured, dropped): the prefill's gate+up GEMM with SwiGLU in its epilogue.

    PYTHONPATH=. python launch/exp_swiglu_gemm.py       # GPU; on a CPU: tiny shapes, interpreted

A Pallas (Triton) kernel computes x @ W_gate and x @ W_up for one [bm, bn] tile in two f32
accumulators over the model's [d, 2, f] gate_up layout, rounds both to bf16 as XLA's dot
output is, and writes silu(g) * u: the [M, 2f] product is never written and the separate
SwiGLU kernel goes. Against XLA's einsum followed by the SwiGLU (what the model runs), at
the batch job's prefill rows (8 x 256 = 2048) and MiMo-7B's d 4096, f 11008. Prints us a
call (best of 3 loops of 50 calls) and TFLOP/s of the product, and for each tiling the max
difference from XLA's result and the share of equal elements."""
import functools, os, sys, time, json
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

def kernel(x_ref, g_ref, u_ref, o_ref, *, bk, nk):
  bm, bn = o_ref.shape
  def body(c, accs):
    ag, au = accs
    k0 = pl.multiple_of(c * bk, bk)
    xb = x_ref[:, pl.ds(k0, bk)]
    ag = ag + jnp.dot(xb, g_ref[pl.ds(k0, bk), :], preferred_element_type=jnp.float32)
    au = au + jnp.dot(xb, u_ref[pl.ds(k0, bk), :], preferred_element_type=jnp.float32)
    return ag, au
  z = jnp.zeros((bm, bn), jnp.float32)
  ag, au = lax.fori_loop(0, nk, body, (z, z))
  g = ag.astype(o_ref.dtype).astype(jnp.float32)   # XLA's dot output is bf16
  u = au.astype(o_ref.dtype).astype(jnp.float32)
  o_ref[...] = (g * jax.nn.sigmoid(g) * u).astype(o_ref.dtype)

def fused(x, gu, *, bm=128, bn=128, bk=64, warps=8, stages=3, interpret=False):
  m, k = x.shape
  f = gu.shape[2]
  return pl.pallas_call(
      functools.partial(kernel, bk=bk, nk=k // bk),
      grid=(m // bm, f // bn),
      in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                pl.BlockSpec((k, None, bn), lambda i, j: (0, 0, j)),
                pl.BlockSpec((k, None, bn), lambda i, j: (0, 1, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((m, f), x.dtype),
      compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
      interpret=interpret)(x, gu, gu)

def xla(x, gu):
  y = jnp.einsum("md,dcf->mcf", x, gu)
  g, u = y[:, 0].astype(jnp.float32), y[:, 1].astype(jnp.float32)
  return (jax.nn.silu(g) * u).astype(x.dtype)

def xla_dot_only(x, gu):
  return jnp.einsum("md,dcf->mcf", x, gu)

cpu = jax.devices()[0].platform == "cpu"
M, K, F = (256, 256, 256) if cpu else (2048, 4096, 11008)
kx, kw = jax.random.split(jax.random.key(0))
x = jax.random.normal(kx, (M, K), jnp.bfloat16)
gu = (jax.random.normal(kw, (K, 2, F), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
want = np.asarray(xla(x, gu), np.float32)
print("device", jax.devices()[0].device_kind, flush=True)

def timeit(fn, reps=20):
  f = jax.jit(fn)
  f(x, gu).block_until_ready()
  best = 1e9
  for _ in range(3):
    t = time.perf_counter()
    for _ in range(reps):
      y = f(x, gu)
    y.block_until_ready()
    best = min(best, (time.perf_counter() - t) / reps)
  return best

flops = 2 * M * K * 2 * F
res = {}
for name, fn in [("xla dot+swiglu", xla), ("xla dot only", xla_dot_only)]:
  t = timeit(fn, 2 if cpu else 50)
  res[name] = t
  print(f"{name:40s} {t*1e6:8.1f} us {flops/t/1e12:6.0f} TFLOP/s", flush=True)
cfgs = [(128, 128, 64, 8, 3)] if cpu else [
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 32, 8, 4), (128, 64, 64, 4, 4),
    (128, 64, 64, 8, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 64, 64, 8, 3),
    (128, 128, 64, 4, 3), (64, 64, 64, 4, 4)]
for bm, bn, bk, w, st in cfgs:
  if F % bn:
    continue
  name = f"pallas fused bm{bm} bn{bn} bk{bk} w{w} st{st}"
  fn = functools.partial(fused, bm=bm, bn=bn, bk=bk, warps=w, stages=st, interpret=cpu)
  try:
    got = np.asarray(jax.jit(fn)(x, gu), np.float32)
    err = float(np.abs(got - want).max())
    same = float((got == want).mean())
    t = timeit(fn, 2 if cpu else 50)
  except Exception as e:
    print(name, "FAILED", type(e).__name__, str(e)[:300], flush=True)
    continue
  res[name] = t
  print(f"{name:40s} {t*1e6:8.1f} us {flops/t/1e12:6.0f} TFLOP/s  max err {err:.3g} equal {same:.4f}", flush=True)
if os.environ.get("OUT"):
  json.dump(res, open(os.path.join(os.environ["OUT"], "swiglu.json"), "w"))
