"""Benchmark paged attention for a draft tree's verify: a tree of about ten rows against
the chain of K + 1 = 4 and plain decoding's one token, on the GPU kernel.

  PYTHONPATH=. python launch/bench_tree_verify.py [--reps 5] [--trees '2,2,1;3,2;budget:9']
      [--batches 1,8] [--ctx 4096] [--check]

Shapes as launch/bench_paged_attention.py's: bf16, Hq=32, KVH=8, D=128, page 16, the
pages in a random permutation of the pool, every row at kv_len = ctx. Per batch size, the
query rows of each request:
  plain          Q = 1, causal (a decode step);
  chain          Q = 4, causal (the K = 3 verify);
  chain as tree  Q = 4 with tree_mask = the lower triangle (what the tree's masking costs
                 at the chain's size; the result is the chain's);
  tree S         Q = S's nodes, tree_mask = its ancestors, [B, Q, Q]; a static spec
                 ("2,2,1": 11 rows, "3,2": 10) is the same tree for every request,
                 "budget:N" a random tree of N + 1 nodes per request (a dynamic tree's
                 shape: the kernel's work depends on Q and the mask only).
Each figure times N calls inside one jitted fori_loop (bench_paged_attention's
`time_per_call`: the output feeds the next call's q) and divides by N; best and median of
--reps loops. Printed: microseconds per call, the ratio to plain and to the chain, and the
largest difference from the XLA reference. With $OUT set, the table (markdown) and raw
results (JSON) are written there.
--check is a CPU run: ctx 256, batches 1 and 2, the GPU kernel in interpret mode (and the
TPU kernel's interpreter for the errors), one call a loop; it fails when a kernel's
result is off the reference, its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_paged_attention import (  # noqa: E402
    HQ, KVH, PAGE, iters, kv_bytes, log, make_inputs, max_err, time_per_call)

from mtp_jax.tree import static_tree  # noqa: E402
from mtp_jax.tree_spec import parse_tree_spec  # noqa: E402
from pallas_kernels.paged_attention import (  # noqa: E402
    default_block_config, paged_attention, paged_attention_reference)

CHAIN = 4  # K + 1 with K = 3
CHECK_TOL = 2e-2  # bf16


def random_tree_mask(nodes, rng):
  """[nodes, nodes] ancestor mask of a random tree in level order (each node's parent an
  earlier node)."""
  parent = [-1] + [int(rng.integers(0, i)) for i in range(1, nodes)]
  mask = np.eye(nodes, dtype=bool)
  for i in range(1, nodes):
    mask[i] |= mask[parent[i]]
  return mask


def tree_mask(spec_text, batch, rng):
  """[B, Q, Q] ancestor masks of a spec: the static tree for every request, or a random
  tree of budget + 1 nodes per request."""
  spec = parse_tree_spec(spec_text)
  if spec.dynamic:
    return np.stack([random_tree_mask(spec.num_nodes, rng) for _ in range(batch)])
  return np.broadcast_to(static_tree(spec.branching).ancestors,
                         (batch, spec.num_nodes, spec.num_nodes))


def variants(trees, batch, rng):
  """(name, Q, tree_mask or None) of each row kind timed."""
  chain = np.broadcast_to(np.tril(np.ones((CHAIN, CHAIN), bool)), (batch, CHAIN, CHAIN))
  out = [("plain", 1, None), ("chain", CHAIN, None), ("chain as tree", CHAIN, chain)]
  for spec in trees:
    mask = tree_mask(spec, batch, rng)
    out.append((f"tree {spec}", mask.shape[1], mask))
  return out


def kernel(backend, interpret):
  def fn(q, k, v, t, l, *mask):
    return paged_attention(q, k, v, t, l, tree_mask=mask[0] if mask else None,
                           backend=backend, interpret=interpret)
  return fn


def reference(q, k, v, t, l, *mask):
  return paged_attention_reference(q, k, v, t, l, tree_mask=mask[0] if mask else None)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--trees", default="2,2,1;3,2;budget:9",
                  help="tree specs separated by ';' (as --draft-tree takes them)")
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--ctx", type=int, default=4096)
  ap.add_argument("--check", action="store_true",
                  help="CPU run: tiny shapes, interpret mode, results checked against the "
                       "reference (figures mean nothing)")
  opts = ap.parse_args()
  batches = [int(b) for b in opts.batches.split(",")]
  ctx, reps = opts.ctx, opts.reps
  if opts.check:
    batches, ctx, reps = [1, 2], 256, 1
  trees = [t.strip() for t in opts.trees.split(";") if t.strip()]
  out_dir = os.environ.get("OUT")
  dev = jax.devices()[0]
  import jaxlib
  header = (f"device: {dev.device_kind}; jax {jax.__version__}, jaxlib {jaxlib.__version__}; "
            f"python {sys.version.split()[0]}")
  log(header)
  ours = kernel("gpu", opts.check)
  key = jax.random.key(0)
  rng = np.random.default_rng(0)
  rows, raw, failed = [], [], []
  for batch in batches:
    timed = {}
    for name, q_len, mask in variants(trees, batch, rng):
      args = make_inputs(batch, ctx, q_len, key)
      if mask is not None:
        args = args + (jnp.asarray(mask),)
      want = reference(*args)
      err = max_err(ours(*args), want)
      entry = dict(batch=batch, ctx=ctx, variant=name, q_len=q_len, max_abs_err=err,
                   config=str(default_block_config(batch, q_len, HQ, KVH, PAGE, ctx // PAGE,
                                                   "gpu")))
      if opts.check:
        entry["tpu_max_abs_err"] = max_err(kernel("tpu", True)(*args), want)
        if max(err, entry["tpu_max_abs_err"]) > CHECK_TOL:
          failed.append(f"B={batch} {name}: error {err:.1e} (gpu) / "
                        f"{entry['tpu_max_abs_err']:.1e} (tpu)")
      n = 1 if opts.check else iters(batch, ctx)
      try:
        _, best, med = time_per_call(ours, args, n, reps)
      except Exception as e:
        log(f"B={batch} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
        best = med = None
      entry.update(best_s=best, median_s=med, iters=n, bytes=kv_bytes(batch, ctx))
      timed[name] = best
      raw.append(entry)
      log(json.dumps(entry))
      del args

    def ratio(a, b):
      return f"{a / b:.2f}" if a and b else "n/a"

    for e in raw[-len(timed):]:
      best, med = e["best_s"], e["median_s"]
      us = f"{best * 1e6:.1f} / {med * 1e6:.1f}" if best else "n/a"
      rows.append(f"| {batch} | {ctx} | {e['variant']} | {e['q_len']} | {us} | "
                  f"{ratio(best, timed['plain'])} | {ratio(best, timed['chain'])} | "
                  f"{e['max_abs_err']:.1e} |")
  table = "\n".join([
      header, "",
      f"Paged attention over a draft tree (GPU kernel): bf16, Hq {HQ}, KVH {KVH}, D 128, "
      f"page {PAGE}; Q rows per request; ratios of best times.", "",
      "| B | ctx | rows | Q | us best / median | / plain | / chain | max abs err vs ref |",
      "|---|---|---|---|---|---|---|---|",
      *rows,
  ])
  log("\n" + table)
  if out_dir:
    with open(os.path.join(out_dir, "bench_tree_verify.md"), "w") as f:
      f.write(table + "\n")
    with open(os.path.join(out_dir, "bench_tree_verify.json"), "w") as f:
      json.dump(dict(header=header, results=raw), f, indent=1)
  if failed:
    log("check FAILED:\n  " + "\n  ".join(failed))
    sys.exit(1)
  if opts.check:
    log("check passed: every kernel result within "
        f"{CHECK_TOL} of the reference")


if __name__ == "__main__":
  main()
