"""DeepSeek Sparse Attention for NVIDIA GPUs: Pallas (Triton backend) kernels for the
indexer's scores and for sparse paged MLA.

The public ops, the layouts and the masking rule are documented in `pallas_kernels.dsa`;
this module holds only the GPU kernels and their wrappers. The top-k between them is
`dsa.radix_topk`: a threshold search whose rounds are `radix_threshold_gpu`, then
`compact_topk_gpu` (both below).

Indexer scores. One program handles (tile of `query_rows` query rows, KV split, batch
row) and walks its share of the visible kv positions `block_k` at a time: each block of
index keys [block_k, di] is one 2-D gather through the block table (one table entry per
position, so any page size works and a block may span pages), loaded once for every
query row of the tile; per query row one [Hp, di] x [di, block_k] tensor-core dot gives
all heads' logits, relu and the weighted head sum ([Hp] weights, a column reduction)
give the row's [block_k] scores, times the per-token scale of fp8 keys. No per-token
loop: the block is the unit. fp8 keys are loaded as 1-byte values and converted in
registers; under bf16 queries the dots run in float16 (e4m3 -> f16 is one packed
conversion, e4m3 -> bf16 goes through f32; index queries and keys are O(1) values, well
inside f16's range), accumulating in f32. Blocks past the tile's visible range are written -inf
without a load, so a short request's programs cost a store. Heads are padded to a
power of two >= 16 (zero queries and weights: tensor-core dots need 16 rows) by the
wrapper in `dsa`. The split is by contiguous shares of the visible blocks, so the
programs of one batch row read disjoint keys: each key byte crosses HBM once, the q
tile (at Hi = 64, di = 128: 16 KiB a row) once a program, from L2 after the first.

Bytes: the keys (di * itemsize a token, plus 4 for an fp8 scale) plus 4 * T bytes of
scores a token, so at T = 1 the scores add 1.6 % to the bf16 keys. Flops: 2 * Hi * di
a token and query row (16 k at Hi = 64, di = 128: 64 flops a key byte at T = 1), under
the tensor cores' ridge point, so the kernel is bound by the key reads up to T ~ 3.

Sparse MLA. One program handles (tile of heads, KV split, query row, batch row), like
`paged_mla_gpu` but the kv positions of a block are `block_k` consecutive entries of the
row's indices rather than consecutive positions: the block's latent [block_k, v_dim]
and rope [block_k, Dk - v_dim] rows are two gathers through the block table, -1 entries
masked (never loaded). Each query row has its own indices, so rows are packed only
across heads (at H = 128 two 64-row tiles read the same rows, the second from L2).
With few programs (small batch) the indices are split across programs
(flash-decoding) and merged by `common.combine_splits`. Reads: topk * Dk * itemsize
bytes a query row and head tile, independent of the context length.

Top-k rounds. The radix select's 8 rounds (4-bit digits) are one launch each: one
program a (segment, row) first fixes the previous digit from the previous round's
[segments, 16] counts of its row (so no XLA step sits between rounds), then streams its
segment 512 scores a step, comparing each key with the 15 candidates of the next digit
(a [512, 16] compare and column sum in registers, one spare lane), and writes 16
partial counts. One coalesced read of the scores a round, no temporaries.

Top-k compaction. Once the k-th largest score of each row is known (as an ordered int32
key), one program a (1024-score chunk, row) reads the chunk, recomputes the keys, takes
the exclusive prefix counts of the scores above and equal to the threshold (Triton
scans) on top of the chunk's offsets (summed in the program from one XLA reduction's
per-chunk counts), and scatters the chosen positions to their slots: ascending
positions, ties towards the lower position, the topk outputs written once and the
scores read once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import MASK_VALUE, combine_splits, gpu_dim_tile, store_rows

NT = (((1,), (1,)), ((), ()))   # a @ b.T
NN = (((1,), (0,)), ((), ()))   # a @ b


def _gather(ref, page, slot, live, start, width, tile):
  """ref[page[k], slot[k], start:start + width] for each k: [len(page), tile]; rows not
  `live` and columns past `width` read as zeros without touching memory."""
  shape = (page.shape[0], tile)
  col = lax.broadcasted_iota(jnp.int32, shape, 1)
  mask = jnp.broadcast_to(live[:, None], shape)
  if tile != width:
    mask &= col < width
  at = (jnp.broadcast_to(page[:, None], shape), jnp.broadcast_to(slot[:, None], shape),
        start + col)
  return pltriton.load(ref.at[at], mask=mask, other=0.0)


def _load_cols(ref, start, width, tile):
  """ref[:, start:start + width] as a [rows, tile] array, zero past `width`."""
  rows = ref.shape[0]
  if tile == width:
    return ref[:, pl.ds(start, width)]
  shape = (rows, tile)
  col = lax.broadcasted_iota(jnp.int32, shape, 1)
  at = (lax.broadcasted_iota(jnp.int32, shape, 0), start + col)
  return pltriton.load(ref.at[at], mask=col < width, other=0.0)


# ------------------------------------------------------------------------ index scores
def _score_kernel(kv_lens_ref, bt_ref, q_ref, w_ref, k_ref, *rest, q_len, heads,
                  query_rows, block_k, num_splits, has_scale):
  if has_scale:
    ks_ref, o_ref = rest
  else:
    (o_ref,) = rest
  tile, split = pl.program_id(0), pl.program_id(1)
  page_size = k_ref.shape[1]
  max_pages = bt_ref.shape[0]
  capacity = max_pages * page_size
  total_blocks = o_ref.shape[1] // block_k
  kv_len = kv_lens_ref[0]
  first_row = kv_len - q_len + tile * query_rows   # position of the tile's first row
  # The tile's last real row sees positions < hi.
  last = jnp.minimum(tile * query_rows + query_rows - 1, q_len - 1)
  hi = jnp.clip(kv_len - q_len + last + 1, 0, capacity)
  visible_blocks = lax.div(hi + block_k - 1, block_k)
  per_split = lax.div(visible_blocks + num_splits - 1, num_splits)
  begin = split * per_split
  end = jnp.minimum(begin + per_split, visible_blocks)
  # Blocks nobody of the tile sees: -inf, shared out among the splits the same way.
  dead = total_blocks - visible_blocks
  dead_per_split = lax.div(dead + num_splits - 1, num_splits)
  dead_begin = visible_blocks + split * dead_per_split
  dead_end = jnp.minimum(dead_begin + dead_per_split, total_blocks)

  # fp8 keys under bf16 queries compute in float16 (module docstring).
  fp8_under_bf16 = k_ref.dtype == jnp.float8_e4m3fn and q_ref.dtype == jnp.bfloat16
  compute = jnp.float16 if fp8_under_bf16 else q_ref.dtype
  precision = lax.Precision.HIGHEST if compute == jnp.float32 else None
  dim = q_ref.shape[1]
  offsets = jnp.arange(block_k, dtype=jnp.int32)
  # Small q tiles (up to 16 k values: 32 KiB of bf16 over the program's threads) stay in
  # registers across the blocks; larger ones are re-read (from L1 / L2) every block.
  resident = query_rows * heads * dim <= 16384
  q_tiles = [q_ref[pl.ds(t * heads, heads), :].astype(compute) for t in range(query_rows)
             ] if resident else None
  w_rows = [w_ref[t, :] for t in range(query_rows)]                    # [Hp] each

  def body(j, carry):
    pos = j * block_k + offsets
    live = pos < hi
    page = bt_ref[jnp.minimum(lax.div(pos, page_size), max_pages - 1)]
    slot = lax.rem(pos, page_size)
    keys = _gather(k_ref, page, slot, live, 0, dim, dim).astype(compute)
    if has_scale:
      scale = pltriton.load(ks_ref.at[page, slot], mask=live, other=0.0)
    for t in range(query_rows):
      qt = q_tiles[t] if resident else q_ref[pl.ds(t * heads, heads), :].astype(compute)
      s = lax.dot_general(qt, keys, NT, precision=precision,
                          preferred_element_type=jnp.float32)          # [Hp, block_k]
      score = jnp.sum(jnp.maximum(s, 0.0) * w_rows[t][:, None], axis=0)  # [block_k]
      if has_scale:
        score = score * scale
      score = jnp.where(score == 0.0, 0.0, score)   # -0.0 -> +0.0 (dsa docstring)
      score = jnp.where((pos <= first_row + t) & (pos < capacity), score, -jnp.inf)
      o_ref[t, pl.ds(j * block_k, block_k)] = score
    return carry

  def dead_body(j, carry):
    for t in range(query_rows):
      o_ref[t, pl.ds(j * block_k, block_k)] = jnp.full((block_k,), -jnp.inf, jnp.float32)
    return carry

  lax.fori_loop(begin, end, body, 0)
  lax.fori_loop(dead_begin, dead_end, dead_body, 0)


def index_scores_gpu(q_packed, w, k_pages, k_scale, block_tables, kv_lens, *, q_len,
                     heads, query_rows, block_k, num_splits, num_warps, num_stages,
                     interpret):
  """q_packed [B, Tp * Hp, di] (Tp a multiple of query_rows, Hp heads a query row, zero
  padded), w [B, Tp, Hp] f32 (zero padded), keys in q's dtype or fp8 with k_scale ->
  scores [B, Tp, Sp] f32, Sp = W * page_size rounded up to block_k (-inf past it)."""
  batch, rows, dim = q_packed.shape
  t_pad = rows // heads
  max_pages = block_tables.shape[1]
  capacity = max_pages * k_pages.shape[1]
  width = -(-capacity // block_k) * block_k
  tiles = t_pad // query_rows
  kernel = functools.partial(
      _score_kernel, q_len=q_len, heads=heads, query_rows=query_rows, block_k=block_k,
      num_splits=num_splits, has_scale=k_scale is not None)
  in_specs = [
      pl.BlockSpec((1,), lambda t, s, b: (b,)),
      pl.BlockSpec((None, max_pages), lambda t, s, b: (b, 0)),
      pl.BlockSpec((None, query_rows * heads, dim), lambda t, s, b: (b, t, 0)),
      pl.BlockSpec((None, query_rows, heads), lambda t, s, b: (b, t, 0)),
      pl.BlockSpec(k_pages.shape, lambda t, s, b: (0, 0, 0)),
  ]
  args = [kv_lens, block_tables, q_packed, w, k_pages]
  if k_scale is not None:
    in_specs.append(pl.BlockSpec(k_scale.shape, lambda t, s, b: (0, 0)))
    args.append(k_scale.astype(jnp.float32))
  return pl.pallas_call(
      kernel,
      grid=(tiles, num_splits, batch),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, query_rows, width), lambda t, s, b: (b, t, 0)),
      out_shape=jax.ShapeDtypeStruct((batch, t_pad, width), jnp.float32),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="dsa_index_scores_gpu",
  )(*args)


# -------------------------------------------------------------------------- sparse MLA
def _sparse_kernel(bt_ref, idx_ref, q_ref, kv_ref, *out_refs, sm_scale, v_dim, block_k,
                   num_splits):
  split = pl.program_id(1)
  head_dim = q_ref.shape[1]
  page_size = kv_ref.shape[1]
  max_pages = bt_ref.shape[0]
  rope_dim = head_dim - v_dim
  v_tile, r_tile = gpu_dim_tile(v_dim), gpu_dim_tile(rope_dim)
  num_blocks = idx_ref.shape[0] // block_k
  per_split = -(-num_blocks // num_splits)
  begin = split * per_split
  end = jnp.minimum(begin + per_split, num_blocks)

  fp8_under_bf16 = kv_ref.dtype == jnp.float8_e4m3fn and q_ref.dtype == jnp.bfloat16
  compute = jnp.float16 if fp8_under_bf16 else q_ref.dtype
  precision = lax.Precision.HIGHEST if compute == jnp.float32 else None
  q_lat = _load_cols(q_ref, 0, v_dim, v_tile).astype(compute)
  q_rope = _load_cols(q_ref, v_dim, rope_dim, r_tile).astype(compute) if rope_dim else None
  rows = q_ref.shape[0]

  def body(j, carry):
    acc, m_prev, l_prev = carry
    idx = idx_ref[pl.ds(j * block_k, block_k)]
    live = idx >= 0
    pos = jnp.maximum(idx, 0)
    page = bt_ref[jnp.minimum(lax.div(pos, page_size), max_pages - 1)]
    slot = lax.rem(pos, page_size)
    lat = _gather(kv_ref, page, slot, live, 0, v_dim, v_tile).astype(compute)
    s = lax.dot_general(q_lat, lat, NT, precision=precision,
                        preferred_element_type=jnp.float32)
    if rope_dim:
      rope = _gather(kv_ref, page, slot, live, v_dim, rope_dim, r_tile).astype(compute)
      s += lax.dot_general(q_rope, rope, NT, precision=precision,
                           preferred_element_type=jnp.float32)
    s = jnp.where(live[None, :], s * sm_scale, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(live[None, :], jnp.exp(s - m_next[:, None]), 0.0)
    pv = lax.dot_general(p.astype(lat.dtype), lat, NN, precision=precision,
                         preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_next, l_prev * alpha + p.sum(axis=1)

  acc = jnp.zeros((rows, v_tile), jnp.float32)
  m = jnp.full((rows,), MASK_VALUE, jnp.float32)
  l = jnp.zeros((rows,), jnp.float32)
  acc, m, l = lax.fori_loop(begin, end, body, (acc, m, l))
  store_rows(out_refs, acc, m, l)


def sparse_mla_gpu(q, kv_pages, block_tables, indices, *, v_dim, sm_scale, block_k,
                   rows_per_block, num_splits, num_warps, num_stages, interpret):
  """q [B, T, Hp, Dk] (Hp a multiple of rows_per_block), indices [B, T, Kp] (Kp a
  multiple of block_k, -1 padded), pages in q's dtype or fp8 -> [B, T, Hp, v_tile] in
  q's dtype (v_tile = gpu_dim_tile(v_dim); columns past v_dim are zero)."""
  batch, q_len, heads, head_dim = q.shape
  topk = indices.shape[2]
  max_pages = block_tables.shape[1]
  assert heads % rows_per_block == 0 and topk % block_k == 0
  v_tile = gpu_dim_tile(v_dim)
  tiles = heads // rows_per_block
  kernel = functools.partial(_sparse_kernel, sm_scale=sm_scale, v_dim=v_dim,
                             block_k=block_k, num_splits=num_splits)
  in_specs = [
      pl.BlockSpec((None, max_pages), lambda h, s, t, b: (b, 0)),
      pl.BlockSpec((None, None, topk), lambda h, s, t, b: (b, t, 0)),
      pl.BlockSpec((None, None, rows_per_block, head_dim), lambda h, s, t, b: (b, t, h, 0)),
      pl.BlockSpec(kv_pages.shape, lambda h, s, t, b: (0, 0, 0)),
  ]
  if num_splits == 1:
    out_shape = [jax.ShapeDtypeStruct((batch, q_len, heads, v_tile), q.dtype)]
    out_specs = [pl.BlockSpec((None, None, rows_per_block, v_tile),
                              lambda h, s, t, b: (b, t, h, 0))]
  else:
    out_shape = [jax.ShapeDtypeStruct((num_splits, batch, q_len, heads, v_tile), jnp.float32),
                 jax.ShapeDtypeStruct((num_splits, batch, q_len, heads), jnp.float32)]
    out_specs = [
        pl.BlockSpec((None, None, None, rows_per_block, v_tile),
                     lambda h, s, t, b: (s, b, t, h, 0)),
        pl.BlockSpec((None, None, None, rows_per_block), lambda h, s, t, b: (s, b, t, h)),
    ]
  outs = pl.pallas_call(
      kernel,
      grid=(tiles, num_splits, q_len, batch),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="dsa_sparse_mla_gpu",
  )(block_tables, indices, q, kv_pages)
  if num_splits == 1:
    return outs[0]
  return combine_splits(*outs).astype(q.dtype)


# ------------------------------------------------------------------------ top-k
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
DIGITS = 16   # 4-bit digits: 15 candidates a round and one spare lane


def _ordered_int32(s):
  """int32 keys in the order of the f32 scores s (-0.0 just below +0.0, NaN above +inf)."""
  bits = lax.bitcast_convert_type(s, jnp.int32)
  return jnp.where(bits < 0, bits ^ INT32_MAX, bits)


def _row_vector(ref, n, width):
  """ref[:n, :width] of a [n, width] block as a [next_pow2(n), width] array, zero rows
  past n (Triton arrays have power-of-two sizes)."""
  rows = 1 << max(0, (n - 1).bit_length())
  shape = (rows, width)
  at = (lax.broadcasted_iota(jnp.int32, shape, 0), lax.broadcasted_iota(jnp.int32, shape, 1))
  return pltriton.load(ref.at[at], mask=at[0] < n, other=0)


def _best_digit(partial_ref, segments, topk):
  """The largest digit whose count (summed over the row's segments) reaches topk."""
  counts = _row_vector(partial_ref, segments, DIGITS).sum(axis=0)     # [16]
  lane = jnp.arange(DIGITS, dtype=jnp.int32)
  return jnp.sum(((counts >= topk) & (lane < DIGITS - 1)).astype(jnp.int32))


def _round_kernel(s_ref, *refs, chunk, steps, segments, shift, topk):
  """One radix round for one (segment, row): the row's prefix from the previous round's
  counts, this round's 15 candidates, their counts over the segment."""
  if shift == 32 - 4:   # the first round: no prefix yet
    o_ref, prefix_out = refs
    prefix = jnp.int32(0)
  else:
    prefix_ref, partial_ref, o_ref, prefix_out = refs
    prefix = prefix_ref[0] | (_best_digit(partial_ref, segments, topk) << (shift + 4))
  lane = jnp.arange(DIGITS, dtype=jnp.int32)
  # The candidates as unsigned keys are prefix | d << shift (d = 1 .. 15); flipping the
  # sign bit gives the int32 ordered keys. The spare lane counts nothing real.
  cand = (prefix | ((lane + 1) << shift)) ^ INT32_MIN
  cand = jnp.where(lane < DIGITS - 1, cand, INT32_MAX)

  def body(i, acc):
    keys = _ordered_int32(s_ref[pl.ds(i * chunk, chunk)])             # [chunk]
    return acc + (keys[:, None] >= cand[None, :]).astype(jnp.int32).sum(axis=0)

  o_ref[...] = lax.fori_loop(0, steps, body, jnp.zeros((DIGITS,), jnp.int32))
  prefix_out[...] = jnp.full((1,), prefix, jnp.int32)   # the same from every segment


def radix_threshold_gpu(scores, *, topk, segment, chunk, interpret):
  """[R] int32: the ordered key of each row's topk-th largest score, in 8 launches.

  scores [R, N] f32, N a multiple of segment, segment of chunk. Round r (4-bit digits,
  most significant first) is one launch of one program a (segment, row): it sums the
  previous round's [segments, 16] counts of its row to fix the previous digit (the
  largest whose count reaches topk), then counts how many of its segment's keys are >=
  each of the 15 candidates for the next digit (a [chunk, 16] compare and column sum in
  registers, `chunk` scores a step: one coalesced read of the scores a round). The
  last digit is fixed from the last round's counts in XLA.
  """
  rows, size = scores.shape
  segments = size // segment
  common = dict(chunk=chunk, steps=segment // chunk, segments=segments, topk=topk)
  out_shape = [jax.ShapeDtypeStruct((rows, segments, DIGITS), jnp.int32),
               jax.ShapeDtypeStruct((rows,), jnp.int32)]
  out_specs = [pl.BlockSpec((None, None, DIGITS), lambda g, r: (r, g, 0)),
               pl.BlockSpec((1,), lambda g, r: (r,))]
  s_spec = pl.BlockSpec((None, segment), lambda g, r: (r, g))
  prev = ()
  for shift in range(28, -1, -4):
    in_specs = [s_spec]
    if prev:
      in_specs += [pl.BlockSpec((1,), lambda g, r: (r,)),
                   pl.BlockSpec((None, segments, DIGITS), lambda g, r: (r, 0, 0))]
    partial, prefix = pl.pallas_call(
        functools.partial(_round_kernel, shift=shift, **common),
        grid=(segments, rows),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="dsa_topk_count_gpu",
    )(scores, *prev)
    prev = (prefix, partial)
  best = jnp.sum(partial.sum(axis=1)[:, :DIGITS - 1] >= topk, axis=-1, dtype=jnp.int32)
  return (prefix | best) ^ jnp.int32(INT32_MIN)


def _compact_kernel(s_ref, thr_ref, per_a_ref, per_e_ref, init_ref, o_ref, *, chunk, topk,
                    chunks):
  del init_ref  # aliased to o_ref: the -1 padding the kernel leaves where it stores nothing
  g = pl.program_id(0)
  s = s_ref[...]                                                      # [chunk] f32
  keys = _ordered_int32(s)
  thr = thr_ref[0]
  # This row's counts above / equal to the threshold, chunk by chunk: those before g are
  # the chunk's offsets, all of the above ones fix how many equal ones to take.
  n = 1 << max(0, (chunks - 1).bit_length())
  idx = jnp.arange(n, dtype=jnp.int32)
  per_a = pltriton.load(per_a_ref.at[idx], mask=idx < chunks, other=0)
  per_e = pltriton.load(per_e_ref.at[idx], mask=idx < chunks, other=0)
  need = topk - per_a.sum()
  off_a = jnp.where(idx < g, per_a, 0).sum()
  off_e = jnp.where(idx < g, per_e, 0).sum()
  above = keys > thr
  equal = (keys == thr) & (s != -jnp.inf)
  a, e = above.astype(jnp.int32), equal.astype(jnp.int32)
  before_e = off_e + jnp.cumsum(e) - e
  chosen = above | (equal & (before_e < need))
  slot = off_a + jnp.cumsum(a) - a + jnp.minimum(before_e, need)
  pos = g * chunk + jnp.arange(chunk, dtype=jnp.int32)
  # Lanes not chosen aim at the spare last column (masked anyway; the interpreter's
  # masked scatter writes them back, which must not land on a chosen slot).
  spare = o_ref.shape[0] - 1
  pltriton.store(o_ref.at[jnp.where(chosen, slot, spare)], pos, mask=chosen)


def compact_topk_gpu(scores, threshold, per_above, per_equal, *, topk, chunk, interpret):
  """The positions the radix select chose, in ascending order, -1 padded: [R, topk].

  scores [R, N] f32 (N a multiple of chunk); threshold [R] int32 (the topk-th largest
  score's ordered key); per_above, per_equal [R, N / chunk] int32 (each chunk's count of
  scores above / equal to it, one XLA reduction). One program a (chunk, row): the
  offsets from the chunks before it, the exclusive prefix counts within the chunk
  (Triton scans), and a masked scatter of the chosen positions to their slots; the
  output starts as -1 (aliased), so slots nobody fills stay -1. It has one spare
  column, the target of the lanes not chosen, sliced off here.
  """
  rows, size = scores.shape
  chunks = size // chunk
  init = jnp.full((rows, topk + 1), -1, jnp.int32)
  return pl.pallas_call(
      functools.partial(_compact_kernel, chunk=chunk, topk=topk, chunks=chunks),
      grid=(chunks, rows),
      in_specs=[
          pl.BlockSpec((None, chunk), lambda g, r: (r, g)),
          pl.BlockSpec((1,), lambda g, r: (r,)),
          pl.BlockSpec((None, chunks), lambda g, r: (r, 0)),
          pl.BlockSpec((None, chunks), lambda g, r: (r, 0)),
          pl.BlockSpec((None, topk + 1), lambda g, r: (r, 0)),
      ],
      out_specs=pl.BlockSpec((None, topk + 1), lambda g, r: (r, 0)),
      out_shape=jax.ShapeDtypeStruct((rows, topk + 1), jnp.int32),
      input_output_aliases={4: 0},
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="dsa_topk_compact_gpu",
  )(scores, threshold, per_above, per_equal, init)[:, :topk]
