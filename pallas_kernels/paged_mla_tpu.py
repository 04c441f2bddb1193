"""Paged MLA for TPUs: a Mosaic TPU kernel with double-buffered page DMAs.

The public op, the layouts and the masking rule are documented in
`pallas_kernels.paged_mla`; this module holds only the TPU kernel and its wrapper.

Grid (batch row, tile of packed query rows). The block tables and kv_lens are
scalar-prefetched into SMEM; the pages stay in HBM and are fetched whole, one DMA per
page ([page_size, Dk]), into a two-slot VMEM buffer, so block j+1 is in flight while
block j is computed. Only pages that hold positions the tile can see are copied. The
latent part buf[:, :v_dim] serves as both the K (with the rope part buf[:, v_dim:]) and
the V, so a page is copied once for both. v_dim must be a multiple of 128 so that the
rope part starts on a lane-tile boundary (`paged_mla.check_tiling`). The [rows, v_dim]
f32 accumulator lives in a VMEM scratch buffer (at H = 128 a 256-row tile's
accumulator is 512 KiB, far more than the vector registers); the running max and sum
are loop carries. A TensorCore runs its grid sequentially, so there is no split-K
here. Copies index the HBM ref with `.at[page]` and write `buf.at[slot, pl.ds(...)]`:
no ref reshape or bitcast, which TPU interpret mode cannot run.

fp8 pages are copied as 1-byte data into a 1-byte VMEM buffer and converted to q's
dtype (through f32: Mosaic converts between float types only by way of f32) right after
the buffer read; the kv_scale factors never reach this kernel (`paged_mla` folds them
into q and the output). A VMEM tile of 8-bit data is (32, 128), so fp8 pages need
page_size % 32 == 0 for every page copy to fill whole tiles (`paged_mla.check_tiling`).
Only interpret mode has run this kernel over fp8 pages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import MASK_VALUE, tile_kv_range, to_compute, visible_mask


def _kernel(kv_lens_ref, bt_ref, q_ref, kv_hbm, o_ref, kv_buf, acc_ref, sems, *,
            sm_scale, q_len, num_heads, v_dim, pages_per_block, max_pages):
  b, tile = pl.program_id(0), pl.program_id(1)
  rows, head_dim = q_ref.shape
  page_size = kv_hbm.shape[1]
  block_k = pages_per_block * page_size
  kv_capacity = max_pages * page_size
  rope_dim = head_dim - v_dim
  kv_len = kv_lens_ref[b]

  # Causal: the tile's visible range starts at 0; hi is its last row's end.
  _, hi = tile_kv_range(tile, kv_len=kv_len, rows_per_block=rows, q_len=q_len,
                        group=num_heads, window=None, kv_capacity=kv_capacity)
  end_page = lax.div(hi + page_size - 1, page_size)
  num_blocks = lax.div(end_page + pages_per_block - 1, pages_per_block)

  def page_copies(j, slot):
    """(guard, copy) for each page of block j; guard: the page holds visible kv."""
    copies = []
    for i in range(pages_per_block):
      page = j * pages_per_block + i
      page_id = bt_ref[b * max_pages + jnp.minimum(page, max_pages - 1)]
      copies.append((page < end_page, pltpu.make_async_copy(
          kv_hbm.at[page_id], kv_buf.at[slot, pl.ds(i * page_size, page_size)],
          sems.at[slot])))
    return copies

  def start(j, slot):
    for guard, copy in page_copies(j, slot):
      pl.when(guard)(copy.start)

  def wait(j, slot):
    for guard, copy in page_copies(j, slot):
      pl.when(guard)(copy.wait)

  @pl.when(num_blocks > 0)
  def _():
    start(0, 0)

  acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
  q_lat = q_ref[:, :v_dim]
  q_rope = q_ref[:, v_dim:] if rope_dim else None
  precision = lax.Precision.HIGHEST if q_lat.dtype == jnp.float32 else None
  row = tile * rows + lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
  col = lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
  kv_row = lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
  nt = (((1,), (1,)), ((), ()))   # a @ b.T
  nn = (((1,), (0,)), ((), ()))   # a @ b

  def body(j, carry):
    m_prev, l_prev = carry
    slot = lax.rem(j, 2)

    @pl.when(j + 1 < num_blocks)
    def _():
      start(j + 1, 1 - slot)

    wait(j, slot)
    pos0 = j * block_k
    # Slots past `hi` hold stale or never-copied data (maybe NaN): zero the latent part,
    # which is also the V. The rope part only reaches masked score columns.
    # fp8 pages: to q's dtype right after the buffer read (exact for e4m3 values).
    lat = to_compute(kv_buf[slot, :, :v_dim], q_lat.dtype)
    lat = jnp.where(pos0 + kv_row < hi, lat, jnp.zeros_like(lat))
    s = lax.dot_general(q_lat, lat, nt, precision=precision,
                        preferred_element_type=jnp.float32)
    if rope_dim:
      rope = to_compute(kv_buf[slot, :, v_dim:], q_lat.dtype)
      s += lax.dot_general(q_rope, rope, nt, precision=precision,
                           preferred_element_type=jnp.float32)
    mask = visible_mask(row, pos0 + col, kv_len=kv_len, q_len=q_len, group=num_heads,
                        window=None, kv_capacity=kv_capacity)
    s = jnp.where(mask, s * sm_scale, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
    pv = lax.dot_general(p.astype(lat.dtype), lat, nn, precision=precision,
                         preferred_element_type=jnp.float32)
    acc_ref[...] = acc_ref[...] * alpha + pv
    return m_next, l_prev * alpha + p.sum(axis=1, keepdims=True)

  m = jnp.full((rows, 1), MASK_VALUE, jnp.float32)
  l = jnp.zeros((rows, 1), jnp.float32)
  m, l = lax.fori_loop(0, num_blocks, body, (m, l))
  seen = l != 0.0  # nothing visible; a NaN in a visible position stays NaN
  out = jnp.where(seen, acc_ref[...] / jnp.where(seen, l, 1.0), 0.0)
  o_ref[...] = out.astype(o_ref.dtype)


def paged_mla_tpu(q_packed, kv_pages, block_tables, kv_lens, *, q_len, num_heads, v_dim,
                  sm_scale, block_k, rows_per_block, interpret):
  """q_packed [B, R, Dk] (R a multiple of rows_per_block), pages in q's dtype or fp8 ->
  [B, R, v_dim]."""
  batch, rows, head_dim = q_packed.shape
  _, page_size, _ = kv_pages.shape
  max_pages = block_tables.shape[1]
  assert rows % rows_per_block == 0, (rows, rows_per_block)
  assert block_k % page_size == 0, (block_k, page_size)

  kernel = functools.partial(
      _kernel, sm_scale=sm_scale, q_len=q_len, num_heads=num_heads, v_dim=v_dim,
      pages_per_block=block_k // page_size, max_pages=max_pages)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(batch, rows // rows_per_block),
      in_specs=[pl.BlockSpec((None, rows_per_block, head_dim), lambda b, t, *_: (b, t, 0)),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((None, rows_per_block, v_dim), lambda b, t, *_: (b, t, 0)),
      scratch_shapes=[
          pltpu.VMEM((2, block_k, head_dim), kv_pages.dtype),
          pltpu.VMEM((rows_per_block, v_dim), jnp.float32),
          pltpu.SemaphoreType.DMA((2,)),  # one per buffer slot
      ],
  )
  return pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((batch, rows, v_dim), q_packed.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="paged_mla_tpu",
  )(kv_lens, block_tables.reshape(-1), q_packed, kv_pages)
