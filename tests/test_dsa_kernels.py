"""DeepSeek Sparse Attention kernels: references vs numpy loops, the GPU and TPU Pallas
kernels (interpret mode on CPU) vs the references, the radix top-k vs lax.top_k, and the
input checks.

Every page slot that no query row may see is NaN (keys, fp8 scales and MLA rows alike),
and unused block-table entries point at NaN pages, so an unmasked or out-of-range read
shows up as NaN. Indexer data come in two kinds: "int" (small integer queries and keys,
weights in quarters, power-of-two fp8 scales) where every score is exact in f32 whatever
the summation order, so kernels must return the very same top-k, ties included (and
there are many ties); and "normal" (Gaussian) for the tolerance comparisons.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dsa
from pallas_kernels.dsa import (IndexerBlockConfig, SparseBlockConfig, index_scores,
                                index_scores_reference, indexer_topk, indexer_topk_kernel,
                                indexer_topk_reference, select_topk, sparse_mla,
                                sparse_mla_kernel, sparse_mla_reference)
from pallas_kernels.paged_mla import paged_mla_reference

FP8 = jnp.float8_e4m3fn


# ------------------------------------------------------------------------- indexer data
@dataclasses.dataclass(frozen=True)
class IdxCase:
  name: str
  q_len: int
  page_size: int
  kv_lens: tuple[int, ...]
  dtype: type = jnp.float32        # q's, and the keys' unless fp8
  fp8: bool = False                # float8_e4m3fn keys with per-token scales
  heads: int = 4
  dim: int = 32
  table_pages: int | None = None   # default: enough for max(kv_lens) plus one
  kind: str = "int"

  @property
  def pages(self):
    return self.table_pages or -(-max(self.kv_lens) // self.page_size) + 1


IDX_CASES = {c.name: c for c in [
    # kv_len at and around page boundaries, and 0 (an inactive row).
    IdxCase("t1_ps8", 1, 8, (40, 57, 0)),
    # Verify rows: each row sees one more position; kv_len < T (rows that see nothing).
    IdxCase("t3_ps16_bf16", 3, 16, (100, 2, 49), jnp.bfloat16),
    IdxCase("t3_ps8_fp8", 3, 8, (64, 41), jnp.bfloat16, fp8=True),
    # Context past the table (capacity 48): positions are capped at the capacity.
    IdxCase("t1_ps16_past_table", 1, 16, (70, 20), table_pages=3),
    IdxCase("t3_ps8_normal", 3, 8, (77, 30), kind="normal"),
]}


def make_indexer(case: IdxCase, seed=0):
  """(q, w, k_pages, block_table, kv_lens, k_scale) with NaN in every unseen slot."""
  rng = np.random.default_rng(seed)
  batch, ps, dim = len(case.kv_lens), case.page_size, case.dim
  num_pages = batch * case.pages + 3
  keys = np.full((num_pages, ps, dim), np.nan, np.float32)
  scale = np.full((num_pages, ps), np.nan, np.float32)
  table = rng.permutation(num_pages)[:batch * case.pages].reshape(batch, case.pages)
  for b, kv_len in enumerate(case.kv_lens):
    for p in range(min(kv_len, case.pages * ps)):
      page, slot = table[b, p // ps], p % ps
      if case.kind == "int":
        keys[page, slot] = rng.integers(-2, 3, dim)
        scale[page, slot] = 2.0 ** rng.integers(-3, 1)
      else:
        keys[page, slot] = rng.standard_normal(dim)
        scale[page, slot] = rng.uniform(0.01, 0.1)
  shape = (batch, case.q_len, case.heads)
  if case.kind == "int":
    q = rng.integers(-2, 3, (*shape, dim)).astype(np.float32)
    w = rng.integers(-4, 5, shape) / 4.0
  else:
    q = rng.standard_normal((*shape, dim))
    w = rng.standard_normal(shape) / math.sqrt(case.heads * dim)
  if case.fp8:
    k_pages, k_scale = jnp.asarray(keys / scale[..., None], FP8), jnp.asarray(scale)
  else:
    k_pages, k_scale = jnp.asarray(keys, case.dtype), None
  return (jnp.asarray(q, case.dtype), jnp.asarray(w, jnp.float32), k_pages,
          jnp.asarray(table, jnp.int32), jnp.asarray(case.kv_lens, jnp.int32), k_scale)


def numpy_scores(q, w, k_pages, table, kv_lens, k_scale):
  """[B, T, W * page_size] float64 scores by a plain loop (-inf where not visible)."""
  q, w = np.asarray(q, np.float64), np.asarray(w, np.float64)
  pages = np.asarray(k_pages.astype(jnp.float32), np.float64)
  if k_scale is not None:
    pages = pages * np.asarray(k_scale, np.float64)[..., None]
  table, kv_lens = np.asarray(table), np.asarray(kv_lens)
  batch, q_len, heads, _ = q.shape
  ps = pages.shape[1]
  capacity = table.shape[1] * ps
  out = np.full((batch, q_len, capacity), -np.inf)
  for b in range(batch):
    for t in range(q_len):
      for s in range(min(kv_lens[b] - q_len + t + 1, capacity)):
        key = pages[table[b, s // ps], s % ps]
        out[b, t, s] = sum(w[b, t, h] * max(q[b, t, h] @ key, 0.0) for h in range(heads))
  return out


def numpy_topk(scores, topk):
  """Ascending positions of the topk highest finite scores (ties: lower position), -1
  padded, by sorting each row in Python."""
  batch, q_len, _ = scores.shape
  out = np.full((batch, q_len, topk), -1, np.int32)
  for b in range(batch):
    for t in range(q_len):
      row = scores[b, t]
      seen = [s for s in range(len(row)) if np.isfinite(row[s])]
      best = sorted(seen, key=lambda s: (-row[s], s))[:topk]
      out[b, t, :len(best)] = sorted(best)
  return out


def assert_scores_close(got, want, tol):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  got = got[..., :want.shape[-1]]
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  finite = np.isfinite(want)
  np.testing.assert_allclose(got[finite], want[finite], rtol=tol, atol=tol)


@pytest.mark.parametrize("name", list(IDX_CASES))
def test_index_scores_reference_matches_numpy(name):
  case = IDX_CASES[name]
  q, w, k, table, lens, k_scale = make_indexer(case)
  want = numpy_scores(q, w, k, table, lens, k_scale)
  got = index_scores_reference(q, w, k, table, lens, k_scale=k_scale)
  assert got.shape == want.shape and got.dtype == jnp.float32
  assert_scores_close(got, want, 1e-5)


@pytest.mark.parametrize("name", ["t1_ps8", "t3_ps16_bf16", "t3_ps8_fp8",
                                  "t1_ps16_past_table"])
@pytest.mark.parametrize("topk", [4, 16])
def test_topk_reference_matches_numpy(name, topk):
  """Integer data: exact scores with many ties, so the tie rule is checked too."""
  case = IDX_CASES[name]
  q, w, k, table, lens, k_scale = make_indexer(case)
  want = numpy_topk(numpy_scores(q, w, k, table, lens, k_scale), topk)
  got = indexer_topk_reference(q, w, k, table, lens, topk=topk, k_scale=k_scale)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, want)


def test_ties_pick_the_lower_position():
  case = IDX_CASES["t1_ps8"]
  q, w, k, table, lens, _ = make_indexer(case)
  k = jnp.ones_like(k)                       # every visible score equal
  got = indexer_topk_reference(q, w, k, table, lens, topk=5)
  np.testing.assert_array_equal(got[0, 0], np.arange(5))
  np.testing.assert_array_equal(got[2, 0], -np.ones(5))   # kv_len 0


def test_zero_scores_are_positive_zero_and_tie():
  """Zero keys under negative weights: every score is a sum of -0.0 terms, stored as
  +0.0 by every backend, so the selection is the lowest positions."""
  case = IDX_CASES["t3_ps8_fp8"]
  q, w, k, table, lens, k_scale = make_indexer(case)
  k = jnp.zeros_like(k)
  w = -jnp.abs(w) - 0.25
  for backend in ("reference", "gpu"):
    scores = np.asarray(index_scores_reference(q, w, k, table, lens, k_scale=k_scale)
                        if backend == "reference" else
                        index_scores(q, w, k, table, lens, k_scale=k_scale, backend="gpu",
                                     interpret=True))
    seen = np.isfinite(scores)
    assert (scores[seen] == 0).all() and not np.signbit(scores[seen]).any(), backend
    got = indexer_topk(q, w, k, table, lens, topk=6, k_scale=k_scale, backend=backend,
                       interpret=True)
    np.testing.assert_array_equal(got[:, :, :], np.broadcast_to(np.arange(6), got.shape))


def test_topk_is_causal_per_row():
  """T = 3: each row selects only positions up to its own, and what it selects does not
  depend on the keys it may not see; the last row can pick its own token."""
  case = IDX_CASES["t3_ps16_bf16"]
  q, w, k, table, lens, k_scale = make_indexer(case)
  topk = 8
  got = np.asarray(indexer_topk_reference(q, w, k, table, lens, topk=topk))
  for b, kv_len in enumerate(case.kv_lens):
    for t in range(3):
      last = kv_len - 3 + t
      picked = got[b, t][got[b, t] >= 0]
      assert (picked <= last).all()
      assert len(picked) == min(topk, max(last + 1, 0))
  # Make the newest token (only row 2 of batch row 0 sees it) win every head's score.
  pos = case.kv_lens[0] - 1
  page, slot = int(table[0, pos // 16]), pos % 16
  k2 = k.at[page, slot].set(jnp.asarray(q[0, 2].astype(jnp.float32).sum(0) * 50, k.dtype))
  w2 = w.at[0].set(jnp.abs(w[0]) + 0.25)
  for backend in ("reference", "gpu"):
    again = np.asarray(indexer_topk(q, w2, k2, table, lens, topk=topk, backend=backend,
                                    interpret=True))
    base = np.asarray(indexer_topk(q, w2, k, table, lens, topk=topk, backend=backend,
                                   interpret=True))
    np.testing.assert_array_equal(again[0, :2], base[0, :2])   # rows 0, 1 cannot see it
    assert pos in again[0, 2]


def test_topk_at_least_visible_selects_all():
  case = IDX_CASES["t3_ps16_bf16"]           # kv_lens 100, 2, 49
  q, w, k, table, lens, _ = make_indexer(case)
  topk = 120
  for backend in ("reference", "gpu"):
    got = np.asarray(indexer_topk(q, w, k, table, lens, topk=topk, backend=backend,
                                  interpret=True))
    for b, kv_len in enumerate(case.kv_lens):
      for t in range(3):
        n = max(kv_len - 3 + t + 1, 0)
        np.testing.assert_array_equal(got[b, t, :n], np.arange(n))
        assert (got[b, t, n:] == -1).all()


def _random_scores(rng, rows, size, ties):
  s = rng.integers(-3, 4, (rows, size)).astype(np.float32) if ties else \
      rng.standard_normal((rows, size)).astype(np.float32)
  s[rng.random((rows, size)) < 0.2] = -np.inf
  s[0, 3:] = -np.inf                             # a row with 3 visible
  s[1, :] = -np.inf                              # a row with none
  s[2, :5] = [-0.0, 0.0, -1e-30, 1e-30, -np.float32(3e38)]   # signs, zeros, extremes
  return s


@pytest.mark.parametrize("size,topk,ties", [(2100, 16, True), (300, 7, False),
                                            (10, 16, True), (64, 64, False)])
def test_radix_topk_matches_lax_topk(size, topk, ties):
  rng = np.random.default_rng(size + topk)
  scores = jnp.asarray(_random_scores(rng, 6, size, ties)).reshape(2, 3, size)
  want = numpy_topk(np.asarray(scores, np.float64), topk)
  for method in dsa.TOPK_METHODS:
    np.testing.assert_array_equal(select_topk(scores, topk, method, interpret=True), want,
                                  err_msg=method)


@pytest.mark.parametrize("topk", [1, 37, 4096])
def test_gpu_radix_rounds_find_the_threshold(topk):
  """The GPU radix rounds (several segments of several steps each) find the same k-th
  largest key as the XLA rounds and as a sort, over ties, signed zeros, extremes and a
  row with fewer than topk finite scores."""
  from pallas_kernels.dsa_gpu import radix_threshold_gpu
  rng = np.random.default_rng(3)
  scores = _random_scores(rng, 3, 4096, ties=topk == 37)
  scores[0, :8] = [-0.0, 0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-45, 3.0]
  got = radix_threshold_gpu(jnp.asarray(scores), topk=topk, segment=2048, chunk=512,
                            interpret=True)
  keys = dsa._ordered_keys(jnp.asarray(scores))
  count = lambda cand: jnp.sum(keys[:, :, None] >= cand[:, None, :], axis=1)
  want = np.asarray(dsa.radix_threshold(count, 3, topk))
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32) ^ np.uint32(1 << 31), want)
  by_sort = np.sort(np.asarray(keys), axis=1)[:, ::-1][:, topk - 1]
  np.testing.assert_array_equal(want, by_sort)


# ---------------------------------------------------------------- indexer kernels (GPU)
GPU_IDX = [
    ("t1_ps8", None),
    ("t1_ps8", IndexerBlockConfig(block_k=16, num_splits=3)),
    ("t3_ps16_bf16", None),
    ("t3_ps16_bf16", IndexerBlockConfig(block_k=32, query_rows=2, num_splits=2)),
    ("t3_ps8_fp8", IndexerBlockConfig(block_k=16, query_rows=3, num_splits=2)),
    ("t1_ps16_past_table", IndexerBlockConfig(block_k=64, num_splits=2)),
    ("t3_ps8_normal", IndexerBlockConfig(block_k=32, query_rows=1, num_splits=4)),
]


@pytest.mark.parametrize("name,cfg", GPU_IDX, ids=[f"{n}-{i}" for i, (n, _) in
                                                   enumerate(GPU_IDX)])
def test_gpu_indexer_matches_reference(name, cfg):
  case = IDX_CASES[name]
  q, w, k, table, lens, k_scale = make_indexer(case)
  want = index_scores_reference(q, w, k, table, lens, k_scale=k_scale)
  got = index_scores(q, w, k, table, lens, k_scale=k_scale, backend="gpu", interpret=True,
                     block_config=cfg)
  assert (np.asarray(got)[..., want.shape[-1]:] == -np.inf).all()
  assert_scores_close(got, want, 1e-5 if case.kind == "int" else 1e-4)
  if case.kind == "int":  # exact scores: the same selection, ties included
    topk = 8
    ref = indexer_topk_reference(q, w, k, table, lens, topk=topk, k_scale=k_scale)
    sel = indexer_topk_kernel(q, w, k, table, lens, topk=topk, k_scale=k_scale,
                              backend="gpu", interpret=True, block_config=cfg)
    np.testing.assert_array_equal(sel, ref)


# ---------------------------------------------------------------- indexer kernels (TPU)
@pytest.mark.parametrize("fp8", [False, True])
def test_tpu_indexer_matches_reference(fp8):
  """di = 128 (a lane tile); bf16 keys of 16-row pages, fp8 keys of 32-row pages."""
  case = IdxCase("tpu", 3, 32 if fp8 else 16, (150, 37), jnp.bfloat16, fp8=fp8, dim=128,
                 heads=4)
  q, w, k, table, lens, k_scale = make_indexer(case)
  want = indexer_topk_reference(q, w, k, table, lens, topk=8, k_scale=k_scale)
  got = indexer_topk_kernel(q, w, k, table, lens, topk=8, k_scale=k_scale, backend="tpu",
                            interpret=True, block_config=IndexerBlockConfig(
                                block_k=128, query_rows=3))
  np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------- sparse MLA data
@dataclasses.dataclass(frozen=True)
class MlaCase:
  name: str
  q_len: int
  page_size: int
  kv_lens: tuple[int, ...]
  topk: int
  dtype: type = jnp.float32
  fp8: bool = False
  heads: int = 4
  v_dim: int = 32
  rope: int = 16

  @property
  def pages(self):
    return -(-max(self.kv_lens) // self.page_size) + 1


MLA_CASES = {c.name: c for c in [
    MlaCase("t1_ps8_k8", 1, 8, (40, 63, 0), 8),
    MlaCase("t3_ps16_k16_bf16", 3, 16, (100, 2, 49), 16, jnp.bfloat16),
    MlaCase("t3_ps8_k12_fp8", 3, 8, (60, 30), 12, jnp.bfloat16, fp8=True),
    MlaCase("t1_ps16_k4_odd_dims", 1, 16, (33, 70), 4, v_dim=24, rope=8),
    MlaCase("t3_ps8_k16_fp8_f32", 3, 8, (50, 17), 16, jnp.float32, fp8=True),
]}
SCALES = (0.02, 0.08)   # (latent, rope): distinct, so a swapped or ignored one fails


def make_mla(case: MlaCase, seed=0):
  """(q, kv_pages, block_table, kv_lens, kv_scale), NaN in every unseen slot."""
  rng = np.random.default_rng(seed)
  batch, ps = len(case.kv_lens), case.page_size
  head_dim = case.v_dim + case.rope
  num_pages = batch * case.pages + 3
  kv = np.full((num_pages, ps, head_dim), np.nan, np.float32)
  table = rng.permutation(num_pages)[:batch * case.pages].reshape(batch, case.pages)
  for b, kv_len in enumerate(case.kv_lens):
    for p in range(kv_len):
      kv[table[b, p // ps], p % ps] = rng.standard_normal(head_dim)
  q = rng.standard_normal((batch, case.q_len, case.heads, head_dim)) / 2
  kv_scale = None
  if case.fp8:
    kv = kv / np.where(np.arange(head_dim) < case.v_dim, *SCALES)
    kv_scale = jnp.asarray(SCALES, jnp.float32)
  pages = jnp.asarray(kv, FP8 if case.fp8 else case.dtype)
  return (jnp.asarray(q, case.dtype), pages, jnp.asarray(table, jnp.int32),
          jnp.asarray(case.kv_lens, jnp.int32), kv_scale)


def random_indices(case: MlaCase, seed=0):
  """[B, T, topk]: a random subset of each row's visible positions in random order,
  with -1 entries scattered among them (and all -1 for rows that see nothing)."""
  rng = np.random.default_rng(seed + 1)
  out = np.full((len(case.kv_lens), case.q_len, case.topk), -1, np.int32)
  for b, kv_len in enumerate(case.kv_lens):
    for t in range(case.q_len):
      n = max(kv_len - case.q_len + t + 1, 0)
      take = min(n, case.topk - 1 if case.topk > 1 else 1)
      out[b, t, :take] = rng.choice(n, take, replace=False)
      out[b, t] = rng.permutation(out[b, t])
  return jnp.asarray(out)


def all_visible(kv_lens, q_len, capacity):
  pos = np.arange(capacity)
  last = np.asarray(kv_lens)[:, None] - q_len + np.arange(q_len)
  return jnp.asarray(np.where(pos <= last[..., None], pos, -1), jnp.int32)


def numpy_masked_dense(q, kv_pages, table, indices, *, v_dim, sm_scale, kv_scale):
  """Dense MLA over every table position in float64, with a mask of the selected ones."""
  q = np.asarray(q.astype(jnp.float32), np.float64)
  pages = np.asarray(kv_pages.astype(jnp.float32), np.float64)
  if kv_scale is not None:
    pages = pages * np.where(np.arange(pages.shape[-1]) < v_dim, *np.asarray(kv_scale))
  table, indices = np.asarray(table), np.asarray(indices)
  batch, q_len, heads, _ = q.shape
  out = np.zeros((batch, q_len, heads, v_dim))
  for b in range(batch):
    rows = pages[table[b]].reshape(-1, pages.shape[-1])       # [capacity, Dk]
    for t in range(q_len):
      mask = np.zeros(len(rows), bool)
      mask[indices[b, t][indices[b, t] >= 0]] = True
      if not mask.any():
        continue
      logits = np.where(mask, q[b, t] @ np.where(mask[:, None], rows, 0).T, -np.inf)
      p = np.exp(logits * sm_scale - (logits * sm_scale).max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      out[b, t] = p @ np.where(mask[:, None], rows, 0)[:, :v_dim]
  return out


def sm(case):
  return 1.0 / math.sqrt(case.v_dim + case.rope)


MLA_TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


@pytest.mark.parametrize("name", list(MLA_CASES))
def test_sparse_reference_matches_masked_dense(name):
  case = MLA_CASES[name]
  q, kv, table, lens, kv_scale = make_mla(case)
  idx = random_indices(case)
  kw = dict(v_dim=case.v_dim, sm_scale=sm(case), kv_scale=kv_scale)
  got = sparse_mla_reference(q, kv, table, idx, **kw)
  assert got.shape == (*q.shape[:3], case.v_dim) and got.dtype == q.dtype
  want = numpy_masked_dense(q, kv, table, idx, **kw)
  tol = MLA_TOL[case.dtype]
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)
  if name == "t3_ps16_k16_bf16":   # batch row 1's first query row selects nothing
    assert (np.asarray(got)[1, 0] == 0).all()


def test_sparse_ignores_unselected_tokens():
  """Changing a row that no index names leaves the output as it was; changing a named
  one does not."""
  case = MLA_CASES["t1_ps8_k8"]
  q, kv, table, lens, _ = make_mla(case)
  idx = random_indices(case)
  kw = dict(v_dim=case.v_dim, sm_scale=sm(case))
  base = sparse_mla_reference(q, kv, table, idx, **kw)
  named = set(np.asarray(idx[0, 0]).tolist())
  free = next(p for p in range(case.kv_lens[0]) if p not in named)
  chosen = next(p for p in named if p >= 0)
  for pos, same in ((free, True), (chosen, False)):
    kv2 = kv.at[table[0, pos // 8], pos % 8].multiply(3.0)
    for backend in ("reference", "gpu"):
      got = sparse_mla(q, kv2, table, idx, **kw, backend=backend, interpret=True)
      assert np.allclose(got, base, atol=1e-6) == same, (pos, backend)


SPARSE_BACKENDS = [("reference", None), ("gpu", None),
                   ("gpu", SparseBlockConfig(block_k=16, rows_per_block=16, num_splits=3,
                                             num_warps=4))]


@pytest.mark.parametrize("name", ["t1_ps8_k8", "t3_ps16_k16_bf16", "t3_ps8_k12_fp8"])
def test_sparse_all_visible_equals_paged_mla(name):
  """indices = every visible position: the dense paged MLA, for every backend."""
  case = MLA_CASES[name]
  q, kv, table, lens, kv_scale = make_mla(case)
  idx = all_visible(lens, case.q_len, table.shape[1] * case.page_size)
  kw = dict(v_dim=case.v_dim, sm_scale=sm(case), kv_scale=kv_scale)
  want = np.asarray(paged_mla_reference(q, kv, table, lens, **kw), np.float64)
  tol = MLA_TOL[case.dtype]
  for backend, cfg in SPARSE_BACKENDS:
    if backend == "reference":
      got = sparse_mla(q, kv, table, idx, **kw, backend="reference")
    else:
      got = sparse_mla_kernel(q, kv, table, idx, **kw, backend=backend, interpret=True,
                              block_config=cfg)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol,
                               err_msg=f"{backend} {cfg}")


@pytest.mark.parametrize("name", list(MLA_CASES))
def test_gpu_sparse_mla_matches_reference(name):
  case = MLA_CASES[name]
  q, kv, table, lens, kv_scale = make_mla(case)
  idx = random_indices(case)
  kw = dict(v_dim=case.v_dim, sm_scale=sm(case), kv_scale=kv_scale)
  want = np.asarray(sparse_mla_reference(q, kv, table, idx, **kw), np.float64)
  cfg = SparseBlockConfig(block_k=16, rows_per_block=16, num_splits=2, num_warps=4)
  tol = MLA_TOL[case.dtype]
  for c in (None, cfg):
    got = sparse_mla_kernel(q, kv, table, idx, **kw, backend="gpu", interpret=True,
                            block_config=c)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


def test_tpu_sparse_mla_matches_paged_mla_and_reference():
  """v_dim 128 (a lane tile), bf16 pages of 16 rows; all-visible indices against the
  dense paged MLA, random ones against the reference."""
  case = MlaCase("tpu", 3, 16, (40, 2), 48, jnp.bfloat16, v_dim=128, rope=32, heads=4)
  q, kv, table, lens, _ = make_mla(case)
  kw = dict(v_dim=case.v_dim, sm_scale=sm(case))
  cfg = SparseBlockConfig(block_k=128, rows_per_block=16)
  idx = np.asarray(all_visible(lens, 3, table.shape[1] * 16))[..., :48]
  idx = jnp.asarray(np.where(np.arange(48) < 46, idx, -1), jnp.int32)  # some -1 tail
  # Random ones first: the first program meets -1 entries in never-written (NaN) buffer
  # rows, which must not reach the output.
  rand = random_indices(case)
  both = jnp.concatenate([rand, idx], axis=0)                 # one kernel call for both
  got = sparse_mla_kernel(q[jnp.array([0, 1, 0, 1])], kv, table[jnp.array([0, 1, 0, 1])],
                          both, **kw, backend="tpu", interpret=True, block_config=cfg)
  want = sparse_mla_reference(q, kv, table, rand, **kw)
  np.testing.assert_allclose(np.asarray(got[:2], np.float32), np.asarray(want, np.float32),
                             atol=3e-2, rtol=3e-2)
  dense = paged_mla_reference(q, kv, table, lens, **kw)
  np.testing.assert_allclose(np.asarray(got[2:], np.float32), np.asarray(dense, np.float32),
                             atol=3e-2, rtol=3e-2)


def test_indexer_then_sparse_pipeline():
  """indexer_topk -> sparse_mla through the GPU kernels equals the references, and with
  topk >= every context the pipeline is the dense paged MLA. One block table addresses
  both caches (the index keys and the latent rows of a token share a page id)."""
  icase = IDX_CASES["t3_ps16_bf16"]
  q, w, k, table, lens, _ = make_indexer(icase)
  rng = np.random.default_rng(7)
  v_dim, rope, heads = 32, 16, 4
  kv = jnp.asarray(rng.standard_normal((k.shape[0], 16, v_dim + rope)), jnp.bfloat16)
  mq = jnp.asarray(rng.standard_normal((3, 3, heads, v_dim + rope)) / 2, jnp.bfloat16)
  kw = dict(v_dim=v_dim, sm_scale=0.2)
  for topk in (8, 128):
    want = indexer_topk_reference(q, w, k, table, lens, topk=topk)
    idx = indexer_topk(q, w, k, table, lens, topk=topk, backend="gpu", interpret=True)
    np.testing.assert_array_equal(idx, want)
    ref = sparse_mla_reference(mq, kv, table, want, **kw)
    got = sparse_mla(mq, kv, table, idx, **kw, backend="gpu", interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               atol=3e-2, rtol=3e-2)
  dense = paged_mla_reference(mq, kv, table, lens, **kw)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(dense, np.float32),
                             atol=3e-2, rtol=3e-2)


# --------------------------------------------------------------------- dispatch, errors
def test_backend_dispatch(monkeypatch):
  case = IDX_CASES["t1_ps8"]
  q, w, k, table, lens, _ = make_indexer(case)
  want = indexer_topk_reference(q, w, k, table, lens, topk=4)
  monkeypatch.delenv(dsa.BACKEND_ENV_VAR, raising=False)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(indexer_topk(q, w, k, table, lens, topk=4), want)
  monkeypatch.setenv(dsa.BACKEND_ENV_VAR, "reference")
  np.testing.assert_array_equal(indexer_topk(q, w, k, table, lens, topk=4), want)
  with pytest.raises(ValueError, match="backend"):
    indexer_topk(q, w, k, table, lens, topk=4, backend="cuda-graph")
  with pytest.raises(ValueError, match="backend"):
    sparse_mla(*make_mla(MLA_CASES["t1_ps8_k8"])[:3], random_indices(MLA_CASES["t1_ps8_k8"]),
               v_dim=32, sm_scale=0.1, backend="nope")


def test_indexer_inputs_are_checked():
  case = IDX_CASES["t3_ps8_fp8"]
  q, w, k, table, lens, k_scale = make_indexer(case)
  ok = dict(topk=4, k_scale=k_scale)
  for backend in ("reference", "gpu"):
    run = lambda *a, **kw: indexer_topk(*a, **{**ok, **kw}, backend=backend, interpret=True)
    with pytest.raises(ValueError, match="topk"):
      run(q, w, k, table, lens, topk=0)
    with pytest.raises(ValueError, match="topk"):
      run(q, w, k, table, lens, topk=2.0)
    with pytest.raises(ValueError, match=r"q must be \[B, T, Hi, di\]"):
      run(q[0], w, k, table, lens)
    with pytest.raises(ValueError, match="w must be"):
      run(q, w[..., :2], k, table, lens)
    with pytest.raises(ValueError, match="k_pages"):
      run(q, w, k[..., :16], table, lens)
    with pytest.raises(ValueError, match="k_scale"):
      run(q, w, k, table, lens, k_scale=None)
    with pytest.raises(ValueError, match="k_scale"):
      run(q, w, k, table, lens, k_scale=k_scale[:, :4])
    with pytest.raises(ValueError, match="dtypes differ"):
      run(q.astype(jnp.float32), w, k.astype(jnp.bfloat16), table, lens)
    with pytest.raises(ValueError, match="block_table"):
      run(q, w, k, table[:1], lens)
    with pytest.raises(ValueError, match="kv_lens"):
      run(q, w, k, table, lens[:1])
    with pytest.raises(ValueError, match="int32"):
      run(q, w, k, table, lens.astype(jnp.float32))
  # Head dims a kernel cannot tile.
  plain = IDX_CASES["t1_ps8"]
  q, w, k, table, lens, _ = make_indexer(dataclasses.replace(plain, dim=24))
  with pytest.raises(ValueError, match="di to be a power of two"):
    indexer_topk(q, w, k, table, lens, topk=4, backend="gpu", interpret=True)
  with pytest.raises(ValueError, match="di to be a multiple of 128"):
    indexer_topk(q, w, k, table, lens, topk=4, backend="tpu", interpret=True)
  np.testing.assert_array_equal(   # the reference takes any di
      indexer_topk(q, w, k, table, lens, topk=4, backend="reference"),
      numpy_topk(numpy_scores(q, w, k, table, lens, None), 4))
  with pytest.raises(ValueError, match="block_k to be a power of two"):
    index_scores(*make_indexer(plain)[:5], backend="gpu", interpret=True,
                 block_config=IndexerBlockConfig(block_k=24))
  wide = make_indexer(dataclasses.replace(plain, q_len=3, dim=128, page_size=16))
  with pytest.raises(ValueError, match="query_rows to be T"):
    index_scores(*wide[:5], backend="tpu", interpret=True,
                 block_config=IndexerBlockConfig(block_k=128, query_rows=2))
  with pytest.raises(TypeError, match="IndexerBlockConfig"):
    index_scores(*make_indexer(plain)[:5], backend="gpu", interpret=True,
                 block_config=dict(block_k=16))
  with pytest.raises(ValueError):
    IndexerBlockConfig(block_k=0)


def test_sparse_inputs_are_checked():
  case = MLA_CASES["t3_ps8_k12_fp8"]
  q, kv, table, lens, kv_scale = make_mla(case)
  idx = random_indices(case)
  ok = dict(v_dim=case.v_dim, sm_scale=0.1, kv_scale=kv_scale)
  for backend in ("reference", "gpu"):
    run = lambda *a, **kw: sparse_mla(*a, **{**ok, **kw}, backend=backend, interpret=True)
    with pytest.raises(ValueError, match="indices"):
      run(q, kv, table, idx[:, :1])
    with pytest.raises(ValueError, match="indices"):
      run(q, kv, table, idx[..., :0])
    with pytest.raises(ValueError, match="int32"):
      run(q, kv, table, idx.astype(jnp.float32))
    with pytest.raises(ValueError, match="Dk"):
      run(q, kv[..., :-1], table, idx)
    with pytest.raises(ValueError, match="kv_lora_rank"):
      run(q, kv, table, idx, v_dim=1000)
    with pytest.raises(ValueError, match="sm_scale"):
      run(q, kv, table, idx, sm_scale=-1.0)
    with pytest.raises(ValueError, match="kv_scale"):
      run(q, kv, table, idx, kv_scale=kv_scale[:1])
    with pytest.raises(ValueError, match="block_table"):
      run(q, kv, table[:1], idx)
    with pytest.raises(ValueError, match="dtypes"):
      run(q, kv.astype(jnp.float32), table, idx)
  with pytest.raises(ValueError, match=r"v_dim \(kv_lora_rank\) to be a multiple of 128"):
    sparse_mla(q, kv, table, idx, **ok, backend="tpu", interpret=True)
  with pytest.raises(ValueError, match="rows_per_block to be a power of two"):
    sparse_mla_kernel(q, kv, table, idx, **ok, backend="gpu", interpret=True,
                      block_config=SparseBlockConfig(rows_per_block=24))
  wide = MlaCase("tpu", 1, 16, (40,), 8, jnp.bfloat16, v_dim=128, rope=32)
  q, kv, table, _, _ = make_mla(wide)
  with pytest.raises(ValueError, match="block_k to be a multiple of 128"):
    sparse_mla_kernel(q, kv, table, random_indices(wide), v_dim=128, sm_scale=0.1,
                      backend="tpu", interpret=True,
                      block_config=SparseBlockConfig(block_k=16, rows_per_block=16))
  with pytest.raises(ValueError):
    SparseBlockConfig(num_splits=0)


def test_default_configs():
  cfg = dsa.default_indexer_config(32, 1, 64, 128, 64, 512, "gpu")
  assert cfg.block_k == 128 and cfg.query_rows == 1 and cfg.num_splits * 32 >= 4 * 132
  cfg = dsa.default_indexer_config(1, 2, 64, 128, 64, 2048, "gpu")
  assert cfg.query_rows == 2 and cfg.num_splits == 4 * 132
  cfg = dsa.default_indexer_config(2, 20, 64, 128, 16, 16, "tpu")
  assert cfg.query_rows == 8 and cfg.block_k % 128 == 0 and cfg.num_splits == 1
  cfg = dsa.default_sparse_config(32, 2, 128, 576, 2048, jnp.bfloat16, "gpu")
  assert (cfg.rows_per_block, cfg.block_k, cfg.num_splits) == (64, 64, 1)
  cfg = dsa.default_sparse_config(1, 1, 128, 576, 2048, jnp.bfloat16, "gpu")
  assert cfg.num_splits > 1


# ------------------------------------------------- lowering at DeepSeek-V3.2 shapes
def _lower_for(platform, fn, *args):
  """Lower fn for `platform` without its device: Pallas' own lowering (to Triton IR for
  cuda, to Mosaic for tpu) runs, catching block shapes and ops the interpreter accepts
  but the compiler would not. Skips where this jax cannot lower for the platform."""
  traced = jax.jit(fn).trace(*args)
  try:
    return traced.lower(lowering_platforms=(platform,)).as_text()
  except (NotImplementedError, RuntimeError) as e:
    if "platform" in str(e).lower() or "unknown backend" in str(e).lower():
      pytest.skip(f"cannot lower for {platform} here: {e}")
    raise


@pytest.mark.parametrize("platform,backend", [("cuda", "gpu"), ("tpu", "tpu")])
def test_kernels_lower_at_deepseek_shapes(platform, backend):
  """Hi 64, di 128, topk 2048, H 128, Dk 576 (512 + 64), page 64, verify T = 2, with
  bf16 and fp8 caches: the kernels lower for the real compiler (not only interpret)."""
  spec = jax.ShapeDtypeStruct
  batch, t, pages, width = 2, 2, 40, 8
  table, lens = spec((batch, width), jnp.int32), spec((batch,), jnp.int32)
  q, w = spec((batch, t, 64, 128), jnp.bfloat16), spec((batch, t, 64), jnp.float32)
  for keys, scale in ((spec((pages, 64, 128), jnp.bfloat16), None),
                      (spec((pages, 64, 128), FP8), spec((pages, 64), jnp.float32))):
    text = _lower_for(platform, lambda q, w, k, bt, kl, s: indexer_topk(
        q, w, k, bt, kl, topk=2048, k_scale=s, backend=backend), q, w, keys, table, lens,
        scale)
    assert "dsa_index_scores" in text
    assert platform != "cuda" or ("dsa_topk_compact" in text and "dsa_topk_count" in text)
  mq, idx = spec((batch, t, 128, 576), jnp.bfloat16), spec((batch, t, 2048), jnp.int32)
  for kv, scale in ((spec((pages, 64, 576), jnp.bfloat16), None),
                    (spec((pages, 64, 576), FP8), spec((2,), jnp.float32))):
    text = _lower_for(platform, lambda q, kv, bt, i, s: sparse_mla(
        q, kv, bt, i, v_dim=512, sm_scale=0.1, kv_scale=s, backend=backend), mq, kv, table,
        idx, scale)
    assert "dsa_sparse_mla" in text
