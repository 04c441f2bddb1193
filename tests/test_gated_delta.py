"""Gated delta rule: the references against a float64 numpy loop and against each other,
the kernels (GPU in interpret mode, TPU in TPU interpret mode) against the references.

Inputs are random with a non-zero initial state and Hv = 2 * Hk, so a kernel that reads
the wrong key head, drops the initial state, the decay, beta or the normalisation fails.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import gated_delta as gd
from pallas_kernels.gated_delta import (gated_delta, gated_delta_chunked_reference,
                                        gated_delta_reference)

HK, HV, DK, DV = 2, 4, 16, 32


@pytest.fixture(autouse=True)
def _f32_matmuls():
  """float32 matmuls at full precision on every backend (a GPU's default is TF32): the
  tolerances below are float32's."""
  with jax.default_matmul_precision("highest"):
    yield


def make_inputs(batch, seq, *, hk=HK, hv=HV, dk=DK, dv=DV, dtype=jnp.float32, seed=0):
  """Random q, k, v (dtype), g = log decay in [-1, -0.01], beta in (0.05, 0.95) and an
  initial state of scale 0.5."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, seq, hk, dk))
  k = rng.standard_normal((batch, seq, hk, dk))
  v = rng.standard_normal((batch, seq, hv, dv))
  g = -rng.uniform(0.01, 1.0, (batch, seq, hv))
  beta = rng.uniform(0.05, 0.95, (batch, seq, hv))
  state = 0.5 * rng.standard_normal((batch, hv, dk, dv))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return (f32(q).astype(dtype), f32(k).astype(dtype), f32(v).astype(dtype), f32(g),
          f32(beta), f32(state))


def numpy_loop(q, k, v, g, beta, state):
  """The rule position by position, head by head, in float64: (out, states [B, T, ...])."""
  q, k, v, g, beta, s = (np.asarray(jnp.asarray(x, jnp.float32), np.float64)
                         for x in (q, k, v, g, beta, state))
  batch, seq, hk, dk = q.shape
  hv = v.shape[2]
  s = s.copy()
  out = np.zeros(v.shape)
  states = np.zeros((batch, seq) + s.shape[1:])
  for b in range(batch):
    for h in range(hv):
      kh = h // (hv // hk)
      for t in range(seq):
        qt = q[b, t, kh] / np.sqrt(np.sum(q[b, t, kh] ** 2) + 1e-6) / np.sqrt(dk)
        kt = k[b, t, kh] / np.sqrt(np.sum(k[b, t, kh] ** 2) + 1e-6)
        s[b, h] *= np.exp(g[b, t, h])
        delta = (v[b, t, h] - s[b, h].T @ kt) * beta[b, t, h]
        s[b, h] += np.outer(kt, delta)
        out[b, t, h] = s[b, h].T @ qt
        states[b, t, h] = s[b, h]
  return out, states


def max_diff(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize("seq", [1, 5])
def test_reference_matches_numpy(seq):
  args = make_inputs(2, seq)
  out, final = gated_delta_reference(*args)
  _, states = gated_delta_reference(*args, all_states=True)
  want_out, want_states = numpy_loop(*args)
  assert out.shape == (2, seq, HV, DV) and out.dtype == jnp.float32
  assert final.shape == (2, HV, DK, DV) and states.shape == (2, seq, HV, DK, DV)
  assert max_diff(out, want_out) < 1e-5
  assert max_diff(final, want_states[:, -1]) < 1e-5
  assert max_diff(states, want_states) < 1e-5
  assert np.array_equal(np.asarray(states[:, -1]), np.asarray(final))


def test_key_head_sharing_is_repeat_interleave():
  """Value head h reads key head h // (Hv // Hk): swapping the key heads of the input
  must move the outputs of value heads {0, 1} and {2, 3} as whole groups."""
  q, k, v, g, beta, state = make_inputs(1, 3)
  out, _ = gated_delta_reference(q, k, v, g, beta, state)
  swap = lambda x: x[:, :, ::-1]
  heads = jnp.array([2, 3, 0, 1])
  out2, _ = gated_delta_reference(swap(q), swap(k), v[:, :, heads], g[:, :, heads],
                                  beta[:, :, heads], state[:, heads])
  assert max_diff(out2[:, :, heads], out) < 1e-6
  assert max_diff(out2, out) > 1e-2  # the swap did change something


@pytest.mark.parametrize("seq", [1, 5, 64, 130])
def test_chunked_reference_matches_recurrent(seq):
  args = make_inputs(2, seq, seed=seq)
  out, final = gated_delta_reference(*args)
  out_c, final_c = gated_delta_chunked_reference(*args)
  assert out_c.shape == out.shape and final_c.shape == final.shape
  assert max_diff(out_c, out) < 2e-5
  assert max_diff(final_c, final) < 2e-5


def test_chunked_reference_other_chunk():
  args = make_inputs(1, 40, seed=3)
  out, final = gated_delta_reference(*args)
  out_c, final_c = gated_delta_chunked_reference(*args, chunk=16)
  assert max_diff(out_c, out) < 2e-5 and max_diff(final_c, final) < 2e-5


def masked_inputs(batch, seq, masked, seed=1, **kw):
  """Inputs whose positions `masked` (a list of t) have g = 0 and beta = 0."""
  q, k, v, g, beta, state = make_inputs(batch, seq, seed=seed, **kw)
  g = g.at[:, masked].set(0.0)
  beta = beta.at[:, masked].set(0.0)
  return q, k, v, g, beta, state


def test_masked_positions_leave_state_unchanged():
  args = masked_inputs(2, 6, [0, 3, 4, 5])
  state = args[-1]
  _, states = gated_delta_reference(*args, all_states=True)
  assert np.array_equal(np.asarray(states[:, 0]), np.asarray(state))
  assert np.array_equal(np.asarray(states[:, 3]), np.asarray(states[:, 2]))
  assert np.array_equal(np.asarray(states[:, 5]), np.asarray(states[:, 2]))
  assert max_diff(states[:, 1], state) > 1e-2  # an unmasked position does change it
  # Trailing padding leaves the final state of the unpadded run.
  _, final = gated_delta_reference(*args)
  _, final_short = gated_delta_reference(*(x[:, :3] for x in args[:5]), state)
  assert max_diff(final, final_short) == 0.0
  _, final_c = gated_delta_chunked_reference(*args)
  assert max_diff(final_c, final_short) < 2e-5


def test_bf16_inputs_reference():
  args = make_inputs(1, 5, dtype=jnp.bfloat16)
  out, final = gated_delta_reference(*args)
  want_out, want_states = numpy_loop(*args)
  assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32
  assert max_diff(out, want_out) < 2e-2
  assert max_diff(final, want_states[:, -1]) < 1e-5
  out_c, _ = gated_delta_chunked_reference(*args)
  assert out_c.dtype == jnp.bfloat16 and max_diff(out_c, want_out) < 2e-2


def test_dispatch_reference(monkeypatch):
  monkeypatch.delenv(gd.BACKEND_ENV_VAR, raising=False)
  short = make_inputs(1, gd.RECURRENT_MAX_T)
  long = make_inputs(1, gd.RECURRENT_MAX_T + 1)
  for args in (short, long):
    out, final = gated_delta(*args, backend="reference")
    want_out, want_states = numpy_loop(*args)
    assert max_diff(out, want_out) < 2e-5 and max_diff(final, want_states[:, -1]) < 2e-5
  _, states = gated_delta(*short, all_states=True, backend="reference")
  assert states.shape == (1, gd.RECURRENT_MAX_T, HV, DK, DV)
  with pytest.raises(ValueError, match="all_states"):
    gated_delta(*long, all_states=True, backend="reference")
  monkeypatch.setenv(gd.BACKEND_ENV_VAR, "bogus")
  with pytest.raises(ValueError, match="bogus"):
    gated_delta(*short)


def _errors_cases():
  q, k, v, g, beta, state = make_inputs(1, 2)
  return [
      ("k", (q, k[..., :8], v, g, beta, state)),
      ("v", (q, k, v[:, :1], g, beta, state)),
      ("Hv", (q, k, v[:, :, :3], g[..., :3], beta[..., :3], state[:, :3])),
      ("g", (q, k, v, g[..., :2], beta, state)),
      ("beta", (q, k, v, g, beta.astype(jnp.bfloat16), state)),
      ("state", (q, k, v, g, beta, state[..., :8])),
      ("state", (q, k, v, g, beta, state.astype(jnp.bfloat16))),
      ("q", (q[0], k, v, g, beta, state)),
      ("v", (q, k, v.astype(jnp.int32), g, beta, state)),
  ]


@pytest.mark.parametrize("backend", ["reference", "gpu", "tpu"])
def test_errors_name_the_argument(backend):
  for name, args in _errors_cases():
    with pytest.raises(ValueError, match=name):
      gated_delta(*args, backend=backend, interpret=True)


@pytest.mark.parametrize("backend, dk, dv, name", [
    ("gpu", 24, 32, "dk=24"), ("gpu", 16, 8, "dv=8"), ("gpu", 16, 48, "dv=48"),
    ("tpu", 12, 32, "dk=12"), ("tpu", 16, 4, "dv=4")])
@pytest.mark.parametrize("seq", [1, 2 * gd.RECURRENT_MAX_T])
def test_kernel_head_dims_are_checked(backend, dk, dv, name, seq):
  args = make_inputs(1, seq, dk=dk, dv=dv)
  with pytest.raises(ValueError, match=name):
    gated_delta(*args, backend=backend, interpret=True)


# ------------------------------------------------------------------------------ kernels
# The TPU kernels run in Pallas TPU interpret mode, which is verified on a CPU host: on a
# GPU host (jax 0.11.2, H200) the interpreter returned the chunked kernel's outputs right
# but a wrong final state, which the CPU's interpreter does not.
KERNEL_BACKENDS = ["gpu", pytest.param("tpu", marks=pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="TPU interpret mode is checked on a CPU host"))]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("seq, all_states, hk, hv", [
    (1, False, HK, HV), (4, True, HK, HV),
    (2, True, 1, 3)])  # three value heads a key head, as Qwen3.5's 16 / 48
def test_recurrent_kernel_matches_reference(backend, seq, all_states, hk, hv):
  args = make_inputs(2, seq, hk=hk, hv=hv, seed=10 + seq)
  out, st = gated_delta(*args, all_states=all_states, backend=backend, interpret=True)
  want_out, want_st = gated_delta_reference(*args, all_states=all_states)
  assert out.shape == want_out.shape and out.dtype == want_out.dtype
  assert st.shape == want_st.shape and st.dtype == jnp.float32
  assert max_diff(out, want_out) < 1e-5
  assert max_diff(st, want_st) < 1e-5


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernel_dispatch_by_length(backend):
  """T = RECURRENT_MAX_T gives all_states (the recurrent kernel); one more position runs
  the chunked kernel, which refuses all_states."""
  short = make_inputs(1, gd.RECURRENT_MAX_T, seed=2)
  _, states = gated_delta(*short, all_states=True, backend=backend, interpret=True)
  _, want = gated_delta_reference(*short, all_states=True)
  assert max_diff(states, want) < 1e-5
  long = make_inputs(1, gd.RECURRENT_MAX_T + 1, seed=2)
  with pytest.raises(ValueError, match="all_states"):
    gated_delta(*long, all_states=True, backend=backend, interpret=True)
  out, final = gated_delta(*long, backend=backend, interpret=True)
  want_out, want_final = gated_delta_reference(*long)
  assert max_diff(out, want_out) < 2e-5 and max_diff(final, want_final) < 2e-5


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_recurrent_kernel_masked_positions_leave_state_unchanged(backend):
  args = masked_inputs(2, 4, [0, 2, 3], seed=4)
  _, states = gated_delta(*args, all_states=True, backend=backend, interpret=True)
  assert np.array_equal(np.asarray(states[:, 0]), np.asarray(args[-1]))
  assert np.array_equal(np.asarray(states[:, 3]), np.asarray(states[:, 1]))
  assert max_diff(states[:, 1], args[-1]) > 1e-2


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_chunked_kernel_matches_reference(backend):
  seq = 128
  args = make_inputs(1, seq, seed=7)
  out, final = gated_delta(*args, backend=backend, interpret=True)
  want_out, want_final = gated_delta_reference(*args)
  assert out.shape == want_out.shape and final.shape == want_final.shape
  assert max_diff(out, want_out) < 2e-5
  assert max_diff(final, want_final) < 2e-5


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_chunked_kernel_pads_and_masks(backend):
  """T not a multiple of the chunk (zero padded inside), masked positions inside and at
  the end: the final state is the one of the unmasked prefix."""
  args = masked_inputs(1, 70, [5, 67, 68, 69], seed=8)
  out, final = gated_delta(*args, backend=backend, interpret=True)
  want_out, want_final = gated_delta_reference(*args)
  assert out.shape == (1, 70, HV, DV)
  assert max_diff(out, want_out) < 2e-5 and max_diff(final, want_final) < 2e-5
  _, prefix = gated_delta_reference(*(x[:, :67] for x in args[:5]), args[5])
  assert max_diff(final, prefix) < 2e-5


def test_gpu_kernels_split_value_columns():
  """Several value-column blocks a head (each program its own slice of the state)."""
  from pallas_kernels import gated_delta_gpu
  args = make_inputs(1, 3, seed=5)
  want_out, want_st = gated_delta_reference(*args, all_states=True)
  out, st = gated_delta_gpu.gated_delta_recurrent(*args, all_states=True, interpret=True,
                                                  block_v=16)
  assert max_diff(out, want_out) < 1e-5 and max_diff(st, want_st) < 1e-5
  args = make_inputs(1, 64, seed=6)
  want_out, want_final = gated_delta_reference(*args)
  out, final = gated_delta_gpu.gated_delta_chunked(*args, interpret=True, block_v=16)
  assert max_diff(out, want_out) < 2e-5 and max_diff(final, want_final) < 2e-5


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernels_bf16_inputs(backend):
  for seq in (3, 64):
    args = make_inputs(1, seq, dtype=jnp.bfloat16, seed=9)
    out, final = gated_delta(*args, backend=backend, interpret=True)
    want_out, want_final = gated_delta_reference(*args)
    assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert max_diff(out, want_out) < 2e-2
    assert max_diff(final, want_final) < 1e-4


def test_tpu_kernel_head_blocks():
  """Several programs a batch row, each a block of whole groups of value heads (the
  key heads of block j are j * heads / group ...): one group a block, then two."""
  from pallas_kernels import gated_delta_tpu
  args = make_inputs(1, 2, hk=2, hv=6, seed=12)
  want_out, want_st = gated_delta_reference(*args, all_states=True)
  for heads in (3, 6):
    out, st = gated_delta_tpu.gated_delta_recurrent(*args, all_states=True, interpret=True,
                                                    heads=heads)
    assert max_diff(out, want_out) < 1e-5 and max_diff(st, want_st) < 1e-5
  with pytest.raises(ValueError, match="heads=4"):
    gated_delta_tpu.gated_delta_recurrent(*args, interpret=True, heads=4)
  assert gated_delta_tpu.recurrent_heads(16, 3, 128, 128, 1, False) == 12  # 4 groups
  assert gated_delta_tpu.recurrent_heads(16, 2, 128, 128, 1, False) == 16
  assert gated_delta_tpu.recurrent_heads(16, 3, 128, 128, 16, True) == 3


def test_gpu_block_widths():
  from pallas_kernels.gated_delta_gpu import chunked_block_v, recurrent_block_v
  assert recurrent_block_v(32, 48, 128) == 64       # 3072 programs of [128, 64]
  assert recurrent_block_v(1, 32, 128) == 16        # batch 1: 256 programs
  assert recurrent_block_v(1, 48, 128) == 16        # 192 programs: 384
  assert chunked_block_v(1, 32, 128) == 32 and chunked_block_v(32, 32, 128) == 64


@pytest.mark.parametrize("seq, all_states", [(1, False), (4, True), (4096, False)])
def test_gpu_kernels_lower_to_triton(seq, all_states):
  """The GPU kernels' Triton lowering at the published head shapes (Hk 16, Hv 32, dk =
  dv = 128, bf16) on any host: what interpret mode does not cover, short of compiling
  PTX on a GPU."""
  f = jax.ShapeDtypeStruct
  batch, hk, hv, d = 2, 16, 32, 128
  args = (f((batch, seq, hk, d), jnp.bfloat16), f((batch, seq, hk, d), jnp.bfloat16),
          f((batch, seq, hv, d), jnp.bfloat16), f((batch, seq, hv), jnp.float32),
          f((batch, seq, hv), jnp.float32), f((batch, hv, d, d), jnp.float32))
  fn = jax.jit(lambda *a: gated_delta(*a, all_states=all_states, backend="gpu"))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  name = "gated_delta_recurrent_gpu" if seq == 1 or all_states else "gated_delta_chunked_gpu"
  assert name in text


@pytest.mark.parametrize("seq, all_states", [(1, False), (4, True), (4096, False)])
def test_tpu_kernels_lower_to_mosaic(monkeypatch, seq, all_states):
  """The TPU kernels' Pallas -> Mosaic lowering (block shapes, ops) at the published head
  shapes on this host, as a v5e: what TPU interpret mode does not check, short of
  compiling on a TPU. Skipped where this jax keeps its chip table elsewhere."""
  tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
  if not all(hasattr(tpu_info, n) for n in ("registry", "get_tpu_info", "ChipVersion",
                                            "get_tpu_info_for_chip")):
    pytest.skip("this jax has no TPU chip registry to stand in for the host")
  monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind,
                      lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1))
  f = jax.ShapeDtypeStruct
  batch, hk, hv, d = 2, 16, 48, 128
  args = (f((batch, seq, hk, d), jnp.bfloat16), f((batch, seq, hk, d), jnp.bfloat16),
          f((batch, seq, hv, d), jnp.bfloat16), f((batch, seq, hv), jnp.float32),
          f((batch, seq, hv), jnp.float32), f((batch, hv, d, d), jnp.float32))
  fn = jax.jit(lambda *a: gated_delta(*a, all_states=all_states, backend="tpu"))
  try:
    text = fn.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
  finally:
    getattr(tpu_info.get_tpu_info, "cache_clear", lambda: None)()
  name = "gated_delta_recurrent_tpu" if seq == 1 or all_states else "gated_delta_chunked_tpu"
  assert name in text
