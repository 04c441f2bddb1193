"""Benchmark weight-only quantized matmul (pallas_kernels.quant_matmul) at 7B decode shapes.

  PYTHONPATH=. python launch/bench_quant_matmul.py [--ms 1,4,16,64] [--shapes o_proj,down]
  PYTHONPATH=. python launch/bench_quant_matmul.py --tiny --json /tmp/q.json    # CPU, seconds

Shapes (x [M, K] @ W [K, N], bf16 activations): Llama-2-7B fused QKV 4096x12288, o_proj
4096x4096, gate+up 4096x22016, down 11008x4096, lm_head 4096x32000; MiMo-7B (hidden
4096, FFN 11008, 32 q / 8 kv heads of 128, vocab 151680) shares o_proj, gate+up and down
and adds fused QKV 4096x6144 and lm_head 4096x151680. M in {1, 4, 16, 64} rows.
Candidates: the bf16 XLA dot; int8 and fp8 (e4m3) per-channel weights (S = 1) and fp8
block-scaled weights (128-row K blocks, S = K / 128) through the reference path (XLA, the
convert fused into the dot where XLA does so) and through the Pallas GPU kernel (default
block config, printed in the table). --sweep adds a few other kernel configs, and at
M = 1 the same CUDA-core GEMV kernel over the bf16 weights themselves (scale 1; a
measurement only: bf16 products run on XLA's dot): whether a GEMV of our own, the base of
any prologue / epilogue fusion, streams bf16 weights as fast as XLA's does.

Timing: many calls inside one jitted fori_loop with a static trip count, each iteration
calling once per weight copy (several distinct copies, together >= 128 MiB of 1-byte
weights, over twice an H100's L2, so no weight stays in L2); one element of each output
feeds the next call's x, so no call can be hoisted or overlapped. Per-call time = loop
time / calls, the loop's own cost included (the header reports it: the same loop around
a call that only copies x); best and median of --reps loops after a warm-up run. Each candidate's
result is checked against an f32 matmul of the dequantized weights (relative Frobenius
error).

Bytes moved per call: weights (K * N * 1 or 2) + scales (S * N * 4) + x (M * K * 2) + out
(M * N * 2), against the copy bandwidth measured in the same run (the shared probe of
launch/bench_paged_attention.py: the best of a torch and an XLA device copy of 4 GiB,
counting bytes read + written). The markdown table is printed last; JSON goes to
$OUT/bench_quant_matmul.json, or --json PATH. --budget-s stops timing new rows after that
many seconds (the rest are listed as skipped): a full run times 196 candidates, about 2 s
each on an H100, mostly compiling.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_paged_attention as paged_attention_bench  # noqa: E402

from pallas_kernels.quant_matmul import (  # noqa: E402
    BlockConfig, default_block_config, quant_matmul, quant_matmul_reference)
from pallas_kernels.quant_matmul_gpu import quant_matmul_gpu  # noqa: E402

SHAPES = (("qkv Llama-2-7B", 4096, 12288), ("qkv MiMo-7B", 4096, 6144),
          ("o_proj both", 4096, 4096), ("gate_up both", 4096, 22016),
          ("down both", 11008, 4096), ("lm_head Llama-2-7B", 4096, 32000),
          ("lm_head MiMo-7B", 4096, 151680))
FULL = dict(shapes=SHAPES, ms=(1, 4, 16, 64), copy_bytes=4 << 30, flush_bytes=128 << 20,
            max_sets=8, target_s=0.02, max_steps=500, block=128)
TINY = dict(shapes=(("tiny", 128, 256),), ms=(1,), copy_bytes=16 << 20,
            flush_bytes=1 << 20, max_sets=2, target_s=0.002, max_steps=2, block=64)
SCHEMES = ("bf16", "int8 channel", "fp8 channel", "fp8 block")


def log(*a):
  print(*a, flush=True)


def sets_for(k, n, p):
  """Distinct weight copies per loop: >= flush_bytes of 1-byte weights, 2..max_sets."""
  return int(min(p["max_sets"], max(2, -(-p["flush_bytes"] // (k * n)))))


def quantize(w, dtype, rows):
  """f32 [K, N] -> (values [K, N] dtype, scale [K // rows, N] f32), absmax per block."""
  k, n = w.shape
  blocks = w.reshape(k // rows, rows, n)
  qmax = 127.0 if dtype == jnp.int8 else 448.0
  scale = jnp.maximum(jnp.abs(blocks).max(axis=1), 1e-12) / qmax
  q = blocks / scale[:, None, :]
  if dtype == jnp.int8:
    q = jnp.round(q)
  return q.reshape(k, n).astype(dtype), scale


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def make_weights(key, k, n, scheme, block):
  """(w, scale) of one scheme: bf16 [K, N] and None, or 1-byte values and f32 scales."""
  w = jax.random.normal(key, (k, n), jnp.float32) / np.sqrt(k)
  if scheme == "bf16":
    return w.astype(jnp.bfloat16), None
  dtype = jnp.int8 if scheme.startswith("int8") else jnp.float8_e4m3fn
  return quantize(w, dtype, block if scheme.endswith("block") else k)


@jax.jit
def truth(x, w, scale):
  """f32 x @ dequantized w (HIGHEST precision): what every candidate approximates."""
  w = w.astype(jnp.float32)
  if scale is not None:
    k, n = w.shape
    w = (w.reshape(scale.shape[0], -1, n) * scale[:, None, :]).reshape(k, n)
  return jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def null_call(x, w, scale):
  """What the timing loop costs by itself: no weight read, one tiny kernel."""
  del w, scale
  return x * 1


def bf16_dot(x, w, scale):
  del scale
  return jnp.dot(x, w)


def config_label(c):
  return (f"bm{c.block_m} bn{c.block_n} bk{c.block_k} s{c.num_splits} w{c.num_warps} "
          f"st{c.num_stages}")


def bf16_gemv_configs(k, n, num_cores=None):
  """One-row CUDA-core configs for bf16 weights: chunks of 8 or 16 KB (128 x 32 and 256 x
  16 with 8 warps, 64 x 128 with 4), K splits for one and for three waves of programs."""
  if num_cores is None:
    num_cores = getattr(jax.devices()[0], "core_count", None) or 132
  out = []
  for bn, bk, warps in ((128, 32, 8), (256, 16, 8), (64, 128, 4)):
    if n % bn or k % bk:
      continue
    for waves in (1, 3):
      splits = max(1, min(-(-waves * num_cores // (n // bn)), k // bk // 2, 64))
      c = BlockConfig(block_m=1, block_n=bn, block_k=bk, num_splits=splits,
                      num_warps=warps, num_stages=4)
      if c not in out:
        out.append(c)
  return out


def candidates(scheme, m, k, n, s, tiny, sweep):
  """[(name, fn(x, w, scale), config label or '')] for one weight scheme."""
  if scheme == "bf16":
    out = [("bf16 XLA dot", bf16_dot, "")]
    if sweep and m == 1:
      unit = jnp.ones((1, n), jnp.float32)  # made once: a constant of the timed program
      out += [(f"bf16 Pallas GEMV ({config_label(c)})",
               lambda x, w, sc, c=c: quant_matmul_gpu(x, w, unit, block=c, interpret=tiny),
               config_label(c)) for c in bf16_gemv_configs(k, n, 132 if tiny else None)]
    return out
  out = [(f"{scheme} XLA", lambda x, w, sc: quant_matmul_reference(x, w, sc), "")]
  values_dtype = jnp.int8 if scheme.startswith("int8") else jnp.float8_e4m3fn
  d = default_block_config(m, k, n, s, "gpu", num_cores=132 if tiny else None,
                           values_dtype=values_dtype)
  cfgs = [d]
  alts = []
  if sweep and m == 1:  # every scheme: the 16-row tensor-core tiling beside the default
    alts.append(default_block_config(16, k, n, s, "gpu", num_cores=132 if tiny else None,
                                     values_dtype=values_dtype))
  if sweep and scheme == "int8 channel":
    alts += [dataclasses.replace(d, num_stages=4), dataclasses.replace(d, num_splits=1),
             dataclasses.replace(d, num_splits=2 * d.num_splits),
             dataclasses.replace(d, block_n=d.block_n // 2)]
    if m == 1:  # the CUDA-core path's other chunk shapes (8 KB each)
      alts += [dataclasses.replace(d, block_n=bn, block_k=8192 // bn)
               for bn in (512, 256, 128) if bn != d.block_n and (k // s) % (8192 // bn) == 0]
    else:  # tensor-core tiles: wider columns (x re-read less), other chunks and warps
      alts += [dataclasses.replace(d, block_n=256, num_warps=w, num_stages=st)
               for w in (4, 8) for st in (3, 4)]
      alts += [dataclasses.replace(d, block_k=bk, num_warps=w, num_stages=st)
               for bk in (32, 64, 256) for w in (4, 8) for st in (3, 4, 5)
               if (k // s) % bk == 0]
      alts += [dataclasses.replace(d, num_warps=8)]
  cfgs += [c for c in alts if n % c.block_n == 0 and c.block_n >= 16 and c not in cfgs]
  for i, c in enumerate(cfgs):
    name = f"{scheme} Pallas" + ("" if i == 0 else f" ({config_label(c)})")
    out.append((name, lambda x, w, sc, c=c: quant_matmul(
        x, w, sc, backend="gpu", interpret=tiny, block_config=c), config_label(c)))
  return out


def time_per_call(fn, x, sets, est_s, reps, target_s, max_steps):
  """(best_s, median_s, calls) per call: calls chained in one jitted fori_loop.

  The trip count is static (a traced one makes XLA's GPU while loop read its predicate
  back to the host every iteration). An optimization barrier keeps the whole output
  live, so XLA cannot narrow the matmul to the one element fed back.
  """
  steps = int(min(max_steps, max(2, target_s / max(est_s * len(sets), 1e-7))))

  def loop(x, sets):
    def body(_, x):
      for w, scale in sets:
        y = lax.optimization_barrier(fn(x, w, scale))
        x = x.at[0, 0].set(y[0, 0].astype(x.dtype))
      return x
    return lax.fori_loop(0, steps, body, x)

  compiled = jax.jit(loop).lower(x, sets).compile()
  compiled(x, sets).block_until_ready()                            # warm-up
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    compiled(x, sets).block_until_ready()
    times.append((time.perf_counter() - t) / (steps * len(sets)))
  return min(times), statistics.median(times), steps * len(sets)


def table(header, copy_line, results):
  lines = [header, copy_line, "",
           "| shape | K x N | M | candidate | us best / median | MB moved | TB/s | % copy "
           "| rel err | config |", "|---|---|---|---|---|---|---|---|---|---|"]
  order = {name: i for i, name in enumerate(r["shape"] for r in results)}
  for r in sorted(results, key=lambda r: (order[r["shape"]], r["m"])):
    head = f"| {r['shape']} | {r['k']}x{r['n']} | {r['m']} | {r['candidate']} |"
    if r["us_best"] is None:
      why = r.get("skipped") or r.get("error", "")
      status = "skipped" if r.get("skipped") else "FAILED"
      lines.append(f"{head} {status}: {why[:80]} | | | | | |")
      continue
    lines.append(f"{head} {r['us_best']:.1f} / {r['us_median']:.1f} | "
                 f"{r['bytes'] / 1e6:.1f} | {r['tbs']:.2f} | {100 * r['frac_copy']:.0f} | "
                 f"{r['rel_err']:.1e} | {r['config']} |")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tiny", action="store_true", help="tiny shapes, interpret mode (CPU)")
  ap.add_argument("--ms", help="comma-separated row counts (default 1,4,16,64)")
  ap.add_argument("--shapes", help="comma-separated shape-name prefixes, e.g. o_proj,down")
  ap.add_argument("--reps", type=int, default=None)
  ap.add_argument("--sweep", action="store_true", help="time a few more kernel configs")
  ap.add_argument("--schemes", help="comma-separated weight schemes (default all: "
                  + ", ".join(SCHEMES) + ")")
  ap.add_argument("--budget-s", type=float, default=None,
                  help="stop timing new rows after this many seconds")
  ap.add_argument("--json", help="JSON path (default $OUT/bench_quant_matmul.json)")
  opts = ap.parse_args(argv)
  p = TINY if opts.tiny else FULL
  ms = [int(v) for v in opts.ms.split(",")] if opts.ms else list(p["ms"])
  reps = opts.reps or (2 if opts.tiny else 3)
  shapes = [sh for sh in p["shapes"]
            if not opts.shapes or any(sh[0].startswith(w) for w in opts.shapes.split(","))]
  schemes = [v.strip() for v in opts.schemes.split(",")] if opts.schemes else list(SCHEMES)
  unknown = [v for v in schemes if v not in SCHEMES]
  if unknown:
    ap.error(f"unknown --schemes {unknown}; known: {', '.join(SCHEMES)}")
  start = time.perf_counter()
  dev = jax.devices()[0]
  header = (f"device: {dev.device_kind}; jax {jax.__version__}; python "
            f"{sys.version.split()[0]}; x bf16; fp8 = float8_e4m3fn; block-scaled = "
            f"{p['block']}-row K blocks{'; TINY (interpret mode)' if opts.tiny else ''}")
  log(header)
  copy_bw, copy_method = paged_attention_bench.best_copy_bandwidth(p["copy_bytes"])
  copy_line = f"copy bandwidth: {copy_bw / 1e12:.3f} TB/s ({copy_method}, read + write)"
  x0 = jnp.ones((1, 128), jnp.bfloat16)
  overhead = time_per_call(null_call, x0, ((x0, None),) * 4, 1e-6, reps, p["target_s"],
                           p["max_steps"])[0]
  copy_line += f"; timing loop alone: {overhead * 1e6:.1f} us a call (included below)"
  log(copy_line)

  key = jax.random.key(0)
  results = []
  for m in ms:
    for shape_name, k, n in shapes:
      nsets = sets_for(k, n, p)
      key, kx = jax.random.split(key)
      x = jax.random.normal(kx, (m, k), jnp.bfloat16)
      for scheme in schemes:
        s = k // p["block"] if scheme.endswith("block") else 1
        cands = candidates(scheme, m, k, n, s, opts.tiny, opts.sweep)
        over = opts.budget_s is not None and time.perf_counter() - start > opts.budget_s
        if over:
          for name, _, cfg in cands:
            results.append(dict(shape=shape_name, k=k, n=n, m=m, candidate=name,
                                us_best=None, skipped="time budget spent", config=cfg))
          continue
        sets = []
        for _ in range(nsets):
          key, kw = jax.random.split(key)
          sets.append(make_weights(kw, k, n, scheme, p["block"]))
        sets = tuple(sets)
        w0, s0 = sets[0]
        want = truth(x, w0, s0)
        w_bytes = k * n * w0.dtype.itemsize + (0 if s0 is None else s0.size * 4)
        nbytes = w_bytes + m * k * 2 + m * n * 2
        for name, fn, cfg in cands:
          entry = dict(shape=shape_name, k=k, n=n, m=m, candidate=name, config=cfg,
                       bytes=nbytes, sets=nsets, us_best=None)
          results.append(entry)
          try:
            entry["rel_err"] = rel_err(jax.jit(fn)(x, w0, s0), want)
            best, med, calls = time_per_call(fn, x, sets, nbytes / (0.7 * copy_bw) + 3e-6,
                                             reps, p["target_s"], p["max_steps"])
          except Exception as e:  # one failing candidate must not end the run
            entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log(f"{shape_name} M={m} {name}: FAILED {entry['error']}")
            continue
          tbs = nbytes / best / 1e12
          entry.update(us_best=best * 1e6, us_median=med * 1e6, calls=calls, tbs=tbs,
                       frac_copy=tbs * 1e12 / copy_bw)
          log(f"{shape_name} M={m} {name}: {best * 1e6:.1f} / {med * 1e6:.1f} us, "
              f"{tbs:.2f} TB/s ({100 * entry['frac_copy']:.0f} % copy), rel err "
              f"{entry['rel_err']:.1e} {cfg}")
        del sets, w0, s0, want

  text = table(header, copy_line, results)
  log("\n" + text)
  path = opts.json or (os.path.join(os.environ["OUT"], "bench_quant_matmul.json")
                       if os.environ.get("OUT") else None)
  if path:
    with open(path, "w") as f:
      json.dump(dict(header=header, copy_bw=copy_bw, copy_method=copy_method,
                     table=text, results=results), f, indent=1)
    log(f"wrote {path}")
  return results


if __name__ == "__main__":
  main()
