"""Gated delta rule for NVIDIA GPUs: Pallas (Triton backend) kernels for the recurrent
form (decode, verify) and the chunked form (prefill).

The op, the layouts and the math are documented in `pallas_kernels.gated_delta`; this
module holds only the GPU kernels and their wrappers. Both kernels take q, k, v, g, beta
and the state in the op's layouts (no XLA transposes around them): program (b, h, j)
reads key head h // (Hv // Hk) of q and k through its BlockSpec, L2-normalises them in
registers, and owns value columns j * BV:(j + 1) * BV of head h's state. The columns of
the state are independent (each one's delta, update and output read only that column
and the shared key / query), so splitting dv into blocks costs only the repeated q / k
loads and norms, and gives small batches more programs than B * Hv.

Recurrent kernel: the [dk, BV] f32 state slice stays in registers for all T steps
(a fori_loop); each step is elementwise work and two reductions over dk, exact f32. It
reads the state once and writes it once (or once per step with all_states): memory
bound, see `recurrent_block_v` for the block width.

Chunked kernel: a fori_loop over the chunks of CHUNK positions carries the state slice;
per chunk it builds the decays, solves the unit lower-triangular WY system by doubling
(`_unit_lower_inverse`) and applies the chunk with tensor-core dots. A T that is not a
multiple of the chunk is zero padded by the wrapper (g = beta = 0 changes nothing).
Dots run in IEEE f32 for f32 inputs and in TF32 (f32 accumulation) for bf16 inputs:
emulating TF32's input rounding on every dot of this algorithm (dk = dv = 128, 1024
positions, random and nearly parallel keys alike) gives outputs within about 1e-3 of
their scale, under the rounding of the bf16 output itself, and nearly parallel keys
lose no more than random ones (the doubling inverse does not amplify the rounding).

Triton tiles are powers of two and tensor-core dots need dims >= 16, so the kernels take
power-of-two dk and dv of at least 16 (ValueError otherwise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

L2_EPS = 1e-6  # as pallas_kernels.gated_delta.L2_EPS (transformers' l2norm)
# Programs below which the recurrent kernel halves its value-column block (down to
# MIN_BLOCK_V): about two per SM of an H100 (132), so batch-1 decode fills the card.
TARGET_PROGRAMS = 264
MIN_BLOCK_V = 16
MAX_BLOCK_V = 64


def check_dims(dk, dv):
  """ValueError unless dk and dv are powers of two >= 16 (Triton tiles, dot dims)."""
  for name, n in (("dk", dk), ("dv", dv)):
    if n < 16 or n & (n - 1):
      raise ValueError(f"the GPU gated-delta kernels need a power-of-two head dim >= 16 "
                       f"(Triton tiles, tensor-core dots); got {name}={n}.")


def recurrent_block_v(batch, num_heads, dv):
  """Value columns per recurrent program: MAX_BLOCK_V (a [128, 64] f32 state slice is 64
  registers a thread over 4 warps), halved while the grid has fewer than
  TARGET_PROGRAMS programs (down to MIN_BLOCK_V). Each program moves dk * BV * 4 bytes
  of state each way, so narrower blocks cost nothing but the repeated q / k loads."""
  block = min(dv, MAX_BLOCK_V)
  while block > MIN_BLOCK_V and batch * num_heads * (dv // block) < TARGET_PROGRAMS:
    block //= 2
  return block


def chunked_block_v(batch, num_heads, dv):
  """Value columns per chunked program: MAX_BLOCK_V at most (the [dk, BV] f32 state and
  the chunk's [C, BV] tiles in registers), halved to 32 while the grid is under a wave.
  Each block repeats the chunk's triangular solve, so blocks stay wide."""
  block = min(dv, MAX_BLOCK_V)
  if block > 32 and batch * num_heads * (dv // block) < TARGET_PROGRAMS // 2:
    block //= 2
  return block


def _normalised(x, scale=1.0):
  """x (f32) * rsqrt(sum(x * x) + eps) over its last axis, times scale."""
  return x * (lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS) * scale)


def _recurrent_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, st_ref, *, seq,
                      all_states):
  dk = q_ref.shape[-1]
  scale = dk ** -0.5

  def step(t, s):
    q = _normalised(q_ref[t, :].astype(jnp.float32), scale)               # [dk]
    k = _normalised(k_ref[t, :].astype(jnp.float32))
    v = v_ref[t, :].astype(jnp.float32)                                   # [BV]
    s = s * jnp.exp(g_ref[t])
    kv_mem = jnp.sum(s * k[:, None], axis=0)
    delta = (v - kv_mem) * b_ref[t]
    s = s + k[:, None] * delta[None, :]
    o_ref[t, :] = jnp.sum(s * q[:, None], axis=0).astype(o_ref.dtype)
    if all_states:
      st_ref[t] = s
    return s

  s = lax.fori_loop(0, seq, step, s_ref[...])
  if not all_states:
    st_ref[...] = s


@functools.partial(jax.jit, static_argnames=("all_states", "interpret", "block_v",
                                             "num_warps"))
def gated_delta_recurrent(q, k, v, g, beta, state, *, all_states=False, interpret=False,
                          block_v=None, num_warps=4):
  """The recurrent kernel (module docstring): inputs and outputs as
  `pallas_kernels.gated_delta.gated_delta`. block_v: value columns per program (default
  `recurrent_block_v`)."""
  batch, seq, kh, dk = q.shape
  hv, dv = v.shape[2:]
  check_dims(dk, dv)
  group = hv // kh
  block_v = block_v or recurrent_block_v(batch, hv, dv)
  grid = (batch, hv, dv // block_v)
  qk_spec = pl.BlockSpec((None, seq, None, dk), lambda b, h, j: (b, 0, h // group, 0))
  v_spec = pl.BlockSpec((None, seq, None, block_v), lambda b, h, j: (b, 0, h, j))
  gb_spec = pl.BlockSpec((None, seq, None), lambda b, h, j: (b, 0, h))
  s_spec = pl.BlockSpec((None, None, dk, block_v), lambda b, h, j: (b, h, 0, j))
  if all_states:
    st_shape = jax.ShapeDtypeStruct((batch, seq, hv, dk, dv), jnp.float32)
    st_spec = pl.BlockSpec((None, seq, None, dk, block_v), lambda b, h, j: (b, 0, h, 0, j))
  else:
    st_shape = jax.ShapeDtypeStruct(state.shape, jnp.float32)
    st_spec = s_spec
  kernel = functools.partial(_recurrent_kernel, seq=seq, all_states=all_states)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[qk_spec, qk_spec, v_spec, gb_spec, gb_spec, s_spec],
      out_specs=[v_spec, st_spec],
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype), st_shape],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="gated_delta_recurrent_gpu",
  )(q, k, v, g, beta, state)


def _unit_lower_inverse(a, precision):
  """(I + a)^-1 for a strictly lower-triangular [C, C] a (C a power of two), by doubling:
  with T_s the inverse of the block diagonal of I + a in s x s blocks (T_1 = I) and E_s
  the lower-left s x s quarters of its 2s x 2s blocks, T_2s = T_s - T_s E_s T_s (exact:
  (T_s E_s)^2 = 0). log2(C) levels of two [C, C] dots; each level is the recursive block
  inversion a triangular solve would do, so it is as stable."""
  size = a.shape[0]
  row = lax.broadcasted_iota(jnp.int32, a.shape, 0)
  col = lax.broadcasted_iota(jnp.int32, a.shape, 1)
  inv = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)
  dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)
  s = 1
  while s < size:
    # Same 2s-block, row in its second half, column in its first.
    quarter = ((lax.div(row, 2 * s) == lax.div(col, 2 * s))
               & (lax.rem(lax.div(row, s), 2) == 1) & (lax.rem(lax.div(col, s), 2) == 0))
    e = jnp.where(quarter, a, 0.0)
    inv = inv - dot(dot(inv, e), inv)
    s *= 2
  return inv


def _chunked_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, st_ref, *, chunk,
                    num_chunks, precision):
  dk = q_ref.shape[-1]
  scale = dk ** -0.5
  row = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
  col = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
  causal = row >= col
  strict = row > col
  dot = functools.partial(lax.dot_general, precision=precision,
                          preferred_element_type=jnp.float32)
  nn = (((1,), (0,)), ((), ()))   # a @ b
  nt = (((1,), (1,)), ((), ()))   # a @ b^T
  tn = (((0,), (0,)), ((), ()))   # a^T @ b

  def body(c, s):
    rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    q = _normalised(q_ref[rows, :].astype(jnp.float32), scale)     # [C, dk]
    k = _normalised(k_ref[rows, :].astype(jnp.float32))
    v = v_ref[rows, :].astype(jnp.float32)                          # [C, BV]
    g = g_ref[rows]                                                 # [C]
    beta = b_ref[rows]
    cum = jnp.cumsum(g)
    total = jnp.sum(g)
    # exp(c_i - c_j) where j <= i (masked before the exp: above the diagonal it grows).
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], 0.0)),
                      0.0)
    kk = dot(k, k, nt)
    a = jnp.where(strict, kk * decay * beta[:, None], 0.0)
    inv = _unit_lower_inverse(a, precision)
    u = dot(inv, v * beta[:, None], nn)                             # [C, BV]
    w = dot(inv, k * (beta * jnp.exp(cum))[:, None], nn)            # [C, dk]
    delta = u - dot(w, s, nn)
    attn = dot(q, k, nt) * decay
    out = dot(q * jnp.exp(cum)[:, None], s, nn) + dot(attn, delta, nn)
    o_ref[rows, :] = out.astype(o_ref.dtype)
    k_decayed = k * jnp.exp(total - cum)[:, None]
    return s * jnp.exp(total) + dot(k_decayed, delta, tn)

  st_ref[...] = lax.fori_loop(0, num_chunks, body, s_ref[...])


@functools.partial(jax.jit, static_argnames=("chunk", "interpret", "block_v", "num_warps",
                                             "num_stages"))
def gated_delta_chunked(q, k, v, g, beta, state, *, chunk=64, interpret=False, block_v=None,
                        num_warps=8, num_stages=1):
  """The chunked kernel (module docstring): inputs and outputs as
  `pallas_kernels.gated_delta.gated_delta` without all_states. block_v: value columns
  per program (default `chunked_block_v`); 8 warps by default, as the chunk's [C, dk]
  and [C, C] f32 tiles live in registers beside the state (untuned: no GPU was at hand
  when this was written; launch/bench_gated_delta.py --sweep times the alternatives)."""
  batch, seq, kh, dk = q.shape
  hv, dv = v.shape[2:]
  check_dims(dk, dv)
  if chunk < 16 or chunk & (chunk - 1):
    raise ValueError(f"chunk must be a power of two >= 16 on GPU, got {chunk}.")
  group = hv // kh
  block_v = block_v or chunked_block_v(batch, hv, dv)
  pad = -seq % chunk
  if pad:
    widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
    q, k, v, g, beta = (jnp.pad(x, widths(x)) for x in (q, k, v, g, beta))
  padded = seq + pad
  grid = (batch, hv, dv // block_v)
  qk_spec = pl.BlockSpec((None, padded, None, dk), lambda b, h, j: (b, 0, h // group, 0))
  v_spec = pl.BlockSpec((None, padded, None, block_v), lambda b, h, j: (b, 0, h, j))
  gb_spec = pl.BlockSpec((None, padded, None), lambda b, h, j: (b, 0, h))
  s_spec = pl.BlockSpec((None, None, dk, block_v), lambda b, h, j: (b, h, 0, j))
  precision = lax.Precision.HIGHEST if v.dtype == jnp.float32 else lax.Precision.DEFAULT
  kernel = functools.partial(_chunked_kernel, chunk=chunk, num_chunks=padded // chunk,
                             precision=precision)
  out, final = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[qk_spec, qk_spec, v_spec, gb_spec, gb_spec, s_spec],
      out_specs=[v_spec, s_spec],
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype),
                 jax.ShapeDtypeStruct(state.shape, jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="gated_delta_chunked_gpu",
  )(q, k, v, g, beta, state)
  return (out[:, :seq] if pad else out), final
