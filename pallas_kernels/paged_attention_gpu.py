"""Paged attention for NVIDIA GPUs: a Pallas (Triton backend) kernel with split-K.

The public op, the layouts and the masking rule are documented in
`pallas_kernels.paged_attention`; this module holds only the GPU kernel and its wrapper.

One program handles one (batch row, kv head, tile of packed query rows, KV split). It
reads its pages through the block table inside the kernel (no XLA gather of the KV),
`pages_per_block` pages at a time, and runs an online softmax over them. With more than
one split (flash-decoding) each program covers a contiguous share of the row's visible
pages and writes a normalised partial output plus its log-sum-exp; `combine_splits`
merges them. The share is computed from the actual kv_len, so short rows do not leave
programs idle behind long ones.

K and V are gathered as 2-D [block_k, D] masked loads with one table entry per row.
Gathering [pages, page_size, D] and reshaping to [block_k, D] computes the same thing,
but Triton then did not pipeline the loads: 2.3 TB/s against 4.1 TB/s at B=64, 4k
context on an H200 (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.paged_attention import MASK_VALUE, tile_kv_range, visible_mask


def _kernel(kv_lens_ref, bt_ref, q_ref, k_ref, v_ref, *out_refs, sm_scale, soft_cap,
            window, q_len, group, pages_per_block, num_splits):
  tile, split = pl.program_id(2), pl.program_id(3)
  rows, head_dim = q_ref.shape
  page_size = k_ref.shape[1]
  max_pages = bt_ref.shape[0]
  block_k = pages_per_block * page_size
  kv_capacity = max_pages * page_size
  kv_len = kv_lens_ref[0]

  lo, hi = tile_kv_range(tile, kv_len=kv_len, rows_per_block=rows, q_len=q_len,
                         group=group, window=window, kv_capacity=kv_capacity)
  first_page = lax.div(lo, page_size)
  end_page = lax.div(hi + page_size - 1, page_size)
  num_blocks = lax.div(end_page - first_page + pages_per_block - 1, pages_per_block)
  per_split = lax.div(num_blocks + num_splits - 1, num_splits)
  begin = split * per_split
  end = jnp.minimum(begin + per_split, num_blocks)

  q = q_ref[...]
  row = tile * rows + lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
  col = lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
  # 2-D [block_k, D] gathers, one table entry per row (module docstring says why).
  kv_shape = (block_k, head_dim)
  kv_row = lax.broadcasted_iota(jnp.int32, kv_shape, 0)
  slot_idx = lax.rem(kv_row, page_size)
  dim_idx = lax.broadcasted_iota(jnp.int32, kv_shape, 1)
  row_page = lax.div(jnp.arange(block_k, dtype=jnp.int32), page_size)
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

  def body(j, carry):
    acc, m_prev, l_prev = carry
    page0 = first_page + j * pages_per_block
    pos0 = page0 * page_size
    # Clamp into the table: the tail of the last block may run past max_pages.
    pages = bt_ref[jnp.minimum(page0 + row_page, max_pages - 1)]
    # Slots outside [lo, hi) are seen by no row of this tile and may hold anything (NaN
    # included): the masked load reads zeros there (and skips the memory traffic), so
    # 0 * NaN never reaches the accumulator.
    kv_mask = (pos0 + kv_row >= lo) & (pos0 + kv_row < hi)
    # Whole-array indices (no slices): the interpreter's masked load needs them.
    at = (jnp.broadcast_to(pages[:, None], kv_shape), slot_idx, dim_idx)
    k = pltriton.load(k_ref.at[at], mask=kv_mask, other=0.0)
    v = pltriton.load(v_ref.at[at], mask=kv_mask, other=0.0)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    mask = visible_mask(row, pos0 + col, kv_len=kv_len, q_len=q_len, group=group,
                        window=window, kv_capacity=kv_capacity)
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_next, l_prev * alpha + p.sum(axis=1)

  acc = jnp.zeros((rows, head_dim), jnp.float32)
  m = jnp.full((rows,), MASK_VALUE, jnp.float32)
  l = jnp.zeros((rows,), jnp.float32)
  acc, m, l = lax.fori_loop(begin, end, body, (acc, m, l))

  store_rows(out_refs, acc, m, l)


def store_rows(out_refs, acc, m, l):
  """Normalise a tile's f32 accumulator and store it: the output alone (one split), or
  the normalised partial and its log-sum-exp for `combine_splits` (several). Rows that
  saw nothing store 0 (lse -inf); a NaN in a visible position stays NaN."""
  seen = l != 0.0
  out = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0)
  if len(out_refs) == 1:
    (o_ref,) = out_refs
    o_ref[...] = out.astype(o_ref.dtype)
  else:
    o_ref, lse_ref = out_refs
    o_ref[...] = out
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def combine_splits(o_parts, lse):
  """Merge split-K partials: o_parts [S, ..., D] (normalised), lse [S, ...] (-inf: empty)."""
  top = lse.max(axis=0)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - top), 0.0)
  den = w.sum(axis=0)
  o = (w[..., None] * o_parts).sum(axis=0)
  return o / jnp.where(den > 0.0, den, 1.0)[..., None]


def paged_attention_gpu(q_packed, k_pages, v_pages, block_tables, kv_lens, *, q_len,
                        group, sm_scale, soft_cap, window, pages_per_block, num_splits,
                        rows_per_block, num_warps, num_stages, interpret):
  """q_packed [B, KVH, R, D] (R a multiple of rows_per_block) -> f32-combined [B, KVH, R, D]."""
  batch, kv_heads, rows, head_dim = q_packed.shape
  _, _, page_size, _ = k_pages.shape
  max_pages = block_tables.shape[1]
  for name, n in (("page_size", page_size), ("head_dim", head_dim),
                  ("pages_per_block", pages_per_block), ("rows_per_block", rows_per_block)):
    if n & (n - 1):
      raise ValueError(f"GPU paged attention needs a power-of-two {name}, got {n}.")
  if rows_per_block < 16 or head_dim < 16 or pages_per_block * page_size < 16:
    raise ValueError("GPU paged attention needs rows_per_block, head_dim and "
                     f"pages_per_block * page_size >= 16 (tensor-core tiles); got "
                     f"{rows_per_block}, {head_dim}, {pages_per_block * page_size}.")
  assert rows % rows_per_block == 0, (rows, rows_per_block)
  grid = (batch, kv_heads, rows // rows_per_block, num_splits)

  kernel = functools.partial(
      _kernel, sm_scale=sm_scale, soft_cap=soft_cap, window=window, q_len=q_len,
      group=group, pages_per_block=pages_per_block, num_splits=num_splits)
  q_spec = pl.BlockSpec((None, None, rows_per_block, head_dim), lambda b, h, t, s: (b, h, t, 0))
  page_spec = pl.BlockSpec((None, *k_pages.shape[1:]), lambda b, h, t, s: (h, 0, 0, 0))
  in_specs = [
      pl.BlockSpec((1,), lambda b, h, t, s: (b,)),
      pl.BlockSpec((None, max_pages), lambda b, h, t, s: (b, 0)),
      q_spec, page_spec, page_spec,
  ]
  if num_splits == 1:
    out_shape = [jax.ShapeDtypeStruct(q_packed.shape, q_packed.dtype)]
    out_specs = [q_spec]
  else:
    out_shape = [jax.ShapeDtypeStruct((num_splits, *q_packed.shape), jnp.float32),
                 jax.ShapeDtypeStruct((num_splits, batch, kv_heads, rows), jnp.float32)]
    out_specs = [
        pl.BlockSpec((None, None, None, rows_per_block, head_dim),
                     lambda b, h, t, s: (s, b, h, t, 0)),
        pl.BlockSpec((None, None, None, rows_per_block), lambda b, h, t, s: (s, b, h, t)),
    ]
  outs = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="paged_attention_gpu",
  )(kv_lens, block_tables, q_packed, k_pages, v_pages)
  if num_splits == 1:
    return outs[0]
  return combine_splits(*outs).astype(q_packed.dtype)
