"""Benchmark DeepSeek Sparse Attention (pallas_kernels.dsa) on a GPU: the indexer's score
kernel, its top-k, sparse paged MLA, and the dense paged MLA kernel for comparison, with
the device's copy bandwidth measured in the same run.

  python launch/bench_dsa.py --out dsa.json [--reps 5] [--no-fp8] [--budget-s S]
  python launch/bench_dsa.py --small          # tiny shapes on CPU, interpret mode
  python launch/bench_dsa.py --sweep --no-table --out sweep.json   # block configs

Shapes (DeepSeek-V3.2 on one device): MLA H=128 heads, Dk=576 (kv_lora_rank 512 + rope
64), bf16 latent pages; indexer Hi=64 heads, di=128, topk=2048, bf16 index keys (and
float8_e4m3fn keys with per-token scales unless --no-fp8); page 64; contexts 4k, 32k,
128k; B 1 and 32; T 1 (decode) and 2 (verify); every row at kv_len = ctx.

Timed per shape (best and median of --reps loops, see `time_call`):
  scores      the indexer's score kernel (GPU Pallas); bytes = index keys (di * 2 a
              token, fp8: di + 4) + the f32 scores written (4 * T a token)
  scores fp8  the same over fp8 keys
  topk radix  `dsa.radix_topk` with the GPU compaction kernel over those scores (the GPU
              default); bytes = one read of the scores (the nominal size, not the
              passes it makes)
  topk radix_xla  the same select compacted by XLA ops only
  topk lax    lax.top_k over the same scores (then a sort of the topk positions)
  indexer     `indexer_topk` as the model calls it (scores + the default top-k)
  sparse      `sparse_mla` (GPU Pallas) over the indexer's own selection; bytes = the
              selected latent rows (B * T * topk * Dk * 2) + q + out
  dense       `paged_mla` (the repo's dense GPU kernel); bytes = B * ctx * Dk * 2 + q + out
"% copy" is bytes / time over the copy bandwidth (read + write of a 4 GiB device copy,
`copy_bandwidth` of launch/bench_paged_attention.py). The table's last columns give the
top-k's share of the score kernel (each method: the target is <= 25 %), DSA attention =
indexer + sparse, and per (B, T) the ratio attention(128k) / attention(4k) for DSA vs
dense: dense grows with the context, DSA's sparse part does not, its indexer does.

Timing: N calls in one jitted fori_loop (N picked for about 50 ms a loop), each call's
output feeding the next call's input through a comparison that is always false (a few
elements read), so nothing is hoisted; block tables rotate over copies of the page pool
(at least 256 MiB of latent pages) so small batches read device memory, not L2. Checks
(B = 1 only, where the references fit): the kernel path's top-k against the reference's
(fraction of equal positions; near-ties may differ by summation order) and sparse MLA's
max abs error against its reference.

--sweep times the score kernel's block configs (block_k 64 / 128 / 256, 4 or 8 warps,
KV splits for 2 / 4 / 8 programs an SM) at B = 32, ctx 32k, T 1 and 2, and sparse MLA's
(32- or 64-head tiles, 32 or 64 positions a block, split counts) at B 1 and 32, T 2,
beside the defaults of `dsa.default_indexer_config` / `default_sparse_config`, which
are not tuned on hardware yet.
"""

from __future__ import annotations

import argparse
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
from pallas_kernels import dsa  # noqa: E402
from pallas_kernels.common import FP8_DTYPE, FP8_MAX  # noqa: E402
from pallas_kernels.paged_mla import paged_mla  # noqa: E402

H, V_DIM, ROPE = 128, 512, 64
HI, DI, TOPK = 64, 128, 2048
PAGE = 64
BATCHES, CTXS, Q_LENS = (1, 32), (4096, 32768, 131072), (1, 2)
POOL_MIN_BYTES = 256 << 20
TARGET_LOOP_S = 0.05
COPY_BYTES, INTERPRET, BACKEND = 4 << 30, False, "gpu"


def small_settings():
  """--small: tiny shapes, the GPU kernels in interpret mode (checks the script on CPU)."""
  global H, V_DIM, ROPE, HI, DI, TOPK, PAGE, BATCHES, CTXS, Q_LENS, POOL_MIN_BYTES
  global TARGET_LOOP_S, COPY_BYTES, INTERPRET
  H, V_DIM, ROPE, HI, DI, TOPK, PAGE = 4, 32, 16, 4, 32, 16, 16
  BATCHES, CTXS, Q_LENS = (1, 2), (64, 256), (1, 2)
  POOL_MIN_BYTES, TARGET_LOOP_S, COPY_BYTES, INTERPRET = 1 << 20, 0.01, 16 << 20, True


def dk():
  return V_DIM + ROPE


def log(*a):
  print(*a, flush=True)


class Budget:
  def __init__(self, seconds):
    self.deadline = None if seconds is None else time.perf_counter() + seconds

  def spent(self):
    return self.deadline is not None and time.perf_counter() > self.deadline


def make_inputs(batch, ctx, q_len, key):
  """Index queries, weights, keys (bf16 and fp8 + scales), MLA q and pages, tables
  [sets, B, pages] rotating over the pool, kv_lens."""
  pages = ctx // PAGE
  mla_bytes = batch * ctx * dk() * 2
  sets = max(1, min(64, -(-POOL_MIN_BYTES // mla_bytes)))
  num_pages = sets * batch * pages
  ks = jax.random.split(key, 6)
  q = jax.random.normal(ks[0], (batch, q_len, HI, DI), jnp.bfloat16)
  w = jax.random.normal(ks[1], (batch, q_len, HI), jnp.float32) * (HI * DI) ** -0.5
  keys = jax.random.normal(ks[2], (num_pages, PAGE, DI), jnp.bfloat16)
  amax = jnp.abs(keys.astype(jnp.float32)).max(axis=-1)
  k_scale = amax / FP8_MAX
  keys8 = (keys.astype(jnp.float32) / k_scale[..., None]).astype(FP8_DTYPE)
  mq = jax.random.normal(ks[3], (batch, q_len, H, dk()), jnp.bfloat16)
  kv = jax.random.normal(ks[4], (num_pages, PAGE, dk()), jnp.bfloat16)
  tables = jax.random.permutation(ks[5], num_pages).reshape(sets, batch, pages)
  kv_lens = jnp.full((batch,), ctx, jnp.int32)
  return dict(q=q, w=w, keys=keys, keys8=keys8, k_scale=k_scale, mq=mq, kv=kv,
              tables=tables.astype(jnp.int32), kv_lens=kv_lens)


def _never(out):
  """An int32 0 that depends on out (a few elements read): feeds the next call."""
  head = out.reshape(-1)[:8].astype(jnp.float32)
  return (head == -12345.0).any().astype(jnp.int32)


def time_call(fn, tables, rest, reps):
  """(compile_s, best_s, median_s) per call of fn(table, dep, *rest), dep an int32 0
  that carries the previous call's output."""
  sets = tables.shape[0]

  def loop(n, tables, *rest):
    def body(i, dep):
      return _never(fn(tables[i % sets], dep, *rest))
    return lax.fori_loop(0, n, body, jnp.int32(0))

  t = time.perf_counter()
  compiled = jax.jit(loop).lower(2, tables, *rest).compile()
  compile_s = time.perf_counter() - t
  compiled(2, tables, *rest).block_until_ready()
  t = time.perf_counter()
  compiled(2, tables, *rest).block_until_ready()
  n = int(min(2000, max(3, TARGET_LOOP_S / max((time.perf_counter() - t) / 2, 1e-6))))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    compiled(n, tables, *rest).block_until_ready()
    times.append((time.perf_counter() - t) / n)
  return compile_s, min(times), statistics.median(times)


def measure(name, fn, tables, rest, nbytes, reps, copy_bw):
  try:
    compile_s, best, med = time_call(fn, tables, rest, reps)
  except Exception as e:
    log(f"{name} failed: {type(e).__name__}: {str(e)[:500]}")
    return None
  r = dict(compile_s=compile_s, best_s=best, median_s=med, bytes=nbytes,
           tbs=nbytes / best / 1e12, pct_copy=100 * nbytes / best / copy_bw)
  log(f"  {name}: {best * 1e6:.1f} us (median {med * 1e6:.1f}), {r['tbs']:.2f} TB/s, "
      f"{r['pct_copy']:.0f} % copy (compile {compile_s:.1f} s)")
  return r


def run_shape(batch, ctx, q_len, key, reps, copy_bw, fp8):
  """Time every component at one shape: a results dict."""
  x = make_inputs(batch, ctx, q_len, key)
  kw = dict(backend=BACKEND, interpret=INTERPRET)
  mkw = dict(v_dim=V_DIM, sm_scale=(128 + ROPE) ** -0.5)
  score_bytes = batch * q_len * ctx * 4
  out = dict(batch=batch, ctx=ctx, q_len=q_len, pool_sets=int(x["tables"].shape[0]))

  def scores_fn(t, dep, q, w, k, lens, *s):
    return dsa.index_scores(q, w, k, t, lens + dep, k_scale=s[0] if s else None, **kw)

  rest = (x["q"], x["w"], x["keys"], x["kv_lens"])
  out["scores"] = measure("scores", scores_fn, x["tables"], rest,
                          batch * ctx * DI * 2 + score_bytes, reps, copy_bw)
  if fp8:
    rest8 = (x["q"], x["w"], x["keys8"], x["kv_lens"], x["k_scale"])
    out["scores_fp8"] = measure("scores fp8", scores_fn, x["tables"], rest8,
                                batch * ctx * (DI + 4) + score_bytes, reps, copy_bw)

  scores = dsa.index_scores(x["q"], x["w"], x["keys"], x["tables"][0], x["kv_lens"], **kw)
  for method in dsa.TOPK_METHODS:
    def topk_fn(t, dep, s, method=method):
      # dep joins as a scalar add, which XLA fuses into the passes rather than copying.
      return dsa.select_topk(s + dep.astype(jnp.float32), TOPK, method, interpret=INTERPRET)
    out[f"topk_{method}"] = measure(f"topk {method}", topk_fn, x["tables"], (scores,),
                                    score_bytes, reps, copy_bw)

  def indexer_fn(t, dep, q, w, k, lens):
    return dsa.indexer_topk(q, w, k, t, lens + dep, topk=TOPK, **kw)
  out["indexer"] = measure("indexer (scores + default top-k)", indexer_fn, x["tables"],
                           rest, batch * ctx * DI * 2 + score_bytes, reps, copy_bw)

  indices = dsa.indexer_topk(x["q"], x["w"], x["keys"], x["tables"][0], x["kv_lens"],
                             topk=TOPK, **kw)
  qo_bytes = batch * q_len * H * (dk() + V_DIM) * 2

  def sparse_fn(t, dep, q, kv, idx):
    return dsa.sparse_mla(q, kv, t, idx + dep, **mkw, **kw)
  out["sparse"] = measure("sparse MLA", sparse_fn, x["tables"], (x["mq"], x["kv"], indices),
                          batch * q_len * TOPK * dk() * 2 + qo_bytes, reps, copy_bw)

  def dense_fn(t, dep, q, kv, lens):
    return paged_mla(q, kv, t, lens + dep, **mkw, backend=BACKEND, interpret=INTERPRET)
  out["dense"] = measure("dense paged MLA", dense_fn, x["tables"],
                         (x["mq"], x["kv"], x["kv_lens"]),
                         batch * ctx * dk() * 2 + qo_bytes, reps, copy_bw)

  if batch == 1 or INTERPRET:  # the references fit
    table = x["tables"][0]
    want = dsa.indexer_topk_reference(x["q"], x["w"], x["keys"], table, x["kv_lens"],
                                      topk=TOPK)
    out["topk_match"] = float((want == indices).mean())
    ref = dsa.sparse_mla_reference(x["mq"], x["kv"], table, indices, **mkw)
    got = dsa.sparse_mla(x["mq"], x["kv"], table, indices, **mkw, **kw)
    out["sparse_max_abs_err"] = float(jnp.abs(got.astype(jnp.float32)
                                              - ref.astype(jnp.float32)).max())
    log(f"  checks: top-k equal to the reference's at {100 * out['topk_match']:.2f} % of "
        f"entries; sparse MLA max abs err {out['sparse_max_abs_err']:.1e}")
  return out


def sweep(reps, copy_bw, key, budget):
  """--sweep: the score kernel's IndexerBlockConfig grid at the target shape (B = 32,
  ctx 32k, T 1 and 2) and sparse MLA's SparseBlockConfig at B 32 and 1; one line each,
  beside the default. Returns the results."""
  out = []
  small = INTERPRET
  batch, ctx = (2, CTXS[0]) if small else (32, 32768)
  cores = 132 if small else (getattr(jax.devices()[0], "core_count", None) or 132)
  for q_len in Q_LENS:
    x = make_inputs(batch, ctx, q_len, key)
    rest = (x["q"], x["w"], x["keys"], x["kv_lens"])
    dflt = dsa.default_indexer_config(batch, q_len, HI, DI, PAGE, ctx // PAGE, "gpu",
                                      num_cores=cores)
    cfgs = [dflt]
    for block_k, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
      for waves in (2, 4, 8):
        blocks = -(-ctx // block_k)
        tiles = -(-q_len // dflt.query_rows)
        splits = max(1, min(-(-waves * cores // (batch * tiles)), blocks))
        cfgs.append(dsa.IndexerBlockConfig(block_k=block_k, query_rows=dflt.query_rows,
                                           num_splits=splits, num_warps=warps))
    for cfg in (cfgs[:2] if small else dict.fromkeys(cfgs)):
      if budget.spent():
        return out

      def fn(t, dep, q, w, k, lens, cfg=cfg):
        return dsa.index_scores(q, w, k, t, lens + dep, backend=BACKEND, interpret=INTERPRET,
                                block_config=cfg)
      tag = f"sweep scores B={batch} ctx={ctx} T={q_len} {cfg}" + (
          " (default)" if cfg == dflt else "")
      r = measure(tag, fn, x["tables"], rest, batch * ctx * DI * 2 + batch * q_len * ctx * 4,
                  reps, copy_bw)
      out.append(dict(op="scores", batch=batch, ctx=ctx, q_len=q_len, cfg=str(cfg),
                      default=cfg == dflt, result=r))
  for batch in ((1, 2) if small else (1, 32)):
    q_len = Q_LENS[-1]
    x = make_inputs(batch, ctx, q_len, key)
    indices = dsa.indexer_topk(x["q"], x["w"], x["keys"], x["tables"][0], x["kv_lens"],
                               topk=TOPK, backend=BACKEND, interpret=INTERPRET)
    dflt = dsa.default_sparse_config(batch, q_len, H, dk(), TOPK, jnp.bfloat16, "gpu",
                                     num_cores=cores)
    cfgs = [dflt] + [dsa.SparseBlockConfig(block_k=bk, rows_per_block=rows,
                                           num_splits=sp, num_warps=8 if rows >= 64 else 4)
                     for rows in (32, 64) for bk in (32, 64)
                     for sp in ((1, 4, 16, 32) if batch == 1 else (1, 2))]
    for cfg in (cfgs[:2] if small else dict.fromkeys(cfgs)):
      if budget.spent():
        return out

      def fn(t, dep, q, kv, idx, cfg=cfg):
        return dsa.sparse_mla_kernel(q, kv, t, idx + dep, v_dim=V_DIM,
                                     sm_scale=(128 + ROPE) ** -0.5, backend=BACKEND,
                                     interpret=INTERPRET, block_config=cfg)
      tag = f"sweep sparse B={batch} T={q_len} {cfg}" + (" (default)" if cfg == dflt else "")
      r = measure(tag, fn, x["tables"], (x["mq"], x["kv"], indices),
                  batch * q_len * TOPK * dk() * 2, reps, copy_bw)
      out.append(dict(op="sparse", batch=batch, q_len=q_len, cfg=str(cfg),
                      default=cfg == dflt, result=r))
  return out


def _t(e, name):
  r = e.get(name)
  return r["best_s"] if r else None


def table_rows(results):
  rows = []

  def us(v):
    return "n/a" if v is None else f"{v * 1e6:.1f}"

  def pct(e, name):
    r = e.get(name)
    return "n/a" if not r else f"{r['pct_copy']:.0f} %"

  def share(a, b):
    return "n/a" if a is None or b is None else f"{100 * a / b:.0f} %"

  for e in results:
    s, ix, sp = _t(e, "scores"), _t(e, "indexer"), _t(e, "sparse")
    attn = None if ix is None or sp is None else ix + sp
    cells = [e["batch"], e["ctx"], e["q_len"],
             f"{us(s)} ({pct(e, 'scores')})",
             f"{us(_t(e, 'scores_fp8'))} ({pct(e, 'scores_fp8')})",
             f"{us(_t(e, 'topk_radix'))} ({share(_t(e, 'topk_radix'), s)})",
             f"{us(_t(e, 'topk_radix_xla'))} ({share(_t(e, 'topk_radix_xla'), s)})",
             f"{us(_t(e, 'topk_lax'))} ({share(_t(e, 'topk_lax'), s)})",
             us(ix), f"{us(sp)} ({pct(e, 'sparse')})", us(attn),
             f"{us(_t(e, 'dense'))} ({pct(e, 'dense')})"]
    rows.append("| " + " | ".join(map(str, cells)) + " |")
  return rows


def growth_rows(results):
  """attention(largest ctx) / attention(smallest ctx) per (B, T), DSA vs dense."""
  rows = []
  lo, hi = min(CTXS), max(CTXS)
  for batch in BATCHES:
    for q_len in Q_LENS:
      pick = {e["ctx"]: e for e in results if e["batch"] == batch and e["q_len"] == q_len}
      if lo not in pick or hi not in pick:
        continue

      def dsa_t(e):
        a, b = _t(e, "indexer"), _t(e, "sparse")
        return None if a is None or b is None else a + b

      def ratio(f):
        a, b = f(pick[hi]), f(pick[lo])
        return "n/a" if a is None or b is None else f"{a / b:.2f}"

      rows.append(f"| {batch} | {q_len} | {ratio(dsa_t)} | "
                  f"{ratio(lambda e: _t(e, 'dense'))} |")
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", help="write the raw results (JSON) here")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--no-fp8", action="store_true", help="skip the fp8 index keys")
  ap.add_argument("--budget-s", type=float, default=None,
                  help="start no new shape after this many seconds")
  ap.add_argument("--sweep", action="store_true",
                  help="also time block configs of the score and sparse kernels")
  ap.add_argument("--no-table", action="store_true", help="skip the main table")
  ap.add_argument("--small", action="store_true",
                  help="tiny shapes, GPU kernels in interpret mode (runs on CPU)")
  opts = ap.parse_args()
  if opts.small:
    small_settings()
  budget = Budget(opts.budget_s)
  dev = jax.devices()[0]
  import jaxlib
  header = (f"device: {dev.device_kind}; jax {jax.__version__}, jaxlib {jaxlib.__version__}; "
            f"python {sys.version.split()[0]}")
  log(header)
  copy = copy_bandwidth(nbytes=COPY_BYTES)
  copy_method = max(copy, key=copy.get)
  copy_bw = copy[copy_method]
  limits = (f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s from {copy_method} (all: "
            f"{', '.join(f'{m} {b / 1e12:.2f}' for m, b in copy.items())})")
  log(limits)

  key = jax.random.key(0)
  results, notes = [], []
  for batch in [] if opts.no_table else BATCHES:
    for ctx in CTXS:
      for q_len in Q_LENS:
        if budget.spent():
          notes.append(f"B={batch} ctx={ctx} T={q_len}: not run (time budget spent)")
          continue
        log(f"B={batch} ctx={ctx} T={q_len}")
        try:
          results.append(run_shape(batch, ctx, q_len, key, opts.reps, copy_bw,
                                   fp8=not opts.no_fp8))
        except Exception as e:
          log(f"B={batch} ctx={ctx} T={q_len} failed: {type(e).__name__}: {str(e)[:500]}")
          notes.append(f"B={batch} ctx={ctx} T={q_len}: failed ({type(e).__name__})")

  table = "\n".join([
      header, limits,
      f"shapes: MLA H={H}, Dk={dk()} (latent {V_DIM} + rope {ROPE}) bf16; indexer Hi={HI}, "
      f"di={DI}, topk={TOPK}; page {PAGE}; every row at kv_len = ctx",
      "",
      "| B | ctx | T | scores us (% copy) | scores fp8 us (% copy) "
      "| topk radix us (% of scores) | topk radix_xla us (% of scores) "
      "| topk lax us (% of scores) | indexer us "
      "| sparse MLA us (% copy) | DSA attention us | dense paged MLA us (% copy) |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|",
      *table_rows(results),
      "",
      f"attention(ctx {max(CTXS)}) / attention(ctx {min(CTXS)}); DSA = indexer + sparse:",
      "",
      "| B | T | DSA | dense |",
      "|---|---|---|---|",
      *growth_rows(results),
      *[f"note: {n}" for n in notes],
  ])
  sweep_results = sweep(opts.reps, copy_bw, key, budget) if opts.sweep else []
  if opts.out:
    with open(opts.out, "w") as f:
      json.dump(dict(header=header, copy=copy, results=results, sweep=sweep_results,
                     notes=notes, table=table), f, indent=1)
  log("\n" + table)


if __name__ == "__main__":
  main()
