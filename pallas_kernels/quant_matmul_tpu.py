"""Weight-only quantized matmul for TPUs: a Mosaic TPU kernel.

The public op and its semantics are documented in `pallas_kernels.quant_matmul`; this
module holds only the TPU kernel and its wrapper.

Grid (N block, M block, K block), K innermost, accumulating in an f32 VMEM scratch. The
pipeline DMAs the [block_k, block_n] 1-byte weight block into VMEM, where the kernel
converts it to x's dtype for the MXU, so HBM traffic stays one byte a weight. The scale
travels as [S, 1, N] so that a block of scale rows, (rows, 1, block_n), is a legal Mosaic
tile whatever S is (its last two dims are a full dim of 1 and a 128-multiple). With
S == 1 the scale row stays resident and multiplies the sum once at the end. Otherwise
block_k either divides the scale block K // S (one scale row per step, multiplying the
step's dot) or is a multiple of it (the step takes one dot per scale block, each
multiplied by its row; on a real TPU those slices of x should be 128-lane multiples, as
the DeepSeek 128-row blocks are). N is the outer, parallel axis: on chips with two
TensorCores each takes half the columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(x_ref, v_ref, s_ref, o_ref, acc_ref, *, num_k, group_rows, per_step_scale):
  kb = pl.program_id(2)

  @pl.when(kb == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
  dims = (((1,), (0,)), ((), ()))
  if not per_step_scale:
    acc_ref[...] += lax.dot_general(x_ref[...], v_ref[...].astype(x_ref.dtype), dims,
                                    precision=precision, preferred_element_type=jnp.float32)
  else:
    for g in range(s_ref.shape[0]):      # scale blocks in this K step (static)
      rows = slice(g * group_rows, (g + 1) * group_rows)
      part = lax.dot_general(x_ref[:, rows], v_ref[rows, :].astype(x_ref.dtype), dims,
                             precision=precision, preferred_element_type=jnp.float32)
      acc_ref[...] += part * s_ref[g]

  @pl.when(kb == num_k - 1)
  def _():
    acc = acc_ref[...]
    if not per_step_scale:
      acc = acc * s_ref[0]
    o_ref[...] = acc.astype(o_ref.dtype)


def _check_block(dim, size, block, name, unit):
  if size % block:
    raise ValueError(f"TPU quant_matmul needs {dim}={size} to be a multiple of "
                     f"{name}={block}.")
  if block != size and block % unit:
    raise ValueError(f"TPU quant_matmul needs {name}={block} to be a multiple of {unit} "
                     f"or the whole {dim}={size} (Mosaic tiles).")


def check_blocks(k, n, s, block):
  """ValueError naming the dimension when `block` cannot tile K, N with S scale rows."""
  bk = k // s
  bm, bn, chunk = block.block_m, block.block_n, block.block_k
  if bm % 8:
    raise ValueError(f"TPU quant_matmul needs block_m={bm} to be a multiple of 8 (Mosaic "
                     "tiles; x is padded to a multiple of block_m).")
  _check_block("N", n, bn, "block_n", 128)
  _check_block("K", k, chunk, "block_k", 128)
  if bk % chunk and chunk % bk:
    raise ValueError(f"TPU quant_matmul needs block_k={chunk} to divide or be a multiple "
                     f"of the scale block K // S = {k} // {s} = {bk}.")
  if block.num_splits != 1:
    raise ValueError("The TPU kernel runs one K split; set BlockConfig.num_splits=1.")


def quant_matmul_tpu(x, values, scale, *, block, interpret):
  """x [M, K], values [K, N] 1-byte, scale [S, N] f32 -> [M, N] in x.dtype."""
  (m, k), (s, n) = x.shape, scale.shape
  check_blocks(k, n, s, block)
  bk = k // s
  bm, bn, chunk = block.block_m, block.block_n, block.block_k
  num_k = k // chunk
  groups = max(1, chunk // bk)               # scale rows per K step
  padded = -(-m // bm) * bm
  xp = jnp.pad(x, ((0, padded - m), (0, 0))) if padded != m else x
  if s == 1:
    s_map = lambda j, i, kb: (0, 0, j)
  else:
    s_map = lambda j, i, kb: (kb * chunk // (bk * groups), 0, j)
  out = pl.pallas_call(
      functools.partial(_kernel, num_k=num_k, group_rows=min(chunk, bk),
                        per_step_scale=s > 1),
      grid=(n // bn, padded // bm, num_k),
      in_specs=[pl.BlockSpec((bm, chunk), lambda j, i, kb: (i, kb)),
                pl.BlockSpec((chunk, bn), lambda j, i, kb: (kb, j)),
                pl.BlockSpec((groups, 1, bn), s_map)],
      out_specs=pl.BlockSpec((bm, bn), lambda j, i, kb: (i, j)),
      out_shape=jax.ShapeDtypeStruct((padded, n), x.dtype),
      scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="quant_matmul_tpu",
  )(xp, values, scale.reshape(s, 1, n))
  return out[:m] if padded != m else out
