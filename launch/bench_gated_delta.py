"""Benchmark the gated delta rule (GDN) kernels against the XLA references, the Mosaic GPU
kernels of `jax_linear_attention` and `tokamax` (where they have the op), and the
device's copy bandwidth, all measured in the same run.

  PYTHONPATH=. python launch/bench_gated_delta.py [--reps 5] [--out FILE] [--small]

Shapes (bf16 q, k, v; f32 g, beta, state; dk = dv = 128):
  Qwen3.5-27B-ish: Hk 16, Hv 48;  Qwen3-Next-80B: Hk 16, Hv 32
  batch 1 and 32; T = 1, 2, 4 (the recurrent kernel; each with and without all_states,
  the verify form) and prefill T = 4096 (the chunked kernel).
Bytes counted (what the op must move at least):
  read state + q, k, v, g, beta; write out + the final state, or the T states with
  all_states (which replace it): B*Hv*dk*dv*4 per state.
Decode and verify are memory bound: their % of the copy bandwidth is the figure of
merit. Prefill is compute bound (chunk matmuls and the triangular solve); its bandwidth
column is given for completeness, with tokens per second.
Columns: ours (backend "gpu"), the XLA reference (`gated_delta_reference` for the
recurrent shapes, `gated_delta_chunked_reference` for prefill, jitted), the Mosaic GPU
`gated_delta_rule` of jax_linear_attention (`jla`, Hopper only, bf16, no all_states: it
is a chunked kernel at every T) and tokamax (which, as of 0.0.12, has no gated-delta or
linear-attention op: the script looks for one and prints why it skips). A missing
package, op or unsupported shape is printed and shown as n/a.
Each figure times N calls inside one jitted fori_loop (the state a call returns is the
next call's state, so no call can be hoisted) and divides by N; best and median of
--reps loops after a warm-up that also reports compile time. The copy bandwidth (the
denominator) is the best of torch `dst.copy_(src)` and a jitted XLA `x + 1` on 4 GiB,
counting read + write bytes.
--small is a CPU smoke run: tiny shapes, our GPU kernels in interpret mode, one call per
loop, a 64 MiB copy; it checks that the script runs, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_paged_attention import copy_bandwidth  # noqa: E402

from pallas_kernels.gated_delta import (  # noqa: E402
    RECURRENT_MAX_T, gated_delta, gated_delta_chunked_reference, gated_delta_reference)

COPY_BYTES = 4 << 30


@dataclasses.dataclass(frozen=True)
class Model:
  name: str
  hk: int
  hv: int
  dk: int = 128
  dv: int = 128


MODELS = [Model("Qwen3.5-27B-ish", 16, 48), Model("Qwen3-Next-80B", 16, 32)]
SMALL_MODELS = [Model("small", 2, 4, 16, 32)]
BATCHES = (1, 32)
DECODE_T = (1, 2, 4)
PREFILL_T = 4096
SMALL_PREFILL_T = 128


def log(*a):
  print(*a, flush=True)


def make_inputs(model, batch, seq, key):
  """bf16 q, k, v, f32 g in [-1, -0.01] (log decay), beta in (0.05, 0.95), a state."""
  kq, kk, kv, kg, kb, ks = jax.random.split(key, 6)
  q = jax.random.normal(kq, (batch, seq, model.hk, model.dk), jnp.bfloat16)
  k = jax.random.normal(kk, (batch, seq, model.hk, model.dk), jnp.bfloat16)
  v = jax.random.normal(kv, (batch, seq, model.hv, model.dv), jnp.bfloat16)
  g = -jax.random.uniform(kg, (batch, seq, model.hv), jnp.float32, 0.01, 1.0)
  beta = jax.random.uniform(kb, (batch, seq, model.hv), jnp.float32, 0.05, 0.95)
  state = 0.1 * jax.random.normal(ks, (batch, model.hv, model.dk, model.dv), jnp.float32)
  return q, k, v, g, beta, state


def op_bytes(model, batch, seq, all_states):
  """Bytes the op moves at least (module docstring)."""
  state = batch * model.hv * model.dk * model.dv * 4
  qk = 2 * batch * seq * model.hk * model.dk * 2
  vo = 2 * batch * seq * model.hv * model.dv * 2
  gb = 2 * batch * seq * model.hv * 4
  return state + qk + vo + gb + (seq * state if all_states else state)


def iters(nbytes, seq):
  if seq > RECURRENT_MAX_T:
    return 3
  return int(min(500, max(10, 0.03 * 3e12 / nbytes)))


# ------------------------------------------------------------------------------ methods
def ours(all_states, interpret):
  return lambda q, k, v, g, b, s: gated_delta(q, k, v, g, b, s, all_states=all_states,
                                              backend="gpu", interpret=interpret)


def xla_reference(all_states, seq):
  if seq > RECURRENT_MAX_T:
    return gated_delta_chunked_reference
  return lambda q, k, v, g, b, s: gated_delta_reference(q, k, v, g, b, s,
                                                        all_states=all_states)


def jla_fn():
  """jax_linear_attention's Mosaic GPU gated_delta_rule as fn(q, k, v, g, beta, state) ->
  (out, final state), or (None, why)."""
  try:
    jla_gdr = importlib.import_module("jla.ops.mosaic_gpu.gated_delta_rule")
  except ImportError as e:
    return None, f"jax_linear_attention not importable ({type(e).__name__}: {e})"
  except Exception as e:  # a broken install: say so, keep benchmarking the rest
    return None, f"jax_linear_attention import failed ({type(e).__name__}: {e})"

  def fn(q, k, v, g, beta, state):
    return jla_gdr.gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                    output_final_state=True, use_qk_l2norm=True)
  return fn, None


def jla_reason(q, k, v, g, beta, state):
  """Why jla's kernel refuses these inputs (None if it takes them)."""
  options = dict(initial_state=state, output_final_state=True, use_qk_l2norm=True)
  try:
    jla_gdr = importlib.import_module("jla.ops.mosaic_gpu.gated_delta_rule")
    if jla_gdr.supports_gated_delta_rule(q, k, v, g, beta, **options):
      return None
    scalar_gate = importlib.import_module("jla.ops.mosaic_gpu.scalar_gate")
    return (scalar_gate.unsupported_reason(q, k, v, (g, beta), options, delta=True)
            or "jla supports_gated_delta_rule() refuses these inputs")
  except Exception as e:
    return f"{type(e).__name__}: {e}"


def tokamax_fn():
  """tokamax's gated delta rule / linear attention op, or (None, why)."""
  try:
    import tokamax
  except ImportError as e:
    return None, f"tokamax not importable ({type(e).__name__}: {e})"
  except Exception as e:
    return None, f"tokamax import failed ({type(e).__name__}: {e})"
  names = ("gated_delta_rule", "gated_delta", "chunk_gated_delta_rule", "gated_deltanet",
           "linear_attention")
  found = [n for n in names if callable(getattr(tokamax, n, None))]
  if not found:
    ops = sorted(n for n in dir(tokamax) if not n.startswith("_"))
    return None, (f"tokamax {getattr(tokamax, '__version__', '?')} has no gated-delta or "
                  f"linear-attention op (looked for {', '.join(names)}; it exports "
                  f"{', '.join(ops)})")
  op = getattr(tokamax, found[0])
  if found[0] == "linear_attention":
    def fn(q, k, v, g, beta, state):
      return op("gated_deltanet", q, k, v, g=g, beta=beta, initial_state=state,
                output_final_state=True, use_qk_l2norm=True)
  else:
    def fn(q, k, v, g, beta, state):
      return op(q, k, v, g, beta, initial_state=state, output_final_state=True,
                use_qk_l2norm=True)
  log(f"tokamax op: {found[0]} (call signature assumed FLA-like; failures are printed)")
  return fn, None


# ------------------------------------------------------------------------------- timing
def time_per_call(fn, args, n, reps):
  """(compile_s, best_s, median_s) per call, n calls chained through the state."""
  inputs, state = args[:5], args[5]

  def next_state(s, result):
    new = result[1]
    return new[:, -1] if new.ndim == 5 else new  # all_states: the last position's

  loop = jax.jit(lambda state, *inputs: lax.fori_loop(
      0, n, lambda _, s: next_state(s, fn(*inputs, s)), state))
  t = time.perf_counter()
  compiled = loop.lower(state, *inputs).compile()
  compile_s = time.perf_counter() - t
  compiled(state, *inputs).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    compiled(state, *inputs).block_until_ready()
    times.append((time.perf_counter() - t) / n)
  return compile_s, min(times), statistics.median(times)


def max_err(a, b):
  return float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())


def run_case(model, batch, seq, all_states, methods, opts, key, denom):
  """One shape: errors against the reference, then each method's timing."""
  args = make_inputs(model, batch, seq, key)
  nbytes = op_bytes(model, batch, seq, all_states)
  n = 1 if opts.small else iters(nbytes, seq)
  tag = f"{model.name} B={batch} T={seq} all_states={all_states}"
  entry = dict(model=model.name, hk=model.hk, hv=model.hv, dk=model.dk, dv=model.dv,
               batch=batch, seq=seq, all_states=all_states, bytes=nbytes, iters=n,
               kernel="recurrent" if seq <= RECURRENT_MAX_T else "chunked")
  want = None
  try:
    want = xla_reference(all_states, seq)(*args)
  except Exception as e:
    log(f"{tag}: reference failed: {type(e).__name__}: {str(e)[:300]}")
  for name, fn in methods:
    if fn is None:
      entry[name] = None
      continue
    if name == "jla" and all_states:
      entry[name] = None  # no per-position states: nothing comparable
      continue
    if name == "jla":
      reason = jla_reason(*args)
      if reason is not None:
        log(f"{tag}: jla skipped: {reason}")
        entry[name] = None
        continue
    try:
      got = fn(*args)
      err = (max_err(got[0], want[0]), max_err(got[1], want[1])) if want else (None, None)
      compile_s, best, med = time_per_call(fn, args, n, opts.reps)
      entry[name] = dict(compile_s=compile_s, best_s=best, median_s=med,
                         tbs=nbytes / best / 1e12, pct_copy=100 * nbytes / best / denom,
                         max_abs_err_out=err[0], max_abs_err_state=err[1],
                         tokens_per_s=batch * seq / best)
      log(f"{tag} {name}: {best * 1e6:.1f} us (median {med * 1e6:.1f}), "
          f"{nbytes / best / 1e12:.3f} TB/s = {100 * nbytes / best / denom:.0f} % of copy; "
          f"max abs err out {err[0]}, state {err[1]}")
    except Exception as e:
      log(f"{tag} {name}: FAILED {type(e).__name__}: {str(e)[:500]}")
      entry[name] = None
  return entry


def sweep(models, batches, prefill, opts, key, denom):
  """Our GPU kernels over value-column blocks, warps (and stages for the chunked one) at
  each model and batch: T=1, T=4 with all_states and the prefill T. Prints a line a
  config; returns the rows."""
  from pallas_kernels import gated_delta_gpu as kernels
  rows = []
  for model, batch in ((m, b) for m in models for b in batches):
    for seq, all_states in ((1, False), (4, True), (prefill, False)):
      args = make_inputs(model, batch, seq, key)
      nbytes = op_bytes(model, batch, seq, all_states)
      n = 1 if opts.small else iters(nbytes, seq)
      if seq <= RECURRENT_MAX_T:
        configs = [dict(block_v=bv, num_warps=w) for bv in (16, 32, 64, 128)
                   for w in (2, 4, 8) if bv <= model.dv]
        base = kernels.gated_delta_recurrent
        default = kernels.recurrent_block_v(batch, model.hv, model.dv)
      else:
        configs = [dict(block_v=bv, num_warps=w, num_stages=st) for bv in (32, 64, 128)
                   for w in (4, 8) for st in (1, 2) if bv <= model.dv]
        base = kernels.gated_delta_chunked
        default = kernels.chunked_block_v(batch, model.hv, model.dv)
      for cfg in configs:
        extra = dict(all_states=all_states) if seq <= RECURRENT_MAX_T else {}
        fn = (lambda cfg, extra: lambda *a: base(*a, interpret=opts.small, **extra, **cfg))(
            cfg, extra)
        tag = f"sweep {model.name} B={batch} T={seq} all_states={all_states} {cfg}"
        try:
          _, best, med = time_per_call(fn, args, n, opts.reps)
        except Exception as e:
          log(f"{tag}: FAILED {type(e).__name__}: {str(e)[:300]}")
          continue
        log(f"{tag}: {best * 1e6:.1f} us, {100 * nbytes / best / denom:.0f} % of copy"
            f"{' (default block_v)' if cfg['block_v'] == default else ''}")
        rows.append(dict(model=model.name, batch=batch, seq=seq, all_states=all_states,
                         **cfg, best_s=best, median_s=med, bytes=nbytes))
  return rows


def cell(r):
  return (f"{r['best_s'] * 1e6:.1f} us, {r['tbs']:.2f} TB/s ({r['pct_copy']:.0f} %)"
          if r else "n/a")


def ratio(entry, a, b):
  """time(a) / time(b), or n/a."""
  ra, rb = entry.get(a), entry.get(b)
  return f"{ra['best_s'] / rb['best_s']:.2f}" if ra and rb else "n/a"


def table(entries):
  rows = [
      "| model | B | T | all_states | kernel | MB moved | ours | XLA reference | jla | "
      "tokamax | ours/XLA time | ours/jla time | ours/tokamax time | ours max err out |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for e in entries:
    o = e.get("ours")
    err = f"{o['max_abs_err_out']:.1e}" if o and o["max_abs_err_out"] is not None else "n/a"
    rows.append(
        f"| {e['model']} | {e['batch']} | {e['seq']} | {e['all_states']} | {e['kernel']} | "
        f"{e['bytes'] / 1e6:.1f} | {cell(o)} | {cell(e.get('xla_reference'))} | "
        f"{cell(e.get('jla'))} | {cell(e.get('tokamax'))} | "
        f"{ratio(e, 'ours', 'xla_reference')} | {ratio(e, 'ours', 'jla')} | "
        f"{ratio(e, 'ours', 'tokamax')} | {err} |")
  return "\n".join(rows)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--out", help="write the results as JSON to this file")
  ap.add_argument("--small", action="store_true",
                  help="CPU smoke run: tiny shapes, interpret mode (figures mean nothing)")
  ap.add_argument("--no-prefill", action="store_true", help="skip the T=4096 rows")
  ap.add_argument("--sweep", action="store_true",
                  help="also time our GPU kernels over block widths, warps and stages")
  opts = ap.parse_args()
  if opts.small:
    opts.reps = 1
  dev = jax.devices()[0]
  import jaxlib
  header = (f"device: {dev.device_kind}; jax {jax.__version__}, jaxlib {jaxlib.__version__}; "
            f"python {sys.version.split()[0]}")
  log(header)
  copy = copy_bandwidth(nbytes=64 << 20 if opts.small else COPY_BYTES)
  denom_method = max(copy, key=copy.get)
  denom = copy[denom_method]
  for m, bw in copy.items():
    log(f"copy bandwidth, {m}: {bw / 1e12:.3f} TB/s")

  jla, jla_why = jla_fn()
  tkm, tkm_why = tokamax_fn()
  skipped = {}
  if jla is None:
    skipped["jla"] = jla_why
    log(f"jla skipped: {jla_why}")
  if tkm is None:
    skipped["tokamax"] = tkm_why
    log(f"tokamax skipped: {tkm_why}")

  key = jax.random.key(0)
  entries = []
  models = SMALL_MODELS if opts.small else MODELS
  batches = (1, 2) if opts.small else BATCHES
  prefill = SMALL_PREFILL_T if opts.small else PREFILL_T
  cases = [(seq, al) for seq in DECODE_T for al in (False, True)]
  if not opts.no_prefill:
    cases.append((prefill, False))
  for model in models:
    for batch in batches:
      for seq, all_states in cases:
        methods = [("ours", ours(all_states, opts.small)),
                   ("xla_reference", xla_reference(all_states, seq)),
                   ("jla", jla), ("tokamax", tkm)]
        entry = run_case(model, batch, seq, all_states, methods, opts, key, denom)
        entries.append(entry)
        log(json.dumps(entry))

  sweep_results = sweep(models, batches, prefill, opts, key, denom) if opts.sweep else []

  text = "\n".join([
      header,
      f"copy bandwidth (denominator): {denom / 1e12:.3f} TB/s from {denom_method} "
      f"(all: {', '.join(f'{m} {b / 1e12:.3f}' for m, b in copy.items())})",
      *(f"{name}: n/a because {why}" for name, why in skipped.items()),
      "",
      "Cells: best time per call, bandwidth of the bytes moved (% of the copy bandwidth). "
      "Ratios < 1: ours faster.",
      "",
      table(entries),
  ])
  log("\n" + text)
  if opts.out:
    with open(opts.out, "w") as f:
      json.dump(dict(header=header, copy=copy, copy_denominator=denom_method,
                     skipped=skipped, results=entries, sweep=sweep_results), f, indent=1)
    log(f"wrote {opts.out}")


if __name__ == "__main__":
  main()
