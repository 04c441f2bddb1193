"""KV-cache writes by slot mapping, onto the [KVH, num_pages, page_size, D] page layout.

A slot is page_id * page_size + offset. Tokens whose slot is >= num_pages * page_size
(DROP_SLOT, say) are dropped. The "do not write" marker is a large positive index rather
than -1 because jnp indexing wraps negative indices: slot -1 would overwrite the last
row of the last page. The write is a plain XLA scatter with mode='drop'; the caller jits
it with the pages donated so XLA updates the cache in place.
"""

from __future__ import annotations

import jax.numpy as jnp

DROP_SLOT = 2**31 - 1  # slot meaning "do not write"


def write_rows(pages, new, slots):
  """Scatter new rows into their slots of one page array; returns the updated pages.

  pages: [KVH, num_pages, page_size, D]
  new:   [T, KVH, D] or [B, T, KVH, D]
  slots: [T] or [B, T] int32; slot >= num_pages * page_size is dropped.
  Slots that repeat within one call write an unspecified one of their rows.
  """
  kv_heads, num_pages, page_size, head_dim = pages.shape
  if new.shape[:-2] != slots.shape:
    raise ValueError(f"new rows {new.shape} must be slots.shape {slots.shape} + [KVH, D].")
  if new.shape[-2:] != (kv_heads, head_dim):
    raise ValueError(f"new rows are {new.shape[-2:]}, pages want ({kv_heads}, {head_dim}).")
  if not jnp.issubdtype(slots.dtype, jnp.integer):
    raise ValueError(f"slots must be integer, got {slots.dtype}.")

  slots = slots.reshape(-1).astype(jnp.int32)
  # [T, KVH, D] -> [KVH, T, D] to match the head-major page layout.
  rows = new.reshape(-1, kv_heads, head_dim).swapaxes(0, 1).astype(pages.dtype)
  # Out-of-range slots (DROP_SLOT) give out-of-range flat rows, which mode='drop' skips.
  # Negative slots are refused too rather than wrapped.
  slots = jnp.where(slots < 0, DROP_SLOT, slots)
  flat = pages.reshape(kv_heads, num_pages * page_size, head_dim)
  return flat.at[:, slots].set(rows, mode="drop").reshape(pages.shape)


def write_kv(k_pages, v_pages, k_new, v_new, slots):
  """`write_rows` for a K and a V page array alike; returns (k_pages, v_pages)."""
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ.")
  if k_new.shape != v_new.shape:
    raise ValueError(f"k_new {k_new.shape} and v_new {v_new.shape} differ.")
  return write_rows(k_pages, k_new, slots), write_rows(v_pages, v_new, slots)


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

