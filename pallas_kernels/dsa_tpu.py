"""DeepSeek Sparse Attention for TPUs: Mosaic TPU kernels for the indexer's scores and
for sparse paged MLA.

The public ops, the layouts and the masking rule are documented in `pallas_kernels.dsa`;
this module holds only the TPU kernels and their wrappers. Only TPU interpret mode has
run them (no TPU was available); their block sizes are untuned.

Indexer scores. Grid (batch row, tile of query rows). The block table and kv_lens are
scalar-prefetched into SMEM; the index keys stay in HBM and are fetched whole pages at
a time (one DMA a page, and one for its [1, page_size] row of fp8 scales) into a
two-slot VMEM buffer of `block_k` positions, so block j+1 is in flight while block j
is scored. Only pages holding positions the tile sees are copied. Per query row one
[Hp, di] x [di, block_k] MXU dot gives every head's logits; relu, times the row's
[Hp, 1] weight column (the wrapper passes w as [B, T, Hp, 1]) and a sublane sum give the
row's [1, block_k] scores. The tile's whole score row [rows, W * page_size] stays in
the output block (VMEM), set to -inf first and overwritten block by block.

Sparse MLA. Grid (batch row, query row, tile of heads). The row's indices arrive twice:
in SMEM (a blocked SMEM input) to address one DMA per selected position ([1, Dk] of
its page, through the prefetched block table) and in VMEM as a [1, topk] lane vector
for the score mask. Blocks of `block_k` positions are double-buffered like the pages
of `paged_mla_tpu`. A -1 entry is masked out of the softmax, but its buffer row is also
a value row, multiplied by its zero weight, so it must hold finite data: the wrapper
copies the row's largest selected position there instead (cache data the row attends to
anyway). A row that selects nothing copies position 0, whatever it holds, and returns 0
(its softmax sum is 0). One DMA a selected row is many small copies
(1152 bytes at Dk = 576 bf16): the scalar unit issuing them may well bound this
kernel, which was not measured.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import MASK_VALUE, to_compute

NT = (((1,), (1,)), ((), ()))   # a @ b.T
NN = (((1,), (0,)), ((), ()))   # a @ b


# ------------------------------------------------------------------------ index scores
def _score_kernel(kv_lens_ref, bt_ref, q_ref, wt_ref, k_hbm, *rest, q_len, heads,
                  query_rows, pages_per_block, max_pages, has_scale):
  if has_scale:
    ks_hbm, o_ref, k_buf, s_buf, sems = rest
  else:
    o_ref, k_buf, sems = rest
    ks_hbm = s_buf = None
  b, tile = pl.program_id(0), pl.program_id(1)
  page_size = k_hbm.shape[1]
  block_k = pages_per_block * page_size
  capacity = max_pages * page_size
  kv_len = kv_lens_ref[b]
  first_row = kv_len - q_len + tile * query_rows
  last = jnp.minimum(tile * query_rows + query_rows - 1, q_len - 1)
  hi = jnp.clip(kv_len - q_len + last + 1, 0, capacity)
  end_page = lax.div(hi + page_size - 1, page_size)
  num_blocks = lax.div(end_page + pages_per_block - 1, pages_per_block)

  def page_copies(j, slot):
    copies = []
    for i in range(pages_per_block):
      page = j * pages_per_block + i
      page_id = bt_ref[b * max_pages + jnp.minimum(page, max_pages - 1)]
      guard = page < end_page
      copies.append((guard, pltpu.make_async_copy(
          k_hbm.at[page_id], k_buf.at[slot, pl.ds(i * page_size, page_size)],
          sems.at[slot])))
      if has_scale:
        copies.append((guard, pltpu.make_async_copy(
            ks_hbm.at[page_id], s_buf.at[slot, :, pl.ds(i * page_size, page_size)],
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

  o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, jnp.float32)
  precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
  col = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)

  def body(j, carry):
    slot = lax.rem(j, 2)

    @pl.when(j + 1 < num_blocks)
    def _():
      start(j + 1, 1 - slot)

    wait(j, slot)
    pos = j * block_k + col                                          # [1, block_k]
    keys = to_compute(k_buf[slot], q_ref.dtype)                      # [block_k, di]
    for t in range(query_rows):
      qt = q_ref[t * heads:(t + 1) * heads, :]                       # [Hp, di]
      s = lax.dot_general(qt, keys, NT, precision=precision,
                          preferred_element_type=jnp.float32)        # [Hp, block_k]
      score = jnp.sum(jnp.maximum(s, 0.0) * wt_ref[t], axis=0, keepdims=True)
      if has_scale:
        score = score * s_buf[slot]
      # Slots past the visible range hold stale or never-copied keys (maybe NaN):
      # each is its own column, replaced here.
      score = jnp.where(score == 0.0, 0.0, score)   # -0.0 -> +0.0 (dsa docstring)
      score = jnp.where((pos <= first_row + t) & (pos < capacity), score, -jnp.inf)
      start_col = pl.multiple_of(j * block_k, 128)
      o_ref[t:t + 1, pl.ds(start_col, block_k)] = score
    return carry

  lax.fori_loop(0, num_blocks, body, 0)


def index_scores_tpu(q_packed, w, k_pages, k_scale, block_tables, kv_lens, *, q_len,
                     heads, query_rows, block_k, interpret):
  """q_packed [B, Tp * Hp, di], w [B, Tp, Hp] f32 (zero padded), keys in q's dtype or
  fp8 with k_scale -> scores [B, Tp, Sp] f32 (Sp = W * page_size rounded up to
  block_k; -inf past what a row sees)."""
  batch, rows, dim = q_packed.shape
  t_pad = rows // heads
  num_pages, page_size, _ = k_pages.shape
  max_pages = block_tables.shape[1]
  assert block_k % page_size == 0, (block_k, page_size)
  width = -(-max_pages * page_size // block_k) * block_k
  has_scale = k_scale is not None
  kernel = functools.partial(
      _score_kernel, q_len=q_len, heads=heads, query_rows=query_rows,
      pages_per_block=block_k // page_size, max_pages=max_pages, has_scale=has_scale)
  w_col = w[..., None]                                               # [B, Tp, Hp, 1]
  in_specs = [pl.BlockSpec((None, query_rows * heads, dim), lambda b, t, *_: (b, t, 0)),
              pl.BlockSpec((None, query_rows, heads, 1), lambda b, t, *_: (b, t, 0, 0)),
              pl.BlockSpec(memory_space=pl.ANY)]
  args = [q_packed, w_col, k_pages]
  scratch = [pltpu.VMEM((2, block_k, dim), k_pages.dtype)]
  if has_scale:
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    args.append(k_scale.astype(jnp.float32).reshape(num_pages, 1, page_size))
    scratch.append(pltpu.VMEM((2, 1, block_k), jnp.float32))
  scratch.append(pltpu.SemaphoreType.DMA((2,)))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(batch, t_pad // query_rows),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, query_rows, width), lambda b, t, *_: (b, t, 0)),
      scratch_shapes=scratch,
  )
  return pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((batch, t_pad, width), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="dsa_index_scores_tpu",
  )(kv_lens, block_tables.reshape(-1), *args)


# -------------------------------------------------------------------------- sparse MLA
def _sparse_kernel(bt_ref, idx_smem, idx_vmem, q_ref, kv_hbm, o_ref, kv_buf, acc_ref, sems,
                   *, sm_scale, v_dim, block_k, max_pages):
  b = pl.program_id(0)
  rows, head_dim = q_ref.shape
  page_size = kv_hbm.shape[1]
  rope_dim = head_dim - v_dim
  num_blocks = idx_smem.shape[1] // block_k

  def copy(j, i, slot):
    # The wrapper replaced -1 entries by a selected position of the same row (module
    # docstring): every copy is of a row the kernel may read.
    pos = idx_smem[0, j * block_k + i]
    page_id = bt_ref[b * max_pages + jnp.minimum(lax.div(pos, page_size), max_pages - 1)]
    row = lax.rem(pos, page_size)
    return pltpu.make_async_copy(
        kv_hbm.at[page_id, pl.ds(row, 1)], kv_buf.at[slot, pl.ds(i, 1)], sems.at[slot])

  def start(j, slot):
    def one(i, carry):
      copy(j, i, slot).start()
      return carry
    lax.fori_loop(0, block_k, one, 0)

  def wait(j, slot):
    def one(i, carry):
      copy(j, i, slot).wait()
      return carry
    lax.fori_loop(0, block_k, one, 0)

  start(0, 0)
  acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
  q_lat = q_ref[:, :v_dim]
  q_rope = q_ref[:, v_dim:] if rope_dim else None
  precision = lax.Precision.HIGHEST if q_lat.dtype == jnp.float32 else None

  def body(j, carry):
    m_prev, l_prev = carry
    slot = lax.rem(j, 2)

    @pl.when(j + 1 < num_blocks)
    def _():
      start(j + 1, 1 - slot)

    wait(j, slot)
    live = idx_vmem[:, pl.ds(pl.multiple_of(j * block_k, block_k), block_k)] >= 0
    lat = to_compute(kv_buf[slot, :, :v_dim], q_lat.dtype)
    s = lax.dot_general(q_lat, lat, NT, precision=precision,
                        preferred_element_type=jnp.float32)
    if rope_dim:
      rope = to_compute(kv_buf[slot, :, v_dim:], q_lat.dtype)
      s += lax.dot_general(q_rope, rope, NT, precision=precision,
                           preferred_element_type=jnp.float32)
    s = jnp.where(live, s * sm_scale, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(live, jnp.exp(s - m_next), 0.0)
    pv = lax.dot_general(p.astype(lat.dtype), lat, NN, precision=precision,
                         preferred_element_type=jnp.float32)
    acc_ref[...] = acc_ref[...] * alpha + pv
    return m_next, l_prev * alpha + p.sum(axis=1, keepdims=True)

  m = jnp.full((rows, 1), MASK_VALUE, jnp.float32)
  l = jnp.zeros((rows, 1), jnp.float32)
  m, l = lax.fori_loop(0, num_blocks, body, (m, l))
  seen = l != 0.0
  out = jnp.where(seen, acc_ref[...] / jnp.where(seen, l, 1.0), 0.0)
  o_ref[...] = out.astype(o_ref.dtype)


def _fetch_positions(indices):
  """The positions the kernel copies: -1 entries replaced by the row's largest selected
  position (0 where the row selects nothing)."""
  fill = jnp.maximum(indices.max(axis=-1, keepdims=True), 0)
  return jnp.where(indices >= 0, indices, fill)


def sparse_mla_tpu(q, kv_pages, block_tables, indices, *, v_dim, sm_scale, block_k,
                   rows_per_block, interpret):
  """q [B, T, Hp, Dk] (Hp a multiple of rows_per_block), indices [B, T, Kp] (Kp a
  multiple of block_k, -1 padded), pages in q's dtype or fp8 -> [B, T, Hp, v_dim]."""
  batch, q_len, heads, head_dim = q.shape
  topk = indices.shape[2]
  max_pages = block_tables.shape[1]
  assert heads % rows_per_block == 0 and topk % block_k == 0
  kernel = functools.partial(_sparse_kernel, sm_scale=sm_scale, v_dim=v_dim,
                             block_k=block_k, max_pages=max_pages)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(batch, q_len, heads // rows_per_block),
      in_specs=[
          pl.BlockSpec((None, None, 1, topk), lambda b, t, h, *_: (b, t, 0, 0),
                       memory_space=pltpu.SMEM),
          pl.BlockSpec((None, None, 1, topk), lambda b, t, h, *_: (b, t, 0, 0)),
          pl.BlockSpec((None, None, rows_per_block, head_dim),
                       lambda b, t, h, *_: (b, t, h, 0)),
          pl.BlockSpec(memory_space=pl.ANY),
      ],
      out_specs=pl.BlockSpec((None, None, rows_per_block, v_dim),
                             lambda b, t, h, *_: (b, t, h, 0)),
      scratch_shapes=[
          pltpu.VMEM((2, block_k, head_dim), kv_pages.dtype),
          pltpu.VMEM((rows_per_block, v_dim), jnp.float32),
          pltpu.SemaphoreType.DMA((2,)),
      ],
  )
  return pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((batch, q_len, heads, v_dim), q.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="dsa_sparse_mla_tpu",
  )(block_tables.reshape(-1), _fetch_positions(indices)[:, :, None, :], indices[:, :, None, :],
    q, kv_pages)
