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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(tile_expert_ref, num_valid_ref, x_ref, w_ref, o_ref, acc_ref, *, num_k):
  del tile_expert_ref  # used by the index maps only
  tile, kb = pl.program_id(1), pl.program_id(2)

  @pl.when(tile < num_valid_ref[0])
  def _():
    @pl.when(kb == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
    acc_ref[...] += lax.dot_general(x_ref[...], w_ref[...], (((1,), (0,)), ((), ())),
                                    precision=precision, preferred_element_type=jnp.float32)

    @pl.when(kb == num_k - 1)
    def _():
      o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _check_block(dim, size, block, name, unit):
  if size % block:
    raise ValueError(f"TPU grouped_matmul needs {dim}={size} to be a multiple of "
                     f"{name}={block}.")
  if block != size and block % unit:
    raise ValueError(f"TPU grouped_matmul needs {name}={block} to be a multiple of {unit} "
                     f"or the whole {dim}={size} (Mosaic tiles).")


def grouped_matmul_tpu(xs, w, tile_expert, num_valid_tiles, *, block, interpret):
  """xs [T * tile_rows, K] (tile-ordered rows), w [E, K, M] -> [T * tile_rows, M] in xs.dtype.

  Rows of tiles >= num_valid_tiles[0] are left unwritten.
  """
  padded_rows, k = xs.shape
  _, _, m = w.shape
  tm, bm, bk = block.tile_rows, block.block_m, block.block_k
  _check_block("K", k, bk, "block_k", 128)
  _check_block("M", m, bm, "block_m", 128)
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

  def o_map(j, tile, kb, tile_expert_ref, num_valid_ref):
    # Staying on the last valid tile's block keeps it resident (no write-back) until
    # the next M block starts; skipped steps do not touch it.
    return step(tile, kb, num_valid_ref)[0], j

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(m // bm, padded_rows // tm, num_k),
      in_specs=[pl.BlockSpec((tm, bk), x_map),
                pl.BlockSpec((None, bk, bm), w_map)],
      out_specs=pl.BlockSpec((tm, bm), o_map),
      scratch_shapes=[pltpu.VMEM((tm, bm), jnp.float32)],
  )
  return pl.pallas_call(
      functools.partial(_kernel, num_k=num_k),
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((padded_rows, m), xs.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="grouped_matmul_tpu",
  )(tile_expert, num_valid_tiles, xs, w)
