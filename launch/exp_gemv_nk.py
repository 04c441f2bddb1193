"""Experiment (measured, dropped): the int8 one-row GEMV with the weights stored [N, K] (K
contiguous, each output's weights one run of K bytes) against the production kernel's
[K, N] layout, at launch/bench_quant_matmul.py's shapes, inputs and timing loop.

    PYTHONPATH=. python launch/exp_gemv_nk.py      # GPU; on a CPU: a tiny interpreted run

A program reads a [bn, K / splits] slab of rows in [bn, bk] chunks, widens them to f32,
multiplies by x's slice and keeps a [bn, bk] accumulator that it sums over K after the
loop; K splits for one and three waves of programs."""
import functools, os, sys, json
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import bench_quant_matmul as bq
import bench_paged_attention as bpa
from pallas_kernels.quant_matmul import quant_matmul, default_block_config
from pallas_kernels.quant_matmul_gpu import widen

def nk_kernel(x_ref, w_ref, s_ref, o_ref, *, bk, nk, splits):
  sp = pl.program_id(1)
  per = -(-nk // splits)
  begin = sp * per
  end = jnp.minimum(begin + per, nk)
  bn = w_ref.shape[0]
  def body(c, acc):
    k0 = pl.multiple_of(c * bk, bk)
    w = widen(w_ref[:, pl.ds(k0, bk)], jnp.float32)        # [bn, bk]
    xb = x_ref[0, pl.ds(k0, bk)].astype(jnp.float32)       # [bk]
    return acc + w * xb[None, :]
  acc = lax.fori_loop(begin, end, body, jnp.zeros((bn, bk), jnp.float32))
  out = jnp.sum(acc, axis=1) * s_ref[0, :]
  o_ref[...] = out[None, :]

def nk_gemv(x, wt, scale, *, bn, bk, splits, warps, stages, interpret=False):
  n, k = wt.shape
  nk = k // bk
  splits = min(splits, nk)
  out = pl.pallas_call(
      functools.partial(nk_kernel, bk=bk, nk=nk, splits=splits),
      grid=(n // bn, splits),
      in_specs=[pl.BlockSpec((1, k), lambda j, s: (0, 0)),
                pl.BlockSpec((bn, k), lambda j, s: (j, 0)),
                pl.BlockSpec((1, bn), lambda j, s: (0, j))],
      out_specs=pl.BlockSpec((None, 1, bn), lambda j, s: (s, 0, j)),
      out_shape=jax.ShapeDtypeStruct((splits, 1, n), jnp.float32),
      compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
      interpret=interpret)(x, wt, scale)
  return out.sum(axis=0).astype(x.dtype)

cpu = jax.devices()[0].platform == "cpu"
p = bq.TINY if cpu else bq.FULL
shapes = bq.TINY["shapes"] if cpu else bq.SHAPES
copy_bw = 1e11 if cpu else bpa.best_copy_bandwidth(p["copy_bytes"])[0]
print("copy", copy_bw / 1e12, flush=True)
key = jax.random.key(0)
res = []
for name, k, n in shapes:
  nsets = bq.sets_for(k, n, p)
  sets, tsets = [], []
  for _ in range(nsets):
    key, kw = jax.random.split(key)
    w, s = bq.make_weights(kw, k, n, "int8 channel", 128)
    sets.append((w, s)); tsets.append((jnp.asarray(w.T), s))
  key, kx = jax.random.split(key)
  x = jax.random.normal(kx, (1, k), jnp.bfloat16)
  want = bq.truth(x, *sets[0])
  nbytes = k * n + n * 4 + 2 * k + 2 * n
  cands = [("prod [K,N]", sets, lambda x, w, s: quant_matmul(x, w, s, backend="gpu", interpret=cpu))]
  grid = [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 8, 4), (64, 128, 8, 4), (16, 512, 4, 3), (8, 512, 2, 4), (32, 512, 8, 3)]
  cores = 132
  for bn, bk, w_, st in ([(16, 64, 4, 2)] if cpu else grid):
    if n % bn or k % bk:
      continue
    for waves in ((1,) if cpu else (1, 3)):
      splits = max(1, min(-(-waves * cores // (n // bn)), k // bk // 2, 64))
      cands.append((f"[N,K] bn{bn} bk{bk} w{w_} st{st} s{splits}", tsets,
                    functools.partial(lambda x, w, s, **kw: nk_gemv(x, w, s, **kw), bn=bn, bk=bk, splits=splits, warps=w_, stages=st, interpret=cpu)))
  for cname, ss, fn in cands:
    try:
      err = bq.rel_err(jax.jit(fn)(x, *ss[0]), want)
      best, med, _ = bq.time_per_call(fn, x, tuple(ss), nbytes / (0.7 * copy_bw) + 3e-6, 3, p["target_s"], p["max_steps"])
    except Exception as e:
      print(name, cname, "FAILED", type(e).__name__, str(e)[:200], flush=True); continue
    r = dict(shape=name, cand=cname, us=best * 1e6, frac=nbytes / best / copy_bw, err=err)
    res.append(r)
    print(f"{name:18s} {cname:36s} {best*1e6:7.1f} us {100*r['frac']:5.1f} % copy err {err:.1e}", flush=True)
if os.environ.get("OUT"):
  json.dump(res, open(os.path.join(os.environ["OUT"], "gemv_nk.json"), "w"), indent=1)
