"""Grouped matmul for NVIDIA GPUs: a Pallas (Triton backend) kernel over one-expert tiles.

The public op, the row layout and the plan are documented in
`pallas_kernels.grouped_matmul`; this module holds only the GPU kernel and its wrapper.

One program handles one (row tile, block_m output columns, K split). It reads its tile's
expert id from `tile_expert` and streams that expert's [K / num_splits, block_m] weight
slab in block_k chunks, accumulating in f32. Triton has no scalar prefetch, so the
weight ref spans all experts and the program indexes it with the id; weights of experts
no tile names are never loaded. The tile's x rows are gathered in the kernel through
`slot_row` (padding slots read row N - 1; their results are never gathered back), which
saves a padded copy of x and the kernel that writes it. Programs of tiles past
`num_valid_tiles` return at once and leave their output rows unwritten: no row is
gathered from them. With num_splits > 1 each split writes an f32 partial sum and the
wrapper adds them (off by default: on an H100 splitting K never helped).

Quantized experts (1-byte w with w_scale [E, S, M]): each chunk is converted to x's
dtype right after its load, so HBM traffic stays 1 byte a weight. block_k divides the
scale block K // S, so a chunk lies in one scale block: with S > 1 each chunk's partial
product is multiplied by its scale row (w_scale[expert, block]) before it is added; with
S == 1 the scale multiplies the sum once at the end.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _kernel(tile_expert_ref, num_valid_ref, slot_row_ref, x_ref, w_ref, *refs, block_k,
            num_k, num_splits, group_chunks):
  *s_refs, o_ref = refs            # s_refs: (w_scale,) for quantized experts, else ()
  tile, split = pl.program_id(0), pl.program_id(2)
  rows, block_m = o_ref.shape

  @pl.when(tile < num_valid_ref[0])
  def _():
    expert = tile_expert_ref[tile]
    per_split = -(-num_k // num_splits)
    begin = split * per_split
    end = jnp.minimum(begin + per_split, num_k)
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
    x_rows = jnp.minimum(slot_row_ref[...], x_ref.shape[0] - 1)

    def body(i, acc):
      k0 = pl.multiple_of(i * block_k, block_k)
      xb = x_ref[x_rows, pl.ds(k0, block_k)]
      wb = w_ref[expert, pl.ds(k0, block_k), :].astype(xb.dtype)   # exact for 1 byte
      part = lax.dot_general(xb, wb, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
      if s_refs and s_refs[0].shape[1] > 1:
        part = part * s_refs[0][expert, i // group_chunks, :][None, :]
      return acc + part

    acc = lax.fori_loop(begin, end, body, jnp.zeros((rows, block_m), jnp.float32))
    if s_refs and s_refs[0].shape[1] == 1:
      acc = acc * s_refs[0][expert, 0, :][None, :]
    o_ref[...] = acc.astype(o_ref.dtype)


def grouped_matmul_gpu(x, slot_row, w, tile_expert, num_valid_tiles, *, block, interpret,
                       w_scale=None):
  """x [N, K], slot_row [T * tile_rows], w [E, K, M] -> [T * tile_rows, M] in x.dtype.

  Output row s is x[slot_row[s]] @ w[tile_expert[s // tile_rows]] (w scaled by w_scale
  [E, S, M] when given); rows of tiles >= num_valid_tiles[0] are left unwritten.
  """
  (padded_rows,), (n, k) = slot_row.shape, x.shape
  num_experts, _, m = w.shape
  tm, bm, bk, splits = block.tile_rows, block.block_m, block.block_k, block.num_splits
  for name, v in (("tile_rows", tm), ("block_m", bm), ("block_k", bk)):
    if v < 16 or v & (v - 1):
      raise ValueError(f"GPU grouped_matmul needs a power-of-two {name} >= 16 (Triton "
                       f"tensor-core tiles), got {v}.")
  for dim, v, name, b in (("K", k, "block_k", bk), ("M", m, "block_m", bm)):
    if v % b:
      raise ValueError(f"GPU grouped_matmul needs {dim}={v} to be a multiple of {name}={b}; "
                       "pick a smaller power-of-two block (partial blocks are not masked).")
  scale_rows = 1 if w_scale is None else w_scale.shape[1]
  if (k // scale_rows) % bk:
    raise ValueError(f"GPU grouped_matmul needs the scale block K // S = {k} // "
                     f"{scale_rows} = {k // scale_rows} to be a multiple of block_k={bk} "
                     "(a K chunk must not straddle two scale blocks).")
  assert padded_rows % tm == 0, (padded_rows, tm)
  num_k = k // bk
  splits = min(splits, num_k)
  grid = (padded_rows // tm, m // bm, splits)

  kernel = functools.partial(_kernel, block_k=bk, num_k=num_k, num_splits=splits,
                             group_chunks=k // scale_rows // bk)
  in_specs = [
      pl.BlockSpec(tile_expert.shape, lambda t, j, s: (0,)),
      pl.BlockSpec((1,), lambda t, j, s: (0,)),
      pl.BlockSpec((tm,), lambda t, j, s: (t,)),
      pl.BlockSpec((n, k), lambda t, j, s: (0, 0)),
      pl.BlockSpec((num_experts, k, bm), lambda t, j, s: (0, 0, j)),
  ]
  operands = [tile_expert, num_valid_tiles, slot_row, x, w]
  if w_scale is not None:
    in_specs.append(pl.BlockSpec((num_experts, scale_rows, bm), lambda t, j, s: (0, 0, j)))
    operands.append(w_scale)
  if splits == 1:
    out_shape = jax.ShapeDtypeStruct((padded_rows, m), x.dtype)
    out_spec = pl.BlockSpec((tm, bm), lambda t, j, s: (t, j))
  else:
    out_shape = jax.ShapeDtypeStruct((splits, padded_rows, m), jnp.float32)
    out_spec = pl.BlockSpec((None, tm, bm), lambda t, j, s: (s, t, j))
  out = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_spec,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=block.num_warps,
                                              num_stages=block.num_stages),
      interpret=interpret,
      name="grouped_matmul_gpu",
  )(*operands)
  if splits == 1:
    return out
  return out.sum(axis=0).astype(x.dtype)
