"""Paged MLA for NVIDIA GPUs: a Pallas (Triton backend) kernel with split-K.

The public op, the layouts and the masking rule are documented in
`pallas_kernels.paged_mla`; this module holds only the GPU kernel and its wrapper.

One program handles one (tile of packed query rows, KV split, batch row). It reads its
pages through the block table inside the kernel (no XLA gather of the cache),
`block_k` kv positions at a time, and runs an online softmax over them. Each block is
loaded once as two 2-D gathers, the latent part [block_k, v_dim] and the rope part
[block_k, Dk - v_dim], one table entry per position, so a block may span several
pages or part of one and any page size works. The scores are q_lat . lat^T +
q_rope . rope^T and the values are the same latent tile, so the page bytes cross
device memory once for both. Splitting Dk into those two power-of-two parts keeps the
Triton tiles power-of-two shaped (576 = 512 + 64 is not a power of two itself); a part
that is not a power of two >= 16 is padded up to one by masked loads (zeros).

Grid order: Pallas launches the first grid axis fastest, so the grid is (row tile,
split, batch row): the tiles that read the same pages of one batch row run side by side
and the second and later reads of a page hit L2. With more than one split
(flash-decoding) each program covers a contiguous share of its tile's visible blocks
and writes a normalised partial output plus its log-sum-exp, merged by the
paged-attention `combine_splits`. Within a program, the blocks that every row of the
tile sees whole run a loop body without masks; only the causal tail is masked.

At H = 128 decode and verify are both bound by the tile's matmul rate, not the page
reads, and that rate sits well below XLA's bf16 matmul on the same device
(launch/bench_paged_mla.py; docs/BENCHMARKS.md, "Kernels"). Why was not profiled (the
64 x 512 f32 accumulator per tile, 128 registers a thread, is the first suspect: 128-row
tiles did not compile for lack of registers).

fp8 pages are loaded as 1-byte values and converted in registers right after the gather
(half the HBM bytes of bf16). Under bf16 queries the tile computes in float16: e4m3 ->
f16 is one packed conversion while e4m3 -> bf16 goes through f32 (two more a value);
the scaled q and the softmax weights fit f16's range at attention's magnitudes, and its
mantissa is finer than bf16's. The dots accumulate in f32 either way. The kv_scale
factors never reach this kernel (`paged_mla` folds them into q and the output).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import (MASK_VALUE, combine_splits, gpu_dim_tile, store_rows,
                                   tile_full_range, tile_kv_range, visible_mask)


def _load_cols(ref, start, width, tile):
  """ref[:, start:start + width] as a [rows, tile] array, zero past `width`."""
  rows = ref.shape[0]
  if tile == width:
    return ref[:, pl.ds(start, width)]
  shape = (rows, tile)
  col = lax.broadcasted_iota(jnp.int32, shape, 1)
  at = (lax.broadcasted_iota(jnp.int32, shape, 0), start + col)
  return pltriton.load(ref.at[at], mask=col < width, other=0.0)


def _gather_kv(kv_ref, page, slot, live, start, width, tile):
  """kv_ref[page[k], slot[k], start:start + width] for each k: [block_k, tile].

  Positions that are not `live` (None: all are) and padding columns read as zeros,
  without touching memory: what the pages hold there (NaN included) never reaches a dot.
  """
  shape = (page.shape[0], tile)
  col = lax.broadcasted_iota(jnp.int32, shape, 1)
  mask = None if live is None else jnp.broadcast_to(live[:, None], shape)
  if tile != width:
    mask = col < width if mask is None else mask & (col < width)
  # Whole-array indices (no slices): the interpreter's masked load needs them.
  at = (jnp.broadcast_to(page[:, None], shape), jnp.broadcast_to(slot[:, None], shape),
        start + col)
  if mask is None:
    return pltriton.load(kv_ref.at[at])
  return pltriton.load(kv_ref.at[at], mask=mask, other=0.0)


def _kernel(kv_lens_ref, bt_ref, q_ref, kv_ref, *out_refs, sm_scale, q_len, num_heads,
            v_dim, block_k, num_splits):
  tile, split = pl.program_id(0), pl.program_id(1)
  rows, head_dim = q_ref.shape
  page_size = kv_ref.shape[1]
  max_pages = bt_ref.shape[0]
  kv_capacity = max_pages * page_size
  rope_dim = head_dim - v_dim
  v_tile, r_tile = gpu_dim_tile(v_dim), gpu_dim_tile(rope_dim)
  kv_len = kv_lens_ref[0]

  # Causal: the tile's visible range starts at 0; hi is its last row's end. Blocks below
  # its first row's end are seen whole by every row and skip all masking.
  ranges = dict(kv_len=kv_len, rows_per_block=rows, q_len=q_len, group=num_heads,
                window=None, kv_capacity=kv_capacity)
  _, hi = tile_kv_range(tile, **ranges)
  _, full_end = tile_full_range(tile, **ranges)
  num_blocks = lax.div(hi + block_k - 1, block_k)
  full_blocks = lax.div(full_end, block_k)
  per_split = lax.div(num_blocks + num_splits - 1, num_splits)
  begin = split * per_split
  end = jnp.minimum(begin + per_split, num_blocks)

  # fp8 pages under bf16 queries compute in float16 (module docstring).
  fp8_under_bf16 = kv_ref.dtype == jnp.float8_e4m3fn and q_ref.dtype == jnp.bfloat16
  compute = jnp.float16 if fp8_under_bf16 else q_ref.dtype
  q_lat = _load_cols(q_ref, 0, v_dim, v_tile).astype(compute)
  q_rope = _load_cols(q_ref, v_dim, rope_dim, r_tile).astype(compute) if rope_dim else None
  precision = lax.Precision.HIGHEST if compute == jnp.float32 else None
  row = tile * rows + lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
  col = lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
  offsets = jnp.arange(block_k, dtype=jnp.int32)
  nt = (((1,), (1,)), ((), ()))   # a @ b.T
  nn = (((1,), (0,)), ((), ()))   # a @ b

  def body(j, carry, masked):
    acc, m_prev, l_prev = carry
    pos0 = j * block_k
    pos = pos0 + offsets
    # Clamp into the table: the tail of the last block may run past max_pages.
    page = bt_ref[jnp.minimum(lax.div(pos, page_size), max_pages - 1)]
    slot = lax.rem(pos, page_size)
    live = pos < hi if masked else None
    # fp8 pages: to the compute dtype right after the load (exact for e4m3 values).
    lat = _gather_kv(kv_ref, page, slot, live, 0, v_dim, v_tile).astype(compute)
    s = lax.dot_general(q_lat, lat, nt, precision=precision,
                        preferred_element_type=jnp.float32)
    if rope_dim:
      rope = _gather_kv(kv_ref, page, slot, live, v_dim, rope_dim, r_tile).astype(compute)
      s += lax.dot_general(q_rope, rope, nt, precision=precision,
                           preferred_element_type=jnp.float32)
    s = s * sm_scale
    if masked:
      mask = visible_mask(row, pos0 + col, kv_len=kv_len, q_len=q_len, group=num_heads,
                          window=None, kv_capacity=kv_capacity)
      s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next[:, None])
    if masked:
      p = jnp.where(mask, p, 0.0)
    # The values are the latent tile already loaded for the scores.
    pv = lax.dot_general(p.astype(lat.dtype), lat, nn, precision=precision,
                         preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_next, l_prev * alpha + p.sum(axis=1)

  acc = jnp.zeros((rows, v_tile), jnp.float32)
  m = jnp.full((rows,), MASK_VALUE, jnp.float32)
  l = jnp.zeros((rows,), jnp.float32)
  mid = jnp.clip(full_blocks, begin, end)
  carry = lax.fori_loop(begin, mid, functools.partial(body, masked=False), (acc, m, l))
  acc, m, l = lax.fori_loop(mid, end, functools.partial(body, masked=True), carry)

  store_rows(out_refs, acc, m, l)


def paged_mla_gpu(q_packed, kv_pages, block_tables, kv_lens, *, q_len, num_heads, v_dim,
                  sm_scale, block_k, num_splits, rows_per_block, num_warps, num_stages,
                  interpret):
  """q_packed [B, R, Dk] (R a multiple of rows_per_block), pages in q's dtype or fp8 ->
  [B, R, v_tile] in q's dtype.

  v_tile = gpu_dim_tile(v_dim); columns past v_dim are zero.
  """
  batch, rows, head_dim = q_packed.shape
  max_pages = block_tables.shape[1]
  assert rows % rows_per_block == 0, (rows, rows_per_block)
  v_tile = gpu_dim_tile(v_dim)
  tiles = rows // rows_per_block
  grid = (tiles, num_splits, batch)   # first axis launches fastest (module docstring)

  kernel = functools.partial(
      _kernel, sm_scale=sm_scale, q_len=q_len, num_heads=num_heads, v_dim=v_dim,
      block_k=block_k, num_splits=num_splits)
  in_specs = [
      pl.BlockSpec((1,), lambda t, s, b: (b,)),
      pl.BlockSpec((None, max_pages), lambda t, s, b: (b, 0)),
      pl.BlockSpec((None, rows_per_block, head_dim), lambda t, s, b: (b, t, 0)),
      pl.BlockSpec(kv_pages.shape, lambda t, s, b: (0, 0, 0)),
  ]
  if num_splits == 1:
    out_shape = [jax.ShapeDtypeStruct((batch, rows, v_tile), q_packed.dtype)]
    out_specs = [pl.BlockSpec((None, rows_per_block, v_tile), lambda t, s, b: (b, t, 0))]
  else:
    out_shape = [jax.ShapeDtypeStruct((num_splits, batch, rows, v_tile), jnp.float32),
                 jax.ShapeDtypeStruct((num_splits, batch, rows), jnp.float32)]
    out_specs = [
        pl.BlockSpec((None, None, rows_per_block, v_tile), lambda t, s, b: (s, b, t, 0)),
        pl.BlockSpec((None, None, rows_per_block), lambda t, s, b: (s, b, t)),
    ]
  outs = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="paged_mla_gpu",
  )(kv_lens, block_tables, q_packed, kv_pages)
  if num_splits == 1:
    return outs[0]
  return combine_splits(*outs).astype(q_packed.dtype)
