"""KV-cache writes by slot mapping, onto the [KVH, num_pages, page_size, D] page layout.

A slot is page_id * page_size + offset. Tokens whose slot is >= num_pages * page_size
(DROP_SLOT, say) are dropped. The "do not write" marker is a large positive index rather
than -1 because jnp indexing wraps negative indices: slot -1 would overwrite the last
row of the last page. The write is a plain XLA scatter with mode='drop'; the caller jits
it with the pages donated so XLA updates the cache in place.

Quantized (fp8) pages: with per-kv-head scales [KVH], kv head h's row x is stored as
clip(x / scale[h], -448, 448) in float8_e4m3fn, the inverse of what paged attention reads
(page * scale; pallas_kernels.paged_attention). Values past the fp8 range saturate to
+-448 instead of becoming NaN (e4m3fn has no infinity: a plain cast of anything from 464
up gives NaN). A non-finite input is stored as NaN (+-inf too, for want of an fp8
infinity), as a plain cast would store it, so it stays visibly non-finite; the cache
zeroes non-finite values before writing. A scale must be positive and finite. Scales are
applied to pages of any dtype (x / scale, cast), as attention applies them whatever the
dtype; without scales nothing changes.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.common import resolve_backend, stored

DROP_SLOT = 2**31 - 1  # slot meaning "do not write"


def quantize_rows(rows, scale, dtype):
  """[KVH, T, D] rows as stored in pages of `dtype` (`stored`, scale [KVH] or None)."""
  return stored(rows, None if scale is None else scale.astype(jnp.float32)[:, None, None],
                dtype)


def _check(pages, new, slots, scale) -> None:
  kv_heads, _, _, head_dim = pages.shape
  if new.shape[:-2] != slots.shape:
    raise ValueError(f"new rows {new.shape} must be slots.shape {slots.shape} + [KVH, D].")
  if new.shape[-2:] != (kv_heads, head_dim):
    raise ValueError(f"new rows are {new.shape[-2:]}, pages want ({kv_heads}, {head_dim}).")
  if not jnp.issubdtype(slots.dtype, jnp.integer):
    raise ValueError(f"slots must be integer, got {slots.dtype}.")
  if scale is not None and (getattr(scale, "shape", None) != (kv_heads,)
                            or not jnp.issubdtype(scale.dtype, jnp.floating)):
    raise ValueError(f"scale must be a float [KVH={kv_heads}] array (one per kv head) or "
                     f"None, got {getattr(scale, 'dtype', type(scale).__name__)} "
                     f"{getattr(scale, 'shape', '')}.")


def write_rows(pages, new, slots, scale=None):
  """Scatter new rows into their slots of one page array; returns the updated pages.

  pages: [KVH, num_pages, page_size, D], any float dtype or float8_e4m3fn
  new:   [T, KVH, D] or [B, T, KVH, D]
  slots: [T] or [B, T] int32; slot >= num_pages * page_size is dropped.
  scale: None or [KVH] float, the per-kv-head scale the pages are read with: stored is
         new / scale[h], for fp8 pages saturated to +-448 (module docstring).
  Slots that repeat within one call write an unspecified one of their rows.
  """
  _check(pages, new, slots, scale)
  kv_heads, num_pages, page_size, head_dim = pages.shape
  slots = slots.reshape(-1).astype(jnp.int32)
  # [T, KVH, D] -> [KVH, T, D] to match the head-major page layout.
  rows = quantize_rows(new.reshape(-1, kv_heads, head_dim).swapaxes(0, 1), scale,
                       pages.dtype)
  # Out-of-range slots (DROP_SLOT) give out-of-range flat rows, which mode='drop' skips.
  # Negative slots are refused too rather than wrapped.
  slots = jnp.where(slots < 0, DROP_SLOT, slots)
  flat = pages.reshape(kv_heads, num_pages * page_size, head_dim)
  return flat.at[:, slots].set(rows, mode="drop").reshape(pages.shape)


def write_pages(pages, new, slots, scales=None, *, backend=None, interpret=False):
  """`write_rows` for page arrays that share one page geometry and one slot mapping (a
  layer's K and V; a latent cache's one array), each with its own rows and scale.

  pages: tuple of [KVH, num_pages, page_size, D_i]; new: tuple of [..., KVH, D_i] rows
  shaped like slots + [KVH, D_i]; scales: None or a tuple of [KVH] float / None.
  backend: None -> $MTP_JAX_ATTENTION_BACKEND or jax.default_backend() (the attention's
  switch): 'gpu' writes every array in one Pallas kernel (`kv_write_gpu`; interpret=True
  runs it in interpret mode), 'tpu' and 'reference' one XLA scatter per array. The
  stored pages are the same either way. Returns the tuple of updated pages."""
  from pallas_kernels.paged_attention import BACKEND_ENV_VAR

  pages, new = tuple(pages), tuple(new)
  scales = (None,) * len(pages) if scales is None else tuple(scales)
  if not len(pages) == len(new) == len(scales):
    raise ValueError(f"{len(pages)} page arrays, {len(new)} row arrays and {len(scales)} "
                     "scales: one of each per array.")
  for p, x, s in zip(pages, new, scales):
    _check(p, x, slots, s)
    if p.shape[:3] != pages[0].shape[:3]:
      raise ValueError(f"page arrays {p.shape} and {pages[0].shape} differ in their "
                       "[KVH, num_pages, page_size]: one slot mapping cannot serve both.")
  if resolve_backend(backend, BACKEND_ENV_VAR, "KV write") != "gpu":
    return tuple(write_rows(p, x, slots, s) for p, x, s in zip(pages, new, scales))
  from pallas_kernels.kv_write_gpu import write_pages_gpu

  kv_heads = pages[0].shape[0]
  rows = tuple(x.reshape(-1, kv_heads, x.shape[-1]) for x in new)
  return write_pages_gpu(pages, rows, slots.reshape(-1), scales, interpret=interpret)


def write_kv(k_pages, v_pages, k_new, v_new, slots, k_scale=None, v_scale=None, *,
             backend=None, interpret=False):
  """`write_pages` for a K and a V page array alike (k_scale / v_scale: None or [KVH], as
  paged attention reads them); returns (k_pages, v_pages)."""
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ.")
  if k_new.shape != v_new.shape:
    raise ValueError(f"k_new {k_new.shape} and v_new {v_new.shape} differ.")
  return write_pages((k_pages, v_pages), (k_new, v_new), slots, (k_scale, v_scale),
                     backend=backend, interpret=interpret)


def slot_mapping(block_tables, positions, page_size, limit):
  """Slots for token positions: block_tables[b, p // page_size] * page_size + p % page_size.

  block_tables: [B, P] int32; positions: [B, T] int32; limit: [B] int32 or int.
  Positions outside [0, limit) map to DROP_SLOT, and so do positions past the table
  (>= P * page_size): their table index is clamped to [0, P) so the table is never
  read out of bounds, and the slot that read gives is not used.
  """
  max_pages = block_tables.shape[1]
  positions = positions.astype(jnp.int32)
  limit = jnp.asarray(limit, jnp.int32)
  if limit.ndim == 1:
    limit = limit[:, None]
  page_idx = jnp.clip(positions // page_size, 0, max_pages - 1)
  pages = jnp.take_along_axis(block_tables, page_idx, axis=1)
  slots = pages * page_size + positions % page_size
  valid = (positions >= 0) & (positions < limit) & (positions < max_pages * page_size)
  return jnp.where(valid, slots, DROP_SLOT).astype(jnp.int32)

