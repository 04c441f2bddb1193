"""Paged MLA: reference vs numpy (expanded, un-absorbed math), kernels vs reference
(interpret on CPU, native on GPU/TPU).

Every page and slot that no query row may see is NaN, and unused block-table entries
point at NaN pages, so an out-of-bounds or unmasked read shows up as NaN in the output.

Scaled cases (fp8 latent caches, and bf16 pages with scales) store the latent part over
one scale and the rope part over another (SCALES, 4x apart), so a kernel that ignores or
swaps a scale fails; every backend is also checked against the numpy oracle over the
dequantized pages (page * its part's scale, in float64).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_mla import (
    MLABlockConfig, check_tiling, default_block_config, paged_mla, paged_mla_reference)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
ORACLE_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}   # vs the float64 expanded form
FP8 = jnp.float8_e4m3fn
# (latent scale, rope scale): N(0, 1) rows over them span most of e4m3's range
# (|x| / 0.015 < 448 to 6.7 sigma).
SCALES = (0.015, 0.06)
NOPE = 16      # per-head q_nope / k_nope width of the expanded (un-absorbed) form
V_HEAD = 8     # per-head value width of the expanded form


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  q_len: int
  heads: int
  page_size: int
  kv_lens: tuple[int, ...]
  dtype: type = jnp.float32
  v_dim: int = 128               # latent width (kv_lora_rank)
  rope: int = 32                 # rope width; Dk = v_dim + rope
  overrides: tuple = ()          # MLABlockConfig fields set on top of the default
  max_pages: int | None = None   # default: enough for max(kv_lens) plus one unused entry
  kv_dtype: type | None = None   # page dtype; None: the dtype of q
  kv_scale: tuple | None = None  # (latent, rope) scales the pages are read with

  @property
  def table_pages(self):
    return self.max_pages or -(-max(self.kv_lens) // self.page_size) + 1


CASES = {c.name: c for c in [
    # kv_len around page boundaries, plus an inactive (kv_len 0) row.
    Case("decode_h4_ps8", 1, 4, 8, (7, 8, 9, 0)),
    Case("decode_h16_ps16_bf16", 1, 16, 16, (15, 16, 17, 45), jnp.bfloat16,
         overrides=(("block_k", 16), ("num_splits", 2))),
    Case("q2_h8_ps8_split3", 2, 8, 8, (9, 16, 23), overrides=(("block_k", 16),
                                                             ("num_splits", 3))),
    # kv_len < Q: the first rows see nothing (padding rows of a verify batch).
    Case("q4_h4_ps16_short_bf16", 4, 4, 16, (16, 33, 4, 2), jnp.bfloat16,
         overrides=(("block_k", 16), ("num_splits", 2))),
    Case("q4_h8_ps8_short_tiles", 4, 8, 8, (3, 0, 17), overrides=(("rows_per_block", 16),)),
    # Chunked prefill: several row tiles per batch row, causal tile ranges.
    Case("prefill32_h4_ps16", 32, 4, 16, (32, 70, 0),
         overrides=(("block_k", 16), ("rows_per_block", 32))),
    Case("prefill32_h2_ps8_split2_bf16", 32, 2, 8, (40, 100), jnp.bfloat16,
         overrides=(("block_k", 16), ("rows_per_block", 16), ("num_splits", 2))),
    # kv range past the table (capacity 24): the last block's table index is clamped.
    Case("q2_h4_ps8_past_table", 2, 4, 8, (20, 30), max_pages=3,
         overrides=(("block_k", 16),)),
    # A page larger than a block: blocks cover part of a page.
    Case("decode_h4_ps32_block16", 1, 4, 32, (40, 70, 31), overrides=(("block_k", 16),)),
    # Widths that are not powers of two (padded on GPU) and no rope part at all.
    Case("q2_h4_ps8_odd_dims", 2, 4, 8, (9, 20), v_dim=24, rope=8),
    Case("decode_h4_ps8_no_rope", 1, 4, 8, (12, 5), v_dim=32, rope=0),
    # DeepSeek-V3 widths (latent 512 + rope 64), 16 heads, verify; default block configs.
    Case("q2_h16_ps16_deepseek_dims_bf16", 2, 16, 16, (33, 70), jnp.bfloat16, v_dim=512,
         rope=64),
    Case("q2_h16_ps16_deepseek_dims", 2, 16, 16, (33, 70), v_dim=512, rope=64),
    # fp8 latent caches. Decode under bf16 q (f16 compute on GPU), split-K 2, kv_len 0.
    Case("decode_h8_ps16_fp8_split2_bf16", 1, 8, 16, (0, 15, 40, 77), jnp.bfloat16,
         kv_dtype=FP8, kv_scale=SCALES, overrides=(("block_k", 16), ("num_splits", 2))),
    # Verify under f32 q, split-K 3, a row shorter than Q.
    Case("q4_h4_ps8_fp8_split3_f32", 4, 4, 8, (2, 19, 30), kv_dtype=FP8, kv_scale=SCALES,
         overrides=(("block_k", 16), ("num_splits", 3))),
    # Pages of 32 rows (a whole 8-bit TPU tile); verify under bf16 q.
    Case("q4_h4_ps32_fp8_bf16", 4, 4, 32, (3, 40, 70), jnp.bfloat16, kv_dtype=FP8,
         kv_scale=SCALES, overrides=(("block_k", 32),)),
    # Padded widths over 1-byte masked loads.
    Case("q2_h4_ps8_fp8_odd_dims", 2, 4, 8, (9, 20), v_dim=24, rope=8, kv_dtype=FP8,
         kv_scale=SCALES),
    # DeepSeek-V3 widths, default block configs (2 KV splits of 64-position blocks).
    Case("decode_h16_ps32_fp8_deepseek_dims_bf16", 1, 16, 32, (33, 70), jnp.bfloat16,
         v_dim=512, rope=64, kv_dtype=FP8, kv_scale=SCALES),
    # fp8 without scales (1.0), and scales over bf16 pages (they apply whatever the dtype).
    Case("decode_h4_ps32_fp8_no_scales_f32", 1, 4, 32, (7, 40, 0), kv_dtype=FP8),
    Case("q2_h4_ps16_bf16_pages_scales", 2, 4, 16, (9, 33), jnp.bfloat16, kv_scale=SCALES,
         overrides=(("block_k", 16), ("num_splits", 2))),
]}
# The TPU interpreter is slow, and the TPU kernel needs v_dim % 128 == 0, bf16 pages of
# 16 rows and fp8 pages of 32: one case per axis value rather than all of them.
TPU_CASES = ["decode_h4_ps8", "decode_h16_ps16_bf16", "q4_h4_ps16_short_bf16",
             "q4_h8_ps8_short_tiles", "prefill32_h4_ps16", "q2_h4_ps8_past_table",
             "q2_h16_ps16_deepseek_dims_bf16", "q4_h4_ps32_fp8_bf16",
             "decode_h4_ps32_fp8_no_scales_f32"]


def make_inputs(case: Case, seed: int = 0):
  """Random absorbed q and a NaN-filled page pool holding only the KV rows can see.

  Also returns the expanded-form pieces: q_nope [B, Q, H, NOPE], w_uk [H, v_dim, NOPE]
  (k_nope = c_kv @ w_uk[h]) and w_uv [H, v_dim, V_HEAD] (v = c_kv @ w_uv[h]), with the
  absorbed q = concat(q_nope @ w_uk[h].T, q_pe) computed in float64.
  With scales the logical rows are N(0, 1) and the pages hold each part divided by its
  scale, cast to the page dtype (fp8 NaN stays NaN).
  """
  rng = np.random.default_rng(seed)
  batch, ps, heads = len(case.kv_lens), case.page_size, case.heads
  head_dim = case.v_dim + case.rope
  max_pages = case.table_pages
  num_pages = batch * max_pages + 3
  kv = np.full((num_pages, ps, head_dim), np.nan, np.float32)
  # Distinct pages in random order; entries past what kv_len needs stay NaN pages.
  tables = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
  for b, kv_len in enumerate(case.kv_lens):
    for p in range(min(kv_len, max_pages * ps)):
      kv[tables[b, p // ps], p % ps] = rng.standard_normal(head_dim)
  q_nope = rng.standard_normal((batch, case.q_len, heads, NOPE))
  q_pe = rng.standard_normal((batch, case.q_len, heads, case.rope))
  w_uk = rng.standard_normal((heads, case.v_dim, NOPE)) / math.sqrt(case.v_dim)
  w_uv = rng.standard_normal((heads, case.v_dim, V_HEAD)) / math.sqrt(case.v_dim)
  q = np.concatenate([np.einsum("bqhn,hcn->bqhc", q_nope, w_uk), q_pe], axis=-1)
  if case.kv_scale:
    kv = kv / part_scales(case.kv_scale, case.v_dim, head_dim)
  args = (jnp.asarray(q, case.dtype), jnp.asarray(kv, case.kv_dtype or case.dtype),
          jnp.asarray(tables, jnp.int32), jnp.asarray(case.kv_lens, jnp.int32))
  return args, dict(q_nope=q_nope, q_pe=q_pe, w_uk=w_uk, w_uv=w_uv)


def sm_scale(case: Case) -> float:
  return 1.0 / math.sqrt(NOPE + case.rope)   # DeepSeek: 1 / sqrt(qk_nope + qk_rope)


def part_scales(kv_scale, v_dim, head_dim):
  """[Dk] float64: each dim's scale, the latent part's then the rope part's."""
  return np.where(np.arange(head_dim) < v_dim, kv_scale[0], kv_scale[1])


def case_kwargs(case: Case, kv_scale=None):
  """paged_mla keywords of a case; kv_scale overrides the case's (latent, rope) pair."""
  kv_scale = kv_scale or case.kv_scale
  return dict(v_dim=case.v_dim, sm_scale=sm_scale(case),
              kv_scale=None if kv_scale is None else jnp.asarray(kv_scale, jnp.float32))


def oracle(case: Case, args, parts, kv_scale=None):
  """The expanded numpy form over the dequantized pages (page * its part's scale), in
  float64: [B, Q, H, V_HEAD], to compare with `expand` of an op's latent output.
  kv_scale overrides the case's (latent, rope) pair."""
  kv_scale = kv_scale or case.kv_scale
  pages = np.asarray(args[1], np.float64)
  if kv_scale is not None:
    pages = pages * part_scales(kv_scale, case.v_dim, pages.shape[-1])
  return numpy_expanded_mla(pages, args[2], args[3], **parts, v_dim=case.v_dim,
                            scale=sm_scale(case))


def expand(latent_out, parts):
  """Absorbed (latent) output [B, Q, H, v_dim] -> per-head values, in float64."""
  return np.einsum("bqhc,hcv->bqhv", np.asarray(latent_out, np.float64), parts["w_uv"])


def numpy_expanded_mla(kv_pages, block_tables, kv_lens, *, q_nope, q_pe, w_uk, w_uv,
                       v_dim, scale):
  """Un-absorbed MLA row by row in float64, reading positions through the table.

  Per head h: k = [c_kv @ w_uk[h], k_pe], v = c_kv @ w_uv[h], q = [q_nope, q_pe].
  Returns [B, Q, H, V_HEAD].
  """
  kv_pages = np.asarray(kv_pages, np.float64)
  block_tables, kv_lens = np.asarray(block_tables), np.asarray(kv_lens)
  batch, q_len, heads, _ = q_nope.shape
  ps = kv_pages.shape[1]
  out = np.zeros((batch, q_len, heads, w_uv.shape[-1]))
  for b in range(batch):
    for i in range(q_len):
      end = min(kv_lens[b] - q_len + i + 1, block_tables.shape[1] * ps)
      if end <= 0:
        continue
      entries = np.stack([kv_pages[block_tables[b, p // ps], p % ps] for p in range(end)])
      c_kv, k_pe = entries[:, :v_dim], entries[:, v_dim:]
      for h in range(heads):
        logits = (c_kv @ w_uk[h] @ q_nope[b, i, h] + k_pe @ q_pe[b, i, h]) * scale
        w = np.exp(logits - logits.max())
        out[b, i, h] = (w / w.sum()) @ (c_kv @ w_uv[h])
  return out


SCALED_CASES = [n for n, c in CASES.items() if c.kv_dtype or c.kv_scale]


@pytest.mark.parametrize("name", ["decode_h4_ps8", "q4_h4_ps16_short_bf16",
                                  "q2_h4_ps8_past_table", "q2_h4_ps8_odd_dims",
                                  "decode_h4_ps8_no_rope", "prefill32_h4_ps16",
                                  *SCALED_CASES])
def test_reference_matches_expanded_numpy(name):
  case = CASES[name]
  args, parts = make_inputs(case)
  got = paged_mla_reference(*args, **case_kwargs(case))
  assert got.dtype == case.dtype and got.shape == (*args[0].shape[:3], case.v_dim)
  tol = ORACLE_TOL[case.dtype]
  np.testing.assert_allclose(expand(got, parts), oracle(case, args, parts), atol=tol,
                             rtol=tol)


class PagedMLATest:
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
    batch, q_len, heads, head_dim = q.shape
    cfg = default_block_config(batch, q_len, heads, case.page_size, case.table_pages,
                               head_dim, q.dtype, self.backend, num_cores=132)
    return dataclasses.replace(cfg, **overrides)

  def test_matches_reference(self, name):
    case = CASES[name]
    args, parts = make_inputs(case)
    q = args[0]
    kw = case_kwargs(case)
    got = paged_mla(*args, **kw, backend=self.backend, interpret=self.interpret,
                    block_config=self.config(case, q))
    want = paged_mla_reference(*args, **kw)
    assert got.dtype == q.dtype and got.shape == (*q.shape[:3], case.v_dim)
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any()
    tol = TOL[case.dtype]
    np.testing.assert_allclose(got, np.asarray(want, np.float32), atol=tol, rtol=tol)
    if name in SCALED_CASES:
      tol = ORACLE_TOL[case.dtype]
      np.testing.assert_allclose(expand(got, parts), oracle(case, args, parts), atol=tol,
                                 rtol=tol)
    # Rows that see nothing are exactly zero.
    for b, kv_len in enumerate(case.kv_lens):
      for i in range(case.q_len):
        if kv_len - case.q_len + i + 1 <= 0:
          assert (got[b, i] == 0).all()


def pytest_generate_tests(metafunc):
  if metafunc.cls is not None and "name" in metafunc.fixturenames:
    metafunc.parametrize("name", metafunc.cls.cases)


class TestPagedMLAGPU(PagedMLATest):
  pass


class TestPagedMLAGPUInterpret(TestPagedMLAGPU):
  interpret = True


class TestPagedMLATPU(PagedMLATest):
  backend = "tpu"
  platform = "tpu"
  cases = TPU_CASES


class TestPagedMLATPUInterpret(TestPagedMLATPU):
  interpret = True


def test_default_config_gpu_kernel_matches_reference():
  case = CASES["q2_h8_ps8_split3"]
  args, _ = make_inputs(case)
  kw = dict(v_dim=case.v_dim, sm_scale=sm_scale(case))
  got = paged_mla(*args, **kw, backend="gpu", interpret=True)
  np.testing.assert_allclose(got, paged_mla_reference(*args, **kw), atol=2e-5, rtol=2e-5)


def test_growing_scores_rescale_the_accumulator():
  # Scores that grow steeply from block to block: every block moves the running max by
  # far more than exp's range, so the accumulator must be rescaled each time.
  case = CASES["q2_h4_ps8_past_table"]
  (q, kv, tables, kv_lens), _ = make_inputs(case)
  pos = np.zeros(kv.shape[:2])
  for b in range(tables.shape[0]):
    for p in range(tables.shape[1] * case.page_size):
      pos[tables[b, p // case.page_size], p % case.page_size] = p
  kv = jnp.abs(kv) * (0.3 * (1 + pos))[:, :, None]
  q = jnp.abs(q)
  kw = dict(v_dim=case.v_dim, sm_scale=0.2)
  got = paged_mla(q, kv, tables, kv_lens, **kw, backend="gpu", interpret=True,
                  block_config=MLABlockConfig(block_k=16, rows_per_block=16, num_warps=4))
  want = paged_mla_reference(q, kv, tables, kv_lens, **kw)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_default_config_shapes():
  # DeepSeek-V3 decode and verify at H = 128: 64-row tiles, 8 warps, 64-position
  # blocks; KV splits only where B * tiles leaves SMs idle; a grid of at most 8 such
  # tiles takes 32-row tiles on 4 warps, split for two waves of its programs.
  for batch, q_len, rows, splits in ((64, 1, 64, 1), (64, 4, 64, 1), (32, 1, 64, 4),
                                     (8, 1, 64, 16), (4, 2, 64, 16), (4, 1, 32, 16),
                                     (1, 4, 32, 16), (1, 2, 32, 33), (1, 1, 32, 64)):
    cfg = default_block_config(batch, q_len, 128, 16, 1024, 576, jnp.bfloat16, "gpu",
                               num_cores=132)
    assert (cfg.rows_per_block, cfg.num_warps, cfg.block_k, cfg.num_splits) == (
        rows, 8 if rows == 64 else 4, 64, splits), (batch, q_len, cfg)
  cfg = default_block_config(2, 1, 128, 16, 1024, 576, jnp.float32, "gpu", num_cores=132)
  assert (cfg.rows_per_block, cfg.block_k) == (32, 32), cfg
  cfg = default_block_config(4, 2, 16, 16, 64, 576, jnp.bfloat16, "tpu")
  assert cfg.block_k % 16 == 0 and cfg.num_splits == 1 and cfg.rows_per_block == 32


def test_backend_dispatch(monkeypatch):
  case = CASES["decode_h4_ps8"]
  args, _ = make_inputs(case)
  kw = dict(v_dim=case.v_dim, sm_scale=sm_scale(case))
  want = paged_mla_reference(*args, **kw)
  monkeypatch.delenv("MTP_JAX_MLA_BACKEND", raising=False)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(paged_mla(*args, **kw), want)
  monkeypatch.setenv("MTP_JAX_MLA_BACKEND", "reference")
  np.testing.assert_array_equal(paged_mla(*args, **kw), want)
  with pytest.raises(ValueError, match="backend"):
    paged_mla(*args, **kw, backend="cuda-graph")


def test_sm_scale_is_used():
  case = CASES["decode_h4_ps8"]
  args, _ = make_inputs(case)
  a = paged_mla_reference(*args, v_dim=case.v_dim, sm_scale=0.5)
  b = paged_mla(*args, v_dim=case.v_dim, sm_scale=0.5, backend="gpu", interpret=True)
  np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
  assert not np.allclose(a, paged_mla_reference(*args, v_dim=case.v_dim, sm_scale=0.1))


@pytest.mark.parametrize("kwargs", [dict(block_k=0), dict(rows_per_block=12),
                                    dict(num_splits=0), dict(num_warps=2.5)])
def test_block_config_validates(kwargs):
  with pytest.raises(ValueError):
    MLABlockConfig(**kwargs)


def test_bad_inputs_are_refused():
  case = CASES["decode_h4_ps8"]
  (q, kv, tables, kv_lens), _ = make_inputs(case)
  ok = dict(v_dim=case.v_dim, sm_scale=0.1)
  with pytest.raises(ValueError, match=r"\[B, Q, H, Dk\]"):
    paged_mla_reference(q[0], kv, tables, kv_lens, **ok)
  with pytest.raises(ValueError, match="Dk"):
    paged_mla_reference(q, kv[..., :-1], tables, kv_lens, **ok)
  with pytest.raises(ValueError, match="kv_lora_rank"):
    paged_mla_reference(q, kv, tables, kv_lens, v_dim=q.shape[-1] + 1, sm_scale=0.1)
  with pytest.raises(ValueError, match="dtypes"):
    paged_mla_reference(q.astype(jnp.bfloat16), kv, tables, kv_lens, **ok)
  with pytest.raises(ValueError, match="kv_lens"):
    paged_mla_reference(q, kv, tables, kv_lens[:2], **ok)
  with pytest.raises(ValueError, match="int32"):
    paged_mla_reference(q, kv, tables, kv_lens.astype(jnp.float32), **ok)
  with pytest.raises(ValueError, match="sm_scale"):
    paged_mla_reference(q, kv, tables, kv_lens, v_dim=case.v_dim, sm_scale=float("nan"))
  with pytest.raises(TypeError, match="MLABlockConfig"):
    paged_mla(q, kv, tables, kv_lens, **ok, backend="gpu", block_config=dict(block_k=16))


def test_untileable_shapes_name_the_dimension():
  case = CASES["q2_h4_ps8_odd_dims"]           # v_dim 24: not a multiple of 128
  args, _ = make_inputs(case)
  with pytest.raises(ValueError, match=r"v_dim \(kv_lora_rank\).*multiple of 128"):
    paged_mla(*args, v_dim=case.v_dim, sm_scale=0.1, backend="tpu", interpret=True)
  case = CASES["q4_h8_ps8_short_tiles"]        # bf16 pages of 8 rows on TPU
  (q, kv, tables, kv_lens), _ = make_inputs(case)
  bf16 = (q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), tables, kv_lens)
  with pytest.raises(ValueError, match="page_size to be a multiple of 16"):
    paged_mla(*bf16, v_dim=case.v_dim, sm_scale=0.1, backend="tpu", interpret=True)
  with pytest.raises(ValueError, match="block_k to be a power of two"):
    paged_mla(q, kv, tables, kv_lens, v_dim=case.v_dim, sm_scale=0.1, backend="gpu",
              interpret=True, block_config=MLABlockConfig(block_k=24))
  with pytest.raises(ValueError, match="rows_per_block to be a power of two"):
    paged_mla(q, kv, tables, kv_lens, v_dim=case.v_dim, sm_scale=0.1, backend="gpu",
              interpret=True, block_config=MLABlockConfig(rows_per_block=8))


def test_swapped_or_ignored_scales_fail():
  """The scaled cases tell the right (latent, rope) scales from ignored or swapped ones:
  the oracle under each wrong pair, and the op given it, are far from the right result;
  so is a latent output not multiplied by its scale."""
  case = CASES["q4_h4_ps8_fp8_split3_f32"]
  args, parts = make_inputs(case)
  want = oracle(case, args, parts)
  s0, s1 = case.kv_scale
  tol = ORACLE_TOL[case.dtype]
  got = paged_mla(*args, **case_kwargs(case), backend="gpu", interpret=True)
  np.testing.assert_allclose(expand(got, parts), want, atol=tol, rtol=tol)
  assert not np.allclose(expand(got / s0, parts), want, atol=tol, rtol=tol)
  for wrong in [(1.0, 1.0), (s1, s0), (s0, 1.0), (1.0, s1)]:
    assert not np.allclose(oracle(case, args, parts, wrong), want, atol=tol, rtol=tol)
    bad = paged_mla_reference(*args, **case_kwargs(case, wrong))
    assert not np.allclose(expand(bad, parts), want, atol=tol, rtol=tol), wrong
  bad = paged_mla(*args, **case_kwargs(case, (s1, s0)), backend="gpu", interpret=True)
  assert not np.allclose(expand(bad, parts), want, atol=tol, rtol=tol)


def test_fp8_mla_is_close_to_bf16():
  """fp8 pages with per-part amax scales (amax / 448) against bf16 pages of the same
  unquantized rows, through the GPU kernel in interpret mode (bf16 q: f16 compute): the
  RMS difference is within 5 % of the bf16 output's RMS and the largest within 8 % of
  its largest value (e4m3 keeps 3 mantissa bits: a stored value is within 2^-4 of its
  input, relatively; 3.1 % and 4-5 % were seen over four seeds). The rope part is 8x
  the latent's magnitude (its q shrunk to match, so both parts move the logits), so the
  two scales differ by about that much."""
  rng = np.random.default_rng(3)
  batch, q_len, heads, v_dim, rope, ps, max_pages = 2, 4, 8, 128, 32, 16, 16
  mag = np.where(np.arange(v_dim + rope) < v_dim, 1.0, 8.0)
  kv = rng.standard_normal((batch * max_pages, ps, v_dim + rope)) * mag
  q = rng.standard_normal((batch, q_len, heads, v_dim + rope)) / mag
  q = jnp.asarray(q, jnp.bfloat16)
  tables = jnp.asarray(rng.permutation(batch * max_pages).reshape(batch, max_pages),
                       jnp.int32)
  kv_lens = jnp.array([200, 256], jnp.int32)
  scale = np.array([np.abs(kv[..., :v_dim]).max(), np.abs(kv[..., v_dim:]).max()]) / 448
  kv8 = jnp.asarray(kv / part_scales(scale, v_dim, v_dim + rope), FP8)
  kw = dict(v_dim=v_dim, sm_scale=1 / math.sqrt(v_dim + rope))
  got = paged_mla(q, kv8, tables, kv_lens, **kw, kv_scale=jnp.asarray(scale, jnp.float32),
                  backend="gpu", interpret=True)
  want = paged_mla_reference(q, jnp.asarray(kv, jnp.bfloat16), tables, kv_lens, **kw)
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  diff = got - want
  assert np.sqrt((diff ** 2).mean()) <= 0.05 * np.sqrt((want ** 2).mean())
  assert np.abs(diff).max() <= 0.08 * np.abs(want).max()


def test_fp8_inputs_are_checked():
  case = CASES["decode_h8_ps16_fp8_split2_bf16"]
  (q, kv, tables, kv_lens), _ = make_inputs(case)
  kw = case_kwargs(case)
  scale = kw.pop("kv_scale")
  with pytest.raises(ValueError, match="float8_e4m3fn pages need"):
    paged_mla_reference(q.astype(FP8), kv, tables, kv_lens, **kw)
  with pytest.raises(ValueError, match="float8_e4m3fn pages need"):
    paged_mla(q.astype(jnp.float16), kv, tables, kv_lens, **kw, backend="gpu",
              interpret=True)
  with pytest.raises(ValueError, match="dtypes differ"):
    paged_mla_reference(q, kv.astype(jnp.float32), tables, kv_lens, **kw)
  with pytest.raises(ValueError, match=r"kv_scale must be \[2\]"):
    paged_mla_reference(q, kv, tables, kv_lens, **kw, kv_scale=scale[:1])
  with pytest.raises(ValueError, match=r"kv_scale must be \[2\]"):
    paged_mla(q, kv, tables, kv_lens, **kw, kv_scale=scale[None], backend="gpu",
              interpret=True)
  with pytest.raises(ValueError, match=r"kv_scale must be \[2\]"):
    paged_mla_reference(q, kv, tables, kv_lens, **kw, kv_scale=list(SCALES))
  with pytest.raises(ValueError, match="kv_scale must be a float"):
    paged_mla_reference(q, kv, tables, kv_lens, **kw, kv_scale=scale.astype(jnp.int32))
  # Pages of 16 1-byte rows are half a (32, 128) TPU tile.
  with pytest.raises(ValueError, match="page_size to be a multiple of 32 for float8"):
    paged_mla(q, kv, tables, kv_lens, **kw, kv_scale=scale, backend="tpu", interpret=True)


def test_fp8_tiling_and_default_config():
  # fp8 pages take bf16's block sizes; their TPU rows tile as the queries' dtype (bf16
  # when not given, the strictest q they take), their pages as 8-bit data.
  for batch, q_len in ((64, 1), (8, 4), (1, 1)):
    args = (batch, q_len, 128, 16, 256, 576)
    assert (default_block_config(*args, FP8, "gpu", num_cores=132)
            == default_block_config(*args, jnp.bfloat16, "gpu", num_cores=132))
  tiling = dict(v_dim=512, head_dim=576, page_size=32, dtype=FP8)
  check_tiling("tpu", **tiling, cfg=MLABlockConfig(block_k=64, rows_per_block=16))
  check_tiling("tpu", **tiling, q_dtype=jnp.float32,
               cfg=MLABlockConfig(block_k=64, rows_per_block=8))
  with pytest.raises(ValueError, match="multiple of 16 for bfloat16 queries"):
    check_tiling("tpu", **tiling, cfg=MLABlockConfig(block_k=64, rows_per_block=8))
  with pytest.raises(ValueError, match="page_size to be a multiple of 32"):
    check_tiling("tpu", **{**tiling, "page_size": 16},
                 cfg=MLABlockConfig(block_k=64, rows_per_block=16))
