"""Grouped matmul for TPUs: a Mosaic TPU kernel over one-expert tiles.

The public op, the row layout and the plan are documented in
`pallas_kernels.grouped_matmul`; this module holds only the TPU kernel and its wrapper.

Grid (M block, row tile, K block), K innermost, accumulating in an f32 VMEM scratch.
`tile_expert` and `num_valid_tiles` are scalar-prefetched into SMEM, so the weight
BlockSpec's index map picks the tile's expert and the pipeline DMAs only that expert's
[block_k, block_m] block. Tiles past `num_valid_tiles` map every operand to the block of
the last valid step (last valid tile, last K block): the pipeline skips a copy whose
block index does not change, so they cost no weight, x or output traffic, and `pl.when`
skips their compute. The M axis is the outer, parallel one: on chips with two
TensorCores each takes half the columns of every tile, which splits the weight reads
evenly whatever the routing.

Quantized experts (1-byte w with w_scale [E, S, M]): the weight block is DMA'd as 1-byte
values and converted to x's dtype in VMEM. The scale travels as [E, S, 1, M], so a block
of scale rows (rows, 1, block_m) is a legal Mosaic tile whatever S is; its index map
follows the weight's (same expert, same K step). With S == 1 the scale multiplies the
sum once at the end; otherwise block_k divides the scale block K // S (one scale row per
step) or is a multiple of it (one dot per scale block within the step, as in
`quant_matmul_tpu`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(tile_expert_ref, num_valid_ref, x_ref, w_ref, *refs, num_k, scale_rows,
            group_rows):
  del tile_expert_ref  # used by the index maps only
  *s_refs, o_ref, acc_ref = refs   # s_refs: (w_scale,) for quantized experts, else ()
  tile, kb = pl.program_id(1), pl.program_id(2)

  @pl.when(tile < num_valid_ref[0])
  def _():
    @pl.when(kb == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
    dims = (((1,), (0,)), ((), ()))
    if scale_rows <= 1:
      acc_ref[...] += lax.dot_general(x_ref[...], w_ref[...].astype(x_ref.dtype), dims,
                                      precision=precision,
                                      preferred_element_type=jnp.float32)
    else:
      s_ref, = s_refs
      for g in range(s_ref.shape[0]):    # scale blocks in this K step (static)
        rows = slice(g * group_rows, (g + 1) * group_rows)
        part = lax.dot_general(x_ref[:, rows], w_ref[rows, :].astype(x_ref.dtype), dims,
                               precision=precision, preferred_element_type=jnp.float32)
        acc_ref[...] += part * s_ref[g]

    @pl.when(kb == num_k - 1)
    def _():
      acc = acc_ref[...]
      if scale_rows == 1:
        acc = acc * s_refs[0][0]
      o_ref[...] = acc.astype(o_ref.dtype)


def _check_block(dim, size, block, name, unit):
  if size % block:
    raise ValueError(f"TPU grouped_matmul needs {dim}={size} to be a multiple of "
                     f"{name}={block}.")
  if block != size and block % unit:
    raise ValueError(f"TPU grouped_matmul needs {name}={block} to be a multiple of {unit} "
                     f"or the whole {dim}={size} (Mosaic tiles).")


def grouped_matmul_tpu(xs, w, tile_expert, num_valid_tiles, *, block, interpret,
                       w_scale=None):
  """xs [T * tile_rows, K] (tile-ordered rows), w [E, K, M] -> [T * tile_rows, M] in xs.dtype.

  w is scaled by w_scale [E, S, M] when given. Rows of tiles >= num_valid_tiles[0] are
  left unwritten.
  """
  padded_rows, k = xs.shape
  num_experts, _, m = w.shape
  tm, bm, bk = block.tile_rows, block.block_m, block.block_k
  _check_block("K", k, bk, "block_k", 128)
  _check_block("M", m, bm, "block_m", 128)
  scale_rows = 0 if w_scale is None else w_scale.shape[1]
  group = k // max(scale_rows, 1)                 # scale block K // S
  if scale_rows and group % bk and bk % group:
    raise ValueError(f"TPU grouped_matmul needs block_k={bk} to divide or be a multiple "
                     f"of the scale block K // S = {k} // {scale_rows} = {group}.")
  groups = max(1, bk // group)                    # scale rows per K step
  assert padded_rows % tm == 0, (padded_rows, tm)
  num_k = k // bk

  def step(tile, kb, num_valid_ref):
    """(tile, K block) to fetch: past the valid tiles, the last valid step's."""
    num_valid = num_valid_ref[0]
    live = tile < num_valid
    return (jnp.where(live, tile, jnp.maximum(num_valid - 1, 0)),
            jnp.where(live, kb, num_k - 1))

  def x_map(j, tile, kb, tile_expert_ref, num_valid_ref):
    return step(tile, kb, num_valid_ref)

  def w_map(j, tile, kb, tile_expert_ref, num_valid_ref):
    t, kb = step(tile, kb, num_valid_ref)
    return tile_expert_ref[t], kb, j

  def s_map(j, tile, kb, tile_expert_ref, num_valid_ref):
    t, kb = step(tile, kb, num_valid_ref)
    return tile_expert_ref[t], kb * bk // (group * groups), 0, j

  def o_map(j, tile, kb, tile_expert_ref, num_valid_ref):
    # Staying on the last valid tile's block keeps it resident (no write-back) until
    # the next M block starts; skipped steps do not touch it.
    return step(tile, kb, num_valid_ref)[0], j

  in_specs = [pl.BlockSpec((tm, bk), x_map), pl.BlockSpec((None, bk, bm), w_map)]
  operands = [tile_expert, num_valid_tiles, xs, w]
  if w_scale is not None:
    in_specs.append(pl.BlockSpec((None, groups, 1, bm), s_map))
    operands.append(w_scale.reshape(num_experts, scale_rows, 1, m))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(m // bm, padded_rows // tm, num_k),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((tm, bm), o_map),
      scratch_shapes=[pltpu.VMEM((tm, bm), jnp.float32)],
  )
  return pl.pallas_call(
      functools.partial(_kernel, num_k=num_k, scale_rows=scale_rows,
                        group_rows=min(bk, group)),
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((padded_rows, m), xs.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="grouped_matmul_tpu",
  )(*operands)
