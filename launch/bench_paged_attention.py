"""Benchmark paged attention against the XLA reference, JAX's bundled GPU kernel and the
device's copy bandwidth, all measured in the same run.

  PYTHONPATH=. python launch/bench_paged_attention.py [--sweep] [--reps 5] [--no-mimo]
      [--no-fp8] [--tiny] [--sweep-pages 64,4096:16,32,64]
      [--sweep-configs '64,4096;32,16384:4/2/3,8/2/3' --kv fp8]

Shapes: bf16, Hq=32, KVH=8, D=128, page 16, pages in a random permutation of the pool,
every row at kv_len = ctx. Bandwidth counts the K+V bytes attended:
  bytes = B * ctx * KVH * D * 2 (K and V) * 2 (bf16)
An fp8-KV table (skip it with --no-fp8) times the same shapes with the pages stored as
float8_e4m3fn with per-kv-head scales (amax / 448, quantized as the cache writes them),
q still bf16: bytes count 1 per value, and the fp8 / bf16 time ratio is 0.5 where both
run at the same bandwidth. Its errors are against the XLA reference on the same fp8 pages
and against our bf16 result (the quantization error).
A second table (skip it with --no-mimo) times the MiMo-V2-Flash layer shapes: Hq=64,
D=192 (keys), Dv=128 (values); sliding layers KVH=8, window 128, attention sinks; full
layers KVH=4, no sinks. There the bytes are B * min(ctx, window) * KVH * (D + Dv) * 2:
the kernel reads only the window's pages, the XLA reference gathers every table page.
Each figure times N calls inside one jitted fori_loop (the output feeds the next call's
q, so no call can be hoisted) and divides by N; best and median of --reps loops, after a
warm-up that also reports compile time. The copy bandwidth (the denominator) is the best
of torch `dst.copy_(src)` and a jitted XLA `x + 1` on 4 GiB, counting read + write bytes.
With $OUT set, the table (markdown) and raw results (JSON) are written there.
--tiny is a CPU smoke run: small shapes, the GPU kernel in interpret mode, one call per
loop, a 64 MiB copy; it checks that the script runs, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from pallas_kernels.common import FP8_DTYPE, FP8_MAX  # noqa: E402
from pallas_kernels.kv_write import quantize_rows  # noqa: E402
from pallas_kernels.paged_attention import (  # noqa: E402
    BlockConfig, default_block_config, paged_attention, paged_attention_reference)

HQ, KVH, D, PAGE = 32, 8, 128, 16
SHAPES = [(1, 4096), (8, 4096), (64, 4096), (32, 16384)]
TINY_SHAPES = [(2, 256)]
COPY_BYTES = 4 << 30


@dataclasses.dataclass(frozen=True)
class Layer:
  """Head shape of one attention layer: Hq, KVH, key dim D, value dim Dv, window, sinks."""
  name: str
  hq: int = HQ
  kvh: int = KVH
  d: int = D
  dv: int = D
  window: int | None = None
  sinks: bool = False


DEFAULT = Layer("default")
MIMO_LAYERS = [Layer("MiMo-V2-Flash sliding", 64, 8, 192, 128, window=128, sinks=True),
               Layer("MiMo-V2-Flash full", 64, 4, 192, 128)]
MIMO_SHAPES = [(1, 4096), (64, 4096), (32, 16384)]


def log(*a):
  print(*a, flush=True)


def copy_bandwidth(reps=10, nbytes=COPY_BYTES):
  """Read+write bandwidth of a device copy (4 GiB by default): {method: bytes/s}."""
  out = {}
  try:
    import torch  # lazy: only the benchmark uses torch, and only for this
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
      a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      a.record()
      dst.copy_(src)
      b.record()
      b.synchronize()
      times.append(a.elapsed_time(b) / 1e3)
    out["torch dst.copy_(src)"] = 2 * nbytes / min(times)
    del src, dst
    torch.cuda.empty_cache()
  except Exception as e:  # no torch / no CUDA torch: the XLA figure stands alone
    log(f"torch copy unavailable: {type(e).__name__}: {e}")
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  f = jax.jit(lambda x: x + 1)
  f(x).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - t)
  out["XLA x + 1"] = 2 * nbytes / min(times)
  del x
  return out


def best_copy_bandwidth(nbytes=COPY_BYTES):
  """(bytes/s, method): the best read + write bandwidth of a device copy of nbytes."""
  bws = copy_bandwidth(nbytes=nbytes)
  method = max(bws, key=bws.get)
  return bws[method], f"{method}, {nbytes >> 20} MiB"


def make_inputs(batch, ctx, q_len, key, layer=DEFAULT, page=PAGE):
  """Pool of exactly the pages needed, in random order; every row at kv_len = ctx."""
  pages_per_seq = ctx // page
  num_pages = batch * pages_per_seq
  kq, kk, kv, kp = jax.random.split(key, 4)
  q = jax.random.normal(kq, (batch, q_len, layer.hq, layer.d), jnp.bfloat16)
  k = jax.random.normal(kk, (layer.kvh, num_pages, page, layer.d), jnp.bfloat16)
  v = jax.random.normal(kv, (layer.kvh, num_pages, page, layer.dv), jnp.bfloat16)
  tables = jax.random.permutation(kp, num_pages).reshape(batch, pages_per_seq)
  kv_lens = jnp.full((batch,), ctx, jnp.int32)
  return q, k, v, tables.astype(jnp.int32), kv_lens


def quantize_kv(k, v):
  """fp8 pages of k and v as the cache writes them: per-kv-head scales amax / 448 and
  clip(x / scale) in float8_e4m3fn. Returns (k8, v8, k_scale [KVH], v_scale [KVH])."""
  out = []
  for x in (k, v):
    scale = jnp.abs(x).max(axis=(1, 2, 3)).astype(jnp.float32) / FP8_MAX
    rows = quantize_rows(x.reshape(x.shape[0], -1, x.shape[3]), scale, FP8_DTYPE)
    out += [rows.reshape(x.shape), scale]
  k8, k_scale, v8, v_scale = out
  return k8, v8, k_scale, v_scale


def layer_kwargs(layer, key=None):
  """paged_attention keywords of a layer: its window and (random, f32) sinks."""
  sinks = None
  if layer.sinks:
    sinks = jax.random.normal(key if key is not None else jax.random.key(1), (layer.hq,),
                              jnp.float32)
  return dict(sliding_window=layer.window, sinks=sinks)


def bundled_fn():
  """JAX's bundled Pallas GPU paged attention as fn(q[B,1,Hq,D], ...) -> [B,1,Hq,D]."""
  from jax.experimental.pallas.ops.gpu import paged_attention as bundled
  params = list(inspect.signature(bundled.paged_attention).parameters)
  log(f"bundled signature: {params}")
  names = ("q", "k_pages", "v_pages", "block_tables", "lengths")

  def fn(q, k, v, tables, kv_lens):
    args = (q[:, 0], k, v, tables, kv_lens)
    if all(n in params for n in names):
      out = bundled.paged_attention(**dict(zip(names, args)))
    else:
      out = bundled.paged_attention(*args)
    return out[:, None]
  return fn


def time_per_call(fn, args, n, reps):
  """(compile_s, best_s, median_s) per call of fn, N calls chained in one fori_loop."""
  q, rest = args[0], args[1:]

  def feed(q, o):
    o = o.astype(q.dtype)
    # Dv < D: the output overwrites q's first Dv columns (still a data dependence).
    return o if o.shape == q.shape else q.at[..., :o.shape[-1]].set(o)

  loop = jax.jit(lambda q, *rest: lax.fori_loop(
      0, n, lambda _, q: feed(q, fn(q, *rest)), q))
  t = time.perf_counter()
  compiled = loop.lower(q, *rest).compile()
  compile_s = time.perf_counter() - t
  compiled(q, *rest).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    compiled(q, *rest).block_until_ready()
    times.append((time.perf_counter() - t) / n)
  return compile_s, min(times), statistics.median(times)


def ours(cfg=None, **kw):
  return lambda q, k, v, t, l, **more: paged_attention(q, k, v, t, l, backend="gpu",
                                                       block_config=cfg, **kw, **more)


def reference(q, k, v, t, l, **kw):
  return paged_attention_reference(q, k, v, t, l, **kw)


def reference_fn(**kw):
  return lambda q, k, v, t, l: reference(q, k, v, t, l, **kw)


def scaled(fn):
  """fn(q, k, v, t, l, **kw) as fn(q, k8, v8, t, l, k_scale, v_scale): fp8 pages."""
  return lambda q, k, v, t, l, ks, vs: fn(q, k, v, t, l, k_scale=ks, v_scale=vs)


def fp8_inputs(args):
  """args (q, k, v, tables, kv_lens) with the pages in fp8 as the cache writes them:
  (q, k8, v8, tables, kv_lens, k_scale, v_scale), the arguments of `scaled` functions."""
  q, k, v, tables, kv_lens = args
  k8, v8, k_scale, v_scale = quantize_kv(k, v)
  return q, k8, v8, tables, kv_lens, k_scale, v_scale


def time_row(results, name, fn, args, n, reps, nbytes, **fields):
  """Time fn on args (n calls a loop, best of reps), log it under `name` and append a
  row with `fields`; the best seconds, or None where it fails (logged)."""
  try:
    _, best, med = time_per_call(fn, args, n, reps)
  except Exception as e:
    log(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
    return None
  tbs = nbytes / best / 1e12
  log(f"{name}: {best * 1e6:.1f} us, {tbs:.2f} TB/s")
  results.append(dict(fields, best_s=best, median_s=med, tbs=tbs))
  return best


def sweep(results, reps, key, fp8=False):
  """Time a few block configs on the target shapes (prints; the defaults come from here).
  fp8: the pages in float8_e4m3fn (bytes 1 a value), a grid with larger blocks too."""
  def run(batch, ctx, q_len, cfg):
    args = make_inputs(batch, ctx, q_len, key)
    fn = ours(cfg)
    if fp8:
      args, fn = fp8_inputs(args), scaled(fn)
    best = time_row(results, f"sweep B={batch} ctx={ctx} Q={q_len} {cfg}", fn, args,
                    iters(batch, ctx), reps, kv_bytes(batch, ctx, itemsize=1 if fp8 else 2),
                    batch=batch, ctx=ctx, q_len=q_len, cfg=str(cfg), fp8=fp8)
    return float("inf") if best is None else best

  timed = {}
  grid = [(8, 4, 1), (8, 4, 2), (8, 4, 3), (8, 4, 4), (8, 8, 2), (8, 8, 3), (8, 8, 4),
          (4, 4, 2), (4, 4, 3), (4, 4, 4), (4, 8, 3), (4, 8, 4),
          (16, 4, 2), (16, 8, 2), (16, 8, 3), (2, 4, 4)]
  if fp8:
    grid = [(8, 4, 2), (8, 4, 3), (8, 4, 4), (16, 4, 3), (16, 4, 4), (16, 8, 2), (16, 8, 3),
            (16, 8, 4), (32, 4, 2), (32, 8, 2), (32, 8, 3)]
  for ppb, warps, stages in grid:
    cfg = BlockConfig(pages_per_block=ppb, num_warps=warps, num_stages=stages)
    timed[cfg] = run(64, 4096, 1, cfg)
  top = sorted(timed, key=timed.get)[:3]
  for cfg in top:
    run(64, 4096, 4, cfg)
  best = top[0]
  for batch, ctx, splits in ((1, 4096, (8, 16, 32)), (8, 4096, (2, 4, 8)),
                             (32, 16384, (1, 2, 4)), (64, 4096, (2,))):
    for s in splits:
      run(batch, ctx, 1, dataclasses.replace(best, num_splits=s))


def sweep_splits(results, reps, key, batches, ctx):
  """At each batch size: Q=1 and Q=4 with the default tiling and with 1, 2 and 4 KV splits
  (the split merge included): whether splitting pays once the grid has a wave or more of
  programs."""
  for batch in batches:
    for q_len in (1, 4):
      args = make_inputs(batch, ctx, q_len, key)
      default = default_block_config(batch, q_len, HQ, KVH, PAGE, ctx // PAGE, "gpu")
      for splits in (None, 1, 2, 4):
        cfg = default if splits is None else dataclasses.replace(default, num_splits=splits)
        _, best, med = time_per_call(ours(cfg), args, iters(batch, ctx), reps)
        tag = "default" if splits is None else f"splits={splits}"
        log(f"splits B={batch} ctx={ctx} Q={q_len} {tag} ({cfg.num_splits}): "
            f"{best * 1e6:.1f} us, {kv_bytes(batch, ctx) / best / 1e12:.2f} TB/s")
        results.append(dict(batch=batch, ctx=ctx, q_len=q_len, cfg=str(cfg), tag=tag,
                            best_s=best, median_s=med))


def sweep_shape(results, reps, key, batch, ctx):
  """At one (batch, ctx): Q=1 and Q=4 with the default tiling, then Q=4 over a grid of kv
  block sizes, KV splits and stages (the verify of K=3 at a short context)."""
  def run(q_len, cfg):
    args = make_inputs(batch, ctx, q_len, key)
    try:
      _, best, med = time_per_call(ours(cfg), args, iters(batch, ctx), reps)
    except Exception as e:
      log(f"sweep B={batch} ctx={ctx} Q={q_len} {cfg}: FAILED {type(e).__name__}: "
          f"{str(e)[:300]}")
      return
    tbs = kv_bytes(batch, ctx) / best / 1e12
    log(f"sweep B={batch} ctx={ctx} Q={q_len} {cfg}: {best * 1e6:.1f} us, {tbs:.2f} TB/s")
    results.append(dict(batch=batch, ctx=ctx, q_len=q_len, cfg=str(cfg), best_s=best,
                        median_s=med, tbs=tbs))

  for q_len in (1, 4):
    run(q_len, default_block_config(batch, q_len, HQ, KVH, PAGE, ctx // PAGE, "gpu"))
  for ppb, splits, stages in itertools.product((2, 4, 8), (1, 2, 4, 8), (2, 3)):
    run(4, BlockConfig(pages_per_block=ppb, num_splits=splits, rows_per_block=16,
                       num_warps=4, num_stages=stages))


def sweep_pages(results, reps, key, batch, ctx, pages, interpret=False):
  """At one (batch, ctx): Q=1 and Q=4 over bf16 and fp8 pages of each page size, with
  the default tiling for that page size and with 256 kv positions a block: whether a
  page's contiguous bytes (page x D x itemsize per kv head) bound the kernel's rate."""
  for page, q_len in itertools.product(pages, (1, 4)):
    args = make_inputs(batch, ctx, q_len, key, page=page)
    both = {False: args, True: fp8_inputs(args)}
    base = default_block_config(batch, q_len, HQ, KVH, page, ctx // page, "gpu")
    cfgs = [("default", base)]
    if 256 // page >= 1:
      cfgs.append(("256 positions", dataclasses.replace(base, pages_per_block=256 // page)))
    for (tag, cfg), fp8 in itertools.product(cfgs, (False, True)):
      fn = ours(cfg, interpret=interpret)
      time_row(results, f"pages B={batch} ctx={ctx} Q={q_len} page={page} "
               f"{'fp8' if fp8 else 'bf16'} {tag} {cfg}", scaled(fn) if fp8 else fn,
               both[fp8], 1 if interpret else iters(batch, ctx), reps,
               kv_bytes(batch, ctx, itemsize=1 if fp8 else 2), batch=batch, ctx=ctx,
               q_len=q_len, page=page, fp8=fp8, tag=tag, cfg=str(cfg))
    del args, both


def sweep_configs(results, reps, key, shapes, configs, fp8, interpret=False):
  """Q=1 and Q=4 at each (B, ctx) with the default tiling and with each (pages per block,
  warps, stages) in place of the default's (its KV splits kept): whether a tiling wins
  across shapes, not at one."""
  for (batch, ctx), q_len in itertools.product(shapes, (1, 4)):
    args = make_inputs(batch, ctx, q_len, key)
    if fp8:
      args = fp8_inputs(args)
    base = default_block_config(batch, q_len, HQ, KVH, PAGE, ctx // PAGE, "gpu",
                                kv_dtype=FP8_DTYPE if fp8 else None)
    cfgs = [("default", base)] + [
        (f"{ppb}/{warps}/{stages}", dataclasses.replace(
            base, pages_per_block=ppb, num_warps=warps, num_stages=stages))
        for ppb, warps, stages in configs]
    for tag, cfg in cfgs:
      fn = ours(cfg, interpret=interpret)
      time_row(results, f"configs B={batch} ctx={ctx} Q={q_len} {'fp8' if fp8 else 'bf16'} "
               f"{tag} {cfg}", scaled(fn) if fp8 else fn, args,
               1 if interpret else iters(batch, ctx), reps,
               kv_bytes(batch, ctx, itemsize=1 if fp8 else 2), batch=batch, ctx=ctx,
               q_len=q_len, fp8=fp8, tag=tag, cfg=str(cfg))
    del args


def kv_bytes(batch, ctx, layer=DEFAULT, itemsize=2):
  """K+V bytes attended (bf16: 2 a value, fp8: 1): the window's positions only, for a
  sliding layer."""
  positions = ctx if layer.window is None else min(ctx, layer.window)
  return batch * positions * layer.kvh * (layer.d + layer.dv) * itemsize


def iters(batch, ctx, layer=DEFAULT):
  return int(min(500, max(10, 0.03 * 3e12 / kv_bytes(batch, ctx, layer))))


def time_into(entry, methods, args, n, reps, nbytes, tag):
  """entry[name] = timing of each (name, fn) on args (None where it fails, logged)."""
  for name, fn in methods:
    try:
      compile_s, best, med = time_per_call(fn, args, n, reps)
      entry[name] = dict(compile_s=compile_s, best_s=best, median_s=med,
                         tbs=nbytes / best / 1e12)
    except Exception as e:
      log(f"{name} {tag} failed: {type(e).__name__}: {str(e)[:500]}")
      entry[name] = None


def bw_cell(r, denom):
  """'TB/s (% of copy bandwidth)' of one timing, or n/a."""
  return f"{r['tbs']:.2f} ({100 * r['tbs'] * 1e12 / denom:.0f} %)" if r else "n/a"


def max_err(a, b):
  return float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())


def fp8_entry(args, n, reps, batch, ctx, interpret):
  """Time ours and the XLA reference over fp8 copies of args' pages: a results dict with
  the fp8 byte count, errors (vs the reference on the fp8 pages, vs our bf16 result) and
  one timing per method (None where it fails, logged)."""
  fp8_args = fp8_inputs(args)
  nbytes = kv_bytes(batch, ctx, itemsize=1)
  ours_fp8, reference_fp8 = scaled(ours(interpret=interpret)), scaled(reference)
  entry = dict(bytes=nbytes)
  tag = f"fp8 B={batch} ctx={ctx} Q={args[0].shape[1]}"
  try:
    got = ours_fp8(*fp8_args)
    entry["max_abs_err"] = max_err(got, reference_fp8(*fp8_args))
    entry["max_abs_err_vs_bf16"] = max_err(got, ours(interpret=interpret)(*args))
  except Exception as e:
    log(f"{tag} check failed: {type(e).__name__}: {str(e)[:500]}")
    entry["max_abs_err"] = entry["max_abs_err_vs_bf16"] = float("nan")
  time_into(entry, (("ours", ours_fp8), ("xla_reference", reference_fp8)), fp8_args, n,
            reps, nbytes, tag)
  return entry


def layer_table(layer, shapes, reps, key, denom):
  """Time ours vs the XLA reference at one layer shape: (markdown rows, raw entries)."""
  kw = layer_kwargs(layer)
  rows, raw = [], []
  for batch, ctx in shapes:
    per_q = {}
    for q_len in (1, 4):
      args = make_inputs(batch, ctx, q_len, key, layer)
      n = iters(batch, ctx, layer)
      nbytes = kv_bytes(batch, ctx, layer)
      cfg = default_block_config(batch, q_len, layer.hq, layer.kvh, PAGE, ctx // PAGE, "gpu")
      entry = dict(layer=dataclasses.asdict(layer), batch=batch, ctx=ctx, q_len=q_len,
                   config=str(cfg), bytes=nbytes, iters=n)
      try:
        entry["max_abs_err"] = float(jnp.abs(
            ours(**kw)(*args).astype(jnp.float32)
            - reference(*args, **kw).astype(jnp.float32)).max())
      except Exception as e:
        log(f"{layer.name} B={batch} ctx={ctx} Q={q_len} check failed: "
            f"{type(e).__name__}: {str(e)[:500]}")
        entry["max_abs_err"] = float("nan")
      time_into(entry, (("ours", ours(**kw)), ("xla_reference", reference_fn(**kw))), args,
                n, reps, nbytes, f"{layer.name} B={batch} ctx={ctx} Q={q_len}")
      per_q[q_len] = entry
      raw.append(entry)
      log(json.dumps(entry))
      del args
    for q_len, e in per_q.items():
      o, x = e.get("ours"), e.get("xla_reference")
      us = f"{o['best_s'] * 1e6:.1f} / {o['median_s'] * 1e6:.1f}" if o else "n/a"
      speedup = f"{x['best_s'] / o['best_s']:.2f}" if o and x else "n/a"
      rows.append(f"| {layer.name} | {batch} | {ctx} | {q_len} | {bw_cell(o, denom)} | {us} | "
                  f"{bw_cell(x, denom)} | {speedup} | {e['max_abs_err']:.1e} |")
  return rows, raw


def fp8_row(entry, denom):
  """One markdown row of the fp8-KV table from a main-table entry holding entry['fp8']."""
  f, b = entry["fp8"].get("ours"), entry.get("ours")
  us = f"{f['best_s'] * 1e6:.1f} / {f['median_s'] * 1e6:.1f}" if f else "n/a"
  bf16_us = f"{b['best_s'] * 1e6:.1f}" if b else "n/a"
  ratio = f"{f['best_s'] / b['best_s']:.2f}" if f and b else "n/a"
  return (f"| {entry['batch']} | {entry['ctx']} | {entry['q_len']} | {bw_cell(f, denom)} | "
          f"{us} | {bf16_us} | {ratio} | {bw_cell(entry['fp8'].get('xla_reference'), denom)} "
          f"| {entry['fp8']['max_abs_err']:.1e} | {entry['fp8']['max_abs_err_vs_bf16']:.1e} |")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--sweep", action="store_true", help="also time a grid of block configs")
  ap.add_argument("--sweep-shape", help="B,ctx: time Q=1 and Q=4 there, and Q=4 over a "
                  "grid of kv blocks, splits and stages (only that)")
  ap.add_argument("--sweep-splits", metavar="B1,B2,...:CTX",
                  help="time Q=1 and Q=4 at these batch sizes with the default tiling and "
                       "1 / 2 / 4 KV splits (only that)")
  ap.add_argument("--sweep-pages", metavar="B,CTX:P1,P2,...",
                  help="time Q=1 and Q=4 over bf16 and fp8 pages of these page sizes at "
                       "one (B, ctx) (only that)")
  ap.add_argument("--sweep-configs", metavar="B,CTX;...:PPB/WARPS/STAGES,...",
                  help="time Q=1 and Q=4 at these shapes with the default tiling and each "
                       "of these (only that; with --kv fp8 over fp8 pages)")
  ap.add_argument("--kv", choices=("bf16", "fp8"), default="bf16",
                  help="the pages of --sweep-configs")
  ap.add_argument("--sweep-fp8", action="store_true",
                  help="time a grid of block configs over fp8 pages (only that)")
  ap.add_argument("--no-table", action="store_true",
                  help="skip the main table (and the MiMo-V2-Flash table)")
  ap.add_argument("--no-mimo", action="store_true",
                  help="skip the MiMo-V2-Flash table (D 192, Dv 128, sinks, window 128)")
  ap.add_argument("--no-fp8", action="store_true", help="skip the fp8-KV table")
  ap.add_argument("--tiny", action="store_true",
                  help="CPU smoke run: small shapes, interpret mode (figures mean nothing)")
  opts = ap.parse_args()
  if opts.tiny:
    opts.reps, opts.no_mimo, opts.sweep = 1, True, False
  out_dir = os.environ.get("OUT")
  dev = jax.devices()[0]
  import jaxlib
  header = (f"device: {dev.device_kind}; jax {jax.__version__}, jaxlib {jaxlib.__version__}; "
            f"python {sys.version.split()[0]}")
  log(header)

  copy = copy_bandwidth(nbytes=64 << 20 if opts.tiny else COPY_BYTES)
  denom_method = max(copy, key=copy.get)
  denom = copy[denom_method]
  for m, bw in copy.items():
    log(f"copy bandwidth, {m}: {bw / 1e12:.2f} TB/s")

  key = jax.random.key(0)
  bundled = None
  try:
    bundled = None if opts.tiny else bundled_fn()
  except Exception as e:
    log(f"bundled kernel unavailable: {e}")
  ours_bf16 = ours(interpret=opts.tiny)
  rows, fp8_rows, raw = [], [], []
  for batch, ctx in [] if opts.no_table else TINY_SHAPES if opts.tiny else SHAPES:
    per_q = {}
    for q_len in (1, 4):
      args = make_inputs(batch, ctx, q_len, key)
      n = 1 if opts.tiny else iters(batch, ctx)
      cfg = default_block_config(batch, q_len, HQ, KVH, PAGE, ctx // PAGE, "gpu")
      err = max_err(ours_bf16(*args), reference(*args))
      entry = dict(batch=batch, ctx=ctx, q_len=q_len, config=str(cfg), max_abs_err=err,
                   bytes=kv_bytes(batch, ctx), iters=n)
      methods = [("ours", ours_bf16), ("xla_reference", reference)]
      if q_len == 1 and bundled is not None:
        methods.append(("bundled", bundled))
      time_into(entry, methods, args, n, opts.reps, kv_bytes(batch, ctx),
                f"B={batch} ctx={ctx} Q={q_len}")
      if not opts.no_fp8:
        entry["fp8"] = fp8_entry(args, n, opts.reps, batch, ctx, opts.tiny)
        fp8_rows.append(fp8_row(entry, denom))
      per_q[q_len] = entry
      raw.append(entry)
      log(json.dumps(entry))
      del args
    ratio = (per_q[4]["ours"]["best_s"] / per_q[1]["ours"]["best_s"]
             if per_q[1].get("ours") and per_q[4].get("ours") else float("nan"))
    for q_len, e in per_q.items():
      def cell(r):
        return bw_cell(r, denom)
      us = f"{e['ours']['best_s'] * 1e6:.1f} / {e['ours']['median_s'] * 1e6:.1f}" \
          if e.get("ours") else "n/a"
      rows.append(f"| {batch} | {ctx} | {q_len} | {cell(e.get('ours'))} | {us} | "
                  f"{cell(e.get('xla_reference'))} | {cell(e.get('bundled'))} | "
                  f"{ratio:.2f} | {e['max_abs_err']:.1e} |")

  table = "\n".join([
      header,
      f"copy bandwidth (denominator): {denom / 1e12:.2f} TB/s from {denom_method} "
      f"(all: {', '.join(f'{m} {b / 1e12:.2f}' for m, b in copy.items())})",
      "",
      "| B | ctx | Q | ours TB/s (% copy) | ours us best / median | XLA reference TB/s "
      "| bundled Pallas TB/s | ours Q=4 / Q=1 time | max abs err vs ref |",
      "|---|---|---|---|---|---|---|---|---|",
      *rows,
  ])
  if fp8_rows:
    table += "\n".join([
        "", "",
        "fp8 KV: the same shapes with K and V pages in float8_e4m3fn (per-kv-head scales), "
        "q bf16. Bytes: 1 per K/V value. Errors: fp8 ours vs the XLA reference on the "
        "same fp8 pages, and vs ours on the bf16 pages (quantization).",
        "",
        "| B | ctx | Q | fp8 ours TB/s (% copy) | fp8 ours us best / median "
        "| bf16 ours us best | fp8 / bf16 time | fp8 XLA reference TB/s (% copy) "
        "| max abs err vs fp8 ref | max abs err vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *fp8_rows,
    ])
  if not (opts.no_table or opts.no_mimo):
    mimo_rows = []
    for layer in MIMO_LAYERS:
      layer_rows, layer_raw = layer_table(layer, MIMO_SHAPES, opts.reps, key, denom)
      mimo_rows += layer_rows
      raw += layer_raw
    table += "\n".join([
        "", "",
        "MiMo-V2-Flash layers: Hq 64, D 192, Dv 128, page 16, bf16; sliding: KVH 8, "
        "window 128, sinks; full: KVH 4. Bytes: the window's K+V only.",
        "",
        "| layer | B | ctx | Q | ours TB/s (% copy) | ours us best / median "
        "| XLA reference TB/s | XLA / ours time | max abs err vs ref |",
        "|---|---|---|---|---|---|---|---|---|",
        *mimo_rows,
    ])
  log("\n" + table)
  sweep_results = []
  if opts.sweep:
    sweep(sweep_results, opts.reps, key)
  if opts.sweep_fp8:
    sweep(sweep_results, opts.reps, key, fp8=True)
  if opts.sweep_shape:
    batch, ctx = map(int, opts.sweep_shape.split(","))
    sweep_shape(sweep_results, opts.reps, key, batch, ctx)
  if opts.sweep_configs:
    shapes, configs = opts.sweep_configs.split(":")
    sweep_configs(sweep_results, opts.reps, key,
                  [tuple(map(int, sh.split(","))) for sh in shapes.split(";")],
                  [tuple(map(int, c.split("/"))) for c in configs.split(",")],
                  opts.kv == "fp8", opts.tiny)
  if opts.sweep_pages:
    shape, pages = opts.sweep_pages.split(":")
    batch, ctx = map(int, shape.split(","))
    sweep_pages(sweep_results, opts.reps, key, batch, ctx, [int(p) for p in pages.split(",")],
                opts.tiny)
  if opts.sweep_splits:
    batches, ctx = opts.sweep_splits.split(":")
    sweep_splits(sweep_results, opts.reps, key, [int(b) for b in batches.split(",")],
                 int(ctx))
  if out_dir:
    with open(os.path.join(out_dir, "bench_paged_attention.md"), "w") as f:
      f.write(table + "\n")
    with open(os.path.join(out_dir, "bench_paged_attention.json"), "w") as f:
      json.dump(dict(header=header, copy=copy, results=raw, sweep=sweep_results), f, indent=1)


if __name__ == "__main__":
  main()
