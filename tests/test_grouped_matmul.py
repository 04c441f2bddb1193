"""Grouped matmul: reference vs numpy, every backend vs reference, the routing plan, the bench.

Every expert that no row is routed to holds NaN weights, so a kernel that reads an
unrouted expert (or gathers a row from a skipped tile) shows NaN in the output. The
ragged_dot backend is exempt: jax's default ragged_dot lowering is a masked dot over all
experts, so it gets finite weights everywhere. Rows with ids outside [0, E) must come out
exactly 0; their x rows are NaN. Quantized experts (1-byte w with w_scale [E, S, M])
poison an unrouted expert's scales with NaN, and its values too where the format has NaN
(fp8; int8 ones get -128, a value the quantizer never writes).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import (
    BlockConfig, GroupPlan, default_block_config, grouped_matmul, grouped_matmul_reference,
    num_tiles, plan_groups)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  ids: str                  # routing pattern, see make_ids
  rows: int
  experts: int = 8
  k: int = 32
  m: int = 64
  dtype: type = jnp.float32
  overrides: tuple = ()     # BlockConfig fields set on top of the default
  values: type | None = None  # 1-byte w dtype of quantized experts, None: w in dtype
  scale_rows: int = 1       # S of w_scale [E, S, M] (quantized experts only)


CASES = {c.name: c for c in [
    # Random ids with -1 and ids >= E; N not a multiple of the tile.
    Case("random_invalid", "random", 37),
    Case("random_invalid_bf16", "random", 37, dtype=jnp.bfloat16),
    # One expert gets every row: several tiles of the same expert.
    Case("one_expert", "one", 40, overrides=(("tile_rows", 16),)),
    # Every row a different expert (decode: one token's top-E).
    Case("all_distinct_bf16", "distinct", 8, dtype=jnp.bfloat16),
    # Only two experts routed, the others empty groups; K in chunks, M in blocks, K split.
    Case("empty_groups_blocks", "two", 21, k=64, m=128,
         overrides=(("block_k", 16), ("block_m", 32), ("num_splits", 3))),
    # No row routed anywhere: all zeros, no tile computed.
    Case("all_invalid", "invalid", 9),
    # Larger tile than rows per expert; uneven splits.
    Case("tile32_split2_bf16", "random", 50, experts=4, k=48, m=32,
         overrides=(("tile_rows", 32), ("block_k", 16), ("num_splits", 2))),
]}
QUANT_CASES = [
    # Quantized experts: int8 per channel; fp8 in 16-row scale blocks, chunks of one block
    # split two ways; e5m2 in 32-row blocks, two chunks per block.
    Case("int8_channel_bf16", "random", 37, values=jnp.int8, dtype=jnp.bfloat16),
    Case("fp8_block16_split2", "random", 21, k=64, values=jnp.float8_e4m3fn,
         scale_rows=4, overrides=(("block_k", 16), ("num_splits", 2))),
    Case("e5m2_block32_distinct_bf16", "distinct", 8, k=64, values=jnp.float8_e5m2,
         scale_rows=2, dtype=jnp.bfloat16, overrides=(("block_k", 16),)),
]
CASES.update((c.name, c) for c in QUANT_CASES)
# The TPU interpreter is slow: fewer cases, and blocks that are legal Mosaic tiles.
TPU_CASES = ["random_invalid", "one_expert", "all_distinct_bf16", "all_invalid",
             "tpu_blocks_bf16", "fp8_block16_split2", "tpu_int8_block128_bf16"]
CASES["tpu_blocks_bf16"] = Case("tpu_blocks_bf16", "random", 19, experts=4, k=256, m=256,
                                dtype=jnp.bfloat16,
                                overrides=(("block_k", 128), ("block_m", 128)))
# One 128-row scale block per K step (fp8_block16_split2 runs whole K: four blocks a step).
CASES["tpu_int8_block128_bf16"] = Case(
    "tpu_int8_block128_bf16", "random", 19, experts=4, k=256, m=128, values=jnp.int8,
    scale_rows=2, dtype=jnp.bfloat16, overrides=(("block_k", 128), ("block_m", 128)))


def make_ids(case: Case, rng) -> np.ndarray:
  n, e = case.rows, case.experts
  if case.ids == "random":
    ids = rng.integers(-2, e + 2, n)
    ids[:2] = (-1, e)                                  # at least one of each kind
  elif case.ids == "one":
    ids = np.full(n, e // 2 + 1)
  elif case.ids == "distinct":
    ids = rng.permutation(e)[:n]
  elif case.ids == "two":
    ids = rng.choice([1, e - 2], n)
  else:
    ids = rng.choice([-1, e, 10 * e], n)
  return ids.astype(np.int32)


QMAX = {jnp.int8: 127.0, jnp.float8_e4m3fn: 448.0, jnp.float8_e5m2: 57344.0}


def quantize(w, value_dtype, scale_rows):
  """float32 [E, K, M] -> (values [E, K, M], w_scale [E, S, M] f32), absmax per block."""
  e, k, m = w.shape
  blocks = w.reshape(e, scale_rows, k // scale_rows, m)
  scale = np.maximum(np.abs(blocks).max(axis=2), 1e-12) / QMAX[value_dtype]
  q = blocks / scale[:, :, None, :]
  if value_dtype == jnp.int8:
    q = np.clip(np.round(q), -127, 127)
  return q.reshape(e, k, m), scale.astype(np.float32)


def make_inputs(case: Case, seed: int = 0, poison: bool = True):
  """Fresh random x, w, ids and w_scale (None unless the case quantizes the experts).

  Invalid rows' x and (poison) unrouted experts' weights, or scales, are NaN.
  """
  rng = np.random.default_rng(seed)
  ids = make_ids(case, rng)
  valid = (ids >= 0) & (ids < case.experts)
  x = rng.standard_normal((case.rows, case.k)).astype(np.float32)
  x[~valid] = np.nan
  w = rng.standard_normal((case.experts, case.k, case.m)).astype(np.float32)
  w /= np.sqrt(case.k)
  scale = None
  if case.values is not None:
    w, scale = quantize(w, case.values, case.scale_rows)
  for e in set(range(case.experts)) - set(ids[valid].tolist()) if poison else ():
    if scale is None:
      w[e] = np.nan
    else:
      scale[e] = np.nan
      w[e] = -128 if case.values == jnp.int8 else np.nan
  x = jnp.asarray(x, case.dtype)
  if scale is None:
    return x, jnp.asarray(w, case.dtype), jnp.asarray(ids), None
  w = jnp.asarray(w, jnp.float32).astype(case.values)
  return x, w, jnp.asarray(ids), jnp.asarray(scale)


def numpy_grouped_matmul(x, w, ids, w_scale=None):
  """float64; quantized experts are dequantized first."""
  if w_scale is not None:
    e, k, m = w.shape
    s = np.asarray(w_scale, np.float64)
    w = np.asarray(w.astype(jnp.float32), np.float64).reshape(e, s.shape[1], -1, m)
    w = (w * s[:, :, None, :]).reshape(e, k, m)
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  w, ids = np.asarray(w, np.float64), np.asarray(ids)
  out = np.zeros((x.shape[0], w.shape[2]))
  for n, g in enumerate(ids):
    if 0 <= g < w.shape[0]:
      out[n] = x[n] @ w[g]
  return out


def check(got, want, case, ids):
  assert got.shape == (case.rows, case.m) and got.dtype == case.dtype
  got = np.asarray(got, np.float32)
  assert np.isfinite(got).all()
  invalid = (np.asarray(ids) < 0) | (np.asarray(ids) >= case.experts)
  assert (got[invalid] == 0).all()
  tol = TOL[case.dtype]
  np.testing.assert_allclose(got, np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_numpy(name):
  case = CASES[name]
  x, w, ids, w_scale = make_inputs(case)
  check(grouped_matmul_reference(x, w, ids, w_scale=w_scale),
        numpy_grouped_matmul(x, w, ids, w_scale), case, ids)


class GroupedMatmulTest:
  """Backend vs reference. Subclasses pick the backend, interpret mode and cases."""

  backend = "gpu"
  interpret = False
  platform = "gpu"          # native runs need jax.default_backend() == platform
  poison = True             # unrouted experts' weights are NaN
  cases = [c for c in CASES if not c.startswith("tpu_")]

  @pytest.fixture(autouse=True)
  def _require_platform(self):
    if not self.interpret and self.platform and jax.default_backend() != self.platform:
      pytest.skip(f"needs a {self.platform} device")

  def block(self, case):
    cfg = default_block_config(case.rows, case.experts, case.k, case.m, self.backend,
                               num_cores=132, scale_rows=case.scale_rows)
    return dataclasses.replace(cfg, **dict(case.overrides))

  def test_matches_reference(self, name):
    case = CASES[name]
    x, w, ids, w_scale = make_inputs(case, seed=1, poison=self.poison)
    got = grouped_matmul(x, w, ids, backend=self.backend, block=self.block(case),
                         interpret=self.interpret, w_scale=w_scale)
    check(got, grouped_matmul_reference(x, w, ids, w_scale=w_scale), case, ids)


def pytest_generate_tests(metafunc):
  if metafunc.cls is not None and "name" in metafunc.fixturenames:
    metafunc.parametrize("name", metafunc.cls.cases)


class TestGroupedMatmulGPU(GroupedMatmulTest):
  pass


class TestGroupedMatmulGPUInterpret(TestGroupedMatmulGPU):
  interpret = True


class TestGroupedMatmulTPU(GroupedMatmulTest):
  backend = "tpu"
  platform = "tpu"
  cases = TPU_CASES

  def block(self, case):
    # Whole K and M in one block, unless the case (tpu_*) sets legal Mosaic blocks itself.
    cfg = BlockConfig(tile_rows=16, block_m=case.m, block_k=case.k)
    overrides = case.overrides if case.name.startswith("tpu_") else ()
    return dataclasses.replace(cfg, **dict(overrides))


class TestGroupedMatmulTPUInterpret(TestGroupedMatmulTPU):
  interpret = True


class TestGroupedMatmulRaggedDot(GroupedMatmulTest):
  backend = "ragged_dot"
  platform = None           # plain XLA: runs wherever jax runs
  interpret = True
  poison = False            # reads every expert (module docstring)


def test_plan_layout():
  rng = np.random.default_rng(3)
  n, e, tm = 45, 6, 8
  ids = rng.integers(-1, e + 1, n).astype(np.int32)
  ids[ids == 2] = 3                                   # an empty group in the middle
  plan = jax.jit(plan_groups, static_argnums=(1, 2))(jnp.asarray(ids), e, tm)
  valid = (ids >= 0) & (ids < e)
  t = num_tiles(n, e, tm)
  assert plan.tile_expert.shape == (t,) and plan.slot_row.shape == (t * tm,)
  np.testing.assert_array_equal(plan.group_sizes, np.bincount(ids[valid], minlength=e))
  np.testing.assert_array_equal(plan.valid_rows, valid)
  tiles = sum(-(-c // tm) for c in np.bincount(ids[valid], minlength=e))
  assert int(plan.num_valid_tiles[0]) == tiles
  te, slot_row, row_slot = (np.asarray(a) for a in (plan.tile_expert, plan.slot_row,
                                                     plan.row_slot))
  # Tiles past the valid ones repeat the last valid expert (no new weight fetch).
  assert (te[tiles:] == te[tiles - 1]).all()
  assert set(te.tolist()) == set(ids[valid].tolist())
  for r in range(n):
    if valid[r]:
      assert slot_row[row_slot[r]] == r and te[row_slot[r] // tm] == ids[r]
    else:
      assert row_slot[r] == t * tm
  assert (slot_row[tiles * tm:] == n).all()
  # Sorted order: by expert, invalid last, stable within an expert.
  keys = np.where(valid, ids, e)
  np.testing.assert_array_equal(plan.sorted_rows, np.argsort(keys, kind="stable"))
  np.testing.assert_array_equal(np.asarray(plan.sorted_rows)[plan.row_rank], np.arange(n))


@pytest.mark.parametrize("n,e,tm", [(1, 8, 16), (37, 8, 16), (45, 6, 8), (300, 16, 32),
                                    (1024, 128, 16)])
def test_plan_methods_agree(n, e, tm):
  plan = jax.jit(plan_groups, static_argnums=(1, 2), static_argnames="method")
  rng = np.random.default_rng(n)
  for ids in (rng.integers(-2, e + 2, n), np.full(n, -1), np.full(n, e - 1)):
    ids = jnp.asarray(ids, jnp.int32)
    a, b = plan(ids, e, tm, method="sort"), plan(ids, e, tm, method="compare")
    for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(leaf_a, leaf_b)
  with pytest.raises(ValueError, match="method"):
    plan_groups(ids, e, tm, method="bucket")


@pytest.mark.parametrize("n,e,tm", [(1, 128, 16), (8, 128, 16), (1024, 128, 16),
                                    (2048, 128, 16), (17, 4, 16), (100, 3, 8)])
def test_num_tiles_bound_is_tight_enough(n, e, tm):
  t = num_tiles(n, e, tm)
  assert t <= n
  # Worst case: min(E, N) - 1 experts with one row each, the rest on one expert.
  g = min(e, n)
  worst = (g - 1) + -(-(n - (g - 1)) // tm)
  assert worst <= t


def test_plan_is_shared_and_jittable():
  case = CASES["random_invalid"]
  x, w, ids, _ = make_inputs(case, seed=4)
  want = grouped_matmul_reference(x, w, ids)
  plan = jax.jit(plan_groups, static_argnums=(1, 2))(ids, case.experts, 16)
  assert isinstance(plan, GroupPlan)
  block = BlockConfig(tile_rows=16, block_m=64, block_k=32)
  run = jax.jit(lambda x, w, plan: grouped_matmul(x, w, ids, backend="gpu", block=block,
                                                  interpret=True, plan=plan))
  check(run(x, w, plan), want, case, ids)
  w = jnp.nan_to_num(w)                                # ragged_dot reads every expert
  check(grouped_matmul(x, w, ids, backend="ragged_dot", plan=plan),
        grouped_matmul_reference(x, w, ids), case, ids)
  with pytest.raises(ValueError, match="tile_rows"):
    grouped_matmul(x, w, ids, backend="gpu", interpret=True, plan=plan,
                   block=dataclasses.replace(block, tile_rows=32))


def test_default_config_gpu_kernel():
  case = CASES["random_invalid_bf16"]
  x, w, ids, _ = make_inputs(case, seed=5)
  check(grouped_matmul(x, w, ids, backend="gpu", interpret=True),
        grouped_matmul_reference(x, w, ids), case, ids)


def test_default_configs_fit_glm_shapes():
  for n in (8, 64, 256, 1024, 2048):
    for k, m in ((4096, 2816), (1408, 4096)):
      g = default_block_config(n, 128, k, m, "gpu", num_cores=132)
      assert k % g.block_k == 0 and m % g.block_m == 0 and g.tile_rows >= 16
      t = default_block_config(n, 128, k, m, "tpu")
      assert k % t.block_k == 0 and m % t.block_m == 0 and t.num_splits == 1
      assert t.block_k % 128 == 0 and t.block_m % 128 == 0


def test_backend_dispatch(monkeypatch):
  case = CASES["random_invalid"]
  x, w, ids, _ = make_inputs(case, poison=False)
  want = grouped_matmul_reference(x, w, ids)
  monkeypatch.delenv("MTP_JAX_MOE_BACKEND", raising=False)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(grouped_matmul(x, w, ids), want)
  monkeypatch.setenv("MTP_JAX_MOE_BACKEND", "ragged_dot")
  np.testing.assert_allclose(grouped_matmul(x, w, ids), want, atol=2e-5, rtol=2e-5)
  with pytest.raises(ValueError, match="backend"):
    grouped_matmul(x, w, ids, backend="cuda-graph")
  # Other ops keep their backend list.
  from pallas_kernels.common import resolve_backend
  with pytest.raises(ValueError, match="backend"):
    resolve_backend("ragged_dot", "MTP_JAX_ATTENTION_BACKEND", "paged-attention")


@pytest.mark.parametrize("kwargs", [dict(tile_rows=12), dict(tile_rows=4), dict(block_m=0),
                                    dict(num_splits=1.5), dict(num_warps=True)])
def test_block_config_validates(kwargs):
  with pytest.raises(ValueError):
    BlockConfig(**kwargs)


def test_bad_inputs_are_refused():
  x, w, ids, _ = make_inputs(CASES["random_invalid"])
  with pytest.raises(ValueError, match="K="):
    grouped_matmul_reference(x[:, :-1], w, ids)
  with pytest.raises(ValueError, match="dtypes"):
    grouped_matmul_reference(x.astype(jnp.bfloat16), w, ids)
  with pytest.raises(ValueError, match="group_ids"):
    grouped_matmul_reference(x, w, ids[:-1])
  with pytest.raises(ValueError, match="multiple"):   # GPU blocks must tile K and M
    grouped_matmul(x, w, ids, backend="gpu", interpret=True,
                   block=BlockConfig(block_k=64, block_m=64))
  with pytest.raises(ValueError, match="multiple of 128"):
    grouped_matmul(x, w, ids, backend="tpu", interpret=True,
                   block=BlockConfig(block_k=16, block_m=64))
  with pytest.raises(TypeError):
    grouped_matmul(x, w, ids, backend="gpu", block=dict(tile_rows=16))


def test_bad_quantized_experts_are_refused():
  case = CASES["fp8_block16_split2"]                  # K=64, M=64, S=4, E=8
  x, w, ids, w_scale = make_inputs(case, poison=False)
  for args, kwargs, match in [
      ((x, w, ids), {}, r"w is float8_e4m3fn \(quantized experts\): pass w_scale "
                        r"\[E=8, S, M=64\] float32"),
      ((x, w.astype(jnp.float32), ids), dict(w_scale=w_scale),
       "w dtype float32 is not supported; expected one of int8, float8_e4m3fn"),
      ((x, w, ids), dict(w_scale=w_scale[:, :, :32]), r"w_scale must be \[8, S, N=64\]"),
      ((x, w, ids), dict(w_scale=w_scale[:4]), r"w_scale must be \[8, S, N=64\]"),
      ((x, w, ids), dict(w_scale=jnp.ones((8, 3, 64))), "K=64 must be a multiple of the 3"),
      ((x, w, ids), dict(w_scale=w_scale.astype(jnp.bfloat16)), "w_scale dtype bfloat16"),
      ((x.astype(jnp.float16), w, ids), dict(w_scale=w_scale), "x dtype float16"),
  ]:
    with pytest.raises(ValueError, match=match):
      grouped_matmul_reference(*args, **kwargs)
    with pytest.raises(ValueError, match=match):
      grouped_matmul(*args, backend="gpu", interpret=True, **kwargs)
  with pytest.raises(ValueError, match="straddle"):     # GPU chunks within scale blocks
    grouped_matmul(x, w, ids, w_scale=w_scale, backend="gpu", interpret=True,
                   block=BlockConfig(block_k=32, block_m=64))
  x, ids = jnp.ones((3, 384), jnp.bfloat16), jnp.array([0, 1, 1], jnp.int32)
  w, w_scale = jnp.ones((2, 384, 128), jnp.int8), jnp.ones((2, 4, 128))  # blocks of 96
  with pytest.raises(ValueError, match="divide or be a multiple of the scale block"):
    grouped_matmul(x, w, ids, w_scale=w_scale, backend="tpu", interpret=True,
                   block=BlockConfig(block_k=128, block_m=128))


@pytest.mark.parametrize("values,scale_rows", [(jnp.int8, 1), (jnp.float8_e4m3fn, 32)],
                         ids=["int8_channel", "fp8_block128"])
def test_gpu_kernel_lowers_quantized_experts(values, scale_rows):
  """The Triton lowering of quantized experts (converts included) runs on any host."""
  n, e, k, m = 8, 128, 4096, 2816
  block = default_block_config(n, e, k, m, "gpu", scale_rows=scale_rows)
  assert (k // scale_rows) % block.block_k == 0
  fn = jax.jit(lambda x, w, ids, s: grouped_matmul(x, w, ids, w_scale=s, backend="gpu",
                                                   block=block, interpret=False))
  args = (jax.ShapeDtypeStruct((n, k), jnp.bfloat16), jax.ShapeDtypeStruct((e, k, m), values),
          jax.ShapeDtypeStruct((n,), jnp.int32),
          jax.ShapeDtypeStruct((e, scale_rows, m), jnp.float32))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "grouped_matmul_gpu" in text


def test_bench_smoke(tmp_path, monkeypatch):
  monkeypatch.delenv("OUT", raising=False)
  spec = importlib.util.spec_from_file_location(
      "bench_moe_kernels", REPO / "launch" / "bench_moe_kernels.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  path = tmp_path / "bench.json"
  bench.main(["--smoke", "--shapes", "down", "--json", str(path)])
  data = json.loads(path.read_text())
  rows = [r for r in data["results"] if r.get("us_best") is not None]
  assert {r["candidate"].split()[0] for r in rows} >= {"gpu", "ragged_dot", "reference"}
  assert all(r["rel_err"] < 2e-2 and r["us_best"] > 0 for r in rows)
