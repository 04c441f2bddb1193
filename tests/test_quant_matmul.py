"""Quantized matmul: reference vs float64 numpy, every kernel vs reference, errors, bench.

Weights are random normal / sqrt(K), quantized per scale block with the block's absolute
maximum mapped to the format's largest value (127 for int8, 448 for e4m3, 57344 for
e5m2), so outputs are O(1). The numpy result dequantizes the stored values in float64
and multiplies, the definition the kernels must meet.
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

from pallas_kernels.quant_matmul import (
    BlockConfig, default_block_config, quant_matmul, quant_matmul_reference)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
QMAX = {jnp.int8: 127.0, jnp.float8_e4m3fn: 448.0, jnp.float8_e5m2: 57344.0}
REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  m: int
  k: int = 64
  n: int = 64
  scale_rows: int = 1       # S: 1 per channel, K // bk block-scaled
  values: type = jnp.int8
  dtype: type = jnp.float32
  overrides: tuple = ()     # BlockConfig fields set on top of the default


def quantize(w, value_dtype, scale_rows):
  """float32 [K, N] -> (values [K, N] value_dtype, scale [S, N] f32), absmax per block."""
  k, n = w.shape
  blocks = w.reshape(scale_rows, k // scale_rows, n)
  scale = np.maximum(np.abs(blocks).max(axis=1), 1e-12) / QMAX[value_dtype]
  q = blocks / scale[:, None, :]
  if value_dtype == jnp.int8:
    q = np.clip(np.round(q), -127, 127)
  values = jnp.asarray(q.reshape(k, n), jnp.float32).astype(value_dtype)
  return values, jnp.asarray(scale, jnp.float32)


def make_inputs(case: Case, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((case.m, case.k)), case.dtype)
  w = (rng.standard_normal((case.k, case.n)) / np.sqrt(case.k)).astype(np.float32)
  return (x, *quantize(w, case.values, case.scale_rows))


def numpy_quant_matmul(x, values, scale):
  """Dequantize in float64, then one matmul."""
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  v = np.asarray(values.astype(jnp.float32), np.float64)
  s = np.asarray(scale, np.float64)
  k, n = v.shape
  w = (v.reshape(s.shape[0], -1, n) * s[:, None, :]).reshape(k, n)
  return x @ w


def check(got, want, case):
  assert got.shape == (case.m, case.n) and got.dtype == case.dtype
  got = np.asarray(jnp.asarray(got, jnp.float32))
  assert np.isfinite(got).all()
  tol = TOL[case.dtype]
  np.testing.assert_allclose(got, np.asarray(jnp.asarray(want, jnp.float32)), atol=tol,
                             rtol=tol)


KINDS = {  # (value dtype, scale block size bk or None for per channel)
    "int8_channel": (jnp.int8, None),
    "fp8_channel": (jnp.float8_e4m3fn, None),
    "fp8_block16": (jnp.float8_e4m3fn, 16),
    "fp8_block32": (jnp.float8_e4m3fn, 32),
}


@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_reference_matches_numpy(kind, dtype, m):
  values, bk = KINDS[kind]
  k = 64
  case = Case(kind, m, k=k, scale_rows=k // bk if bk else 1, values=values, dtype=dtype)
  x, v, s = make_inputs(case, seed=m)
  check(quant_matmul_reference(x, v, s), numpy_quant_matmul(x, v, s), case)


CASES = {c.name: c for c in [
    # Batch-1 GEMV, default blocks: one row on CUDA cores, K splits fill the cores.
    Case("int8_channel_m1", 1),
    # Rows on CUDA cores: 4 per program over 3 rows (the last repeats row 2), three
    # uneven K splits; two rows per program under two scale blocks of two chunks each.
    Case("int8_gemv_rows4_m3_bf16", 3, k=128, n=128, dtype=jnp.bfloat16,
         overrides=(("block_m", 4), ("block_n", 32), ("block_k", 16), ("num_splits", 3))),
    Case("fp8_block32_gemv_rows2_m2", 2, scale_rows=2, values=jnp.float8_e4m3fn,
         overrides=(("block_m", 2), ("block_k", 16))),
    # Three M blocks of 16, narrow N blocks, three K splits of which the last is empty.
    Case("int8_channel_m33_bf16", 33, k=128, n=128, dtype=jnp.bfloat16,
         overrides=(("block_m", 16), ("block_n", 32), ("block_k", 32), ("num_splits", 3))),
    # fp8 per channel under bf16 x: the tensor-core path multiplies in float16.
    Case("fp8_channel_m5_bf16", 5, values=jnp.float8_e4m3fn, dtype=jnp.bfloat16),
    Case("e5m2_channel_m16_bf16", 16, values=jnp.float8_e5m2, dtype=jnp.bfloat16,
         overrides=(("num_splits", 2),)),
    # Block-scaled: one chunk per scale block, split across two K splits.
    Case("fp8_block16_m16_bf16", 16, scale_rows=4, values=jnp.float8_e4m3fn,
         dtype=jnp.bfloat16, overrides=(("block_k", 16), ("num_splits", 2))),
    # Two chunks per scale block.
    Case("fp8_block32_m5", 5, scale_rows=2, values=jnp.float8_e4m3fn,
         overrides=(("block_k", 16),)),
    Case("e5m2_block32_m1_bf16", 1, k=128, scale_rows=4, values=jnp.float8_e5m2,
         dtype=jnp.bfloat16),
    Case("int8_block32_m33", 33, scale_rows=2),
    # TPU: legal Mosaic blocks. Two K steps under one scale row; one scale row per step
    # (bk 128); four 32-row scale blocks inside one 128-wide step.
    Case("tpu_int8_channel_m5_bf16", 5, k=256, n=256, dtype=jnp.bfloat16,
         overrides=(("block_m", 16), ("block_n", 128), ("block_k", 128))),
    Case("tpu_fp8_block128_m1_bf16", 1, k=256, n=128, scale_rows=2,
         values=jnp.float8_e4m3fn, dtype=jnp.bfloat16,
         overrides=(("block_m", 16), ("block_n", 128), ("block_k", 128))),
    Case("tpu_fp8_block32_m16", 16, k=128, n=128, scale_rows=4, values=jnp.float8_e4m3fn,
         overrides=(("block_m", 16), ("block_n", 128), ("block_k", 128))),
]}


class QuantMatmulTest:
  """Kernel vs reference. Subclasses pick the backend, interpret mode and cases."""

  backend = "gpu"
  interpret = False
  platform = "gpu"          # native runs need jax.default_backend() == platform
  cases = [c for c in CASES if not c.startswith("tpu_")]

  @pytest.fixture(autouse=True)
  def _require_platform(self):
    if not self.interpret and jax.default_backend() != self.platform:
      pytest.skip(f"needs a {self.platform} device")

  def block(self, case):
    cfg = default_block_config(case.m, case.k, case.n, case.scale_rows, self.backend,
                               num_cores=132)
    return dataclasses.replace(cfg, **dict(case.overrides))

  def test_matches_reference(self, name):
    case = CASES[name]
    x, v, s = make_inputs(case, seed=1)
    got = quant_matmul(x, v, s, backend=self.backend, interpret=self.interpret,
                       block_config=self.block(case))
    check(got, quant_matmul_reference(x, v, s), case)


def pytest_generate_tests(metafunc):
  if metafunc.cls is not None and "name" in metafunc.fixturenames:
    metafunc.parametrize("name", metafunc.cls.cases)


class TestQuantMatmulGPU(QuantMatmulTest):
  pass


class TestQuantMatmulGPUInterpret(TestQuantMatmulGPU):
  interpret = True


class TestQuantMatmulTPU(QuantMatmulTest):
  backend = "tpu"
  platform = "tpu"
  cases = [c for c in CASES if c.startswith("tpu_")]


class TestQuantMatmulTPUInterpret(TestQuantMatmulTPU):
  interpret = True


@pytest.mark.parametrize("m", [1, 4], ids=["gemv", "dot"])
@pytest.mark.parametrize("values", [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2],
                         ids=["int8", "e4m3", "e5m2"])
def test_gpu_kernel_lowers_to_triton(values, m):
  """The Triton lowering (converts included) runs on any host, no GPU needed."""
  k, n, s = 4096, 4096, 32
  from pallas_kernels.quant_matmul_gpu import quant_matmul_gpu
  block = default_block_config(m, k, n, s, "gpu", num_cores=132)
  args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), values),
          jax.ShapeDtypeStruct((s, n), jnp.float32))
  fn = jax.jit(lambda x, v, sc: quant_matmul_gpu(x, v, sc, block=block, interpret=False))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "quant_matmul_gpu" in text


@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 1e30])
def test_fp8_rows_beyond_float16_range_stay_exact(magnitude):
  """The float16 dot of fp8 weights rescales each row of x by a power of two: rows far
  outside f16's range (and one row of zeros) match the reference, with no inf or 0."""
  case = Case("f16_range", 16, k=128, n=64, values=jnp.float8_e4m3fn, dtype=jnp.bfloat16)
  x, v, s = make_inputs(case, seed=3)
  x = (x.astype(jnp.float32) * magnitude).at[2].set(0.0).at[5, 7].mul(300.0)
  x = x.astype(jnp.bfloat16)
  got = quant_matmul(x, v, s, backend="gpu", interpret=True,
                     block_config=BlockConfig(block_m=16, block_n=64, block_k=32,
                                              num_splits=2))
  want = numpy_quant_matmul(x, v, s)
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  assert np.isfinite(got).all() and (got[2] == 0).all()
  np.testing.assert_allclose(got / magnitude, want / magnitude, rtol=2e-2,
                             atol=2e-2 * np.abs(want / magnitude).max())


def test_zero_rows():
  x, v, s = make_inputs(Case("zero", 1))
  for backend in ("gpu", "tpu", "reference"):
    out = quant_matmul(x[:0], v, s, backend=backend, interpret=True)
    assert out.shape == (0, 64) and out.dtype == x.dtype


LLAMA_7B = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096), (4096, 32000),
            (4096, 6144), (4096, 151680)]


def test_default_configs_fit_7b_shapes():
  for k, n in LLAMA_7B:
    for s in (1, k // 128):
      for m in (1, 4, 16, 64, 200):
        g = default_block_config(m, k, n, s, "gpu", num_cores=132)
        assert n % g.block_n == 0 and (k // s) % g.block_k == 0
        assert all(v >= 16 and v & (v - 1) == 0 for v in (g.block_n, g.block_k))
        programs = -(-m // g.block_m) * (n // g.block_n) * g.num_splits
        if m == 1:                                            # one row on CUDA cores
          assert g.block_m == 1 and g.block_k == 32 and g.block_n in (128, 256), (k, n, s, g)
          assert g.num_warps == (8 if g.block_n == 256 else 4)
          assert programs >= 3 * 132 and k // g.num_splits <= 1024 or g.num_splits == 64
          i8 = default_block_config(m, k, n, s, "gpu", num_cores=132, values_dtype=jnp.int8)
          assert (i8.block_n, i8.block_k, i8.num_warps) == (128, 32, 4), (k, n, s, i8)
          assert i8.num_splits == g.num_splits  # twice the programs of 256-wide blocks
          continue
        assert g.block_m >= 16 and g.block_m & (g.block_m - 1) == 0
        assert programs >= 66 or m > 64, (k, n, s, m, g)     # at most half the SMs idle
        if m <= 16:                                           # 128-wide blocks stream best
          assert g.block_n == 128 and g.num_stages == 4, (k, n, s, m, g)
        t = default_block_config(m, k, n, s, "tpu")
        assert t.block_m % 8 == 0 and n % t.block_n == 0 and k % t.block_k == 0
        assert t.block_n % 128 == 0 and t.block_k % 128 == 0
        assert (k // s) % t.block_k == 0 or t.block_k % (k // s) == 0
  # A batch-1 GEMV at N=4096: 16 N blocks x 25 K splits, three waves on 132 SMs; at 16
  # rows, 32 N blocks x 4 K splits, one wave.
  g = default_block_config(1, 4096, 4096, 1, "gpu", num_cores=132)
  assert (g.block_n, g.block_k, g.num_splits) == (256, 32, 25)
  g = default_block_config(16, 4096, 4096, 1, "gpu", num_cores=132)
  assert (4096 // g.block_n) * g.num_splits == 128


def test_backend_dispatch(monkeypatch):
  x, v, s = make_inputs(Case("dispatch", 3))
  want = quant_matmul_reference(x, v, s)
  monkeypatch.delenv("MTP_JAX_QMATMUL_BACKEND", raising=False)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(quant_matmul(x, v, s), want)
  monkeypatch.setenv("MTP_JAX_QMATMUL_BACKEND", "reference")
  np.testing.assert_array_equal(quant_matmul(x, v, s), want)
  with pytest.raises(ValueError, match="backend"):
    quant_matmul(x, v, s, backend="ragged_dot")


@pytest.mark.parametrize("kwargs", [dict(block_m=0), dict(block_k=1.5),
                                    dict(num_splits=True)])
def test_block_config_validates(kwargs):
  with pytest.raises(ValueError):
    BlockConfig(**kwargs)


def test_bad_inputs_are_refused():
  x, v, s = make_inputs(Case("bad", 5))                      # K = N = 64, S = 1
  ref = quant_matmul_reference
  for args, match in [
      ((x[0], v, s), r"x must be \[M, K\]"),
      ((x, v[None], s), r"values must be \[K=64, N\]"),
      ((x, v[:32], s), r"values must be \[K=64, N\]"),
      ((x, v, s[0]), r"scale must be \[S, N\]"),
      ((x, v, jnp.ones((3, 64))), "K=64 must be a multiple of the 3 scale rows"),
      ((x, v, s[:, :32]), r"scale must be \[S, N=64\]"),
      ((x.astype(jnp.float16), v, s), "x dtype float16 is not supported; expected one of "
                                      "bfloat16, float32"),
      ((x, v.astype(jnp.bfloat16), s), "values dtype bfloat16 is not supported; expected "
                                       "one of int8, float8_e4m3fn, float8_e5m2"),
      ((x, v, s.astype(jnp.bfloat16)), "scale dtype bfloat16 is not supported; expected "
                                       "float32"),
  ]:
    with pytest.raises(ValueError, match=match):
      ref(*args)
    with pytest.raises(ValueError, match=match):
      quant_matmul(*args, backend="gpu", interpret=True)


@pytest.mark.parametrize("backend,kwargs,match", [
    ("gpu", dict(block_n=128), "N=64 to be a multiple of block_n=128"),
    ("gpu", dict(block_m=24), "power-of-two block_m"),
    ("gpu", dict(block_m=3), "power-of-two block_m"),
    ("gpu", dict(block_n=64, block_k=64, scale=4),
     "scale block K // S = 64 // 4 = 16 to be a multiple of block_k=64"),
    ("tpu", dict(block_n=32, block_k=64), "block_n=32 to be a multiple of 128"),
    ("tpu", dict(block_m=12, block_k=64), "block_m=12 to be a multiple of 8"),
    ("tpu", dict(block_n=64, block_k=48), "K=64 to be a multiple of block_k=48"),
    ("tpu", dict(block_n=64, block_k=64, num_splits=2), "one K split"),
])
def test_blocks_that_do_not_tile_are_refused(backend, kwargs, match):
  scale_rows = kwargs.pop("scale", 1)
  x, v, s = make_inputs(Case("blocks", 5, scale_rows=scale_rows))
  with pytest.raises(ValueError, match=match):
    quant_matmul(x, v, s, backend=backend, interpret=True, block_config=BlockConfig(**kwargs))
  with pytest.raises(TypeError):
    quant_matmul(x, v, s, backend=backend, interpret=True, block_config=dict(block_m=16))


def test_tpu_block_k_must_align_with_scale_blocks():
  case = Case("tpu_align", 8, k=384, n=128, scale_rows=4)   # scale block 96
  x, v, s = make_inputs(case)
  with pytest.raises(ValueError, match="divide or be a multiple of the scale block"):
    quant_matmul(x, v, s, backend="tpu", interpret=True,
                 block_config=BlockConfig(block_m=8, block_n=128, block_k=128))


def test_bench_smoke(tmp_path, monkeypatch):
  monkeypatch.delenv("OUT", raising=False)
  spec = importlib.util.spec_from_file_location(
      "bench_quant_matmul", REPO / "launch" / "bench_quant_matmul.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  path = tmp_path / "bench.json"
  bench.main(["--tiny", "--json", str(path)])
  data = json.loads(path.read_text())
  rows = [r for r in data["results"] if r.get("us_best") is not None]
  names = {r["candidate"] for r in rows}
  assert {"bf16 XLA dot", "int8 channel XLA", "fp8 channel XLA", "fp8 block XLA",
          "int8 channel Pallas", "fp8 channel Pallas", "fp8 block Pallas"} <= names
  assert all(r["rel_err"] < 2e-2 and r["us_best"] > 0 and r["bytes"] > 0 for r in rows)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_widen_int8_through_float_bits_is_exact(dtype):
  """The CUDA-core path widens int8 through integer adds and a float subtract (no I2F):
  every one of the 256 values must come out exactly, in the asked dtype."""
  from pallas_kernels.quant_matmul_gpu import widen
  v = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8).reshape(16, 16)
  got = jax.jit(lambda v: widen(v, dtype))(v)
  assert got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.arange(-128, 128, dtype=np.float32).reshape(16, 16))
  fp8 = jnp.asarray(np.linspace(-4, 4, 16), jnp.float8_e4m3fn)
  np.testing.assert_array_equal(np.asarray(widen(fp8, jnp.float32)),
                                np.asarray(fp8.astype(jnp.float32)))
