"""The fused gate+up + SwiGLU kernel against its reference: the Mosaic GPU kernel in its
interpret mode on any machine and natively on a Hopper GPU, with and without Step-3.5's
clamp; the errors for shapes, backends and devices it cannot take; and the model's MLP
choosing it only for prefill-sized rows on a Hopper GPU, with the same result."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels import swiglu_matmul as op
from pallas_kernels.swiglu_matmul_gpu import BlockConfig, smem_bytes

try:
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # a jax without the Mosaic GPU interpreter
  InterpretGPUParams = None
# The interpreter is the CPU's check (CI); on a GPU the native runs check the kernel. (On a
# GPU machine with jax 0.11.2 the interpreter's products differed from XLA's by a bf16 ulp
# on up to a fifth of the elements, as if each K chunk's partial product were rounded.)
NO_INTERPRET = (InterpretGPUParams is None or jax.default_backend() != "cpu")
WHY_NO_INTERPRET = ("the Mosaic GPU interpreter checks the kernel on CPU hosts (a GPU host "
                    "runs it natively); needs a jax that has it")

M, K, F = 256, 128, 256
SMALL = BlockConfig(stages=2)  # 2 M blocks x 2 N blocks x 2 K chunks: the ring wraps

RUNNERS = [
    pytest.param("interpret", id="interpret", marks=pytest.mark.skipif(
        NO_INTERPRET, reason=WHY_NO_INTERPRET)),
    pytest.param("native", id="native", marks=pytest.mark.skipif(
        not op.is_hopper(), reason="needs a Hopper GPU (wgmma)")),
]


def _inputs(m=M, k=K, f=F, seed=0, dtype=jnp.bfloat16):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (k, 2, f), jnp.float32) / np.sqrt(k)).astype(dtype)
  return x, w


def _run(runner, x, w, limit=None, block=SMALL):
  if runner == "interpret":
    return op.swiglu_matmul(x, w, limit=limit, block=block, num_sms=3,
                            interpret=InterpretGPUParams())
  return jax.jit(lambda x, w: op.swiglu_matmul(x, w, limit=limit, block=block,
                                               backend="gpu"))(x, w)


def _close(got, want, min_equal=0.999):
  """Equal but for the products' accumulation order: an ulp on a few elements (float16's
  finer ulp shows more of them)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -10)
  assert (got == want).mean() > min_equal


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("limit,dtype,block", [
    (None, jnp.bfloat16, SMALL), (0.5, jnp.bfloat16, SMALL), (None, jnp.float16, SMALL),
    (None, jnp.bfloat16, BlockConfig(stages=2, mma_in_flight=1))])
def test_kernel_matches_reference(runner, limit, dtype, block):
  """One kernel call covers several tiles per CTA (4 tiles on 3 CTAs), a ring of 2
  slots over 2 K chunks, (limit 0.5) both sides of Step-3.5's clamp, float16, and a
  wgmma group left in flight across chunks."""
  x, w = _inputs(dtype=dtype)
  want = op.reference(x, w, limit)
  got = _run(runner, x, w, limit, block)
  assert got.shape == (M, F) and got.dtype == dtype
  _close(got, want, 0.999 if dtype == jnp.bfloat16 else 0.995)
  if limit is not None:  # the clamp took effect on some outputs
    assert not np.allclose(np.asarray(want, np.float32),
                           np.asarray(op.reference(x, w), np.float32))


def test_reference_is_the_f32_swiglu_of_the_bf16_products():
  x, w = _inputs(m=8, k=32, f=16)
  gu = np.asarray(jnp.einsum("mk,kcf->mcf", x, w), np.float32)
  g, u = gu[:, 0], gu[:, 1]
  want = (g / (1 + np.exp(-g)) * u).astype(jnp.bfloat16).astype(np.float32)
  np.testing.assert_allclose(np.asarray(op.reference(x, w), np.float32), want,
                             rtol=2 ** -8, atol=1e-6)


def test_errors_name_what_to_do():
  x, w = _inputs()
  with pytest.raises(ValueError, match=r"\[K, 2, F\]"):
    op.swiglu_matmul(x, w.reshape(K, 2 * F))
  if not op.is_hopper():
    with pytest.raises(ValueError, match="Hopper.*backend='reference'"):
      op.swiglu_matmul(x, w, backend="gpu")
  if not NO_INTERPRET:
    with pytest.raises(ValueError, match="do not fit.*backend='reference'"):
      op.swiglu_matmul(x[:200], w, interpret=InterpretGPUParams())
  with pytest.raises(ValueError, match="block_m % 128"):
    BlockConfig(block_m=64)
  with pytest.raises(ValueError, match="positive int"):
    BlockConfig(stages=0)
  with pytest.raises(ValueError, match="mma_in_flight must be 0 or 1, and below stages"):
    BlockConfig(stages=1, mma_in_flight=1)
  with pytest.raises(ValueError, match="unknown swiglu-matmul backend"):
    op.swiglu_matmul(x, w, backend="cuda-graphs")


def test_default_tiling_fits_shared_memory():
  """The default ring + output tile stays within a Hopper CTA's 227 KiB."""
  assert smem_bytes(BlockConfig(), 2) <= 227 * 1024


def test_use_kernel_only_for_prefill_rows_on_hopper(monkeypatch):
  monkeypatch.setenv(op.BACKEND_ENV_VAR, "gpu")
  monkeypatch.setattr(op, "is_hopper", lambda device=None: True)
  assert op.use_kernel(op.MIN_ROWS, 4096, 11008, jnp.bfloat16)
  assert not op.use_kernel(op.MIN_ROWS - 128, 4096, 11008, jnp.bfloat16)  # decode / verify
  assert not op.use_kernel(op.MIN_ROWS + 64, 4096, 11008, jnp.bfloat16)  # rows off the tile
  assert not op.use_kernel(op.MIN_ROWS, 4096, 11000, jnp.bfloat16)  # F off the tile
  assert not op.use_kernel(op.MIN_ROWS, 4096, 1408, jnp.bfloat16)  # too few tiles
  assert not op.use_kernel(op.MIN_ROWS, 4096, 11008, jnp.float32)
  monkeypatch.setattr(op, "is_hopper", lambda device=None: False)
  assert not op.use_kernel(op.MIN_ROWS, 4096, 11008, jnp.bfloat16)
  monkeypatch.setenv(op.BACKEND_ENV_VAR, "reference")
  monkeypatch.setattr(op, "is_hopper", lambda device=None: True)
  assert not op.use_kernel(op.MIN_ROWS, 4096, 11008, jnp.bfloat16)


@pytest.mark.parametrize("runner", RUNNERS)
def test_mlp_takes_the_kernel_for_prefill_rows(runner, monkeypatch):
  """The model's MLP through the kernel gives the reference's activations to its down
  projection, and takes its einsum path for rows under the kernel's minimum. Interpreted,
  a stand-in for the Hopper check lets M rows in; natively the MLP decides by itself at
  MIN_ROWS rows (MIN_COLUMNS lowered to this F)."""
  from mtp_jax import layers
  from mtp_jax.qarray import value

  mlp = layers.MLP(K, F, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), limit=None)
  calls = []
  real = layers.swiglu_matmul
  rows = M if runner == "interpret" else op.MIN_ROWS

  def counted(x, w, *, limit=None, backend=None):
    calls.append(x.shape)
    if runner == "native":
      return real(x, w, limit=limit, backend=backend)
    return op.swiglu_matmul(x, w, limit=limit, block=SMALL, num_sms=3,
                            interpret=InterpretGPUParams())

  monkeypatch.setattr(layers, "swiglu_matmul", counted)
  if runner == "interpret":
    monkeypatch.setattr(layers, "use_swiglu_kernel",
                        lambda m, k, f, dtype: m >= M and m % 128 == 0)
  else:  # the rule's row count at this small F
    monkeypatch.setattr(op, "MIN_COLUMNS", F)
  x = jax.random.normal(jax.random.key(3), (2, rows // 2, K), jnp.float32).astype(jnp.bfloat16)
  got = mlp(x)
  assert calls == [(rows, K)]
  w = value(mlp.gate_up)
  h = op.reference(x.reshape(rows, K), w).reshape(2, rows // 2, F)
  want = jnp.einsum("btf,fd->btd", h, value(mlp.down))
  _close(got, want)
  mlp(x[:, :8])  # 16 rows: the einsum path
  assert calls == [(rows, K)]


@pytest.mark.skipif(NO_INTERPRET, reason=WHY_NO_INTERPRET)
def test_bench_smoke(tmp_path, monkeypatch):
  """launch/bench_swiglu_matmul.py --tiny: every candidate timed, the kernel equal to the
  reference but for a bf16 ulp, the model's bf16 SwiGLU within bf16 rounding of it."""
  monkeypatch.delenv("OUT", raising=False)
  spec = importlib.util.spec_from_file_location(
      "bench_swiglu_matmul",
      pathlib.Path(__file__).resolve().parents[1] / "launch" / "bench_swiglu_matmul.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  path = tmp_path / "bench.json"
  bench.main(["--tiny", "--json", str(path)])
  rows = {r["candidate"]: r for r in json.loads(path.read_text())["results"]}
  assert {"xla einsum + swiglu", "xla reference", "xla einsum alone",
          "kernel 128x128x64/4"} <= set(rows)
  assert all(r["best_s"] > 0 for r in rows.values())
  assert rows["xla reference"]["max_diff"] == 0
  assert rows["kernel 128x128x64/4"]["max_diff"] < 2 ** -6
  assert rows["kernel 128x128x64/4"]["equal"] > 0.999
  assert rows["xla einsum + swiglu"]["max_diff"] < 0.1
