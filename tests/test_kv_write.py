"""KV write by slot mapping: writes land in their slots, dropped slots change nothing;
fp8 pages store new / scale saturated to +-448 and read back within fp8 precision. The
writes of K and V run through each backend of `write_pages`: XLA's scatter ('reference'),
the GPU kernel in interpret mode on any machine, and natively on a GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import FP8_DTYPE, FP8_MAX
from pallas_kernels.kv_write import (
    DROP_SLOT, slot_mapping, write_kv, write_pages, write_rows)

KVH, NUM_PAGES, PS, D = 2, 6, 4, 8

# (backend, interpret) of write_pages: XLA's scatter, the GPU kernel interpreted, native.
WRITERS = [pytest.param(("reference", False), id="xla"),
           pytest.param(("gpu", True), id="gpu-interpret"),
           pytest.param(("gpu", False), id="gpu-native",
                        marks=pytest.mark.skipif(jax.default_backend() != "gpu",
                                                 reason="needs a gpu device"))]


def _pages(seed=0):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((KVH, NUM_PAGES, PS, D)).astype(np.float32)
  v = rng.standard_normal((KVH, NUM_PAGES, PS, D)).astype(np.float32)
  return k, v


@functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames=("writer",))
def _write_donated(k_pages, v_pages, k_new, v_new, slots, writer=("reference", False)):
  backend, interpret = writer
  return write_kv(k_pages, v_pages, k_new, v_new, slots, backend=backend, interpret=interpret)


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("batched", [False, True])
def test_writes_land_and_drops_leave_pages_untouched(batched, writer):
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
  k1, v1 = _write_donated(k_in, v_in, *map(jnp.asarray, args), writer=writer)
  # Bit-identical everywhere: written slots hold the new rows, all others the old ones
  # (the last slot of the last page too: DROP_SLOT must not wrap like -1 would).
  np.testing.assert_array_equal(np.asarray(k1), want_k)
  np.testing.assert_array_equal(np.asarray(v1), want_v)


@pytest.mark.parametrize("writer", WRITERS)
def test_all_dropped_is_identity_and_negative_slots_do_not_wrap(writer):
  k0, v0 = _pages()
  slots = jnp.array([DROP_SLOT, -1, NUM_PAGES * PS + 7], jnp.int32)
  new = jnp.ones((3, KVH, D), jnp.float32)
  k1, v1 = _write_donated(jnp.asarray(k0), jnp.asarray(v0), new, new, slots, writer=writer)
  np.testing.assert_array_equal(np.asarray(k1), k0)
  np.testing.assert_array_equal(np.asarray(v1), v0)


@pytest.mark.parametrize("writer", WRITERS)
def test_no_tokens_writes_nothing(writer):
  k0, v0 = map(jnp.asarray, _pages())
  empty = jnp.zeros((0, KVH, D), jnp.float32)
  k1, v1 = write_kv(k0, v0, empty, empty, jnp.zeros((0,), jnp.int32), backend=writer[0],
                    interpret=writer[1])
  np.testing.assert_array_equal(np.asarray(k1), np.asarray(k0))
  np.testing.assert_array_equal(np.asarray(v1), np.asarray(v0))


@pytest.mark.parametrize("writer", WRITERS)
def test_write_casts_to_page_dtype(writer):
  k0, v0 = _pages()
  k0, v0 = jnp.asarray(k0, jnp.bfloat16), jnp.asarray(v0, jnp.bfloat16)
  new = jnp.full((1, KVH, D), 3.0, jnp.float32)
  k1, _ = write_kv(k0, v0, new, new, jnp.array([6], jnp.int32), backend=writer[0],
                   interpret=writer[1])
  assert k1.dtype == jnp.bfloat16
  assert (np.asarray(k1[:, 1, 2], np.float32) == 3.0).all()


def test_bad_shapes_are_refused():
  k0, v0 = map(jnp.asarray, _pages())
  with pytest.raises(ValueError):
    write_kv(k0, v0, jnp.zeros((2, KVH, D)), jnp.zeros((2, KVH, D)), jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError):
    write_kv(k0, v0, jnp.zeros((2, KVH + 1, D)), jnp.zeros((2, KVH + 1, D)),
             jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="one slot mapping"):
    write_pages((k0, k0[:, :3]), (jnp.zeros((2, KVH, D)),) * 2, jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="one of each"):
    write_pages((k0, v0), (jnp.zeros((2, KVH, D)),), jnp.zeros((2,), jnp.int32))


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


def _fp8_pages(fill=np.nan):
  return jnp.full((KVH, NUM_PAGES, PS, D), fill, FP8_DTYPE)


def _bits(x):
  return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("writer", WRITERS)
def test_fp8_write_round_trip(writer):
  """Rows of magnitudes 1 and 100 (one per head) with amax / 448 scales read back as
  page * scale within e4m3 precision: half an ulp, 2^-4 relatively, or 2^-10 * scale
  (half the smallest subnormal) near zero. The stored bytes are exactly the cast of
  new / scale."""
  rng = np.random.default_rng(3)
  slots = np.array([0, 5, 13, 23], np.int32)
  mag = np.array([1.0, 100.0], np.float32)
  k_new = (rng.standard_normal((len(slots), KVH, D)) * mag[:, None]).astype(np.float32)
  v_new = (rng.standard_normal((len(slots), KVH, D)) * mag[:, None]).astype(np.float32)
  k_scale = np.abs(k_new).max(axis=(0, 2)) / FP8_MAX
  v_scale = np.abs(v_new).max(axis=(0, 2)) / FP8_MAX
  k1, v1 = write_kv(_fp8_pages(), _fp8_pages(), jnp.asarray(k_new), jnp.asarray(v_new),
                    jnp.asarray(slots), jnp.asarray(k_scale), jnp.asarray(v_scale),
                    backend=writer[0], interpret=writer[1])
  assert k1.dtype == v1.dtype == FP8_DTYPE
  for pages, new, scale in ((k1, k_new, k_scale), (v1, v_new, v_scale)):
    stored = np.asarray(pages)[:, slots // PS, slots % PS].swapaxes(0, 1)  # [T, KVH, D]
    want = np.clip(new / scale[:, None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    np.testing.assert_array_equal(_bits(stored), _bits(want))
    got = stored.astype(np.float32) * scale[:, None]
    assert (np.abs(got - new) <= 2.0 ** -4 * np.abs(new) + 2.0 ** -10 * scale[:, None]).all()
    # Every other slot still holds the NaN it started with.
    rest = np.ones((NUM_PAGES * PS,), bool)
    rest[slots] = False
    assert np.isnan(np.asarray(pages, np.float32).reshape(KVH, -1, D)[:, rest]).all()


@pytest.mark.parametrize("writer", WRITERS)
def test_fp8_write_saturates_and_keeps_non_finite_nan(writer):
  """Finite values past +-448 after the scale (with a tiny scale x / scale even
  overflows f32) are stored as +-448, never NaN; NaN and +-inf inputs are stored as NaN."""
  x = np.array([447.0, 500.0, -1e4, 3e38, -3e38, 1e-3, 0.0, np.nan, np.inf, -np.inf],
               np.float32)
  finite = np.isfinite(x)
  new = jnp.asarray(np.broadcast_to(x[:, None, None], (len(x), KVH, D)))
  slots = jnp.arange(len(x), dtype=jnp.int32)
  for scale in (None, np.array([1.0, 1e-3], np.float32)):
    (got,) = write_pages((_fp8_pages(0.0),), (new,), slots,
                         (None if scale is None else jnp.asarray(scale),),
                         backend=writer[0], interpret=writer[1])
    got = np.asarray(got, np.float32).reshape(KVH, -1, D)[:, :len(x)]  # [KVH, T, D]
    s = np.ones(KVH, np.float32) if scale is None else scale
    with np.errstate(over="ignore"):
      want = np.where(finite, np.clip(x / s[:, None], -FP8_MAX, FP8_MAX), np.nan)
    want = want.astype(FP8_DTYPE).astype(np.float32)                    # [KVH, T]
    np.testing.assert_array_equal(got, np.broadcast_to(want[..., None], got.shape))
    assert np.isfinite(got[:, finite]).all() and np.isnan(got[:, ~finite]).all()
    assert (np.abs(got[:, 1:5]) == FP8_MAX).all()   # 500, -1e4, +-3e38
  assert (np.abs(got[1, 0]) == FP8_MAX).all()       # 447 / 1e-3


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("batched", [False, True])
def test_fp8_dropped_slots_leave_pages_untouched(batched, writer):
  k0 = jnp.asarray(np.random.default_rng(4).standard_normal((KVH, NUM_PAGES, PS, D)),
                   FP8_DTYPE)
  slots = np.array([DROP_SLOT, -1, NUM_PAGES * PS, 2], np.int32)
  new = np.full((len(slots), KVH, D), 3.0, np.float32)
  scale = jnp.array([0.5, 2.0], jnp.float32)
  if batched:
    slots, new = slots.reshape(2, 2), new.reshape(2, 2, KVH, D)
  k1, _ = _write_donated_scaled(k0.copy(), k0.copy(), jnp.asarray(new), jnp.asarray(new),
                                jnp.asarray(slots), scale, scale, writer=writer)
  want = np.asarray(k0).copy()
  want[:, 0, 2] = np.array([6.0, 1.5], np.float32)[:, None].astype(FP8_DTYPE)
  np.testing.assert_array_equal(_bits(k1), _bits(want))


@functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames=("writer",))
def _write_donated_scaled(k_pages, v_pages, k_new, v_new, slots, k_scale, v_scale, writer):
  return write_kv(k_pages, v_pages, k_new, v_new, slots, k_scale, v_scale,
                  backend=writer[0], interpret=writer[1])


def test_scale_on_plain_pages_divides_and_is_checked():
  """Scales mean the same for every page dtype: bf16 pages store new / scale (no clip)."""
  k0 = jnp.zeros((KVH, NUM_PAGES, PS, D), jnp.bfloat16)
  new = jnp.full((1, KVH, D), 1000.0, jnp.float32)
  got = write_rows(k0, new, jnp.array([6], jnp.int32), jnp.array([0.5, 2.0], jnp.float32))
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got[:, 1, 2, 0], np.float32), [2000.0, 500.0])
  with pytest.raises(ValueError, match="scale must be"):
    write_rows(k0, new, jnp.array([6], jnp.int32), jnp.ones((KVH + 1,), jnp.float32))
  with pytest.raises(ValueError, match="scale must be"):
    write_rows(k0, new, jnp.array([6], jnp.int32), jnp.ones((KVH,), jnp.int32))


@pytest.mark.parametrize("writer", WRITERS[1:])
@pytest.mark.parametrize("dims,dtype,tokens", [
    ((128, 128), jnp.bfloat16, 70),        # a prefill chunk: token blocks, a ragged last
    ((192, 128), jnp.bfloat16, 37),        # D != Dv, a key dim split 128 + 64
    ((576,), jnp.bfloat16, 19),            # a latent cache's one array: 512 + 64
    ((20, 20), jnp.float32, 1),            # one decode row; a tail padded by masked columns
    ((128, 128), FP8_DTYPE, 70),           # quantized, per-head scales
], ids=["prefill", "d192-dv128", "latent576", "d20-one-row", "fp8"])
def test_kernel_writes_what_xla_writes(dims, dtype, tokens, writer):
  """The kernel's pages equal XLA's scatter bit for bit: random slots (past one row, some
  dropped and one negative), bf16 rows of magnitude up to ~100, every array of a layer."""
  rng = np.random.default_rng(5)
  kvh, num_pages, ps = (4, 12, 16) if tokens > 40 else (2, 7, 16)
  pages = tuple(jnp.asarray(rng.standard_normal((kvh, num_pages, ps, d)), dtype) for d in dims)
  new = tuple(jnp.asarray(rng.standard_normal((tokens, kvh, d)) * 30, jnp.bfloat16)
              for d in dims)
  slots = rng.permutation(num_pages * ps)[:tokens].astype(np.int32)
  if tokens > 1:
    slots[::5] = DROP_SLOT
    slots[1] = -3
  scales = tuple(jnp.asarray(rng.uniform(0.1, 2.0, (kvh,)), jnp.float32)
                 if dtype == FP8_DTYPE else None for _ in dims)
  want = write_pages(pages, new, jnp.asarray(slots), scales, backend="reference")
  got = write_pages(tuple(jnp.array(p) for p in pages), new, jnp.asarray(slots), scales,
                    backend=writer[0], interpret=writer[1])
  for w, g in zip(want, got):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(_bits(g) if dtype == FP8_DTYPE else np.asarray(g),
                                  _bits(w) if dtype == FP8_DTYPE else np.asarray(w))


@pytest.mark.parametrize("dims, dtype", [((128, 128), jnp.bfloat16), ((128, 128), FP8_DTYPE),
                                         ((192, 128), jnp.bfloat16), ((576,), jnp.bfloat16)],
                         ids=["bf16", "fp8", "d192-dv128", "latent576"])
def test_gpu_kernel_lowers_to_triton(dims, dtype):
  """The GPU kernel's Triton lowering (masks, fp8 scales, split key dims) on any host: what
  interpret mode does not cover, short of compiling PTX on a GPU."""
  kvh, num_pages, ps, tokens = 4, 12, 16, 37
  pages = tuple(jax.ShapeDtypeStruct((kvh, num_pages, ps, d), dtype) for d in dims)
  new = tuple(jax.ShapeDtypeStruct((tokens, kvh, d), jnp.bfloat16) for d in dims)
  scales = tuple(jax.ShapeDtypeStruct((kvh,), jnp.float32) if dtype == FP8_DTYPE else None
                 for _ in dims)
  fn = jax.jit(lambda p, n, s, sc: write_pages(p, n, s, sc, backend="gpu", interpret=False))
  text = fn.trace(pages, new, jax.ShapeDtypeStruct((tokens,), jnp.int32), scales).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count('name = "kv_write_gpu"') == 1
