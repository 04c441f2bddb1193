"""Paged attention for NVIDIA GPUs: a Pallas (Triton backend) kernel with split-K.

The public op, the layouts, the masking rule and the sink semantics are documented in
`pallas_kernels.paged_attention`; this module holds only the GPU kernel and its wrapper.

One program handles one (batch row, kv head, tile of packed query rows, KV split). It
gathers its packed rows (query i, head h*G + g at row i*G + g) from q as the op takes it
and, unsplit, stores its output rows straight back into that layout: the packing costs no
XLA transposes, pads or slices around the kernel. It reads its pages through the block
table inside the kernel (no XLA gather of the KV), `pages_per_block` pages at a time, and
runs an online softmax over them. Blocks that every row of the tile sees in full (all but
the causal diagonal, a window's first blocks and a partial last page) run in a loop of
their own with no masks on their loads or logits. With more than one split
(flash-decoding) each program covers a contiguous share of the row's visible pages and
writes a normalised partial output plus its log-sum-exp; `combine_splits` merges them.
The share is computed from the actual kv_len, so short rows do not leave programs idle
behind long ones. A sink enters split 0's initial softmax state only, so the combine
counts it once. Under a draft tree (`tree_mask`) each row's ancestor bits and depth come
in as one more input (`common.tree_rows`) and mask its blocks (`common.tree_visible_mask`):
only the positions before the tree run unmasked.

K and V are gathered as 2-D [block_k, width] masked loads with one table entry per row.
Gathering [pages, page_size, D] and reshaping to [block_k, D] computes the same thing,
but Triton does not pipeline the loads of the reshape, while it does the 2-D gather's
(docs/DECISIONS.md, "Paged attention (GPU)"). A key dim that is not a power of two is
split into power-of-two parts (`common.key_dim_parts`: 192 = 128 + 64), one gather and
one dot each; a part or value dim that is not a power of two >= 16 is padded up by masked
loads (`common.gpu_dim_tile`), and the output then carries gpu_dim_tile(Dv) columns,
sliced by the caller.

fp8 pages are loaded as 1-byte values and converted to q's dtype in registers right after
the gather (half the HBM bytes of bf16; the dots stay bf16 / f32). The per-kv-head scales
come in as one [KVH, 2] f32 array: program (b, h, ...) reads k_scale[h] into its logit
scale and v_scale[h] into its output (the split partials carry it; the combine is linear).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import (MASK_VALUE, combine_splits, gpu_dim_tile, key_dim_parts,
                                   normalised, store_rows, tile_full_range, tile_kv_range,
                                   tree_visible_mask, tree_words, unpack_rows,
                                   visible_mask)


LOG2E = 1.4426950408889634  # log2(e): logits in base 2
LN2 = 0.6931471805599453  # ln(2): a base-2 running max back to natural log units


def _packed_rows(tile, rows, *, q_len, group, num_q_heads):
  """Where the tile's packed rows live in the unpacked q / out of one batch row, viewed as
  [Q * Hq, D]: packed row p = i * G + g of kv head h is query i's head h * G + g, at row
  i * Hq + h * G + g. Padding rows (p >= Q * G) get the out-of-bounds row Q * Hq, so the
  interpreter's scatter drops them; their loads and stores are masked on a GPU."""
  p = tile * rows + lax.broadcasted_iota(jnp.int32, (rows,), 0)
  i, g = lax.div(p, group), lax.rem(p, group)
  at = i * num_q_heads + pl.program_id(1) * group + g
  valid = p < q_len * group
  return jnp.where(valid, at, q_len * num_q_heads), valid


def _load_q_cols(q_ref, at, valid, start, width, tile):
  """q rows `at` (valid: `valid`), columns start:start + width, as a [rows, tile] array:
  zero past `width` and in padding rows."""
  shape = (at.shape[0], tile)
  col = lax.broadcasted_iota(jnp.int32, shape, 1)
  mask = valid[:, None] & (col < width)
  return pltriton.load(q_ref.at[jnp.broadcast_to(at[:, None], shape), start + col],
                       mask=mask, other=0.0)


def _kernel(kv_lens_ref, bt_ref, scale_ref, q_ref, k_ref, v_ref, *refs, sm_scale, soft_cap,
            window, q_len, group, rows, pages_per_block, num_splits, has_sinks, tree_len):
  sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
  tree_ref, out_refs = (refs[0], refs[1:]) if tree_len else (None, refs)
  tile, split = pl.program_id(2), pl.program_id(3)
  head_dim = q_ref.shape[-1]
  num_q_heads = q_ref.shape[0] // q_len
  v_dim = v_ref.shape[-1]
  page_size = k_ref.shape[1]
  max_pages = bt_ref.shape[0]
  block_k = pages_per_block * page_size
  kv_capacity = max_pages * page_size
  kv_len = kv_lens_ref[0]
  # This kv head's scales: k_scale joins the logit scale, v_scale the output. The softmax
  # runs in base 2 (one ex2 per logit rather than expf's range reduction): logits times
  # log2(e), the running max in that unit; the sums are the same in either base.
  logit_scale = sm_scale * scale_ref[0]
  v_scale = scale_ref[1]

  lo, hi = tile_kv_range(tile, kv_len=kv_len, rows_per_block=rows, q_len=q_len,
                         group=group, window=window, kv_capacity=kv_capacity,
                         tree_len=tree_len)
  first_page = lax.div(lo, page_size)
  end_page = lax.div(hi + page_size - 1, page_size)
  num_blocks = lax.div(end_page - first_page + pages_per_block - 1, pages_per_block)
  per_split = lax.div(num_blocks + num_splits - 1, num_splits)
  begin = split * per_split
  end = jnp.minimum(begin + per_split, num_blocks)

  k_parts = key_dim_parts(head_dim)
  v_part = (0, v_dim, gpu_dim_tile(v_dim))
  # fp8 pages under bf16 queries compute in float16: e4m3 -> f16 is one packed
  # conversion, -> bf16 goes through f32 (two more per value); q and p fit f16's range
  # at attention's magnitudes, and its mantissa is finer than bf16's.
  compute = (jnp.float16 if k_ref.dtype == jnp.float8_e4m3fn and q_ref.dtype == jnp.bfloat16
             else q_ref.dtype)
  q_at, q_valid = _packed_rows(tile, rows, q_len=q_len, group=group, num_q_heads=num_q_heads)
  q_parts = [_load_q_cols(q_ref, q_at, q_valid, *part).astype(compute) for part in k_parts]
  row = tile * rows + lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
  col = lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
  # 2-D [block_k, width] gathers, one table entry per row (module docstring says why):
  # (kv row, page slot, column) indices per distinct tile width.
  idx = {}
  for _, _, width in (*k_parts, v_part):
    kv_row = lax.broadcasted_iota(jnp.int32, (block_k, width), 0)
    idx[width] = (kv_row, lax.rem(kv_row, page_size),
                  lax.broadcasted_iota(jnp.int32, (block_k, width), 1))
  row_page = lax.div(jnp.arange(block_k, dtype=jnp.int32), page_size)
  if tree_len:  # the tile's rows' ancestor bit words and depths, [rows, 1] each
    words = tree_words(tree_len)
    tree_bits = [tree_ref[w][:, None] for w in range(words)]
    tree_depth = tree_ref[words][:, None]
  precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

  def gather(ref, pages, pos0, start, width, tile_w, masked):
    kv_row, slot_idx, dim_idx = idx[tile_w]
    # Slots outside [lo, hi) are seen by no row of this tile and may hold anything (NaN
    # included): the masked load reads zeros there (and skips the memory traffic), so
    # 0 * NaN never reaches the accumulator. Padding columns read as zeros too. A block
    # inside every row's range needs neither.
    mask = ((pos0 + kv_row >= lo) & (pos0 + kv_row < hi)) if masked else None
    if tile_w != width:
      cols = dim_idx < width
      mask = cols if mask is None else mask & cols
    # Whole-array indices (no slices): the interpreter's masked load needs them.
    at = (jnp.broadcast_to(pages[:, None], kv_row.shape), slot_idx, start + dim_idx)
    # fp8 pages: to the compute dtype right after the load (exact for e4m3 values).
    return pltriton.load(ref.at[at], mask=mask, other=None if mask is None else 0.0
                         ).astype(compute)

  def body(j, carry, masked):
    acc, m_prev, l_prev = carry
    page0 = first_page + j * pages_per_block
    pos0 = page0 * page_size
    # Clamp into the table: the tail of the last block may run past max_pages.
    pages = bt_ref[jnp.minimum(page0 + row_page, max_pages - 1)]
    s = None
    for q_part, part in zip(q_parts, k_parts):
      k = gather(k_ref, pages, pos0, *part, masked)
      s_part = lax.dot_general(q_part, k, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)
      s = s_part if s is None else s + s_part
    v = gather(v_ref, pages, pos0, *v_part, masked)
    if soft_cap is None:
      s = s * (logit_scale * LOG2E)
    else:
      s = soft_cap * jnp.tanh(s * logit_scale / soft_cap) * LOG2E
    if masked and tree_len:
      mask = tree_visible_mask(tree_bits, tree_depth, pos0 + col, kv_len=kv_len,
                               tree_len=tree_len, window=window, kv_capacity=kv_capacity)
    elif masked:
      mask = visible_mask(row, pos0 + col, kv_len=kv_len, q_len=q_len, group=group,
                          window=window, kv_capacity=kv_capacity)
    if masked:
      s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    if masked:
      p = jnp.where(mask, p, 0.0)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_next, l_prev * alpha + p.sum(axis=1)

  acc = jnp.zeros((rows, v_part[2]), jnp.float32)
  m = jnp.full((rows,), MASK_VALUE, jnp.float32)
  l = jnp.zeros((rows,), jnp.float32)
  if has_sinks:
    # The sink as a zero-value column processed first: max s, sum e^(s - s) = 1 (0 for
    # s = -inf). Split 0 only, so the combine counts it once.
    sink = sink_ref[...] * LOG2E
    m_sink = jnp.maximum(sink, MASK_VALUE)
    l_sink = jnp.exp2(sink - m_sink)
    if num_splits == 1:
      m, l = m_sink, l_sink
    else:
      m, l = jnp.where(split == 0, m_sink, m), jnp.where(split == 0, l_sink, l)
  # Blocks every row of the tile sees in full run without masks; the blocks at the
  # edges (the causal diagonal, the window's start, the last partial page) with them.
  full_lo, full_hi = tile_full_range(tile, kv_len=kv_len, rows_per_block=rows, q_len=q_len,
                                     group=group, window=window, kv_capacity=kv_capacity,
                                     tree_len=tree_len)
  first_pos = first_page * page_size
  inner_lo = jnp.clip(lax.div(jnp.maximum(full_lo - first_pos, 0) + block_k - 1, block_k),
                      begin, end)
  inner_hi = jnp.clip(lax.div(jnp.maximum(full_hi - first_pos, 0), block_k), inner_lo, end)
  masked_body = functools.partial(body, masked=True)
  carry = (acc, m, l)
  if window is not None:  # only a window masks blocks before the interior
    carry = lax.fori_loop(begin, inner_lo, masked_body, carry)
  carry = lax.fori_loop(inner_lo, inner_hi, functools.partial(body, masked=False), carry)
  acc, m, l = lax.fori_loop(inner_hi, end, masked_body, carry)

  if num_splits == 1:  # straight into the unpacked output's rows
    (o_ref,) = out_refs
    out = normalised(acc, l, v_scale)
    shape = out.shape
    at = (jnp.broadcast_to(q_at[:, None], shape), lax.broadcasted_iota(jnp.int32, shape, 1))
    pltriton.store(o_ref.at[at], out.astype(o_ref.dtype), mask=q_valid[:, None])
  else:
    store_rows(out_refs, acc, m * LN2, l, v_scale)


def paged_attention_gpu(q, k_pages, v_pages, block_tables, kv_lens, scales, sink_rows=None,
                        tree_rows=None, *, q_len, group, sm_scale, soft_cap, window,
                        pages_per_block, num_splits, rows_per_block, num_warps, num_stages,
                        interpret, tree_len=0):
  """q [B, Q, Hq, D] as the op takes it (the kernel gathers each kv head's packed rows
  itself), pages in q's dtype or fp8, scales [KVH, 2] f32 (k_scale, v_scale per kv head),
  sink_rows None or [KVH, R] f32 (packed row r's sink, R the packed rows padded to the
  tile), tree_rows None (causal) or [B, R, W + 1] int32 (`common.tree_rows`: packed row
  r's ancestor bit words and depth over a tree of tree_len rows, the last of kv_len) ->
  [B, Q, Hq, gpu_dim_tile(Dv)] in q's dtype; columns past Dv are zero. One split stores
  its rows straight into that layout; split partials keep the packed layout and their
  combine unpacks."""
  batch, _, num_q_heads, head_dim = q.shape
  kv_heads, _, page_size, v_dim = v_pages.shape
  max_pages = block_tables.shape[1]
  for name, n in (("page_size", page_size), ("pages_per_block", pages_per_block),
                  ("rows_per_block", rows_per_block)):
    if n & (n - 1):
      raise ValueError(f"GPU paged attention needs a power-of-two {name} (Triton tiles are "
                       f"powers of two), got {n}.")
  if rows_per_block < 16 or pages_per_block * page_size < 16:
    raise ValueError("GPU paged attention needs rows_per_block and pages_per_block * "
                     "page_size >= 16 (tensor-core tiles); got "
                     f"{rows_per_block} and {pages_per_block * page_size}.")
  assert q_len == q.shape[1] and num_q_heads == kv_heads * group, (q.shape, kv_heads, group)
  assert scales.shape == (kv_heads, 2) and scales.dtype == jnp.float32, (scales.shape,
                                                                         scales.dtype)
  packed = q_len * group
  rows = -(-packed // rows_per_block) * rows_per_block
  grid = (batch, kv_heads, rows // rows_per_block, num_splits)
  v_tile = gpu_dim_tile(v_dim)

  kernel = functools.partial(
      _kernel, sm_scale=sm_scale, soft_cap=soft_cap, window=window, q_len=q_len,
      group=group, rows=rows_per_block, pages_per_block=pages_per_block,
      num_splits=num_splits, has_sinks=sink_rows is not None, tree_len=tree_len)
  flat = (None, q_len * num_q_heads)  # one batch row's [Q * Hq, width], rows gathered
  in_specs = [
      pl.BlockSpec((1,), lambda b, h, t, s: (b,)),
      pl.BlockSpec((None, max_pages), lambda b, h, t, s: (b, 0)),
      pl.BlockSpec((None, 2), lambda b, h, t, s: (h, 0)),
      pl.BlockSpec((*flat, head_dim), lambda b, h, t, s: (b, 0, 0)),
      pl.BlockSpec((None, *k_pages.shape[1:]), lambda b, h, t, s: (h, 0, 0, 0)),
      pl.BlockSpec((None, *v_pages.shape[1:]), lambda b, h, t, s: (h, 0, 0, 0)),
  ]
  args = [kv_lens, block_tables, scales, q.reshape(batch, q_len * num_q_heads, head_dim),
          k_pages, v_pages]
  if sink_rows is not None:
    in_specs.append(pl.BlockSpec((None, rows_per_block), lambda b, h, t, s: (h, t)))
    args.append(sink_rows)
  if tree_rows is not None:
    # [B, W + 1, R]: each column a row of its own, so the kernel loads it as a [rows]
    # vector (Triton cannot slice a loaded tile)
    cols = tree_rows.shape[-1]
    in_specs.append(pl.BlockSpec((None, cols, rows_per_block), lambda b, h, t, s: (b, 0, t)))
    args.append(tree_rows.transpose(0, 2, 1))
  if num_splits == 1:
    out_shape = [jax.ShapeDtypeStruct((batch, q_len * num_q_heads, v_tile), q.dtype)]
    out_specs = [pl.BlockSpec((*flat, v_tile), lambda b, h, t, s: (b, 0, 0))]
  else:
    out_dims = (batch, kv_heads, rows, v_tile)
    out_shape = [jax.ShapeDtypeStruct((num_splits, *out_dims), jnp.float32),
                 jax.ShapeDtypeStruct((num_splits, batch, kv_heads, rows), jnp.float32)]
    out_specs = [
        pl.BlockSpec((None, None, None, rows_per_block, v_tile),
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
  )(*args)
  if num_splits == 1:
    return outs[0].reshape(batch, q_len, num_q_heads, v_tile)
  return unpack_rows(combine_splits(*outs).astype(q.dtype), q_len, group)
