"""Paged attention for TPUs: a Mosaic TPU kernel with double-buffered page DMAs.

The public op, the layouts, the masking rule and the sink semantics are documented in
`pallas_kernels.paged_attention`; this module holds only the TPU kernel and its wrapper.

Grid (batch row, kv head, tile of packed query rows). The block tables and kv_lens are
scalar-prefetched into SMEM; the pages stay in HBM and are fetched page by page with
async copies into a two-slot VMEM buffer, so block j+1 is in flight while block j is
computed. Only pages that hold visible positions are copied. A TensorCore runs its grid
sequentially, so unlike the GPU kernel there is no split-K here, and a sink simply
starts the online softmax. Copies index the HBM ref with `.at[head, page]` and write
`buf.at[slot, pl.ds(...)]`: no ref reshape or bitcast, which TPU interpret mode cannot
run. K and V pages have their own widths D and Dv; every block spans a full head dim,
so a D such as 192 (not a multiple of the 128 lanes) is one dot whose contracting dim
Mosaic pads to whole lane tiles in VMEM and masks (nothing is padded in HBM). Under a
draft tree (`tree_mask`) each row's ancestor bits and depth come in as a (rows, W + 1)
int32 block per row tile (`common.tree_rows`) and mask its blocks
(`common.tree_visible_mask`).

fp8 pages are copied as 1-byte data into 1-byte VMEM buffers and converted to q's dtype
(through f32: Mosaic converts between arbitrary float types only by way of f32) right
after the buffer read. The per-kv-head scales are scalar-prefetched into SMEM beside the
block tables: k_scale[h] joins the logit scale, v_scale[h] multiplies the output. A VMEM
tile of 8-bit data is (32, 128) (16 rows for 16-bit, 8 for 32-bit), and page i of a block
lands at row i * page_size of its buffer, so fp8 pages need page_size % 32 == 0 for every
page copy to fill whole tiles (`paged_attention_tpu` refuses other sizes rather than leave
a sub-tile DMA to the compiler; only interpret mode has run this kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import (MASK_VALUE, tile_kv_range, to_compute, tree_visible_mask,
                                   tree_words, visible_mask)

# Rows of a VMEM tile of 8-bit data: (32, 128), four rows packed per 32-bit sublane.
FP8_TILE_ROWS = 32


def _kernel(kv_lens_ref, bt_ref, scale_ref, q_ref, k_hbm, v_hbm, *refs, sm_scale, soft_cap,
            window, q_len, group, pages_per_block, max_pages, has_sinks, tree_len):
  sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
  tree_ref, refs = (refs[0], refs[1:]) if tree_len else (None, refs)
  o_ref, k_buf, v_buf, sems = refs
  b, h, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows = q_ref.shape[0]
  v_dim = v_hbm.shape[3]
  page_size = k_hbm.shape[2]
  block_k = pages_per_block * page_size
  kv_capacity = max_pages * page_size
  kv_len = kv_lens_ref[b]
  # This kv head's scales ([KVH * 2] in SMEM): k_scale joins the logit scale, v_scale the
  # output.
  logit_scale = sm_scale * scale_ref[2 * h]
  v_scale = scale_ref[2 * h + 1]

  lo, hi = tile_kv_range(tile, kv_len=kv_len, rows_per_block=rows, q_len=q_len,
                         group=group, window=window, kv_capacity=kv_capacity,
                         tree_len=tree_len)
  first_page = lax.div(lo, page_size)
  end_page = lax.div(hi + page_size - 1, page_size)
  num_blocks = lax.div(end_page - first_page + pages_per_block - 1, pages_per_block)

  def page_copies(j, slot):
    """(guard, K copy, V copy) for each page of block j; guard: page holds visible kv."""
    copies = []
    for i in range(pages_per_block):
      page = first_page + j * pages_per_block + i
      page_id = bt_ref[b * max_pages + jnp.minimum(page, max_pages - 1)]
      dst = pl.ds(i * page_size, page_size)
      copies.append((
          page < end_page,
          pltpu.make_async_copy(k_hbm.at[h, page_id], k_buf.at[slot, dst], sems.at[0, slot]),
          pltpu.make_async_copy(v_hbm.at[h, page_id], v_buf.at[slot, dst], sems.at[1, slot]),
      ))
    return copies

  def start(j, slot):
    for guard, k_copy, v_copy in page_copies(j, slot):
      @pl.when(guard)
      def _():
        k_copy.start()
        v_copy.start()

  def wait(j, slot):
    for guard, k_copy, v_copy in page_copies(j, slot):
      @pl.when(guard)
      def _():
        k_copy.wait()
        v_copy.wait()

  @pl.when(num_blocks > 0)
  def _():
    start(0, 0)

  q = q_ref[...]
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  row = tile * rows + lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
  col = lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
  v_col = lax.broadcasted_iota(jnp.int32, (block_k, v_dim), 0)
  if tree_len:  # the tile's rows' ancestor bit words and depths, (rows, 1) columns
    words = tree_words(tree_len)
    tree_bits = [tree_ref[:, w:w + 1] for w in range(words)]
    tree_depth = tree_ref[:, words:words + 1]

  def body(j, carry):
    acc, m_prev, l_prev = carry
    slot = lax.rem(j, 2)

    @pl.when(j + 1 < num_blocks)
    def _():
      start(j + 1, 1 - slot)

    wait(j, slot)
    k = to_compute(k_buf[slot], q.dtype)
    v = to_compute(v_buf[slot], q.dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * logit_scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    pos0 = (first_page + j * pages_per_block) * page_size
    if tree_len:
      mask = tree_visible_mask(tree_bits, tree_depth, pos0 + col, kv_len=kv_len,
                               tree_len=tree_len, window=window, kv_capacity=kv_capacity)
    else:
      mask = visible_mask(row, pos0 + col, kv_len=kv_len, q_len=q_len, group=group,
                          window=window, kv_capacity=kv_capacity)
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
    # Slots past `hi` hold stale or never-copied data (maybe NaN): zero them in V too.
    v_pos = pos0 + v_col
    v = jnp.where((v_pos >= lo) & (v_pos < hi), v, jnp.zeros_like(v))
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)
    return acc * alpha + pv, m_next, l_prev * alpha + p.sum(axis=1, keepdims=True)

  acc = jnp.zeros((rows, v_dim), jnp.float32)
  if has_sinks:
    # The sink as a zero-value column processed first: max s, sum e^(s - s) = 1 (0 for
    # s = -inf); a row that sees nothing keeps acc = 0 and returns 0.
    sink = sink_ref[...]
    m = jnp.maximum(sink, MASK_VALUE)
    l = jnp.exp(sink - m)
  else:
    m = jnp.full((rows, 1), MASK_VALUE, jnp.float32)
    l = jnp.zeros((rows, 1), jnp.float32)
  acc, m, l = lax.fori_loop(0, num_blocks, body, (acc, m, l))
  seen = l != 0.0  # nothing visible; a NaN in a visible position stays NaN
  out = jnp.where(seen, acc / jnp.where(seen, l, 1.0), 0.0) * v_scale
  o_ref[...] = out.astype(o_ref.dtype)


def paged_attention_tpu(q_packed, k_pages, v_pages, block_tables, kv_lens, scales,
                        sink_rows=None, tree_rows=None, *, q_len, group, sm_scale, soft_cap,
                        window, pages_per_block, rows_per_block, interpret, tree_len=0):
  """q_packed [B, KVH, R, D] (R a multiple of rows_per_block), pages in q's dtype or fp8,
  scales [KVH, 2] f32 (k_scale, v_scale per kv head), sink_rows None or [KVH, R] f32
  (packed row r's sink), tree_rows None (causal) or [B, R, W + 1] int32
  (`common.tree_rows`: packed row r's ancestor bit words and depth over a tree of tree_len
  rows, the last of kv_len) -> [B, KVH, R, Dv]."""
  batch, kv_heads, rows, head_dim = q_packed.shape
  _, _, page_size, v_dim = v_pages.shape
  max_pages = block_tables.shape[1]
  assert rows % rows_per_block == 0, (rows, rows_per_block)
  assert scales.shape == (kv_heads, 2) and scales.dtype == jnp.float32, (scales.shape,
                                                                         scales.dtype)
  if k_pages.dtype.itemsize == 1 and page_size % FP8_TILE_ROWS:
    raise ValueError(f"TPU paged attention over 1-byte ({k_pages.dtype}) pages needs a "
                     f"page_size that is a multiple of {FP8_TILE_ROWS} (a VMEM tile of 8-bit "
                     f"data is ({FP8_TILE_ROWS}, 128): each page copy must fill whole "
                     f"tiles), got {page_size}.")
  block_k = pages_per_block * page_size

  kernel = functools.partial(
      _kernel, sm_scale=sm_scale, soft_cap=soft_cap, window=window, q_len=q_len,
      group=group, pages_per_block=pages_per_block, max_pages=max_pages,
      has_sinks=sink_rows is not None, tree_len=tree_len)
  q_spec = pl.BlockSpec((None, None, rows_per_block, head_dim),
                        lambda b, h, t, *_: (b, h, t, 0))
  in_specs = [q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
  args = [kv_lens, block_tables.reshape(-1), scales.reshape(-1), q_packed, k_pages, v_pages]
  if sink_rows is not None:
    # [KVH, R, 1]: a (rows, 1) column, the layout of the running max and sum.
    in_specs.append(pl.BlockSpec((None, rows_per_block, 1), lambda b, h, t, *_: (h, t, 0)))
    args.append(sink_rows[..., None])
  if tree_rows is not None:
    cols = tree_rows.shape[-1]
    in_specs.append(pl.BlockSpec((None, rows_per_block, cols), lambda b, h, t, *_: (b, t, 0)))
    args.append(tree_rows)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3,
      grid=(batch, kv_heads, rows // rows_per_block),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, None, rows_per_block, v_dim),
                             lambda b, h, t, *_: (b, h, t, 0)),
      scratch_shapes=[
          pltpu.VMEM((2, block_k, head_dim), k_pages.dtype),
          pltpu.VMEM((2, block_k, v_dim), v_pages.dtype),
          pltpu.SemaphoreType.DMA((2, 2)),  # [K or V, buffer slot]
      ],
  )
  return pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((batch, kv_heads, rows, v_dim), q_packed.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="paged_attention_tpu",
  )(*args)
