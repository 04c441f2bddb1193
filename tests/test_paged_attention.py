"""Paged attention: reference vs numpy, kernels vs reference (interpret on CPU, native on GPU/TPU).

Every page and slot that no query row may see is NaN, and unused block-table entries
point at NaN pages, so an out-of-bounds or unmasked read shows up as NaN in the output.
Cases with attention sinks, a value head dim other than the key head dim or scaled (fp8)
pages also check every backend against the numpy oracle directly.

fp8 cases store K and V as float8_e4m3fn with per-kv-head scales that differ between
heads and between K and V, so a kernel that ignores, swaps or misassigns a scale fails;
the oracle attends over the dequantized pages (page * scale) in float64.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import tile_full_range, tile_kv_range, visible_mask
from pallas_kernels.paged_attention import (
    BlockConfig, default_block_config, paged_attention, paged_attention_reference)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  q_len: int
  group: int
  page_size: int
  kv_lens: tuple[int, ...]
  dtype: type = jnp.float32
  window: int | None = None
  soft_cap: float | None = None
  overrides: tuple = ()          # BlockConfig fields set on top of the default
  max_pages: int | None = None   # default: enough for max(kv_lens) plus one unused entry
  kv_heads: int = 2
  head_dim: int = 32
  v_dim: int | None = None       # value head dim; default head_dim
  sinks: bool = False            # per-query-head attention-sink logits
  kv_dtype: type | None = None   # page dtype; default dtype (q's)
  scales: bool = False           # per-kv-head k_scale / v_scale (else None: 1.0)


CASES = {c.name: c for c in [
    # kv_len around page boundaries, plus an inactive (kv_len 0) row.
    Case("decode_g1_ps8", 1, 1, 8, (7, 8, 9, 0)),
    Case("decode_g4_ps16_bf16", 1, 4, 16, (15, 16, 17, 45), jnp.bfloat16,
         overrides=(("pages_per_block", 1),)),
    Case("q2_g8_ps8_window", 2, 8, 8, (9, 16, 23), window=6,
         overrides=(("pages_per_block", 2),)),
    Case("q4_g4_ps16_window_softcap_bf16", 4, 4, 16, (16, 33, 4), jnp.bfloat16, window=20,
         soft_cap=2.0, overrides=(("pages_per_block", 2), ("num_splits", 2))),
    # kv_len < Q: the first rows see nothing (padding rows of a verify batch).
    Case("q8_g1_ps8_short", 8, 1, 8, (8, 5, 17)),
    Case("q4_g8_ps8_split3_bf16", 4, 8, 8, (31, 32, 33), jnp.bfloat16,
         overrides=(("pages_per_block", 2), ("num_splits", 3))),
    # Chunked prefill: several row tiles per kv head, causal tile ranges.
    Case("prefill64_g4_ps16", 64, 4, 16, (64, 100, 0), overrides=(("pages_per_block", 2),)),
    Case("prefill64_g1_ps8_window_bf16", 64, 1, 8, (70, 130), jnp.bfloat16, window=32,
         overrides=(("pages_per_block", 2),)),
    # the default prefill tiling (>= 128 packed rows: 128-row tiles over 64 kv positions)
    Case("prefill64_g4_ps8_window_default_bf16", 64, 4, 8, (64, 150, 0), jnp.bfloat16,
         window=90),
    Case("prefill32_g8_ps16_d192_dv128_sinks_default_bf16", 32, 8, 16, (32, 77), jnp.bfloat16,
         head_dim=192, v_dim=128, sinks=True),
    Case("decode_g4_ps8_split4", 1, 4, 8, (150, 3, 64), overrides=(("pages_per_block", 2),
                                                                 ("num_splits", 4))),
    # kv range past the table (capacity 24): the last block's table index is clamped.
    Case("q2_g4_ps8_past_table", 2, 4, 8, (20, 30), max_pages=3,
         overrides=(("pages_per_block", 2),)),
    # Attention sinks. Split-K: the sink must count once, not once per split (rows at
    # kv_len 5 leave splits 1 and 2 empty; kv_len 0 sees nothing).
    Case("decode_g4_ps8_sinks_split3", 1, 4, 8, (0, 5, 40, 17), sinks=True,
         overrides=(("pages_per_block", 2), ("num_splits", 3))),
    Case("q4_g2_ps8_window_sinks_split2_bf16", 4, 2, 8, (2, 19, 30), jnp.bfloat16,
         window=20, sinks=True, overrides=(("pages_per_block", 2), ("num_splits", 2))),
    # Value head dim != key head dim; 48 = 32 + 16 is not a power of two.
    Case("q4_g2_ps8_d48_dv32_split2", 4, 2, 8, (9, 33, 3), head_dim=48, v_dim=32,
         overrides=(("pages_per_block", 2), ("num_splits", 2))),
    # MiMo-V2-Flash sliding layer, scaled down: D 192 = 128 + 64, Dv 128, sinks, window.
    Case("decode_g8_ps16_d192_dv128_window_sinks_bf16", 1, 8, 16, (0, 40, 150),
         jnp.bfloat16, window=32, sinks=True, kv_heads=1, head_dim=192, v_dim=128,
         overrides=(("pages_per_block", 1), ("num_splits", 2))),
    # D 40 = 32 + 8 and Dv 24: parts padded by masked loads on GPU.
    Case("q2_g4_ps8_d40_dv24_sinks", 2, 4, 8, (12, 1), head_dim=40, v_dim=24, sinks=True,
         overrides=(("pages_per_block", 2),)),
    # fp8 pages with per-kv-head scales. Decode, GQA 4, split-K 3 (kv_len 0 and 15 leave
    # splits empty).
    Case("decode_g4_ps16_fp8_split3", 1, 4, 16, (0, 15, 40, 77), jnp.bfloat16, kv_dtype=FP8,
         scales=True, overrides=(("pages_per_block", 1), ("num_splits", 3))),
    # Verify Q = 4 with a window and sinks, split-K 2.
    Case("q4_g2_ps8_fp8_window_sinks_split2", 4, 2, 8, (2, 19, 30), jnp.bfloat16, window=12,
         sinks=True, kv_dtype=FP8, scales=True,
         overrides=(("pages_per_block", 2), ("num_splits", 2))),
    # f32 q over fp8 pages, D 48 = 32 + 16, Dv 32, soft cap (k_scale applies before it).
    Case("q2_g4_ps8_d48_dv32_fp8_softcap_f32_split2", 2, 4, 8, (9, 33, 3), soft_cap=3.0,
         head_dim=48, v_dim=32, kv_dtype=FP8, scales=True,
         overrides=(("pages_per_block", 2), ("num_splits", 2))),
    # MiMo-V2-Flash sliding shape (D 192, Dv 128, window, sinks) over fp8 pages.
    Case("decode_g8_ps16_d192_dv128_fp8_window_sinks", 1, 8, 16, (0, 40, 150),
         jnp.bfloat16, window=32, sinks=True, head_dim=192, v_dim=128, kv_dtype=FP8,
         scales=True, overrides=(("pages_per_block", 1), ("num_splits", 2))),
    # fp8 without scales (1.0), and scales over bf16 pages (they apply whatever the dtype).
    Case("decode_g1_ps8_fp8_no_scales_f32", 1, 1, 8, (7, 8, 9, 0), kv_dtype=FP8),
    # the GPU default for fp8 pages with many programs: 64 kv positions, 2 warps, 3 stages
    Case("q4_g4_ps16_fp8_2warps", 4, 4, 16, (0, 15, 64, 77), jnp.bfloat16, kv_dtype=FP8,
         scales=True, overrides=(("pages_per_block", 4), ("num_splits", 1),
                                 ("num_warps", 2), ("num_stages", 3))),
    Case("q4_g4_ps16_bf16_pages_scales", 4, 4, 16, (16, 33, 4), jnp.bfloat16, scales=True,
         overrides=(("pages_per_block", 2),)),
    # Page size 32: what the TPU kernel needs for 1-byte pages (whole (32, 128) tiles).
    Case("q4_g2_ps32_fp8_window_sinks", 4, 2, 32, (3, 40, 70), jnp.bfloat16, window=40,
         sinks=True, kv_dtype=FP8, scales=True, overrides=(("pages_per_block", 2),)),
    Case("decode_g4_ps32_d48_dv32_fp8_f32", 1, 4, 32, (0, 33, 64), head_dim=48, v_dim=32,
         kv_dtype=FP8, scales=True, overrides=(("pages_per_block", 1),)),
]}
# The TPU interpreter is slow: one case per axis value rather than all of them.
TPU_CASES = ["decode_g1_ps8", "decode_g4_ps16_bf16", "q2_g8_ps8_window",
             "q4_g4_ps16_window_softcap_bf16", "q8_g1_ps8_short", "prefill64_g4_ps16",
             "q2_g4_ps8_past_table", "q4_g2_ps8_window_sinks_split2_bf16",
             "decode_g8_ps16_d192_dv128_window_sinks_bf16", "q2_g4_ps8_d40_dv24_sinks",
             "q4_g4_ps16_bf16_pages_scales", "q4_g2_ps32_fp8_window_sinks",
             "decode_g4_ps32_d48_dv32_fp8_f32"]


def make_scales(case: Case):
  """(k_scale, v_scale) [KVH] f32, or (None, None). They differ between heads (x2.5 per
  head) and between K and V (opposite orders), and are small enough that the stored fp8
  values span most of the e4m3 range (|N(0, 1)| / 0.015 < 448)."""
  if not case.scales:
    return None, None
  h = np.arange(case.kv_heads)
  return (jnp.asarray(0.015 * 2.5 ** h, jnp.float32),
          jnp.asarray(0.06 / 2.5 ** h, jnp.float32))


def make_inputs(case: Case, seed: int = 0):
  """Random q and a NaN-filled page pool holding only the KV some query row can see.

  With scales the logical K and V are N(0, 1) and the pages hold them divided by their
  head's scale, cast to the page dtype (fp8 NaN stays NaN)."""
  rng = np.random.default_rng(seed)
  batch, ps, kvh, d = len(case.kv_lens), case.page_size, case.kv_heads, case.head_dim
  dv = case.v_dim or d
  max_pages = case.max_pages or -(-max(case.kv_lens) // ps) + 1
  num_pages = batch * max_pages + 3
  k = np.full((kvh, num_pages, ps, d), np.nan, np.float32)
  v = np.full((kvh, num_pages, ps, dv), np.nan, np.float32)
  # Distinct pages in random order; entries past what kv_len needs stay NaN pages.
  tables = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
  for b, kv_len in enumerate(case.kv_lens):
    lo = 0 if case.window is None else max(0, kv_len - case.q_len + 1 - case.window)
    for p in range(lo, min(kv_len, max_pages * ps)):
      page = tables[b, p // ps]
      k[:, page, p % ps] = rng.standard_normal((kvh, d))
      v[:, page, p % ps] = rng.standard_normal((kvh, dv))
  q = rng.standard_normal((batch, case.q_len, kvh * case.group, d)).astype(np.float32)
  k_scale, v_scale = make_scales(case)
  if case.scales:
    k = k / np.asarray(k_scale)[:, None, None, None]
    v = v / np.asarray(v_scale)[:, None, None, None]
  page = lambda x: jnp.asarray(x, case.kv_dtype or case.dtype)
  return (jnp.asarray(q, case.dtype), page(k), page(v), jnp.asarray(tables, jnp.int32),
          jnp.asarray(case.kv_lens, jnp.int32))


def make_sinks(case: Case, seed: int = 1):
  """Sink logits [Hq] large enough to move the output well past the tolerances."""
  if not case.sinks:
    return None
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.uniform(0.0, 4.0, case.kv_heads * case.group), jnp.float32)


def case_kwargs(case: Case):
  k_scale, v_scale = make_scales(case)
  return dict(sliding_window=case.window, soft_cap=case.soft_cap, sinks=make_sinks(case),
              k_scale=k_scale, v_scale=v_scale)


def dequantize(pages, scale):
  """Pages as float64 logical values: page * scale[h] (scale None: 1.0)."""
  pages = np.asarray(pages, np.float64)
  return pages if scale is None else pages * np.asarray(scale, np.float64)[:, None, None, None]


def numpy_attention(q, k_pages, v_pages, block_tables, kv_lens, *, window=None,
                    soft_cap=None, sinks=None):
  """Row-by-row dense softmax in float64, reading positions through the table.

  sinks [Hq]: appended as one more logit column, softmaxed, then dropped (transformers'
  gpt-oss / MiMo-V2 eager attention)."""
  q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
  block_tables, kv_lens = np.asarray(block_tables), np.asarray(kv_lens)
  batch, q_len, num_heads, d = q.shape
  kvh, _, ps, dv = v_pages.shape
  group = num_heads // kvh
  out = np.zeros((batch, q_len, num_heads, dv))
  for b in range(batch):
    for i in range(q_len):
      end = kv_lens[b] - q_len + i + 1
      start = 0 if window is None else max(0, end - window)
      positions = range(max(start, 0), min(end, block_tables.shape[1] * ps))
      if not positions:
        continue  # with a sink: softmax([s]) = [1], dropped: no value, output 0
      pages = [block_tables[b, p // ps] for p in positions]
      for h in range(num_heads):
        kk = np.stack([k_pages[h // group, pg, p % ps] for pg, p in zip(pages, positions)])
        vv = np.stack([v_pages[h // group, pg, p % ps] for pg, p in zip(pages, positions)])
        logits = kk @ q[b, i, h] / math.sqrt(d)
        if soft_cap is not None:
          logits = soft_cap * np.tanh(logits / soft_cap)
        if sinks is not None:
          logits = np.concatenate([logits, [float(sinks[h])]])
        w = np.exp(logits - logits.max())
        probs = w / w.sum()
        if sinks is not None:
          probs = probs[:-1]
        out[b, i, h] = probs @ vv
  return out


def numpy_oracle(case: Case, args, scales=None):
  """The oracle on the case's inputs, over pages dequantized with `scales` (default: the
  case's own (k_scale, v_scale))."""
  q, k, v, tables, kv_lens = args
  k_scale, v_scale = make_scales(case) if scales is None else scales
  return numpy_attention(q, dequantize(k, k_scale), dequantize(v, v_scale), tables, kv_lens,
                         window=case.window, soft_cap=case.soft_cap, sinks=make_sinks(case))


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_numpy(name):
  case = CASES[name]
  args = make_inputs(case)
  got = paged_attention_reference(*args, **case_kwargs(case))
  want = numpy_oracle(case, args)
  tol = TOL[case.dtype]
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


class PagedAttentionTest:
  """Kernel vs reference. Subclasses pick the backend, interpret mode and cases."""

  backend = "gpu"
  interpret = False
  platform = "gpu"          # native runs need jax.default_backend() == platform
  cases = list(CASES)

  @pytest.fixture(autouse=True)
  def _require_platform(self):
    if not self.interpret and jax.default_backend() != self.platform:
      pytest.skip(f"needs a {self.platform} device")

  def config(self, case, q):
    overrides = dict(case.overrides)
    if self.backend == "tpu":
      overrides.pop("num_splits", None)
    batch, q_len, num_heads, _ = q.shape
    max_pages = case.max_pages or -(-max(case.kv_lens) // case.page_size) + 1
    cfg = default_block_config(batch, q_len, num_heads, case.kv_heads, case.page_size,
                               max_pages, self.backend, num_cores=132)
    return dataclasses.replace(cfg, **overrides)

  def test_matches_reference(self, name):
    case = CASES[name]
    q, k, v, tables, kv_lens = make_inputs(case)
    kw = case_kwargs(case)
    got = paged_attention(q, k, v, tables, kv_lens, backend=self.backend,
                          interpret=self.interpret, block_config=self.config(case, q), **kw)
    want = paged_attention_reference(q, k, v, tables, kv_lens, **kw)
    assert got.dtype == q.dtype and got.shape == (*q.shape[:3], v.shape[3])
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any()
    tol = TOL[case.dtype]
    np.testing.assert_allclose(got, np.asarray(want, np.float32), atol=tol, rtol=tol)
    if case.sinks or case.v_dim or case.scales or case.kv_dtype:
      want = numpy_oracle(case, (q, k, v, tables, kv_lens))
      np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    # Rows that see nothing are exactly zero.
    for b, kv_len in enumerate(case.kv_lens):
      for i in range(case.q_len):
        if kv_len - case.q_len + i + 1 <= 0:
          assert (got[b, i] == 0).all()


def pytest_generate_tests(metafunc):
  if metafunc.cls is not None and "name" in metafunc.fixturenames:
    metafunc.parametrize("name", metafunc.cls.cases)


class TestPagedAttentionGPU(PagedAttentionTest):
  pass


class TestPagedAttentionGPUInterpret(TestPagedAttentionGPU):
  interpret = True


class TestPagedAttentionTPU(PagedAttentionTest):
  backend = "tpu"
  platform = "tpu"
  cases = TPU_CASES


class TestPagedAttentionTPUInterpret(TestPagedAttentionTPU):
  interpret = True


def test_default_config_gpu_kernel_matches_reference():
  case = CASES["decode_g4_ps8_split4"]
  args = make_inputs(case)
  got = paged_attention(*args, backend="gpu", interpret=True)
  np.testing.assert_allclose(got, paged_attention_reference(*args), atol=2e-5, rtol=2e-5)


def test_gpu_default_splits_kv_only_below_a_wave_of_programs():
  # Hq 32 / KVH 8, page 16, 1k context, 132 SMs: B x 8 programs (Q=1 or the verify's Q=4)
  def splits(batch, q_len):
    return default_block_config(batch, q_len, 32, 8, 16, 64, "gpu", num_cores=132).num_splits

  assert [splits(b, 1) for b in (1, 8, 16)] == [8, 5, 3]  # 8, 64, 128 programs
  assert [splits(b, q) for b in (17, 32, 64) for q in (1, 4)] == [1] * 6  # 136 and more
  # never more splits than kv blocks (256 positions: 2 blocks of 8 pages)
  assert default_block_config(1, 1, 32, 8, 16, 16, "gpu", num_cores=132).num_splits == 2


def test_gpu_default_fp8_pages_take_two_warps_from_2_5_programs_an_sm():
  # Hq 32 / KVH 8, page 16, 4k context, 132 SMs: B x 8 programs
  def cfg(batch, kv_dtype, q_len=1):
    return default_block_config(batch, q_len, 32, 8, 16, 256, "gpu", num_cores=132,
                                kv_dtype=kv_dtype)

  for batch, q_len in ((64, 1), (64, 4), (42, 1)):  # 512 and 336 programs
    got = cfg(batch, FP8, q_len)
    assert (got.pages_per_block, got.num_splits, got.rows_per_block, got.num_warps,
            got.num_stages) == (4, 1, 16, 2, 3)
  assert cfg(64, jnp.bfloat16) == cfg(64, None)  # bf16 pages keep theirs
  assert cfg(41, FP8) == cfg(41, None)  # 328 programs: fewer than 2.5 an SM
  assert cfg(64, FP8, q_len=32) == cfg(64, None, q_len=32)  # a prefill chunk's tiling


@pytest.mark.parametrize("q_len,group,rows,window", [
    (1, 4, 16, None), (4, 4, 16, None), (4, 4, 16, 20), (256, 4, 128, None),
    (64, 1, 64, 32), (8, 1, 16, 5), (2, 8, 16, 6)])
def test_tile_ranges_match_the_mask(q_len, group, rows, window):
  """[lo, hi) of tile_kv_range holds every position some row of the tile sees, and that of
  tile_full_range exactly the positions every row sees: the kernels read the first range
  with masks and run blocks inside the second without any."""
  capacity = 96
  tiles = -(-q_len * group // rows)
  pos = np.arange(capacity + 8)
  for kv_len in (0, 1, q_len - 1, q_len, q_len + 7, 50, capacity, capacity + 5):
    for tile in range(tiles):
      row = tile * rows + np.arange(rows)
      seen = np.asarray(visible_mask(row[:, None], pos[None, :], kv_len=kv_len, q_len=q_len,
                                     group=group, window=window, kv_capacity=capacity))
      kw = dict(kv_len=kv_len, rows_per_block=rows, q_len=q_len, group=group, window=window,
                kv_capacity=capacity)
      lo, hi = (int(x) for x in tile_kv_range(tile, **kw))
      some = np.flatnonzero(seen.any(axis=0))
      assert ((some >= lo) & (some < hi)).all(), (kv_len, tile, lo, hi)
      lo, hi = (int(x) for x in tile_full_range(tile, **kw))
      every = np.flatnonzero(seen.all(axis=0))
      assert every.tolist() == list(range(lo, hi)), (kv_len, tile, lo, hi, every)


def test_backend_dispatch(monkeypatch):
  case = CASES["decode_g1_ps8"]
  args = make_inputs(case)
  want = paged_attention_reference(*args)
  monkeypatch.delenv("MTP_JAX_ATTENTION_BACKEND", raising=False)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(paged_attention(*args), want)
  monkeypatch.setenv("MTP_JAX_ATTENTION_BACKEND", "reference")
  np.testing.assert_array_equal(paged_attention(*args), want)
  with pytest.raises(ValueError, match="backend"):
    paged_attention(*args, backend="cuda-graph")


def test_sm_scale_is_used():
  case = CASES["decode_g1_ps8"]
  args = make_inputs(case)
  a = paged_attention_reference(*args, sm_scale=0.5)
  b = paged_attention(*args, sm_scale=0.5, backend="gpu", interpret=True)
  np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
  assert not np.allclose(a, paged_attention_reference(*args))


@pytest.mark.parametrize("kwargs", [dict(pages_per_block=3), dict(rows_per_block=4),
                                    dict(num_splits=0), dict(num_warps=2.5)])
def test_block_config_validates(kwargs):
  with pytest.raises(ValueError):
    BlockConfig(**kwargs)


def test_bad_inputs_are_refused():
  q, k, v, tables, kv_lens = make_inputs(CASES["decode_g1_ps8"])
  with pytest.raises(ValueError, match="multiple"):
    paged_attention_reference(q[:, :, :1], k, v, tables, kv_lens)
  with pytest.raises(ValueError, match="k_pages and v_pages"):
    paged_attention_reference(q, k, v[:, :-1], tables, kv_lens)
  with pytest.raises(ValueError, match="kv_lens"):
    paged_attention_reference(q, k, v, tables, kv_lens[:2])
  with pytest.raises(ValueError, match="int32"):
    paged_attention_reference(q, k, v, tables, kv_lens.astype(jnp.float32))


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.sinks])
def test_sink_cases_are_sensitive(name):
  """The sink cases tell a correct kernel from one that ignores the sink or adds it once
  per KV split (split-K partials each with e^s: the combined sum holds S * e^s)."""
  case = CASES[name]
  q, k, v, tables, kv_lens = make_inputs(case)
  want = numpy_oracle(case, (q, k, v, tables, kv_lens))
  k_scale, v_scale = make_scales(case)
  args = (q, dequantize(k, k_scale), dequantize(v, v_scale), tables, kv_lens)
  splits = dict(case.overrides).get("num_splits", 1)
  wrong = [numpy_attention(*args, window=case.window, soft_cap=case.soft_cap)]
  if splits > 1:
    wrong.append(numpy_attention(*args, window=case.window, soft_cap=case.soft_cap,
                                 sinks=np.asarray(make_sinks(case)) + math.log(splits)))
  tol = 3 * TOL[case.dtype]  # fails the backends' check with room to spare
  for w in wrong:
    assert not np.allclose(w, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.scales])
def test_scale_cases_are_sensitive(name):
  """The scaled cases tell a correct kernel from one that ignores the scales, applies
  them to the wrong heads or swaps K's and V's."""
  case = CASES[name]
  args = make_inputs(case)
  k_scale, v_scale = make_scales(case)
  want = numpy_oracle(case, args)
  ones = jnp.ones_like(k_scale)
  wrong = [(ones, ones), (ones, v_scale), (k_scale, ones), (v_scale, k_scale)]
  if case.kv_heads > 1:
    wrong.append((k_scale[::-1], v_scale[::-1]))
  tol = 3 * TOL[case.dtype]
  for scales in wrong:
    assert not np.allclose(numpy_oracle(case, args, scales), want, atol=tol, rtol=tol)


def test_fp8_attention_is_close_to_bf16():
  """fp8 pages with per-head amax scales (amax / 448) against bf16 pages of the same
  unquantized K and V: per kv head, the RMS difference is within 6 % of the bf16
  output's RMS and the largest within 10 % of its largest value (e4m3 keeps 3 mantissa
  bits: a stored value is within 2^-4 of its input, relatively; about 4 % is typical).
  The heads' K and V magnitudes differ by 8x (q shrunk to match, so both heads' logits
  are about N(0, 1)): one shared scale would waste range on one of them."""
  rng = np.random.default_rng(3)
  batch, q_len, kvh, group, d, ps, max_pages = 2, 4, 2, 4, 64, 16, 16
  mag = np.array([1.0, 8.0])
  k = rng.standard_normal((kvh, batch * max_pages, ps, d)) * mag[:, None, None, None]
  v = rng.standard_normal((kvh, batch * max_pages, ps, d)) * mag[:, None, None, None]
  q = rng.standard_normal((batch, q_len, kvh, group, d)) / mag[:, None, None]
  q = jnp.asarray(q.reshape(batch, q_len, kvh * group, d), jnp.bfloat16)
  tables = jnp.asarray(rng.permutation(batch * max_pages).reshape(batch, max_pages),
                       jnp.int32)
  kv_lens = jnp.array([200, 256], jnp.int32)
  k_scale = np.abs(k).reshape(kvh, -1).max(1) / 448
  v_scale = np.abs(v).reshape(kvh, -1).max(1) / 448
  k8 = jnp.asarray(k / k_scale[:, None, None, None], FP8)
  v8 = jnp.asarray(v / v_scale[:, None, None, None], FP8)
  got = paged_attention(q, k8, v8, tables, kv_lens, k_scale=jnp.asarray(k_scale, jnp.float32),
                        v_scale=jnp.asarray(v_scale, jnp.float32), backend="gpu",
                        interpret=True)
  want = paged_attention_reference(q, jnp.asarray(k, jnp.bfloat16),
                                   jnp.asarray(v, jnp.bfloat16), tables, kv_lens)
  got, want = (np.asarray(x, np.float64).reshape(batch, q_len, kvh, group, d)
               for x in (got, want))
  for h in range(kvh):
    diff, ref = got[:, :, h] - want[:, :, h], want[:, :, h]
    assert np.sqrt((diff ** 2).mean()) <= 0.06 * np.sqrt((ref ** 2).mean()), h
    assert np.abs(diff).max() <= 0.10 * np.abs(ref).max(), h


def test_fp8_inputs_are_checked():
  case = CASES["decode_g4_ps16_fp8_split3"]
  q, k, v, tables, kv_lens = make_inputs(case)
  k_scale, v_scale = make_scales(case)
  with pytest.raises(ValueError, match="dtypes differ"):
    paged_attention_reference(q, k, v.astype(jnp.bfloat16), tables, kv_lens)
  with pytest.raises(ValueError, match="dtypes differ"):
    paged_attention_reference(q, k.astype(jnp.float32), v.astype(jnp.float32), tables,
                              kv_lens)
  with pytest.raises(ValueError, match="float8_e4m3fn pages need"):
    paged_attention_reference(q.astype(FP8), k, v, tables, kv_lens)
  with pytest.raises(ValueError, match="k_scale must be"):
    paged_attention_reference(q, k, v, tables, kv_lens, k_scale=k_scale[:1])
  with pytest.raises(ValueError, match="v_scale must be"):
    paged_attention(q, k, v, tables, kv_lens, v_scale=v_scale[None], backend="gpu",
                    interpret=True)
  with pytest.raises(ValueError, match="v_scale must be a float"):
    paged_attention_reference(q, k, v, tables, kv_lens, v_scale=v_scale.astype(jnp.int32))
  # Page size 16 of 1-byte data is half a (32, 128) TPU tile.
  with pytest.raises(ValueError, match="multiple of 32"):
    paged_attention(q, k, v, tables, kv_lens, k_scale=k_scale, v_scale=v_scale,
                    backend="tpu", interpret=True, block_config=BlockConfig(pages_per_block=1))


def test_sinks_and_value_dim_inputs_are_checked():
  case = CASES["q2_g4_ps8_d40_dv24_sinks"]
  q, k, v, tables, kv_lens = make_inputs(case)
  sinks = make_sinks(case)
  with pytest.raises(ValueError, match="sinks"):
    paged_attention_reference(q, k, v, tables, kv_lens, sinks=sinks[:-1])
  with pytest.raises(ValueError, match="sinks"):
    paged_attention(q, k, v, tables, kv_lens, sinks=sinks[None], backend="gpu",
                    interpret=True)
  with pytest.raises(ValueError, match="float"):
    paged_attention_reference(q, k, v, tables, kv_lens, sinks=sinks.astype(jnp.int32))
  with pytest.raises(ValueError, match="k_pages and v_pages"):
    paged_attention_reference(q, k, v[:, :, :4], tables, kv_lens)
  with pytest.raises(ValueError, match="k_pages and v_pages"):
    paged_attention_reference(q, k, v[:1], tables, kv_lens)
  with pytest.raises(ValueError, match="key head dim"):
    paged_attention_reference(q[..., :24], k, v, tables, kv_lens)


def test_gpu_tiling_errors_name_the_dimension():
  case = dataclasses.replace(CASES["q2_g4_ps8_d40_dv24_sinks"], page_size=12)
  args = make_inputs(case)
  with pytest.raises(ValueError, match="power-of-two page_size"):
    paged_attention(*args, backend="gpu", interpret=True)


@pytest.mark.parametrize("batch, q_len, d, dv, kv, sinks", [
    (1, 1, 128, 128, jnp.bfloat16, False),       # batch-1 decode: KV splits, the combine
    (64, 4, 128, 128, jnp.bfloat16, False),      # a verify over a full wave: unsplit
    (64, 1, 128, 128, jnp.float8_e4m3fn, False),  # fp8 pages (the 2-warp tiling), scales
    (2, 256, 128, 128, jnp.bfloat16, False),     # a prefill chunk: the 128-row tiling
    (2, 4, 192, 128, jnp.bfloat16, True),        # D 192 (128 + 64), Dv 128, sinks
], ids=["decode-split", "verify", "fp8", "prefill", "d192-sinks"])
def test_gpu_kernel_lowers_to_triton(batch, q_len, d, dv, kv, sinks):
  """The GPU kernel's Triton lowering on any host (the packed-row gather from q, the
  unpacked stores and the split combine included): what interpret mode does not cover,
  short of compiling PTX on a GPU."""
  hq, kvh, ps, width = 32, 8, 16, 64
  f = jax.ShapeDtypeStruct
  args = (f((batch, q_len, hq, d), jnp.bfloat16), f((kvh, batch * width, ps, d), kv),
          f((kvh, batch * width, ps, dv), kv), f((batch, width), jnp.int32),
          f((batch,), jnp.int32))
  extra = dict(sinks=f((hq,), jnp.float32) if sinks else None,
               k_scale=f((kvh,), jnp.float32) if kv != jnp.bfloat16 else None,
               v_scale=f((kvh,), jnp.float32) if kv != jnp.bfloat16 else None)
  fn = jax.jit(lambda *a, **kw: paged_attention(*a, **kw, backend="gpu"))
  text = fn.trace(*args, **extra).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count('name = "paged_attention_gpu"') == 1  # one Triton kernel, no fallback
