"""Paged MLA: reference vs numpy (expanded, un-absorbed math), kernels vs reference
(interpret on CPU, native on GPU/TPU).

Every page and slot that no query row may see is NaN, and unused block-table entries
point at NaN pages, so an out-of-bounds or unmasked read shows up as NaN in the output.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_mla import (
    MLABlockConfig, default_block_config, paged_mla, paged_mla_reference)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
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
]}
# The TPU interpreter is slow, and the TPU kernel needs v_dim % 128 == 0 and bf16 pages
# of 16 rows: one case per axis value rather than all of them.
TPU_CASES = ["decode_h4_ps8", "decode_h16_ps16_bf16", "q4_h4_ps16_short_bf16",
             "q4_h8_ps8_short_tiles", "prefill32_h4_ps16", "q2_h4_ps8_past_table",
             "q2_h16_ps16_deepseek_dims_bf16"]


def make_inputs(case: Case, seed: int = 0):
  """Random absorbed q and a NaN-filled page pool holding only the KV rows can see.

  Also returns the expanded-form pieces: q_nope [B, Q, H, NOPE], w_uk [H, v_dim, NOPE]
  (k_nope = c_kv @ w_uk[h]) and w_uv [H, v_dim, V_HEAD] (v = c_kv @ w_uv[h]), with the
  absorbed q = concat(q_nope @ w_uk[h].T, q_pe) computed in float64.
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
  cast = lambda x: jnp.asarray(x, case.dtype)
  args = (cast(q), cast(kv), jnp.asarray(tables, jnp.int32),
          jnp.asarray(case.kv_lens, jnp.int32))
  return args, dict(q_nope=q_nope, q_pe=q_pe, w_uk=w_uk, w_uv=w_uv)


def sm_scale(case: Case) -> float:
  return 1.0 / math.sqrt(NOPE + case.rope)   # DeepSeek: 1 / sqrt(qk_nope + qk_rope)


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


@pytest.mark.parametrize("name", ["decode_h4_ps8", "q4_h4_ps16_short_bf16",
                                  "q2_h4_ps8_past_table", "q2_h4_ps8_odd_dims",
                                  "decode_h4_ps8_no_rope", "prefill32_h4_ps16"])
def test_reference_matches_expanded_numpy(name):
  case = CASES[name]
  args, parts = make_inputs(case)
  got = paged_mla_reference(*args, v_dim=case.v_dim, sm_scale=sm_scale(case))
  assert got.dtype == case.dtype and got.shape == (*args[0].shape[:3], case.v_dim)
  # Absorbed output (latent) -> per-head values, in float64.
  got = np.einsum("bqhc,hcv->bqhv", np.asarray(got, np.float64), parts["w_uv"])
  want = numpy_expanded_mla(args[1], args[2], args[3], **parts, v_dim=case.v_dim,
                            scale=sm_scale(case))
  tol = 1e-4 if case.dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


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
    args, _ = make_inputs(case)
    q = args[0]
    kw = dict(v_dim=case.v_dim, sm_scale=sm_scale(case))
    got = paged_mla(*args, **kw, backend=self.backend, interpret=self.interpret,
                    block_config=self.config(case, q))
    want = paged_mla_reference(*args, **kw)
    assert got.dtype == q.dtype and got.shape == (*q.shape[:3], case.v_dim)
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any()
    tol = TOL[case.dtype]
    np.testing.assert_allclose(got, np.asarray(want, np.float32), atol=tol, rtol=tol)
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
  # blocks; KV splits only where B * tiles leaves SMs idle.
  for batch, q_len, splits in ((64, 1, 1), (64, 4, 1), (32, 1, 4), (8, 1, 16), (1, 1, 64)):
    cfg = default_block_config(batch, q_len, 128, 16, 1024, 576, jnp.bfloat16, "gpu",
                               num_cores=132)
    assert (cfg.rows_per_block, cfg.num_warps, cfg.block_k, cfg.num_splits) == (
        64, 8, 64, splits), cfg
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
