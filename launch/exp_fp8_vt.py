"""Experiment: fp8 value pages stored transposed per page ([Dv, page_size], not [page_size, Dv]).

Hypothesis: fp8 V as the second operand of p @ V has Dv contiguous; 8-bit operands have
no transposing ldmatrix, so Triton assembles the fragments byte by byte (the fp8
kernel's doubled instruction count). With transposed pages the kv positions are
contiguous.

Minimal decode kernels (Q=1, G=4 in 16-row tiles, full blocks, one split) per layout
variant (vn: row pages; vt2d: transposed pages, 2-D gather; vt3d: 3-D gather laid into
[Dv, block_k]; vtA: o^T = V^T p^T), beside the production kernel (bf16 and fp8 pages).

  PYTHONPATH=. python launch/exp_fp8_vt.py 64,4096 "4/2/3,8/4/2"     # pages/warps/stages
  ncu --kernel-name regex:"exp_|paged_attention" --section InstructionStats ... \
      python launch/exp_fp8_vt.py ncu 64,4096 "prod:4/2/3,vn:4/2/3,vt3d:4/2/3"
$MODES (default bf16,vt2d,vt3d,vtA) picks the variants. On CPU: a tiny interpret-mode
check. An experiment (docs/BENCHMARKS.md, "fp8 value pages stored transposed").
"""
import functools, json, os, sys, time, statistics
sys.path.insert(0, os.path.join(os.getcwd(), "launch"))
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from bench_paged_attention import make_inputs, ours, scaled, fp8_inputs, time_per_call, best_copy_bandwidth, kv_bytes
from pallas_kernels.paged_attention import paged_attention_reference

INTERPRET = jax.default_backend() == "cpu"
LOG2E = 1.4426950408889634
MODES = os.environ.get("MODES", "bf16,vt2d,vt3d,vtA").split(",")


def kernel(bt_ref, q_ref, k_ref, v_ref, o_ref, *, ppb, vmode, nblocks, compute):
  page = k_ref.shape[1]
  d = q_ref.shape[-1]
  bk = ppb * page
  q = q_ref[...].astype(compute)                      # [16, D]
  kv_row = lax.broadcasted_iota(jnp.int32, (bk, d), 0)
  dim = lax.broadcasted_iota(jnp.int32, (bk, d), 1)
  row_page = jnp.arange(bk, dtype=jnp.int32) // page
  if vmode in ("vt2d", "vtA"):
    vd = lax.broadcasted_iota(jnp.int32, (d, bk), 0)
    vcol = lax.broadcasted_iota(jnp.int32, (d, bk), 1)

  def body(j, carry):
    acc, m_prev, l_prev = carry
    page0 = j * ppb
    pages = bt_ref[page0 + row_page]
    k = pltriton.load(k_ref.at[(jnp.broadcast_to(pages[:, None], (bk, d)), kv_row % page, dim)]
                      ).astype(compute)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * LOG2E
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    if vmode == "vn":
      v = pltriton.load(v_ref.at[(jnp.broadcast_to(pages[:, None], (bk, d)), kv_row % page, dim)]
                        ).astype(compute)
      pv = lax.dot_general(p.astype(compute), v, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)
    else:
      if vmode == "vt3d":
        pg = bt_ref[page0 + jnp.arange(ppb, dtype=jnp.int32)]
        shape = (ppb, d, page)
        vt = pltriton.load(v_ref.at[(jnp.broadcast_to(pg[:, None, None], shape),
                                     lax.broadcasted_iota(jnp.int32, shape, 1),
                                     lax.broadcasted_iota(jnp.int32, shape, 2))])
        vt = vt.transpose(1, 0, 2).reshape(d, bk).astype(compute)
      else:
        vt = pltriton.load(v_ref.at[(jnp.broadcast_to(pages[None, :], (d, bk)), vd, vcol % page)]
                           ).astype(compute)
      if vmode == "vtA":   # acc^T [D, 16] = V^T [D, bk] @ p^T
        pv = lax.dot_general(vt, p.astype(compute), (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
        return acc * alpha[None, :] + pv, m_next, l_prev * alpha + p.sum(axis=1)
      pv = lax.dot_general(p.astype(compute), vt, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_next, l_prev * alpha + p.sum(axis=1)

  rows = q_ref.shape[0]
  shape = (d, rows) if vmode == "vtA" else (rows, d)
  carry = (jnp.zeros(shape, jnp.float32), jnp.full((rows,), -1e30, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  acc, m, l = lax.fori_loop(0, nblocks, body, carry)
  if vmode == "vtA":
    acc = acc.T
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def minimal(vmode, ppb, warps, stages, ctx):
  def fn(q, k, v, t, l, ks, vs):
    b, _, hq, d = q.shape
    kvh = k.shape[0]
    g = hq // kvh
    qs = q.reshape(b, kvh, g, d).astype(jnp.float32) * (ks / d ** 0.5)[None, :, None, None]
    qp = jnp.pad(qs.astype(q.dtype), ((0, 0), (0, 0), (0, 16 - g), (0, 0)))
    compute = jnp.float16 if k.dtype == jnp.float8_e4m3fn else q.dtype
    page = k.shape[2]
    nblocks = ctx // (ppb * page)
    kern = functools.partial(kernel, ppb=ppb, vmode=vmode, nblocks=nblocks, compute=compute)
    out = pl.pallas_call(
        kern, grid=(b, kvh),
        in_specs=[pl.BlockSpec((None, t.shape[1]), lambda i, h: (i, 0)),
                  pl.BlockSpec((None, None, 16, d), lambda i, h: (i, h, 0, 0)),
                  pl.BlockSpec((None, *k.shape[1:]), lambda i, h: (h, 0, 0, 0)),
                  pl.BlockSpec((None, *v.shape[1:]), lambda i, h: (h, 0, 0, 0))],
        out_specs=pl.BlockSpec((None, None, 16, d), lambda i, h: (i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kvh, 16, d), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=INTERPRET, name=f"exp_{vmode}")(t, qp, k, v)
    o = out[:, :, :g, :] * vs[None, :, None, None].astype(q.dtype)
    return o.reshape(b, 1, hq, d)
  return fn


def profile():
  """One call of each variant (for ncu): argv ncu B,CTX "mode:ppb/w/s,...", mode vn / vt3d /
  bf16 (vn on bf16 pages) / prod / prodbf16."""
  batch, ctx = (int(x) for x in sys.argv[2].split(","))
  args = make_inputs(batch, ctx, 1, jax.random.key(0))
  q, k8, v8, t, l, ks, vs = fp8_inputs(args)
  bf = (*args, jnp.ones((8,), jnp.float32), jnp.ones((8,), jnp.float32))
  v8t = v8.transpose(0, 1, 3, 2)
  for item in sys.argv[3].split(","):
    mode, cfg = item.split(":")
    ppb, w, st = (int(x) for x in cfg.split("/"))
    if mode == "prod":
      fn, a = scaled(ours()), (q, k8, v8, t, l, ks, vs)
    elif mode == "prodbf16":
      fn, a = ours(), args
    elif mode == "bf16":
      fn, a = minimal("vn", ppb, w, st, ctx), bf
    else:
      fn, a = minimal(mode, ppb, w, st, ctx), (q, k8, v8t if mode.startswith("vt") else v8, t, l, ks, vs)
    f = jax.jit(fn)
    for _ in range(2):
      f(*a).block_until_ready()
    print("ran", item, flush=True)


def main():
  if sys.argv[1:2] == ["ncu"]:
    return profile()
  batch, ctx = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "64,4096").split(","))
  configs = sys.argv[2] if len(sys.argv) > 2 else "4/2/3,8/4/2,4/4/3,8/4/3"
  reps = 7
  key = jax.random.key(0)
  if INTERPRET:
    batch, ctx, configs, reps = 2, 256, "4/2/3", 1
  args = make_inputs(batch, ctx, 1, key)
  f8 = fp8_inputs(args)
  q, k8, v8, t, l, ks, vs = f8
  v8t = v8.transpose(0, 1, 3, 2)          # [KVH, P, D, page]
  bf = (*args, jnp.ones((8,), jnp.float32), jnp.ones((8,), jnp.float32))
  want = paged_attention_reference(q, k8, v8, t, l, k_scale=ks, v_scale=vs).astype(jnp.float32)
  denom = best_copy_bandwidth()[0] if not INTERPRET else 1.0
  n = 50 if not INTERPRET else 1
  fp8b, bfb = kv_bytes(batch, ctx, itemsize=1), kv_bytes(batch, ctx, itemsize=2)
  out = []

  def row(name, fn, a, nbytes):
    try:
      got = jax.jit(fn)(*a).astype(jnp.float32)
      err = float(jnp.abs(got - want).max()) if a[1].dtype != jnp.bfloat16 else float("nan")
      if INTERPRET:
        c, best, med = 0, 1, 1
      else:
        c, best, med = time_per_call(fn, a, n, reps)
    except Exception as e:
      print(json.dumps(dict(name=name, error=f"{type(e).__name__}: {str(e)[:400]}")), flush=True)
      return
    r = dict(name=name, us=best * 1e6, med_us=med * 1e6, tbs=nbytes / best / 1e12,
             pct_copy=100 * nbytes / best / denom,
             err=err)
    out.append(r)
    print(json.dumps(r), flush=True)

  print(json.dumps(dict(batch=batch, ctx=ctx, copy_tbs=denom / 1e12 if not INTERPRET else 0,
                        device=str(jax.devices()[0]))), flush=True)
  if "bf16" in MODES:
    row("prod bf16", ours(), args, bfb)
  row("prod fp8", scaled(ours()), f8, fp8b)
  for cfg in configs.split(","):
    ppb, w, s = (int(x) for x in cfg.split("/"))
    if "bf16" in MODES:
      row(f"min bf16 vn {cfg}", minimal("vn", ppb, w, s, ctx), bf, bfb)
    row(f"min fp8 vn {cfg}", minimal("vn", ppb, w, s, ctx), f8, fp8b)
    for vm in [m for m in ("vt2d", "vt3d", "vtA") if m in MODES]:
      row(f"min fp8 {vm} {cfg}", minimal(vm, ppb, w, s, ctx), (q, k8, v8t, t, l, ks, vs), fp8b)
  path = os.environ.get("OUT")
  if path:
    with open(os.path.join(path, f"fp8_vt_{batch}_{ctx}.json"), "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
