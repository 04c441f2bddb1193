"""Weight-only quantized matmul for NVIDIA GPUs: a Pallas (Triton backend) kernel.

The public op and its semantics are documented in `pallas_kernels.quant_matmul`; this
module holds only the GPU kernel and its wrapper.

Grid (M block, N block, K split). One program streams its [K / num_splits, block_n] slab
of 1-byte weights in [block_k, block_n] chunks, converts each chunk to x's dtype after
the load (so HBM traffic stays one byte a weight) and accumulates dots in f32. block_k
divides the scale block K // S, so a chunk lies in one scale block: with S > 1 each
chunk's partial product is multiplied by its block's scale row before it is added; with
S == 1 the scale multiplies the sum once at the end.

With block_m of 8 or fewer (the default at M = 1) `_gemv_kernel` runs instead: the same
grid and chunks, but products summed on CUDA cores in f32, with no 16-row tensor-core tile
and no operand layout change for the dot.

Rows: a Triton dot needs at least 16 rows, and decode has M = 1..64. A program indexes
x with row ids clamped to M - 1 and stores its result through the same ids, so rows past
M recompute row M - 1 and write its own value to it again: no padded copy of x, and an
output of exactly M rows that needs no slicing. At decode a batch-1 GEMV has only
N / block_n programs; K splits fill the SMs, each writing an f32 partial sum of the M
real rows, and the wrapper adds them (one small XLA reduction that also casts).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

GEMV_MAX_ROWS = 8  # block_m up to this runs on CUDA cores (_gemv_kernel)


def _program_span(x_ref, block_m, num_k, num_splits):
  """This program's rows of x (clamped to M - 1) and its split's K chunks [begin, end)."""
  i, split = pl.program_id(0), pl.program_id(2)
  per_split = -(-num_k // num_splits)
  begin = split * per_split
  end = jnp.minimum(begin + per_split, num_k)
  rows = jnp.minimum(i * block_m + jnp.arange(block_m, dtype=jnp.int32), x_ref.shape[0] - 1)
  return rows, begin, end


def _kernel(x_ref, v_ref, s_ref, o_ref, *, block_m, block_k, group_chunks, num_k,
            num_splits):
  rows, begin, end = _program_span(x_ref, block_m, num_k, num_splits)
  block_n = o_ref.shape[-1]
  precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
  per_chunk_scale = s_ref.shape[0] > 1
  half = f16_dot(x_ref.dtype, v_ref.dtype, s_ref.shape[0])
  if half:
    # A power of two per row (and split) that brings the row's largest |x| to 2^14:
    # x / row_scale is exact and inside float16's range.
    def amax(c, top):
      xb = x_ref[rows, pl.ds(pl.multiple_of(c * block_k, block_k), block_k)]
      return jnp.maximum(top, jnp.abs(xb.astype(jnp.float32)).max(axis=1))
    top = lax.fori_loop(begin, end, amax, jnp.zeros((block_m,), jnp.float32))
    row_scale = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(top, 2.0 ** -100))) - 14.0)
    inv_scale = 1.0 / row_scale

  def body(c, acc):
    k0 = pl.multiple_of(c * block_k, block_k)
    xb = x_ref[rows, pl.ds(k0, block_k)]
    if half:  # fp8 -> f16 is one packed conversion; -> bf16 goes through f32
      xb = (xb.astype(jnp.float32) * inv_scale[:, None]).astype(jnp.float16)
    vb = v_ref[pl.ds(k0, block_k), :].astype(xb.dtype)    # 1 byte read, exact convert
    part = lax.dot_general(xb, vb, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)
    if per_chunk_scale:
      part = part * s_ref[c // group_chunks, :][None, :]
    return acc + part

  acc = lax.fori_loop(begin, end, body, jnp.zeros((block_m, block_n), jnp.float32))
  if half:
    acc = acc * row_scale[:, None]
  if not per_chunk_scale:
    acc = acc * s_ref[0, :][None, :]
  # Rows past M carry row M - 1's value: storing them again is harmless.
  o_ref[rows, :] = acc.astype(o_ref.dtype)


def f16_dot(x_dtype, v_dtype, scale_rows: int) -> bool:
  """Whether the tensor-core path multiplies in float16: per-channel fp8 weights under
  bf16 x (x rescaled per row by a power of two, exact, into f16's range; f16's mantissa
  is finer than bf16's, so the products lose nothing against a bf16 dot). It speeds up
  per-channel fp8; block-scaled fp8 measured slower with it, so it keeps the bf16 dot
  (docs/DECISIONS.md, "Quantized weights")."""
  return (scale_rows == 1 and jnp.dtype(x_dtype) == jnp.bfloat16
          and jnp.dtype(v_dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)))


def widen(v, dtype):
  """1-byte weights to `dtype`, exactly, for the CUDA-core path. int8 skips the
  int-to-float conversion instruction (I2F, 16 results per clock per SM on recent NVIDIA
  GPUs): the weight is sign-extended to int32 and added to the bits of 1.5 * 2^23, whose
  ulp is 1, and that float is subtracted again (|w| <= 128, so any float dtype holds the
  result exactly). It is faster than the conversion instruction on the CUDA-core path
  and slower under the tensor-core dot, so `_kernel` keeps the plain convert
  (docs/DECISIONS.md, "Quantized weights")."""
  if v.dtype != jnp.int8 or not jnp.issubdtype(dtype, jnp.floating):
    return v.astype(dtype)
  bits = v.astype(jnp.int32) + jnp.int32(0x4B400000)
  w = lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(12582912.0)
  return w.astype(dtype)


def _gemv_kernel(x_ref, v_ref, s_ref, o_ref, *, block_m, block_k, group_chunks, num_k,
                 num_splits):
  """block_m <= GEMV_MAX_ROWS rows on CUDA cores: no tensor-core tile, so no 16-row
  padding and no operand layout change. One row keeps a [block_k, block_n] f32
  accumulator of products and reduces it over K once, after the loop; a few rows reduce
  each chunk's products over K as they go."""
  rows, begin, end = _program_span(x_ref, block_m, num_k, num_splits)
  block_n = o_ref.shape[-1]
  per_chunk_scale = s_ref.shape[0] > 1

  def body(c, acc):
    k0 = pl.multiple_of(c * block_k, block_k)
    w = widen(v_ref[pl.ds(k0, block_k), :], jnp.float32)       # 1 byte read, exact
    if per_chunk_scale:
      w = w * s_ref[c // group_chunks, :][None, :]
    xb = x_ref[rows, pl.ds(k0, block_k)].astype(jnp.float32)   # [block_m, block_k]
    if block_m == 1:
      return acc + xb[0][:, None] * w
    return acc + jnp.sum(xb[:, :, None] * w[None, :, :], axis=1)

  shape = (block_k, block_n) if block_m == 1 else (block_m, block_n)
  acc = lax.fori_loop(begin, end, body, jnp.zeros(shape, jnp.float32))
  if block_m == 1:
    acc = jnp.sum(acc, axis=0)[None, :]
  if not per_chunk_scale:
    acc = acc * s_ref[0, :][None, :]
  o_ref[rows, :] = acc.astype(o_ref.dtype)


def check_blocks(k, n, s, block):
  """ValueError naming the dimension when `block` cannot tile K, N with S scale rows."""
  bk = k // s
  bm, bn, chunk = block.block_m, block.block_n, block.block_k
  if bm & (bm - 1) or bm > GEMV_MAX_ROWS and bm < 16:
    raise ValueError(f"GPU quant_matmul needs a power-of-two block_m: 1..{GEMV_MAX_ROWS} "
                     f"(rows on CUDA cores) or >= 16 (Triton tensor-core tiles), got {bm}.")
  for name, v in (("block_n", bn), ("block_k", chunk)):
    if v < 16 or v & (v - 1):
      raise ValueError(f"GPU quant_matmul needs a power-of-two {name} >= 16 (Triton "
                       f"tiles), got {v}.")
  if n % bn:
    raise ValueError(f"GPU quant_matmul needs N={n} to be a multiple of block_n={bn}; "
                     "pick a smaller power-of-two block (partial blocks are not masked).")
  if bk % chunk:
    raise ValueError(f"GPU quant_matmul needs the scale block K // S = {k} // {s} = {bk} "
                     f"to be a multiple of block_k={chunk} (a K chunk must not straddle "
                     "two scale blocks).")


def quant_matmul_gpu(x, values, scale, *, block, interpret):
  """x [M, K], values [K, N] 1-byte, scale [S, N] f32 -> [M, N] in x.dtype."""
  (m, k), (s, n) = x.shape, scale.shape
  check_blocks(k, n, s, block)
  bm, bn, chunk = block.block_m, block.block_n, block.block_k
  bk = k // s
  num_k = k // chunk
  splits = min(block.num_splits, num_k)
  grid = (pl.cdiv(m, bm), n // bn, splits)
  kernel = functools.partial(_gemv_kernel if bm < 16 else _kernel, block_m=bm,
                             block_k=chunk, group_chunks=bk // chunk, num_k=num_k,
                             num_splits=splits)
  in_specs = [
      pl.BlockSpec((m, k), lambda i, j, sp: (0, 0)),
      pl.BlockSpec((k, bn), lambda i, j, sp: (0, j)),
      pl.BlockSpec((s, bn), lambda i, j, sp: (0, j)),
  ]
  # The output block spans all M rows; each program stores its own rows by index.
  if splits == 1:
    out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
    out_spec = pl.BlockSpec((m, bn), lambda i, j, sp: (0, j))
  else:
    out_shape = jax.ShapeDtypeStruct((splits, m, n), jnp.float32)
    out_spec = pl.BlockSpec((None, m, bn), lambda i, j, sp: (sp, 0, j))
  out = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_spec,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=block.num_warps,
                                              num_stages=block.num_stages),
      interpret=interpret,
      name="quant_matmul_gpu",
  )(x, values, scale)
  if splits == 1:
    return out
  return out.sum(axis=0).astype(x.dtype)
