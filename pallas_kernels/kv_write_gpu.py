"""KV-cache writes for NVIDIA GPUs: one Pallas (Triton backend) kernel for a layer's page
arrays (K and V, or a latent cache's one array) under one slot mapping.

The semantics are `pallas_kernels.kv_write.write_rows`'s, array by array: token t's row
goes to slot slots[t] = page * page_size + offset of every array, stored as rows / scale[h]
(saturated to +-448 with non-finite inputs kept NaN for fp8 pages, a plain cast otherwise);
slots outside [0, num_pages * page_size) write nothing. XLA runs that as one scatter per
array; this is one kernel for a layer's K and V instead. One program moves a block of
tokens of one kv head for every array: masked 2-D loads of the new rows and masked stores
into their page rows, with the pages aliased in place (`launch/bench_kv_write.py`;
docs/DECISIONS.md, "Paged attention (GPU)").

The head dim is tiled as the paged attention kernel tiles it (`key_dim_parts`: a power-
of-two head and a tail, 576 = 512 + 64; a tail under 16 or not a power of two is padded
by masked columns). Lanes that write nothing (tokens past T, dropped slots, padding
columns) are masked, so the GPU touches no memory for them; their page index is also put
out of bounds, which the interpreter's scatter drops, so interpret mode never writes a
masked lane's stale value back over a row another lane writes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import head_scales, key_dim_parts, stored

def _kernel(slots_ref, scale_ref, *refs, n, num_tokens, block_t, has_scale):
  news, outs = refs[:n], refs[2 * n:]  # refs[n:2n]: the pages in, aliased to outs
  num_pages, page_size = outs[0].shape[:2]
  t = pl.program_id(0) * block_t + lax.broadcasted_iota(jnp.int32, (block_t,), 0)
  in_t = t < num_tokens
  t = jnp.minimum(t, num_tokens - 1)
  slot = pltriton.load(slots_ref.at[t], mask=in_t, other=-1)
  ok = in_t & (slot >= 0) & (slot < num_pages * page_size)
  page = jnp.where(ok, lax.div(slot, page_size), num_pages)  # out of bounds: see above
  offset = jnp.where(ok, lax.rem(slot, page_size), 0)
  for i in range(n):
    for start, width, tile in key_dim_parts(outs[i].shape[-1]):
      shape = (block_t, tile)
      col = start + lax.broadcasted_iota(jnp.int32, shape, 1)
      mask = ok[:, None] & (col < start + width)
      x = pltriton.load(news[i].at[jnp.broadcast_to(t[:, None], shape), col], mask=mask,
                        other=0.0)
      y = stored(x, scale_ref[i] if has_scale[i] else None, outs[i].dtype)
      at = (jnp.broadcast_to(page[:, None], shape), jnp.broadcast_to(offset[:, None], shape),
            col)
      pltriton.store(outs[i].at[at], y, mask=mask)


@functools.partial(jax.jit, static_argnames=("block_t", "num_warps", "interpret"))
def write_pages_gpu(pages, new, slots, scales, *, block_t=16, num_warps=4, interpret=False):
  """pages: tuple of [KVH, num_pages, page_size, D_i] arrays (one page geometry, any
  float dtype or float8_e4m3fn), new: tuple of [T, KVH, D_i] rows, slots: [T] int32,
  scales: tuple of [KVH] float or None per array. Returns the updated pages: in place
  when the caller's program donates them (the engine's do), else written into a copy."""
  n = len(pages)
  kv_heads, num_pages, page_size, _ = pages[0].shape
  num_tokens = slots.shape[0]
  if block_t & (block_t - 1):
    raise ValueError(f"block_t must be a power of two, got {block_t}.")
  if num_tokens == 0:  # nothing to write (and no grid to launch)
    return tuple(pages)
  has_scale = tuple(s is not None for s in scales)
  scale = head_scales(*scales, num_kv_heads=kv_heads)  # [KVH, n], 1.0 for None
  kernel = functools.partial(_kernel, n=n, num_tokens=num_tokens, block_t=block_t,
                             has_scale=has_scale)
  page_specs = [pl.BlockSpec((None, num_pages, page_size, p.shape[-1]),
                             lambda t, h: (h, 0, 0, 0)) for p in pages]
  in_specs = [pl.BlockSpec((num_tokens,), lambda t, h: (0,)),
              pl.BlockSpec((None, n), lambda t, h: (h, 0)),
              *[pl.BlockSpec((num_tokens, None, x.shape[-1]), lambda t, h: (0, h, 0))
                for x in new],
              *page_specs]
  out = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(num_tokens, block_t), kv_heads),
      in_specs=in_specs,
      out_specs=page_specs,
      out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pages],
      input_output_aliases={2 + n + i: i for i in range(n)},
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="kv_write_gpu",
  )(slots.astype(jnp.int32), scale, *new, *pages)
  return tuple(out)
