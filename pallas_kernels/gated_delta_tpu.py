"""Gated delta rule for TPUs: Mosaic TPU kernels for the recurrent form (decode, verify)
and the chunked form (prefill).

The op, the layouts and the math are documented in `pallas_kernels.gated_delta`; this
module holds only the TPU kernels and their wrappers. The wrappers lay q, k and v out
head-major ([B, H, T, d]: a block's last two dims are then whole (positions, head dim)
tiles, where the op's [B, T, H, d] would need one-row blocks of a head) and g, beta as
rows of positions; the outputs come back to the op's layout by an XLA transpose. The
states keep their layout: a [dk, dv] state is a whole tile either way.

Recurrent kernel: grid (batch row, block of value heads: `recurrent_heads`); each
head's [dk, dv] f32 state stays in VMEM / vregs for the T steps, unrolled (T <=
RECURRENT_MAX_T), a fori_loop over the block's heads around them. Each step is VPU
work, exact f32: k and q are needed as columns (one value per sublane, against the
state's rows) and arrive as rows, so `_column` turns a row into a column with a diagonal
select and a lane reduction rather than a transpose; g_t and beta_t come out of their
rows by a select and a reduction too (`_lane`).

Chunked kernel: grid (batch row, value head, chunk), the chunk axis sequential
("arbitrary"): the state lives in a VMEM scratch across the chunks of a head, loaded
from the input at chunk 0 and stored at the last. Per chunk: the decays, the WY system
solved by doubling (`_unit_lower_inverse`) and the chunk applied with MXU dots at
HIGHEST precision (f32 accuracy; untuned: no TPU was available, only interpret mode has
run these kernels).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

L2_EPS = 1e-6  # as pallas_kernels.gated_delta.L2_EPS (transformers' l2norm)
# State bytes a recurrent program reads and writes (double-buffered: twice this in VMEM,
# a quarter of v5e's 16 MiB default scoped VMEM): 16 heads of [128, 128] f32 in and out.
STATE_BLOCK_BYTES = 2 << 20
_HIGHEST = lax.Precision.HIGHEST


def check_dims(dk, dv):
  """ValueError unless dk and dv are multiples of 8 (whole sublane tiles of a state;
  the lane dim is a full block dim, so any multiple of 8 tiles)."""
  for name, n in (("dk", dk), ("dv", dv)):
    if n < 8 or n % 8:
      raise ValueError(f"the TPU gated-delta kernels need a head dim that is a multiple of "
                       f"8 (sublane tiles of the f32 state); got {name}={n}.")


def _normalised(x, scale=1.0):
  """Rows of x (f32) times rsqrt(sum(x * x) + eps) over the lanes, times scale."""
  return x * (lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS) * scale)


def _column(row):
  """A [1, n] row as an [n, 1] column: the diagonal of its sublane broadcast, summed
  over the lanes (select + reduce, no transpose)."""
  n = row.shape[1]
  square = jnp.broadcast_to(row, (n, n))
  eye = lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(
      jnp.int32, (n, n), 1)
  return jnp.sum(jnp.where(eye, square, 0.0), axis=1, keepdims=True)


def _row(column):
  """An [n, 1] column as a [1, n] row (the transpose `_column` undoes)."""
  n = column.shape[0]
  square = jnp.broadcast_to(column, (n, n))
  eye = lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(
      jnp.int32, (n, n), 1)
  return jnp.sum(jnp.where(eye, square, 0.0), axis=0, keepdims=True)


def _lane(row, t):
  """Element t (static) of a [1, n] row, as [1, 1]."""
  lane = lax.broadcasted_iota(jnp.int32, row.shape, 1)
  return jnp.sum(jnp.where(lane == t, row, 0.0), axis=1, keepdims=True)


def _recurrent_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, st_ref, *, seq,
                      group, all_states):
  heads, dk = s_ref.shape[0], q_ref.shape[-1]

  def head(i, carry):
    kh = lax.div(i, group)  # this value head's key head within the block
    g = g_ref[i]                                                   # [1, T]
    beta = b_ref[i]
    s = s_ref[i]                                                   # [dk, dv]
    for t in range(seq):
      at = pl.ds(t, 1)  # position t's row of q, k, v: [1, d]
      q_col = _column(_normalised(q_ref[kh, at, :].astype(jnp.float32), dk ** -0.5))
      k_col = _column(_normalised(k_ref[kh, at, :].astype(jnp.float32)))  # [dk, 1]
      s = s * jnp.exp(_lane(g, t))
      kv_mem = jnp.sum(s * k_col, axis=0, keepdims=True)           # [1, dv]
      delta = (v_ref[i, at, :].astype(jnp.float32) - kv_mem) * _lane(beta, t)
      s = s + k_col * delta
      o_ref[i, at, :] = jnp.sum(s * q_col, axis=0, keepdims=True).astype(o_ref.dtype)
      if all_states:
        st_ref[t, i] = s
    if not all_states:
      st_ref[i] = s
    return carry

  lax.fori_loop(0, heads, head, 0)


def recurrent_heads(kh, group, dk, dv, seq, all_states):
  """Value heads per recurrent program: group * m for the largest m dividing Hk whose
  state bytes (the state read, and the state or the T states written) fit
  STATE_BLOCK_BYTES, at least one group. Each grid step costs a fixed overhead, so a
  program takes many [dk, dv] states rather than one; whole groups, so that a program's
  key heads are a contiguous block too."""
  per_head = dk * dv * 4 * (1 + (seq if all_states else 1))
  m = max([d for d in range(1, kh + 1)
           if kh % d == 0 and group * d * per_head <= STATE_BLOCK_BYTES] or [1])
  return group * m


def _head_major(q, k, v, g, beta):
  """q, k [B, Hk, T, dk], v [B, Hv, T, dv], g and beta [B, Hv, 1, T]."""
  q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
  g, beta = (x.transpose(0, 2, 1)[:, :, None, :] for x in (g, beta))
  return q, k, v, g, beta


@functools.partial(jax.jit, static_argnames=("all_states", "interpret", "heads"))
def gated_delta_recurrent(q, k, v, g, beta, state, *, all_states=False, interpret=False,
                          heads=None):
  """The recurrent kernel (module docstring): inputs and outputs as
  `pallas_kernels.gated_delta.gated_delta`. heads: value heads per program, a multiple
  of Hv // Hk dividing Hv (default `recurrent_heads`)."""
  batch, seq, kh, dk = q.shape
  hv, dv = v.shape[2:]
  check_dims(dk, dv)
  group = hv // kh
  heads = heads or recurrent_heads(kh, group, dk, dv, seq, all_states)
  if heads % group or hv % heads:
    raise ValueError(f"heads={heads} must be a multiple of Hv // Hk = {group} dividing "
                     f"Hv = {hv}.")
  q, k, v, g, beta = _head_major(q, k, v, g, beta)
  qk_spec = pl.BlockSpec((None, heads // group, seq, dk), lambda b, j: (b, j, 0, 0))
  v_spec = pl.BlockSpec((None, heads, seq, dv), lambda b, j: (b, j, 0, 0))
  gb_spec = pl.BlockSpec((None, heads, 1, seq), lambda b, j: (b, j, 0, 0))
  s_spec = pl.BlockSpec((None, heads, dk, dv), lambda b, j: (b, j, 0, 0))
  if all_states:
    st_shape = jax.ShapeDtypeStruct((batch, seq, hv, dk, dv), jnp.float32)
    st_spec = pl.BlockSpec((None, seq, heads, dk, dv), lambda b, j: (b, 0, j, 0, 0))
  else:
    st_shape = jax.ShapeDtypeStruct(state.shape, jnp.float32)
    st_spec = s_spec
  kernel = functools.partial(_recurrent_kernel, seq=seq, group=group, all_states=all_states)
  out, states = pl.pallas_call(
      kernel,
      grid=(batch, hv // heads),
      in_specs=[qk_spec, qk_spec, v_spec, gb_spec, gb_spec, s_spec],
      out_specs=[v_spec, st_spec],
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype), st_shape],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="gated_delta_recurrent_tpu",
  )(q, k, v, g, beta, state)
  return out.transpose(0, 2, 1, 3), states


def _unit_lower_inverse(a):
  """(I + a)^-1 for a strictly lower-triangular [C, C] a (C a power of two), by doubling
  (as the GPU kernel: T_2s = T_s - T_s E_s T_s, E_s the lower-left quarters of the 2s
  blocks). Block masks by shifts: Mosaic has no vector integer divide."""
  size = a.shape[0]
  row = lax.broadcasted_iota(jnp.int32, a.shape, 0)
  col = lax.broadcasted_iota(jnp.int32, a.shape, 1)
  inv = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)
  dot = functools.partial(jnp.dot, precision=_HIGHEST, preferred_element_type=jnp.float32)
  level = 0
  while (1 << level) < size:
    r, c = lax.shift_right_logical(row, level), lax.shift_right_logical(col, level)
    quarter = ((lax.shift_right_logical(r, 1) == lax.shift_right_logical(c, 1))
               & ((r & 1) == 1) & ((c & 1) == 0))
    inv = inv - dot(dot(inv, jnp.where(quarter, a, 0.0)), inv)
    level += 1
  return inv


def _chunked_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, st_ref, s_scratch):
  c = pl.program_id(2)

  @pl.when(c == 0)
  def _():
    s_scratch[...] = s_ref[...]

  chunk, dk = q_ref.shape
  q = _normalised(q_ref[...].astype(jnp.float32), dk ** -0.5)     # [C, dk]
  k = _normalised(k_ref[...].astype(jnp.float32))
  v = v_ref[...].astype(jnp.float32)                               # [C, dv]
  g = g_ref[...]                                                   # [1, C]
  beta = _column(b_ref[...])                                       # [C, 1]
  row = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
  col = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
  causal = row >= col
  # Cumulative log decay as a column (row i: sum of g_j, j <= i) and as a row.
  cum = jnp.sum(jnp.where(causal, jnp.broadcast_to(g, (chunk, chunk)), 0.0), axis=1,
                keepdims=True)
  cum_row = _row(cum)
  total = jnp.sum(g, axis=1, keepdims=True)                        # [1, 1]
  decay = jnp.where(causal, jnp.exp(jnp.where(causal, cum - cum_row, 0.0)), 0.0)
  dot = functools.partial(lax.dot_general, precision=_HIGHEST,
                          preferred_element_type=jnp.float32)
  nn = (((1,), (0,)), ((), ()))   # a @ b
  nt = (((1,), (1,)), ((), ()))   # a @ b^T
  tn = (((0,), (0,)), ((), ()))   # a^T @ b
  a = jnp.where(row > col, dot(k, k, nt) * decay * beta, 0.0)
  inv = _unit_lower_inverse(a)
  s = s_scratch[...]
  u = dot(inv, v * beta, nn)
  w = dot(inv, k * (beta * jnp.exp(cum)), nn)
  delta = u - dot(w, s, nn)
  attn = dot(q, k, nt) * decay
  out = dot(q * jnp.exp(cum), s, nn) + dot(attn, delta, nn)
  o_ref[...] = out.astype(o_ref.dtype)
  s = s * jnp.exp(total) + dot(k * jnp.exp(total - cum), delta, tn)
  s_scratch[...] = s

  @pl.when(c == pl.num_programs(2) - 1)
  def _():
    st_ref[...] = s


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"))
def gated_delta_chunked(q, k, v, g, beta, state, *, chunk=64, interpret=False):
  """The chunked kernel (module docstring): inputs and outputs as
  `pallas_kernels.gated_delta.gated_delta` without all_states."""
  batch, seq, kh, dk = q.shape
  hv, dv = v.shape[2:]
  check_dims(dk, dv)
  if chunk < 8 or chunk & (chunk - 1):
    raise ValueError(f"chunk must be a power of two >= 8 on TPU, got {chunk}.")
  group = hv // kh
  pad = -seq % chunk
  if pad:
    widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
    q, k, v, g, beta = (jnp.pad(x, widths(x)) for x in (q, k, v, g, beta))
  num_chunks = (seq + pad) // chunk
  q, k, v, g, beta = _head_major(q, k, v, g, beta)
  # g, beta [B, Hv, 1, T] -> [B, Hv, n, 1, C]: one (1, C) row a chunk, a whole block.
  g, beta = (x.reshape(batch, hv, num_chunks, 1, chunk) for x in (g, beta))
  qk_spec = pl.BlockSpec((None, None, chunk, dk), lambda b, h, c: (b, h // group, c, 0))
  v_spec = pl.BlockSpec((None, None, chunk, dv), lambda b, h, c: (b, h, c, 0))
  gb_spec = pl.BlockSpec((None, None, None, 1, chunk), lambda b, h, c: (b, h, c, 0, 0))
  s_spec = pl.BlockSpec((None, None, dk, dv), lambda b, h, c: (b, h, 0, 0))
  out, final = pl.pallas_call(
      _chunked_kernel,
      grid=(batch, hv, num_chunks),
      in_specs=[qk_spec, qk_spec, v_spec, gb_spec, gb_spec, s_spec],
      out_specs=[v_spec, s_spec],
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype),
                 jax.ShapeDtypeStruct(state.shape, jnp.float32)],
      scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="gated_delta_chunked_tpu",
  )(q, k, v, g, beta, state)
  return out.transpose(0, 2, 1, 3)[:, :seq], final
