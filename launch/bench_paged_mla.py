"""Benchmark paged MLA (pallas_kernels.paged_mla) on a GPU against the XLA reference, the
device's copy bandwidth and its bf16 matrix rate, all measured in the same run.

  python launch/bench_paged_mla.py --out mla.json [--sweep] [--sweep-fp8] [--no-fp8]
                                   [--reps 5]

Shapes: DeepSeek-V3 attention on one device: H=128 heads, Dk=576 (latent 512 + rope
64), v_dim=512, bf16, page 16, pages in a random permutation of the pool, every row at
kv_len = ctx; B in {1, 8, 64} x ctx in {4096, 16384} x Q in {1, 4}.

Limits beside each figure:
  bytes = B * ctx * Dk * 2 (each latent entry read once) + q bytes + out bytes
  flops = 2 * H * (Dk + v_dim) * (visible (row, position) pairs), about
          2 * B * Q * H * ctx * (Dk + v_dim)
  floor = max(bytes / copy bandwidth, flops / bf16 matmul rate)
At H = 128 the op does about 2 * H * Q flops per byte: Q = 1 sits near an H100's ridge
point and Q = 4 is compute bound, so "% of copy" cannot reach 100 % there; "% of floor"
is the honest efficiency figure.

fp8 latent cache (skip it with --no-fp8): every shape is timed again with the pages in
float8_e4m3fn, quantized from the same bf16 pages with one scale for the latent part and
one for the rope part (amax / 448 each, saturated as the cache writes them), q still
bf16. Its bytes count 1 per cached value, its limits are the same copy bandwidth and
matmul rate, and its table gives the fp8 / bf16 time ratio (0.5 where both run at the
same bandwidth; nearer 1 where the matrix work binds) and two errors: against the XLA
reference on the same fp8 pages, and against our bf16 result (the quantization).

Timing: N calls inside one jitted fori_loop, N a run-time argument picked so that a loop
takes about 50 ms; best and median of --reps loops after a warm-up (compile time is
reported apart). Each call's result feeds the next call's kv_lens through a NaN check
(zero unless the output holds a NaN), so no call can be hoisted; that check reads the
output once per call, which is counted in neither bytes nor flops. The block tables
rotate over several copies of the page pool (at least 256 MiB of bf16 pages in all, half
that in fp8), so small-batch calls read device memory rather than L2. The copy bandwidth is
`copy_bandwidth` of launch/bench_paged_attention.py (the best of torch and XLA copies of
4 GiB, read + write bytes); the matmul rate is the best of --reps jitted 8192^3 bf16
products on random data.

--sweep times a grid of block configs at (B=64, 4k) and KV split counts at small B
(the defaults in `paged_mla.default_block_config` come from it); --sweep-small times
16-, 32- and 64-row tiles, unsplit and split for 1, 2 and 4 waves, at B 1 and 4, Q 1, 2
and 4 (decode and verify), ctx 4k and 16k; --sweep-fp8 times the
same over fp8 pages, with larger kv blocks too (1-byte stages leave shared memory for
them). --budget-s stops starting new measurements after that many seconds and reports
what finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

LAUNCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, LAUNCH)
sys.path.insert(0, os.path.dirname(LAUNCH))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from bench_paged_attention import copy_bandwidth  # noqa: E402
from pallas_kernels.common import FP8_DTYPE, FP8_MAX  # noqa: E402
from pallas_kernels.paged_mla import (  # noqa: E402
    MLABlockConfig, default_block_config, paged_mla, paged_mla_reference)

H, V_DIM, ROPE, PAGE = 128, 512, 64, 16
DK = V_DIM + ROPE
SM_SCALE = 192 ** -0.5          # DeepSeek-V3: 1 / sqrt(qk_nope 128 + qk_rope 64)
BATCHES, CTXS, Q_LENS = (1, 8, 64), (4096, 16384), (1, 4)
POOL_MIN_BYTES = 256 << 20      # rotate tables over at least this much page data
TARGET_LOOP_S = 0.05
REFERENCE_MAX_FRACTION = 0.6    # of device memory, for the reference's temporaries
COPY_BYTES, MATMUL_N, INTERPRET = 4 << 30, 8192, False


def smoke_settings():
  """--smoke: tiny shapes, the GPU kernel in interpret mode; checks the script on CPU."""
  global H, BATCHES, CTXS, POOL_MIN_BYTES, TARGET_LOOP_S, COPY_BYTES, MATMUL_N, INTERPRET
  H, BATCHES, CTXS, POOL_MIN_BYTES = 4, (1, 2), (64,), 1 << 20
  TARGET_LOOP_S, COPY_BYTES, MATMUL_N, INTERPRET = 0.01, 16 << 20, 256, True


def log(*a):
  print(*a, flush=True)


class Budget:
  def __init__(self, seconds):
    self.deadline = None if seconds is None else time.perf_counter() + seconds

  def spent(self):
    return self.deadline is not None and time.perf_counter() > self.deadline


def kv_bytes(batch, ctx, itemsize=2):
  """Latent cache bytes attended (bf16: 2 a value, fp8: 1)."""
  return batch * ctx * DK * itemsize


def io_bytes(batch, ctx, q_len, itemsize=2):
  return kv_bytes(batch, ctx, itemsize) + batch * q_len * H * (DK + V_DIM) * 2


def flops(batch, ctx, q_len):
  pairs = q_len * ctx - q_len * (q_len - 1) // 2       # visible (query row, position)
  return 2 * batch * H * pairs * (DK + V_DIM)


def make_inputs(batch, ctx, q_len, key):
  """q, a pool of `sets` copies of the pages needed, tables [sets, B, pages], kv_lens."""
  pages = ctx // PAGE
  sets = max(1, min(64, -(-POOL_MIN_BYTES // kv_bytes(batch, ctx))))
  num_pages = sets * batch * pages
  kq, kk, kp = jax.random.split(key, 3)
  q = jax.random.normal(kq, (batch, q_len, H, DK), jnp.bfloat16)
  kv = jax.random.normal(kk, (num_pages, PAGE, DK), jnp.bfloat16)
  tables = jax.random.permutation(kp, num_pages).reshape(sets, batch, pages)
  kv_lens = jnp.full((batch,), ctx, jnp.int32)
  return q, kv, tables.astype(jnp.int32), kv_lens


def quantize(args):
  """args with fp8 pages as the cache writes them, plus their kv_scale [2] f32: the
  latent and the rope part each over amax / 448, clip(x / scale) in float8_e4m3fn."""
  q, kv, tables, kv_lens = args
  x = kv.astype(jnp.float32)
  amax = jnp.stack([jnp.abs(x[..., :V_DIM]).max(), jnp.abs(x[..., V_DIM:]).max()])
  scale = amax / FP8_MAX
  per_dim = jnp.where(jnp.arange(DK) < V_DIM, scale[0], scale[1])
  kv8 = jnp.clip(x / per_dim, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
  return q, kv8, tables, kv_lens, scale


def time_per_call(fn, args, reps):
  """(compile_s, best_s, median_s) per call of fn(q, kv, table, kv_lens, *scale)."""
  q, kv, tables, kv_lens, *scale = args
  sets = tables.shape[0]

  def loop(n, q, kv, tables, kv_lens, *scale):
    def body(i, lens):
      out = fn(q, kv, tables[i % sets], lens, *scale)
      return lens + jnp.isnan(out).any().astype(jnp.int32)
    return lax.fori_loop(0, n, body, kv_lens)

  t = time.perf_counter()
  compiled = jax.jit(loop).lower(2, *args).compile()
  compile_s = time.perf_counter() - t
  compiled(2, *args).block_until_ready()
  t = time.perf_counter()
  compiled(2, *args).block_until_ready()
  n = int(min(2000, max(3, TARGET_LOOP_S / max((time.perf_counter() - t) / 2, 1e-6))))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    compiled(n, *args).block_until_ready()
    times.append((time.perf_counter() - t) / n)
  return compile_s, min(times), statistics.median(times)


def ours(cfg=None):
  """fn(q, kv, table, kv_lens, *scale): the GPU kernel; scale: () or (kv_scale,)."""
  def fn(q, kv, t, l, *scale):
    return paged_mla(q, kv, t, l, v_dim=V_DIM, sm_scale=SM_SCALE,
                     kv_scale=scale[0] if scale else None, backend="gpu",
                     interpret=INTERPRET, block_config=cfg)
  return fn


def reference(q, kv, t, l, *scale):
  return paged_mla_reference(q, kv, t, l, v_dim=V_DIM, sm_scale=SM_SCALE,
                             kv_scale=scale[0] if scale else None)


def reference_fits(batch, ctx, q_len, itemsize=2):
  """Whether the reference's temporaries (gather, its bf16 copy for fp8 pages, the
  masked copy, f32 logits / probs / values) fit."""
  copies = 2 if itemsize == 1 else 1   # bf16-sized: the masked copy (and the cast)
  need = (kv_bytes(batch, ctx, itemsize) + copies * kv_bytes(batch, ctx)
          + batch * ctx * V_DIM * 4 + 3 * batch * q_len * H * ctx * 4)
  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit", 80e9)
  return need < REFERENCE_MAX_FRACTION * limit, need


def first_call(fn, args):
  """fn on args' first table copy, as f32."""
  q, kv, tables, kv_lens, *scale = args
  return fn(q, kv, tables[0], kv_lens, *scale).astype(jnp.float32)


def max_err(args):
  return float(jnp.abs(first_call(ours(), args) - first_call(reference, args)).max())


def matmul_rate(reps):
  """Best bf16 FLOP/s of a jitted 8192^3 product on random data."""
  n = MATMUL_N
  ka, kb = jax.random.split(jax.random.key(1))
  a = jax.random.normal(ka, (n, n), jnp.bfloat16)
  b = jax.random.normal(kb, (n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  f(a, b).block_until_ready()
  times = []
  for _ in range(max(reps, 5)):
    t = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n ** 3 / min(times)


def measure(batch, ctx, q_len, fn, reps, copy_bw, mm_rate, key, args=None):
  args = args or make_inputs(batch, ctx, q_len, key)
  compile_s, best, med = time_per_call(fn, args, reps)
  nbytes = io_bytes(batch, ctx, q_len, itemsize=args[1].dtype.itemsize)
  floor = max(nbytes / copy_bw, flops(batch, ctx, q_len) / mm_rate)
  return dict(compile_s=compile_s, best_s=best, median_s=med,
              tbs=nbytes / best / 1e12,
              pct_copy=100 * nbytes / best / copy_bw,
              tflops=flops(batch, ctx, q_len) / best / 1e12,
              pct_floor=100 * floor / best)


def fp8_entry(args, batch, ctx, q_len, reps, copy_bw, mm_rate, key, notes):
  """Time ours and the XLA reference over fp8 copies of args' pages: a results dict with
  the fp8 byte count, the errors (vs the reference on the fp8 pages, vs ours on args'
  bf16 pages; NaN where not measured) and one timing per method (None where it fails,
  logged)."""
  tag = f"fp8 B={batch} ctx={ctx} Q={q_len}"
  entry = dict(bytes=io_bytes(batch, ctx, q_len, itemsize=1), max_abs_err=float("nan"),
               max_abs_err_vs_bf16=float("nan"), ours=None, xla_reference=None)
  fp8_args = quantize(args)
  try:
    got = first_call(ours(), fp8_args)
    entry["max_abs_err_vs_bf16"] = float(jnp.abs(got - first_call(ours(), args)).max())
    entry["ours"] = measure(batch, ctx, q_len, ours(), reps, copy_bw, mm_rate, key,
                            fp8_args)
  except Exception as e:
    log(f"ours {tag} failed: {type(e).__name__}: {str(e)[:500]}")
    return entry
  fits, need = reference_fits(batch, ctx, q_len, itemsize=1)
  if not fits:
    notes.append(f"{tag}: reference skipped (needs about {need / 1e9:.0f} GB of "
                 "temporaries)")
    return entry
  try:
    entry["max_abs_err"] = float(jnp.abs(got - first_call(reference, fp8_args)).max())
    entry["xla_reference"] = measure(batch, ctx, q_len, reference, reps, copy_bw, mm_rate,
                                     key, fp8_args)
  except Exception as e:
    log(f"reference {tag} failed: {type(e).__name__}: {str(e)[:300]}")
    notes.append(f"{tag}: reference failed ({type(e).__name__})")
  return entry


def sweep(results, reps, copy_bw, mm_rate, key, budget, fp8=False):
  """Time block configs at (64, 4k) and split counts at small B; prints and appends.

  Each config is also checked against the reference (max abs error, printed). fp8: the
  pages in float8_e4m3fn (bytes 1 a value), a grid with larger kv blocks too.
  """
  want = {}

  def run(batch, ctx, q_len, cfg):
    if budget.spent():
      return float("inf")
    label = f"sweep{' fp8' if fp8 else ''} B={batch} ctx={ctx} Q={q_len} {cfg}"
    try:
      args = make_inputs(batch, ctx, q_len, key)
      if fp8:
        args = quantize(args)
      if (batch, ctx, q_len) not in want:
        want[batch, ctx, q_len] = first_call(reference, args)
      err = float(jnp.abs(first_call(ours(cfg), args) - want[batch, ctx, q_len]).max())
      r = measure(batch, ctx, q_len, ours(cfg), reps, copy_bw, mm_rate, key, args)
      log(f"{label}: {r['best_s'] * 1e6:.1f} us, {r['pct_copy']:.0f} % copy, "
          f"{r['tflops']:.0f} TFLOP/s, {r['pct_floor']:.0f} % floor, err {err:.1e} "
          f"(compile {r['compile_s']:.1f} s)")
      results.append(dict(batch=batch, ctx=ctx, q_len=q_len, cfg=str(cfg), max_abs_err=err,
                          fp8=fp8, **r))
      return r["best_s"]
    except Exception as e:
      log(f"{label}: FAILED {type(e).__name__}: {str(e)[:400]}")
      return float("inf")

  big = 1 if INTERPRET else 64
  grid = [(64, 8, 32, 2), (64, 8, 64, 2), (64, 8, 32, 3), (64, 8, 16, 3), (32, 4, 32, 2),
          (32, 4, 64, 2), (16, 4, 64, 2), (128, 16, 32, 2)]
  if fp8:
    grid += [(64, 8, 128, 2), (64, 8, 64, 3), (32, 4, 128, 2)]
  timed = {}
  for rows, warps, block_k, stages in grid[:2] if INTERPRET else grid:
    cfg = MLABlockConfig(block_k=block_k, rows_per_block=rows, num_warps=warps,
                         num_stages=stages)
    t1 = run(big, CTXS[0], 1, cfg)
    t4 = run(big, CTXS[0], 4, cfg)
    timed[cfg] = t1 + t4
  best = min(timed, key=timed.get)
  log(f"sweep{' fp8' if fp8 else ''} best at (B={big}, ctx={CTXS[0]}), Q=1 + Q=4: {best}")
  small = [(1, 4096, 1, (16, 32, 64)), (8, 4096, 1, (4, 8, 16)), (1, 16384, 1, (32, 64)),
           (1, 4096, 4, (4, 8, 16))]
  for batch, ctx, q_len, splits in [(1, 64, 1, (2,))] if INTERPRET else small:
    for s in splits:
      run(batch, ctx, q_len, dataclasses.replace(best, num_splits=s))


def sweep_small(results, reps, copy_bw, mm_rate, key, budget):
  """Small-batch decode and verify (B 1 and 4, Q 1 / 2 / 4, ctx 4k and 16k): 16-, 32- and
  64-row tiles, each unsplit and with KV splits for one, two and four waves of programs,
  beside the default config. Prints one line per config; appends to results."""
  cores = 132 if INTERPRET else (getattr(jax.devices()[0], "core_count", None) or 132)
  shapes = ([(1, 64, 2)] if INTERPRET else
            [(b, c, q) for b in (1, 4) for c in (4096, 16384) for q in (1, 2, 4)])
  for batch, ctx, q_len in shapes:
    args = make_inputs(batch, ctx, q_len, key)
    dflt = default_block_config(batch, q_len, H, PAGE, ctx // PAGE, DK, jnp.bfloat16, "gpu",
                                num_cores=cores)
    cfgs = {dflt}
    for rows in (16, 32, 64):
      base = dataclasses.replace(dflt, rows_per_block=rows, num_warps=8 if rows >= 64 else 4)
      programs = batch * -(-q_len * H // rows)
      blocks = -(-ctx // base.block_k)
      for waves in (0, 1, 2, 4):
        splits = 1 if waves == 0 else max(1, min(-(-waves * cores // programs), blocks, 64))
        cfgs.add(dataclasses.replace(base, num_splits=splits))
    for cfg in sorted(cfgs, key=lambda c: (c.rows_per_block, c.num_splits)):
      if budget.spent():
        return
      label = f"small B={batch} ctx={ctx} Q={q_len} {cfg}{' (default)' if cfg == dflt else ''}"
      try:
        r = measure(batch, ctx, q_len, ours(cfg), reps, copy_bw, mm_rate, key, args)
      except Exception as e:
        log(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}")
        continue
      log(f"{label}: {r['best_s'] * 1e6:.1f} us")
      results.append(dict(batch=batch, ctx=ctx, q_len=q_len, cfg=str(cfg),
                          default=cfg == dflt, small=True, **r))


def table_row(batch, ctx, q_len, e, ratio):
  o, r = e.get("ours"), e.get("xla_reference")

  def us(x):
    return f"{x['best_s'] * 1e6:.1f} / {x['median_s'] * 1e6:.1f}" if x else "n/a"

  def tbs(x):
    return f"{x['tbs']:.2f} ({x['pct_copy']:.0f} %)" if x else "n/a"

  cells = [batch, ctx, q_len, e["tiling"], us(o), tbs(o),
           f"{o['tflops']:.0f}" if o else "n/a",
           f"{o['pct_floor']:.0f} %" if o else "n/a",
           us(r), tbs(r),
           f"{r['best_s'] / o['best_s']:.1f}x" if o and r else "n/a",
           f"{ratio:.2f}", f"{e.get('max_abs_err', float('nan')):.1e}"]
  return "| " + " | ".join(map(str, cells)) + " |"


def fp8_row(e):
  """One markdown row of the fp8 table from a main-table entry holding e['fp8']."""
  f, r, b = e["fp8"]["ours"], e["fp8"]["xla_reference"], e.get("ours")

  def us(x):
    return f"{x['best_s'] * 1e6:.1f} / {x['median_s'] * 1e6:.1f}" if x else "n/a"

  def tbs(x):
    return f"{x['tbs']:.2f} ({x['pct_copy']:.0f} %)" if x else "n/a"

  cells = [e["batch"], e["ctx"], e["q_len"], us(f), tbs(f),
           f"{f['tflops']:.0f}" if f else "n/a",
           f"{f['pct_floor']:.0f} %" if f else "n/a",
           f"{b['best_s'] * 1e6:.1f}" if b else "n/a",
           f"{f['best_s'] / b['best_s']:.2f}" if f and b else "n/a",
           us(r), tbs(r), f"{e['fp8']['max_abs_err']:.1e}",
           f"{e['fp8']['max_abs_err_vs_bf16']:.1e}"]
  return "| " + " | ".join(map(str, cells)) + " |"


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", help="write the raw results (JSON) here")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--sweep", action="store_true", help="also time a grid of block configs")
  ap.add_argument("--sweep-fp8", action="store_true",
                  help="also time a grid of block configs over fp8 pages")
  ap.add_argument("--sweep-small", action="store_true",
                  help="time tile heights and KV split counts at small batch (decode, verify)")
  ap.add_argument("--no-fp8", action="store_true", help="skip the fp8 table")
  ap.add_argument("--no-table", action="store_true", help="skip the main table")
  ap.add_argument("--budget-s", type=float, default=None,
                  help="start no new measurement after this many seconds")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
  opts = ap.parse_args()
  if opts.smoke:
    smoke_settings()
  budget = Budget(opts.budget_s)
  dev = jax.devices()[0]
  import jaxlib
  header = (f"device: {dev.device_kind}; jax {jax.__version__}, jaxlib {jaxlib.__version__}; "
            f"python {sys.version.split()[0]}")
  log(header)

  copy = copy_bandwidth(nbytes=COPY_BYTES)
  copy_method = max(copy, key=copy.get)
  copy_bw = copy[copy_method]
  mm_rate = matmul_rate(opts.reps)
  limits = (f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s from {copy_method} (all: "
            f"{', '.join(f'{m} {b / 1e12:.2f}' for m, b in copy.items())}); "
            f"bf16 matmul {MATMUL_N}^3 (XLA): {mm_rate / 1e12:.0f} TFLOP/s")
  log(limits)

  key = jax.random.key(0)
  raw, rows, fp8_rows, notes = [], [], [], []
  for batch in [] if opts.no_table else BATCHES:
    for ctx in CTXS:
      per_q = {}
      for q_len in Q_LENS:
        if budget.spent():
          notes.append(f"B={batch} ctx={ctx} Q={q_len}: not run (time budget spent)")
          continue
        args = make_inputs(batch, ctx, q_len, key)
        cfg = default_block_config(batch, q_len, H, PAGE, ctx // PAGE, DK, jnp.bfloat16,
                                   "gpu", num_cores=132 if INTERPRET else None)
        entry = dict(batch=batch, ctx=ctx, q_len=q_len, config=str(cfg),
                     tiling=f"{cfg.rows_per_block}/{cfg.block_k}/{cfg.num_splits}",
                     bytes=io_bytes(batch, ctx, q_len), flops=flops(batch, ctx, q_len),
                     pool_sets=int(args[2].shape[0]))
        try:
          entry["ours"] = measure(batch, ctx, q_len, ours(), opts.reps, copy_bw, mm_rate,
                                  key, args)
        except Exception as e:
          log(f"ours B={batch} ctx={ctx} Q={q_len} failed: {type(e).__name__}: "
              f"{str(e)[:500]}")
          entry["ours"] = None
        fits, need = reference_fits(batch, ctx, q_len)
        if not fits:
          notes.append(f"B={batch} ctx={ctx} Q={q_len}: reference skipped (needs about "
                       f"{need / 1e9:.0f} GB of temporaries)")
          entry["xla_reference"] = None
        else:
          try:
            entry["max_abs_err"] = max_err(args)
            entry["xla_reference"] = measure(batch, ctx, q_len, reference, opts.reps,
                                             copy_bw, mm_rate, key, args)
          except Exception as e:
            log(f"reference B={batch} ctx={ctx} Q={q_len} failed: {type(e).__name__}: "
                f"{str(e)[:300]}")
            notes.append(f"B={batch} ctx={ctx} Q={q_len}: reference failed "
                         f"({type(e).__name__})")
            entry["xla_reference"] = None
        if not opts.no_fp8 and budget.spent():
          notes.append(f"fp8 B={batch} ctx={ctx} Q={q_len}: not run (time budget spent)")
        elif not opts.no_fp8:
          entry["fp8"] = fp8_entry(args, batch, ctx, q_len, opts.reps, copy_bw, mm_rate, key,
                                   notes)
          fp8_rows.append(fp8_row(entry))
        per_q[q_len] = entry
        raw.append(entry)
        log(json.dumps(entry))
        del args
      ok = all(per_q.get(q, {}).get("ours") for q in Q_LENS)
      ratio = per_q[4]["ours"]["best_s"] / per_q[1]["ours"]["best_s"] if ok else float("nan")
      for q_len, e in per_q.items():
        rows.append(table_row(batch, ctx, q_len, e, ratio))

  table = "\n".join([
      header, limits,
      f"shapes: H={H}, Dk={DK} (latent {V_DIM} + rope {ROPE}), bf16, page {PAGE}, every "
      "row at kv_len = ctx; default MLABlockConfig per shape",
      "",
      "| B | ctx | Q | rows / block_k / splits | ours us best / median | ours TB/s (% copy) "
      "| ours TFLOP/s "
      "| ours % of floor | XLA ref us best / median | XLA ref TB/s (% copy) "
      "| ref / ours time | ours Q=4 / Q=1 time | max abs err vs ref |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
      *rows,
      *([] if not fp8_rows else [
          "",
          "fp8 latent cache: the same shapes with the pages in float8_e4m3fn (latent and "
          "rope scales, amax / 448 each), q bf16. Bytes: 1 per cached value; limits as "
          "above. Errors: fp8 ours vs the XLA reference on the same fp8 pages, and vs ours "
          "on the bf16 pages (the quantization).",
          "",
          "| B | ctx | Q | fp8 ours us best / median | fp8 ours TB/s (% copy) "
          "| fp8 ours TFLOP/s | fp8 ours % of floor | bf16 ours us best | fp8 / bf16 time "
          "| fp8 XLA ref us best / median | fp8 XLA ref TB/s (% copy) "
          "| max abs err vs fp8 ref | max abs err vs bf16 |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
          *fp8_rows]),
      *[f"note: {n}" for n in notes],
  ])
  sweep_results = []
  if opts.sweep:
    sweep(sweep_results, opts.reps, copy_bw, mm_rate, key, budget)
  if opts.sweep_fp8:
    sweep(sweep_results, opts.reps, copy_bw, mm_rate, key, budget, fp8=True)
  if opts.sweep_small:
    sweep_small(sweep_results, opts.reps, copy_bw, mm_rate, key, budget)
  if opts.out:
    with open(opts.out, "w") as f:
      json.dump(dict(header=header, copy=copy, matmul_flops=mm_rate, results=raw,
                     sweep=sweep_results, notes=notes, table=table), f, indent=1)
  log("\n" + table)


if __name__ == "__main__":
  main()
