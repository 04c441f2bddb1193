"""KV write by slot mapping: writes land in their slots, dropped slots change nothing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_write import DROP_SLOT, slot_mapping, write_kv

KVH, NUM_PAGES, PS, D = 2, 6, 4, 8


def _pages(seed=0):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((KVH, NUM_PAGES, PS, D)).astype(np.float32)
  v = rng.standard_normal((KVH, NUM_PAGES, PS, D)).astype(np.float32)
  return k, v


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_donated(k_pages, v_pages, k_new, v_new, slots):
  return write_kv(k_pages, v_pages, k_new, v_new, slots)


@pytest.mark.parametrize("batched", [False, True])
def test_writes_land_and_drops_leave_pages_untouched(batched):
  k0, v0 = _pages()
  rng = np.random.default_rng(1)
  slots = np.array([5, DROP_SLOT, 0, NUM_PAGES * PS - 1, NUM_PAGES * PS, 13], np.int32)
  k_new = rng.standard_normal((len(slots), KVH, D)).astype(np.float32)
  v_new = rng.standard_normal((len(slots), KVH, D)).astype(np.float32)

  want_k, want_v = k0.copy(), v0.copy()
  for t, s in enumerate(slots):
    if s < NUM_PAGES * PS:
      want_k[:, s // PS, s % PS] = k_new[t]
      want_v[:, s // PS, s % PS] = v_new[t]

  args = (k_new, v_new, slots)
  if batched:
    args = tuple(x.reshape(2, 3, *x.shape[1:]) for x in args)
  k_in, v_in = jnp.asarray(k0), jnp.asarray(v0)
  k1, v1 = _write_donated(k_in, v_in, *map(jnp.asarray, args))
  # Bit-identical everywhere: written slots hold the new rows, all others the old ones
  # (the last slot of the last page too: DROP_SLOT must not wrap like -1 would).
  np.testing.assert_array_equal(np.asarray(k1), want_k)
  np.testing.assert_array_equal(np.asarray(v1), want_v)


def test_all_dropped_is_identity_and_negative_slots_do_not_wrap():
  k0, v0 = _pages()
  slots = jnp.array([DROP_SLOT, -1, NUM_PAGES * PS + 7], jnp.int32)
  new = jnp.ones((3, KVH, D), jnp.float32)
  k1, v1 = _write_donated(jnp.asarray(k0), jnp.asarray(v0), new, new, slots)
  np.testing.assert_array_equal(np.asarray(k1), k0)
  np.testing.assert_array_equal(np.asarray(v1), v0)


def test_write_casts_to_page_dtype():
  k0, v0 = _pages()
  k0, v0 = jnp.asarray(k0, jnp.bfloat16), jnp.asarray(v0, jnp.bfloat16)
  new = jnp.full((1, KVH, D), 3.0, jnp.float32)
  k1, _ = write_kv(k0, v0, new, new, jnp.array([6], jnp.int32))
  assert k1.dtype == jnp.bfloat16
  assert (np.asarray(k1[:, 1, 2], np.float32) == 3.0).all()


def test_bad_shapes_are_refused():
  k0, v0 = map(jnp.asarray, _pages())
  with pytest.raises(ValueError):
    write_kv(k0, v0, jnp.zeros((2, KVH, D)), jnp.zeros((2, KVH, D)), jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError):
    write_kv(k0, v0, jnp.zeros((2, KVH + 1, D)), jnp.zeros((2, KVH + 1, D)),
             jnp.zeros((2,), jnp.int32))


def test_slot_mapping():
  tables = jnp.array([[4, 1, 3], [0, 5, 2]], jnp.int32)
  positions = jnp.array([[0, 3, 4, 9, 11, 12], [-1, 5, 6, 7, 8, 100]], jnp.int32)
  limit = jnp.array([12, 7], jnp.int32)
  got = np.asarray(slot_mapping(tables, positions, PS, limit))
  want = np.full(positions.shape, DROP_SLOT, np.int64)
  for b in range(2):
    for t, p in enumerate(np.asarray(positions[b])):
      if 0 <= p < limit[b] and p < tables.shape[1] * PS:
        want[b, t] = tables[b, p // PS] * PS + p % PS
  np.testing.assert_array_equal(got, want)
  assert got[0, 4] == 3 * PS + 3 and got[0, 5] == DROP_SLOT  # p = 12 == limit, past the table
  # An int limit applies to every row; positions past the table drop even under it.
  got = np.asarray(slot_mapping(tables, positions, PS, 1000))
  assert got[1, 5] == DROP_SLOT and got[0, 5] == DROP_SLOT and got[1, 4] == 2 * PS


def test_slot_mapping_then_write_round_trip():
  """Tokens written at slot_mapping's slots read back through the block table."""
  tables = jnp.array([[2, 0], [5, 3]], jnp.int32)
  positions = jnp.arange(6, dtype=jnp.int32)[None].repeat(2, 0) + jnp.array([[0], [2]])
  limit = jnp.array([5, 8], jnp.int32)
  slots = slot_mapping(tables, positions, PS, limit)
  rng = np.random.default_rng(2)
  k_new = jnp.asarray(rng.standard_normal((2, 6, KVH, D)), jnp.float32)
  k1, _ = write_kv(*map(jnp.asarray, _pages()), k_new, k_new, slots)
  for b in range(2):
    for t in range(6):
      p = int(positions[b, t])
      if p < int(limit[b]):
        page = int(tables[b, p // PS])
        np.testing.assert_array_equal(k1[:, page, p % PS], k_new[b, t])
