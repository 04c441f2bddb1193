"""Benchmark the MoE grouped matmul (pallas_kernels.grouped_matmul) at GLM-4.5-Air shapes.

  PYTHONPATH=. python launch/bench_moe_kernels.py [--ns 8,32,64,256,1024] [--sweep]
  PYTHONPATH=. python launch/bench_moe_kernels.py --smoke --json /tmp/moe.json   # CPU

Shapes: E=128 experts, bf16, gate+up fused (K=4096, M=2816) and down (K=1408, M=4096);
N rows = N/8 tokens with random top-8 routing. Candidates: our GPU kernel (default and a
couple of other block configs, plus the default with the routing plan hoisted out of
the loop, i.e. kernel + gathers only), `ragged_dot` (sort, jax.lax.ragged_dot, unsort),
the reference (gather w[group_ids] + einsum; skipped where the gather would be huge) and
tokamax's ragged_dot when `import tokamax` works.

Before timing, each candidate is checked against the reference (relative Frobenius
error) and run once more with every unrouted expert's weights set to NaN: a finite
result shows it did not read them (--sweep configs skip this). Timing: many calls inside
one jitted fori_loop with a static trip count, each iteration calling once per weight set
(--sets distinct weight arrays, so no expert stays in L2); the output feeds the next
call's x, and the routing passes through a select on the output, so neither the call
nor its routing plan can be hoisted. Per-call time = loop time / calls, loop overhead
included (amortised over the sets); best and median of --reps loops after warm-up.
tokamax is optional and needs its own dependencies installed (xprof among them).

Bandwidth counts routed weight bytes only (distinct experts x K x M x 2), against the
copy bandwidth measured in the same run (torch dst.copy_(src) on 4 GiB, read + write,
when torch has CUDA; else an XLA copy). The table is printed last; JSON goes to
$OUT/bench_moe_kernels.json, or --json PATH.
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_paged_attention as paged_attention_bench  # noqa: E402

from pallas_kernels.grouped_matmul import (  # noqa: E402
    default_block_config, grouped_matmul, grouped_matmul_reference, plan_groups)

FULL = dict(experts=128, top_k=8, shapes=(("gate_up", 4096, 2816), ("down", 1408, 4096)),
            ns=(8, 32, 64, 256, 1024), copy_bytes=4 << 30, sets=4, target_s=0.05)
SMOKE = dict(experts=8, top_k=2, shapes=(("gate_up", 64, 64), ("down", 32, 64)),
             ns=(8,), copy_bytes=16 << 20, sets=2, target_s=0.002)
REFERENCE_MAX_BYTES = 8 << 30   # the reference gathers N weight matrices per call
CHECK_CHUNK_BYTES = 1 << 30


def log(*a):
  print(*a, flush=True)


def route(key, tokens, experts, top_k):
  """[tokens * top_k] expert ids: top_k distinct random experts per token."""
  scores = jax.random.uniform(key, (tokens, experts))
  return lax.top_k(scores, top_k)[1].reshape(-1).astype(jnp.int32)


def reference_in_chunks(x, w, ids, k, m):
  """The reference, a few rows at a time so the w[ids] gather stays under 1 GiB."""
  rows = max(1, CHECK_CHUNK_BYTES // (k * m * 2))
  return jnp.concatenate([grouped_matmul_reference(x[i:i + rows], w, ids[i:i + rows])
                          for i in range(0, x.shape[0], rows)])


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def tokamax_candidates():
  """{name: fn} for tokamax's ragged_dot implementations, or a reason there are none."""
  try:
    import tokamax  # optional: not a dependency of this repo
  except Exception as e:
    return {}, f"import tokamax failed: {type(e).__name__}: {e}"

  def make(impl):
    def fn(x, w, ids):
      plan = plan_groups(ids, w.shape[0], 16)       # tile_rows unused: sort only
      ys = tokamax.ragged_dot(x[plan.sorted_rows], w, plan.group_sizes,
                              preferred_element_type=jnp.float32, implementation=impl)
      out = jnp.where(plan.valid_rows[:, None], ys[plan.row_rank], 0.0)
      return out.astype(x.dtype)
    return fn
  return {f"tokamax {impl}": make(impl) for impl in ("mosaic", "triton")}, None


def candidates(n, k, m, smoke, configs):
  """[(name, fn(x, w, ids), tile_rows of a plan hoisted out of the loop or None, skip)]."""
  out = []
  interpret = smoke
  for label, cfg in configs:
    out.append((f"gpu {label}", lambda x, w, ids, c=cfg: grouped_matmul(
        x, w, ids, backend="gpu", block=c, interpret=interpret), None, None))
  default = configs[0][1]
  out.append(("gpu default, plan hoisted",
              lambda x, w, ids, plan, c=default: grouped_matmul(
                  x, w, ids, backend="gpu", block=c, interpret=interpret, plan=plan),
              default.tile_rows, None))
  out.append(("ragged_dot", lambda x, w, ids: grouped_matmul(x, w, ids,
                                                              backend="ragged_dot"),
              None, None))
  gathered = n * k * m * 2
  skip = (None if gathered <= REFERENCE_MAX_BYTES else
          f"gathers {gathered / 2**30:.1f} GiB of weights per call")
  out.append(("reference", grouped_matmul_reference, None, skip))
  return out


def block_configs(n, k, m, experts, sweep):
  """(label, BlockConfig) to time; the first is the default."""
  d = default_block_config(n, experts, k, m, "gpu")
  cfgs = [("default", d)]
  alts = [dataclasses.replace(d, num_stages=4), dataclasses.replace(d, block_k=128),
          dataclasses.replace(d, block_m=64)]
  if sweep:
    alts += [dataclasses.replace(d, block_m=bm, block_k=bk, num_splits=s, num_stages=st)
             for bm in (32, 64, 128) for bk in (64, 128, 256) for s in (1, 2)
             for st in (3, 4)]
  for c in alts:
    if (k % c.block_k == 0 and m % c.block_m == 0 and c not in [x for _, x in cfgs]
        and c.block_k >= 16):
      cfgs.append((f"bm{c.block_m} bk{c.block_k} s{c.num_splits} w{c.num_warps} "
                   f"st{c.num_stages}", c))
  return cfgs


def time_per_call(fn, x, ws, ids, hoist_tile_rows, reps, target_s):
  """(best_s, median_s, calls) per call: calls chained in one jitted fori_loop.

  The trip count is static: with a traced one, XLA's GPU while loop reads its
  predicate back to the host every iteration (about 20 us on an H100), which would be
  charged to the calls.
  """
  experts = ws[0].shape[0]

  def compile_loop(steps):
    def loop(x, ws, ids):
      plan = plan_groups(ids, experts, hoist_tile_rows) if hoist_tile_rows else None

      def body(_, carry):
        x, bad = carry
        for w in ws:
          # `bad` is never set on real data, but the compiler cannot know: the routing
          # (and its plan) depends on the previous output, so it stays in the loop.
          r = ids if plan is not None else jnp.where(bad, 0, ids)
          y = fn(x, w, r, plan) if plan is not None else fn(x, w, r)
          bad = jnp.isnan(y[0, 0])
          x = x.at[0, 0].set(y[0, 0].astype(x.dtype))
        return x, bad
      return lax.fori_loop(0, steps, body, (x, jnp.bool_(False)))[0]
    return jax.jit(loop).lower(x, ws, ids).compile()

  probe = compile_loop(2)
  probe(x, ws, ids).block_until_ready()                            # warm-up
  t = time.perf_counter()
  probe(x, ws, ids).block_until_ready()
  per_step = (time.perf_counter() - t) / 2
  steps = int(min(1000, max(2, target_s / max(per_step, 1e-7))))
  compiled = compile_loop(steps)
  compiled(x, ws, ids).block_until_ready()                         # warm at full length
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    compiled(x, ws, ids).block_until_ready()
    times.append((time.perf_counter() - t) / (steps * len(ws)))
  return min(times), statistics.median(times), steps * len(ws)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
  ap.add_argument("--ns", help="comma-separated row counts (default 8,32,64,256,1024)")
  ap.add_argument("--reps", type=int, default=None)
  ap.add_argument("--sets", type=int, default=None, help="distinct weight sets rotated")
  ap.add_argument("--sweep", action="store_true", help="time a grid of GPU block configs")
  ap.add_argument("--shapes", help="comma-separated subset of gate_up,down")
  ap.add_argument("--json", help="JSON path (default $OUT/bench_moe_kernels.json)")
  opts = ap.parse_args(argv)
  p = SMOKE if opts.smoke else FULL
  ns = [int(v) for v in opts.ns.split(",")] if opts.ns else list(p["ns"])
  reps = opts.reps or (2 if opts.smoke else 5)
  sets = opts.sets or p["sets"]
  experts, top_k = p["experts"], p["top_k"]
  shapes = [s for s in p["shapes"] if not opts.shapes or s[0] in opts.shapes.split(",")]
  dev = jax.devices()[0]
  header = (f"device: {dev.device_kind}; jax {jax.__version__}; python "
            f"{sys.version.split()[0]}; E={experts}, top-{top_k}, bf16"
            f"{'; SMOKE (interpret mode)' if opts.smoke else ''}")
  log(header)
  copy_bw, copy_method = paged_attention_bench.best_copy_bandwidth(p["copy_bytes"])
  log(f"copy bandwidth: {copy_bw / 1e12:.3f} TB/s ({copy_method}, read + write)")
  tok, tok_reason = tokamax_candidates()
  if tok_reason:
    log(f"tokamax skipped: {tok_reason}")

  key = jax.random.key(0)
  results = []
  for shape_name, k, m in shapes:
    # Fresh random weights, scaled so outputs stay O(1) when fed back as x.
    ws = []
    for s in range(sets):
      key, sub = jax.random.split(key)
      ws.append((jax.random.normal(sub, (experts, k, m), jnp.float32)
                 / np.sqrt(k)).astype(jnp.bfloat16))
    ws = tuple(ws)
    for n in ns:
      key, kx, kr = jax.random.split(key, 3)
      ids = route(kr, max(1, n // top_k), experts, top_k)[:n]
      x = jax.random.normal(kx, (n, k), jnp.bfloat16)
      routed = np.unique(np.asarray(ids))
      distinct = len(routed)
      routed_bytes = distinct * k * m * 2
      mask = np.zeros(experts, bool)
      mask[routed] = True
      want = reference_in_chunks(x, ws[0], ids, k, m)
      poisoned = jnp.where(jnp.asarray(mask)[:, None, None], ws[0], jnp.nan)
      cfgs = block_configs(n, k, m, experts, opts.sweep)
      if opts.smoke:
        cfgs = cfgs[:1]
      cands = candidates(n, k, m, opts.smoke, cfgs)
      cands += [(name, fn, None, None) for name, fn in tok.items()]
      for name, fn, hoist, skip in cands:
        entry = dict(shape=shape_name, k=k, m=m, n=n, experts=distinct,
                     routed_bytes=routed_bytes, candidate=name, us_best=None)
        results.append(entry)
        if skip:
          entry["skipped"] = skip
          log(f"{shape_name} N={n} {name}: skipped ({skip})")
          continue
        try:
          call = fn
          if hoist:
            call = lambda x, w, ids, fn=fn, h=hoist: fn(x, w, ids, plan_groups(ids, experts, h))
          out = jax.jit(call)(x, ws[0], ids)
          entry["rel_err"] = rel_err(out, want)
          if not (opts.sweep and name.startswith("gpu bm")):   # sweep: time only
            entry["reads_unrouted"] = not bool(
                jnp.isfinite(jax.jit(call)(x, poisoned, ids).astype(jnp.float32)).all())
          best, med, calls = time_per_call(fn, x, ws, ids, hoist, reps, p["target_s"])
        except Exception as e:  # one failing candidate must not end the run
          entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
          log(f"{shape_name} N={n} {name}: FAILED {entry['error']}")
          continue
        tbs = routed_bytes / best / 1e12
        entry.update(us_best=best * 1e6, us_median=med * 1e6, calls=calls, tbs=tbs,
                     frac_copy=tbs * 1e12 / copy_bw)
        log(f"{shape_name} N={n} experts={distinct} {name}: {best * 1e6:.1f} / "
            f"{med * 1e6:.1f} us, {tbs:.2f} TB/s ({100 * entry['frac_copy']:.0f} % copy), "
            f"rel err {entry['rel_err']:.1e}"
            f"{', READS UNROUTED EXPERTS' if entry.get('reads_unrouted') else ''}")
      del poisoned, want
    del ws

  lines = [header, f"copy bandwidth: {copy_bw / 1e12:.3f} TB/s ({copy_method}, read + write)",
           "", "| shape | N | experts | candidate | us best / median | routed MB | TB/s "
           "| % copy | rel err | unrouted read |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    if r["us_best"] is None:
      why = r.get("skipped") or r.get("error", "")
      lines.append(f"| {r['shape']} | {r['n']} | {r['experts']} | {r['candidate']} | "
                   f"{'skipped' if r.get('skipped') else 'FAILED'}: {why[:60]} | | | | | |")
      continue
    lines.append(f"| {r['shape']} | {r['n']} | {r['experts']} | {r['candidate']} | "
                 f"{r['us_best']:.1f} / {r['us_median']:.1f} | {r['routed_bytes'] / 1e6:.0f} "
                 f"| {r['tbs']:.2f} | {100 * r['frac_copy']:.0f} | {r['rel_err']:.1e} | "
                 f"{ {True: 'YES', False: 'no'}.get(r.get('reads_unrouted'), '-')} |")
  log("\n" + "\n".join(lines))
  path = opts.json or (os.path.join(os.environ["OUT"], "bench_moe_kernels.json")
                       if os.environ.get("OUT") else None)
  if path:
    with open(path, "w") as f:
      json.dump(dict(header=header, copy_bw=copy_bw, copy_method=copy_method,
                     tokamax=tok_reason or "ok", results=results), f, indent=1)
    log(f"wrote {path}")
  return results


if __name__ == "__main__":
  main()
