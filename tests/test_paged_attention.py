"""Paged attention: reference vs numpy, kernels vs reference (interpret on CPU, native on GPU/TPU).

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

from pallas_kernels.paged_attention import (
    BlockConfig, default_block_config, paged_attention, paged_attention_reference)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


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
    Case("decode_g4_ps8_split4", 1, 4, 8, (150, 3, 64), overrides=(("pages_per_block", 2),
                                                                 ("num_splits", 4))),
    # kv range past the table (capacity 24): the last block's table index is clamped.
    Case("q2_g4_ps8_past_table", 2, 4, 8, (20, 30), max_pages=3,
         overrides=(("pages_per_block", 2),)),
]}
# The TPU interpreter is slow: one case per axis value rather than all of them.
TPU_CASES = ["decode_g1_ps8", "decode_g4_ps16_bf16", "q2_g8_ps8_window",
             "q4_g4_ps16_window_softcap_bf16", "q8_g1_ps8_short", "prefill64_g4_ps16",
             "q2_g4_ps8_past_table"]


def make_inputs(case: Case, seed: int = 0):
  """Random q and a NaN-filled page pool holding only the KV some query row can see."""
  rng = np.random.default_rng(seed)
  batch, ps, kvh, d = len(case.kv_lens), case.page_size, case.kv_heads, case.head_dim
  max_pages = case.max_pages or -(-max(case.kv_lens) // ps) + 1
  num_pages = batch * max_pages + 3
  k = np.full((kvh, num_pages, ps, d), np.nan, np.float32)
  v = np.full((kvh, num_pages, ps, d), np.nan, np.float32)
  # Distinct pages in random order; entries past what kv_len needs stay NaN pages.
  tables = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
  for b, kv_len in enumerate(case.kv_lens):
    lo = 0 if case.window is None else max(0, kv_len - case.q_len + 1 - case.window)
    for p in range(lo, min(kv_len, max_pages * ps)):
      page = tables[b, p // ps]
      k[:, page, p % ps] = rng.standard_normal((kvh, d))
      v[:, page, p % ps] = rng.standard_normal((kvh, d))
  q = rng.standard_normal((batch, case.q_len, kvh * case.group, d)).astype(np.float32)
  cast = lambda x: jnp.asarray(x, case.dtype)
  return (cast(q), cast(k), cast(v), jnp.asarray(tables, jnp.int32),
          jnp.asarray(case.kv_lens, jnp.int32))


def numpy_attention(q, k_pages, v_pages, block_tables, kv_lens, *, window=None,
                    soft_cap=None):
  """Row-by-row dense softmax in float64, reading positions through the table."""
  q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
  block_tables, kv_lens = np.asarray(block_tables), np.asarray(kv_lens)
  batch, q_len, num_heads, d = q.shape
  kvh, _, ps, _ = k_pages.shape
  group = num_heads // kvh
  out = np.zeros_like(q)
  for b in range(batch):
    for i in range(q_len):
      end = kv_lens[b] - q_len + i + 1
      start = 0 if window is None else max(0, end - window)
      positions = range(max(start, 0), min(end, block_tables.shape[1] * ps))
      if not positions:
        continue
      pages = [block_tables[b, p // ps] for p in positions]
      for h in range(num_heads):
        kk = np.stack([k_pages[h // group, pg, p % ps] for pg, p in zip(pages, positions)])
        vv = np.stack([v_pages[h // group, pg, p % ps] for pg, p in zip(pages, positions)])
        logits = kk @ q[b, i, h] / math.sqrt(d)
        if soft_cap is not None:
          logits = soft_cap * np.tanh(logits / soft_cap)
        w = np.exp(logits - logits.max())
        out[b, i, h] = (w / w.sum()) @ vv
  return out


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_numpy(name):
  case = CASES[name]
  args = make_inputs(case)
  got = paged_attention_reference(*args, sliding_window=case.window, soft_cap=case.soft_cap)
  want = numpy_attention(*args, window=case.window, soft_cap=case.soft_cap)
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
    kw = dict(sliding_window=case.window, soft_cap=case.soft_cap)
    got = paged_attention(q, k, v, tables, kv_lens, backend=self.backend,
                          interpret=self.interpret, block_config=self.config(case, q), **kw)
    want = paged_attention_reference(q, k, v, tables, kv_lens, **kw)
    assert got.dtype == q.dtype and got.shape == q.shape
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
