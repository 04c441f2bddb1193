"""Tree-masked paged attention: reference vs a dense numpy oracle, kernels vs reference
(GPU in interpret mode, TPU through its interpreter; native on a device), the chain as a
tree against the causal result, and the Triton and Mosaic lowerings with a tree.

A tree of T rows sits at kv positions base .. base + T - 1 (base = kv_len - T); the
queries are its last Q rows (Q = T: a verify; Q < T: drafting one level), and each sees
every position before the tree and the tree rows its mask names (its ancestors and
itself). The pages are those of tests/test_paged_attention.py: whatever no row may see is
NaN, so an unmasked read shows up as NaN.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import (TREE_WORD_BITS, tile_full_range, tile_kv_range, tree_rows,
                                   tree_visible_mask)
from pallas_kernels.paged_attention import (
    default_block_config, paged_attention, paged_attention_reference)
from test_paged_attention import TOL, Case, dequantize, make_inputs, make_scales, make_sinks

FP8 = jnp.float8_e4m3fn


def static_parents(branching):
  """Parent per node of the tree with `branching[d]` children per node at depth d, level by
  level (node 0 the root), siblings together in their parent's order."""
  parents, level = [-1], [0]
  for b in branching:
    nxt = []
    for p in level:
      for _ in range(b):
        parents.append(p)
        nxt.append(len(parents) - 1)
    level = nxt
  return parents


def random_parents(q_len, rng):
  """A random tree in node order: each node's parent is an earlier node."""
  return [-1] + [int(rng.integers(0, i)) for i in range(1, q_len)]


def ancestor_mask(parents):
  """[Q, Q] bool: row i holds its ancestors and itself."""
  q_len = len(parents)
  mask = np.zeros((q_len, q_len), bool)
  for i in range(q_len):
    j = i
    while j >= 0:
      mask[i, j] = True
      j = parents[j]
  return mask


@dataclasses.dataclass(frozen=True)
class TreeCase:
  name: str
  base: Case                     # geometry; its q_len is the tree's row count T
  trees: tuple                   # one parent list per batch row, or a single one for all
  queries: int | None = None     # Q: the queries are the tree's last Q rows (default T)

  @property
  def q_len(self) -> int:
    return self.queries or self.base.q_len


def _tree_case(name, trees, group, page_size, kv_lens, dtype=jnp.float32, queries=None,
               **kw):
  trees = tuple(tuple(t) for t in trees)
  return TreeCase(name, Case(name, len(trees[0]), group, page_size, kv_lens, dtype, **kw),
                  trees, queries)


RNG = np.random.default_rng(7)
TREE_CASES = {c.name: c for c in [
    # "2,2,1" (11 rows), one tree for the batch; a row shorter than the tree (kv_len 5: its
    # first rows sit at negative positions) and an empty one
    _tree_case("t221_g4_ps8", [static_parents((2, 2, 1))], 4, 8, (30, 5, 0, 11),
               overrides=(("pages_per_block", 2),)),
    # "3,1" (7 rows), GQA 1, bf16, KV splits
    _tree_case("t31_g1_ps16_split2_bf16", [static_parents((3, 1))], 1, 16, (7, 40, 64),
               jnp.bfloat16, overrides=(("pages_per_block", 1), ("num_splits", 2))),
    # a different random tree per batch row, sinks, soft cap
    _tree_case("random_per_row_g2_ps8_sinks_softcap",
               [random_parents(9, RNG) for _ in range(3)], 2, 8, (9, 23, 50), sinks=True,
               soft_cap=3.0, overrides=(("pages_per_block", 2), ("num_splits", 2))),
    # a sliding window (>= the tree) over a long context: a row's window starts at its depth
    _tree_case("t221_g2_ps8_window", [static_parents((2, 2, 1))], 2, 8, (60, 17, 11),
               window=16, overrides=(("pages_per_block", 2),)),
    # 40 rows: two bit words per row, prefill-sized tiles with the default config
    _tree_case("random40_g4_ps16_two_words", [random_parents(40, RNG) for _ in range(2)], 4,
               16, (40, 90)),
    # fp8 pages with per-kv-head scales, a window, page 32 (the TPU kernel's fp8 page size)
    _tree_case("t221_g4_ps32_fp8_window", [static_parents((2, 2, 1))], 4, 32, (11, 70),
               jnp.bfloat16, window=20, kv_dtype=FP8, scales=True,
               overrides=(("pages_per_block", 1),)),
    # drafting one level: the queries are the last level of "2,2,1" (4 of 11 rows), a
    # window; and the last 3 rows of a random tree of 20 (a row shorter than the tree)
    _tree_case("t221_last_level_g4_ps8_window", [static_parents((2, 2, 1))], 4, 8,
               (11, 40, 25), window=12, queries=4, overrides=(("pages_per_block", 2),)),
    _tree_case("random20_last3_g2_ps16_split2", [random_parents(20, RNG) for _ in range(3)],
               2, 16, (20, 9, 77), queries=3,
               overrides=(("pages_per_block", 1), ("num_splits", 2))),
]}
TPU_TREE_CASES = ["t221_g4_ps8", "random_per_row_g2_ps8_sinks_softcap", "t221_g2_ps8_window",
                  "t221_g4_ps32_fp8_window", "t221_last_level_g4_ps8_window"]


def tree_masks(case: TreeCase):
  """[B, Q, T] bool ancestor masks of the query rows, one tree per batch row."""
  trees = case.trees * len(case.base.kv_lens) if len(case.trees) == 1 else case.trees
  return np.stack([ancestor_mask(t) for t in trees])[:, case.base.q_len - case.q_len:]


def tree_inputs(case: TreeCase):
  """make_inputs for the whole tree (its KV and what any tree row could see filled, the
  rest NaN), q cut to the query rows."""
  q, k, v, tables, kv_lens = make_inputs(case.base)
  return q[:, case.base.q_len - case.q_len:], k, v, tables, kv_lens


def case_kwargs(case: TreeCase):
  base = case.base
  k_scale, v_scale = make_scales(base)
  return dict(sliding_window=base.window, soft_cap=base.soft_cap, sinks=make_sinks(base),
              k_scale=k_scale, v_scale=v_scale, tree_mask=jnp.asarray(tree_masks(case)))


def dense_tree_attention(q, k_pages, v_pages, block_tables, kv_lens, masks, *, window=None,
                         soft_cap=None, sinks=None):
  """The naive computation in float64: per query row, the list of positions it sees (those
  before the tree, in the window placed at base + its depth, and its ancestors' tree
  positions), their keys and values read through the table, one softmax. masks
  [B, Q, T]: the queries are the tree's last Q rows."""
  q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
  block_tables, kv_lens = np.asarray(block_tables), np.asarray(kv_lens)
  batch, q_len, num_heads, d = q.shape
  kvh, _, ps, dv = v_pages.shape
  tree_len = masks.shape[-1]
  group = num_heads // kvh
  capacity = block_tables.shape[1] * ps
  out = np.zeros((batch, q_len, num_heads, dv))
  for b in range(batch):
    base = kv_lens[b] - tree_len
    for i in range(q_len):
      own = tree_len - q_len + i
      depth = int(masks[b, i, :own].sum())
      start = 0 if window is None else base + depth + 1 - window
      positions = [p for p in range(max(start, 0), base)]
      positions += [base + j for j in range(own + 1) if masks[b, i, j] and base + j >= 0]
      positions = [p for p in positions if p < capacity]
      if not positions:
        continue
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


def oracle(case: TreeCase, args):
  q, k, v, tables, kv_lens = args
  base = case.base
  k_scale, v_scale = make_scales(base)
  return dense_tree_attention(q, dequantize(k, k_scale), dequantize(v, v_scale), tables,
                              kv_lens, tree_masks(case), window=base.window,
                              soft_cap=base.soft_cap, sinks=make_sinks(base))


@pytest.mark.parametrize("name", list(TREE_CASES))
def test_reference_matches_dense(name):
  case = TREE_CASES[name]
  args = tree_inputs(case)
  got = paged_attention_reference(*args, **case_kwargs(case))
  tol = TOL[case.base.dtype]
  np.testing.assert_allclose(np.asarray(got, np.float64), oracle(case, args), atol=tol,
                             rtol=tol)


@pytest.mark.parametrize("name", list(TREE_CASES))
def test_tree_cases_differ_from_causal(name):
  """A kernel that ignored the tree mask (and masked causally) would fail these cases."""
  case = TREE_CASES[name]
  args = tree_inputs(case)
  kw = case_kwargs(case)
  tree = np.asarray(paged_attention_reference(*args, **kw), np.float32)
  kw.pop("tree_mask")
  causal = np.asarray(paged_attention_reference(*args, **kw), np.float32)
  tol = 3 * TOL[case.base.dtype]
  assert not np.allclose(tree, causal, atol=tol, rtol=tol)


class TreeAttentionTest:
  """Kernel vs reference and the dense oracle. Subclasses pick backend and interpret mode."""

  backend = "gpu"
  interpret = False
  platform = "gpu"
  cases = list(TREE_CASES)

  @pytest.fixture(autouse=True)
  def _require_platform(self):
    if not self.interpret and jax.default_backend() != self.platform:
      pytest.skip(f"needs a {self.platform} device")

  def config(self, base, q):
    overrides = dict(base.overrides)
    if self.backend == "tpu":
      overrides.pop("num_splits", None)
    batch, q_len, num_heads, _ = q.shape
    max_pages = -(-max(base.kv_lens) // base.page_size) + 1
    cfg = default_block_config(batch, q_len, num_heads, base.kv_heads, base.page_size,
                               max_pages, self.backend, num_cores=132)
    return dataclasses.replace(cfg, **overrides)

  def run(self, args, cfg, **kw):
    return paged_attention(*args, backend=self.backend, interpret=self.interpret,
                           block_config=cfg, **kw)

  def test_matches_reference(self, name):
    case = TREE_CASES[name]
    args = tree_inputs(case)
    kw = case_kwargs(case)
    got = self.run(args, self.config(case.base, args[0]), **kw)
    assert got.dtype == args[0].dtype and got.shape[:3] == args[0].shape[:3]
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any()
    tol = TOL[case.base.dtype]
    want = paged_attention_reference(*args, **kw)
    np.testing.assert_allclose(got, np.asarray(want, np.float32), atol=tol, rtol=tol)
    np.testing.assert_allclose(got, oracle(case, args), atol=tol, rtol=tol)
    # rows at negative positions (kv_len < the row's place) see nothing: exactly zero
    for b, kv_len in enumerate(case.base.kv_lens):
      for i in range(case.q_len):
        if kv_len - case.q_len + i < 0:
          assert (got[b, i] == 0).all()

  def test_chain_is_causal(self):
    """The chain (each row's parent the row before) as a tree mask gives the causal result,
    with and without a window."""
    for base in (Case("chain4_g4", 4, 4, 8, (3, 17, 40), overrides=(("pages_per_block", 2),
                                                                    ("num_splits", 2))),
                 Case("chain4_g2_window", 4, 2, 8, (9, 33), window=6,
                      overrides=(("pages_per_block", 2),))):
      args = make_inputs(base)
      cfg = self.config(base, args[0])
      chain = jnp.tril(jnp.ones((base.q_len, base.q_len), bool))
      kw = dict(sliding_window=base.window)
      want = np.asarray(self.run(args, cfg, **kw))
      got = np.asarray(self.run(args, cfg, tree_mask=chain, **kw))
      np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
      np.testing.assert_array_equal(np.asarray(paged_attention_reference(
          *args, tree_mask=chain, **kw)), np.asarray(paged_attention_reference(*args, **kw)))


def pytest_generate_tests(metafunc):
  if metafunc.cls is not None and "name" in metafunc.fixturenames:
    metafunc.parametrize("name", metafunc.cls.cases)


class TestTreeAttentionGPU(TreeAttentionTest):
  pass


class TestTreeAttentionGPUInterpret(TestTreeAttentionGPU):
  interpret = True


class TestTreeAttentionTPU(TreeAttentionTest):
  backend = "tpu"
  platform = "tpu"
  cases = TPU_TREE_CASES


class TestTreeAttentionTPUInterpret(TestTreeAttentionTPU):
  interpret = True


def test_tree_rows_pack_ancestor_bits_and_depth():
  """Bit j of word w is tree row 32 w + j; the depth counts the rows seen before the
  query's own; entries past its own row are dropped; packed rows repeat their query.
  40 tree rows (two words), the queries its last 30."""
  rng = np.random.default_rng(0)
  tree_len, q_len, group = 40, 30, 2
  full = np.stack([ancestor_mask(random_parents(tree_len, rng)) for _ in range(2)])
  masks = full[:, tree_len - q_len:]
  noisy = masks | np.triu(rng.random((q_len, tree_len)) < 0.5, tree_len - q_len + 1)
  rows = tree_rows(jnp.asarray(noisy), group, 64)
  assert rows.shape == (2, 64, 3) and rows.dtype == jnp.int32
  bits = np.asarray(rows[..., :2]).view(np.uint32).astype(np.int64)
  for b in range(2):
    for r in range(64):
      i = min(r // group, q_len - 1)
      got = [bool(bits[b, r, j // TREE_WORD_BITS] >> (j % TREE_WORD_BITS) & 1)
             for j in range(2 * TREE_WORD_BITS)]
      assert got == list(masks[b, i]) + [False] * (2 * TREE_WORD_BITS - tree_len)
      assert rows[b, r, 2] == masks[b, i, :tree_len - q_len + i].sum()


@pytest.mark.parametrize("q_len,tree_len,group,rows,window", [
    (11, 11, 4, 16, None), (7, 7, 1, 16, 8), (40, 40, 4, 128, None), (11, 11, 2, 16, 12),
    (4, 11, 4, 16, 11), (3, 20, 8, 16, None)])
def test_tree_tile_ranges_cover_the_mask(q_len, tree_len, group, rows, window):
  """Every position a tile's rows see lies in tile_kv_range(tree_len=T), and every position
  in tile_full_range(tree_len=T) is seen by all of them: the kernels mask the first range
  and run the second without masks."""
  rng = np.random.default_rng(q_len)
  capacity = 128
  tiles = -(-q_len * group // rows)
  pos = np.arange(capacity + 8)
  masks = ancestor_mask(random_parents(tree_len, rng))[None, tree_len - q_len:]
  packed = tree_rows(jnp.asarray(masks), group, tiles * rows)[0]
  for kv_len in (0, 3, tree_len, tree_len + 5, 70, capacity, capacity + 3):
    for tile in range(tiles):
      cols = packed[tile * rows:(tile + 1) * rows]
      seen = np.asarray(tree_visible_mask(
          [cols[:, w:w + 1] for w in range(cols.shape[1] - 1)], cols[:, -1:], pos[None, :],
          kv_len=kv_len, tree_len=tree_len, window=window, kv_capacity=capacity))
      kw = dict(kv_len=kv_len, rows_per_block=rows, q_len=q_len, group=group, window=window,
                kv_capacity=capacity, tree_len=tree_len)
      lo, hi = (int(x) for x in tile_kv_range(tile, **kw))
      some = np.flatnonzero(seen.any(axis=0))
      assert ((some >= lo) & (some < hi)).all(), (kv_len, tile, lo, hi)
      lo, hi = (int(x) for x in tile_full_range(tile, **kw))
      assert seen[:, lo:max(lo, hi)].all(), (kv_len, tile, lo, hi)


def test_tree_mask_inputs_are_checked():
  case = TREE_CASES["t221_g4_ps8"]
  args = tree_inputs(case)
  masks = jnp.asarray(tree_masks(case))
  with pytest.raises(ValueError, match="tree_mask must be"):
    paged_attention_reference(*args, tree_mask=masks[:, :4, :4])
  with pytest.raises(ValueError, match="T >= Q"):
    paged_attention_reference(*args, tree_mask=masks[:, :, :5])
  with pytest.raises(ValueError, match="tree_mask must be bool"):
    paged_attention(*args, tree_mask=masks.astype(jnp.int32), backend="gpu", interpret=True)
  with pytest.raises(ValueError, match="window"):
    paged_attention_reference(*args, tree_mask=masks, sliding_window=8)
  # one [Q, Q] mask serves every batch row
  np.testing.assert_array_equal(
      np.asarray(paged_attention_reference(*args, tree_mask=masks[0])),
      np.asarray(paged_attention_reference(*args, tree_mask=masks)))


@pytest.mark.parametrize("batch,q_len,window", [(1, 11, None), (8, 40, 128)])
def test_tree_kernels_lower(monkeypatch, batch, q_len, window):
  """The tree kernels' Triton and Mosaic lowerings (block shapes, the bit shifts) at a
  7B head shape, on any host: what the interpreters do not check."""
  f = jax.ShapeDtypeStruct
  hq, kvh, ps, width, d = 32, 8, 16, 64, 128
  args = (f((batch, q_len, hq, d), jnp.bfloat16), f((kvh, batch * width, ps, d), jnp.bfloat16),
          f((kvh, batch * width, ps, d), jnp.bfloat16), f((batch, width), jnp.int32),
          f((batch,), jnp.int32), f((batch, q_len, q_len), jnp.bool_))

  def lower(backend, platform):
    fn = jax.jit(lambda *a: paged_attention(*a[:5], tree_mask=a[5], sliding_window=window,
                                            backend=backend))
    return fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()

  assert lower("gpu", "cuda").count('name = "paged_attention_gpu"') == 1
  tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
  if not all(hasattr(tpu_info, n) for n in ("registry", "get_tpu_info", "ChipVersion",
                                            "get_tpu_info_for_chip")):
    pytest.skip("this jax has no TPU chip registry to stand in for the host")
  monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind,
                      lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1))
  try:
    assert "paged_attention_tpu" in lower("tpu", "tpu")
  finally:
    getattr(tpu_info.get_tpu_info, "cache_clear", lambda: None)()

