"""The SwiGLU gate+up product in one kernel: silu(x @ W_gate) * (x @ W_up).

Layouts: x [M, K]; gate_up [K, 2, F] (the model's MLP weight: [:, 0] gate, [:, 1] up);
out [M, F] in x.dtype. With `limit` L (Step-3.5's clamped SwiGLU):
min(silu(g), L) * clip(u, -L, L).

Numerics (both backends): g and u are the products rounded to x.dtype, as an einsum in
x.dtype returns them; silu(g) * u is computed in f32 and rounded once.

Why: a prefill forward runs the gate+up product as one XLA dot that writes [M, 2F] and
then the SwiGLU as a kernel of its own that reads it back and writes [M, F]. At the batch
job's prefill sizes the SwiGLU pass and half the product's write are worth saving beside
the dot. The GPU kernel keeps both accumulators of a tile in registers and writes only
silu(g) * u (swiglu_matmul_gpu.py).

Backends (`backend=...`, else $MTP_JAX_SWIGLU_BACKEND, else the platform):
  gpu        Mosaic GPU kernel with TMA loads and wgmma (swiglu_matmul_gpu.py); Hopper
             (compute capability 9.x) only: wgmma exists nowhere else. Tested in Mosaic
             GPU interpret mode on the CPU.
  tpu        the reference: XLA on TPU already fuses elementwise epilogues into the
             dot's output, so there is no kernel to write.
  reference  pure jnp, the definition above.

`use_kernel` is what the model asks before taking this op: only prefill-sized row counts
(MIN_ROWS and up) of MLPs at least MIN_COLUMNS wide, on a Hopper GPU with one device,
shapes the tiles divide. Everything else keeps the model's einsum + SwiGLU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import resolve_backend, swiglu

BACKEND_ENV_VAR = "MTP_JAX_SWIGLU_BACKEND"
# Thresholds set by launch/bench_swiglu_matmul.py; the measurements are in
# docs/DECISIONS.md, "Prefill and batch jobs".
# Fewest rows that take the kernel: below it a partial last wave of tiles loses what the
# fused epilogue saves.
MIN_ROWS = 2048
# Fewest MLP columns F that take it: narrower MLPs (a small shared expert) give too few
# tiles for the SMs.
MIN_COLUMNS = 4096
DTYPES = (jnp.bfloat16, jnp.float16)


def reference(x, gate_up, limit=None):
  """[M, F]: the products in x.dtype, silu(g) * u in f32, rounded to x.dtype."""
  gu = jnp.einsum("mk,kcf->mcf", x, gate_up)
  return swiglu(gu[:, 0].astype(jnp.float32), gu[:, 1].astype(jnp.float32),
                limit).astype(x.dtype)


def is_hopper(device=None) -> bool:
  """Whether `device` (default: the first device) is an NVIDIA GPU of compute
  capability 9.x, the only one with wgmma."""
  device = device or jax.devices()[0]
  return device.platform == "gpu" and str(getattr(device, "compute_capability", "")
                                          ).startswith("9")


def fits(m: int, k: int, f: int, dtype, block=None) -> bool:
  """Whether the GPU kernel's tiles divide [M, K] x [K, 2, F] of `dtype`."""
  from pallas_kernels.swiglu_matmul_gpu import BlockConfig

  block = block or BlockConfig()
  return (jnp.dtype(dtype) in map(jnp.dtype, DTYPES) and m % block.block_m == 0
          and k % block.block_k == 0 and f % block.block_n == 0)


def use_kernel(m: int, k: int, f: int, dtype) -> bool:
  """Whether a model's gate+up product of m rows takes the GPU kernel: the backend
  resolves to gpu on a Hopper device, m >= MIN_ROWS, f >= MIN_COLUMNS, the tiles fit."""
  if resolve_backend(None, BACKEND_ENV_VAR, "swiglu-matmul") != "gpu":
    return False
  return (m >= MIN_ROWS and f >= MIN_COLUMNS and fits(m, k, f, dtype) and is_hopper())


def swiglu_matmul(x, gate_up, *, limit=None, backend=None, block=None, interpret=None,
                  num_sms=None):
  """silu(x @ gate_up[:, 0]) * (x @ gate_up[:, 1]) for x [M, K], gate_up [K, 2, F].

  backend: gpu / tpu / reference (module docstring). interpret: Mosaic GPU interpret
  params, to run the GPU kernel on a CPU. num_sms: the GPU kernel's persistent grid."""
  m, k = x.shape
  if gate_up.ndim != 3 or gate_up.shape[:2] != (k, 2):
    raise ValueError(f"gate_up {gate_up.shape} must be [K, 2, F] with K = {k}.")
  f = gate_up.shape[2]
  choice = "gpu" if interpret is not None else resolve_backend(
      backend, BACKEND_ENV_VAR, "swiglu-matmul")
  if choice != "gpu":
    return reference(x, gate_up, limit)
  if interpret is None and not is_hopper():
    raise ValueError(
        f"the swiglu-matmul gpu backend needs a Hopper GPU (wgmma); {jax.devices()[0]} "
        "is not one. Use backend='reference' (XLA's dot + SwiGLU).")
  if not fits(m, k, f, x.dtype, block):
    raise ValueError(f"swiglu-matmul gpu kernel: x {x.shape} {x.dtype}, F={f} do not fit "
                     f"its tiles ({block or 'the default'}); use backend='reference'.")
  from pallas_kernels.swiglu_matmul_gpu import swiglu_matmul_gpu

  return swiglu_matmul_gpu(x, gate_up.reshape(k, 2 * f), block=block, limit=limit,
                           num_sms=num_sms, interpret=interpret)
