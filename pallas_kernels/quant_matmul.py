"""Weight-only quantized matmul: the decode GEMV / small GEMM with 1-byte weights.

Layouts (einsum letters: m row, k contraction, n output column, s scale block):
  x       [M, K]  bfloat16 or float32
  values  [K, N]  int8, float8_e4m3fn or float8_e5m2
  scale   [S, N]  float32, K % S == 0; scale block size bk = K // S
  out     [M, N]  in x.dtype, f32 accumulation
  out[m, n] = sum_s (sum_{k in block s} x[m, k] * values[k, n]) * scale[s, n]
i.e. x @ W with W[k, n] = values[k, n] * scale[k // bk, n]. S == 1 is per-output-channel
quantization (int8 or fp8); S = K / 128 is DeepSeek-style block-scaled fp8 (128-row
blocks along K, the scale already expanded to one f32 per (K block, column)).

Decode reads every weight once per step and does little else, so its time is the bytes
of the weights: 1-byte values plus S * N * 4 bytes of scales move half of what bf16
does. The kernels keep it that way: they load the 1-byte tile and convert it to x's
dtype in registers / VMEM (exact: every int8 and every e4m3 / e5m2 value is a bf16),
take a dot with f32 accumulation, and multiply each scale block's partial sum by its
scale row, so no dequantized copy of the weights is ever written.

On a GPU one row (a batch-1 decode step) runs on CUDA cores (`_gemv_block_config`): the
smallest Triton dot is 16 rows, so at one row a tensor-core tile is 15/16 padding; the
CUDA-core kernel multiplies the 1-byte chunk in f32 instead. More rows take the
tensor-core tiling, which beats one CUDA-core pass per row. See docs/DECISIONS.md,
"Quantized weights".

Backends (`quant_matmul(backend=...)`, else $MTP_JAX_QMATMUL_BACKEND, else the platform):
  gpu         Pallas Triton kernel, grid over N blocks and K splits (quant_matmul_gpu.py)
  tpu         Mosaic TPU kernel, K innermost into an f32 VMEM accumulator
              (quant_matmul_tpu.py)
  reference   pure jnp: what CPU runs and the XLA baseline. S == 1 is
              `(x @ values.astype(x.dtype)) * scale` with f32 accumulation, one dot that
              XLA can fuse the convert into; S > 1 is one dot per scale block (a batched
              einsum over s), scaled and summed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import (check_positive_ints, first_divisor, next_pow2,
                                   resolve_backend)

BACKEND_ENV_VAR = "MTP_JAX_QMATMUL_BACKEND"
X_DTYPES = (jnp.bfloat16, jnp.float32)
VALUE_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)

# GPU tiling, set by launch/bench_quant_matmul.py --sweep; the measurements are in
# docs/DECISIONS.md, "Quantized weights".
# Tensor-core tiling (more than one row): each K split gets at least this many K chunks,
# so its load pipeline fills.
SPLIT_MIN_CHUNKS = 8
# block_n narrows from 128 only where 128-wide blocks with their splits would use less
# than this share of their waves' program slots: narrower blocks stream slower.
NARROW_BELOW_BALANCE = 0.5
# One row on CUDA cores: K rows a split at most (the wide products split this far, and
# shorter splits lost on them), and the waves of 256-column blocks the splits are raised
# to (products with few column blocks need them; past that, more programs only add
# partial sums and pipeline fills).
GEMV_SPLIT_MAX_ROWS = 1024
GEMV_TARGET_WAVES = 3
# One row's weight chunk as (columns, rows, warps): fp8 streams best in 256-column chunks
# on 8 warps, int8 in 128-column chunks on 4 (fp8 takes those where 256 does not divide N).
GEMV_FP8_CHUNK = (256, 32, 8)
GEMV_INT8_CHUNK = (128, 32, 4)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Tiling of one quantized-matmul call.

  block_m:    rows of x per program / grid step (GPU: a power of two >= 16, the smallest
              Triton dot, or 1..8 rows on CUDA cores without a dot; rows past M repeat
              row M - 1. TPU: multiple of 8; x is padded).
  block_n:    output columns per program / grid step.
  block_k:    contraction chunk per loop / grid step; it divides K // S or (TPU only) is
              a multiple of it, so no chunk straddles a scale block.
  num_splits: K splits per (M block, N block), f32 partial sums added after the kernel
              (GPU only: fills the SMs when N / block_n is small, as in a batch-1 GEMV).
  num_warps, num_stages: Triton launch parameters (GPU only).
  Backend-specific limits are checked by the kernel wrappers with the shapes in hand.
  """

  block_m: int = 16
  block_n: int = 128
  block_k: int = 128
  num_splits: int = 1
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    check_positive_ints(self)


def default_block_config(m, k, n, s, backend, num_cores=None,
                         values_dtype=None) -> BlockConfig:
  """Block sizes for x [m, k] @ values [k, n] with s scale rows (values_dtype: the 1-byte
  weights' dtype, which picks the one-row GPU chunk shape; None: as fp8).

  GPU, one row (M = 1): `_gemv_block_config`, on CUDA cores. More rows: block_m the rows
  as a power of two in 16..64; block_k up to 128 dividing K // S;
  block_n 128 (128 one-byte columns: one cache line per weight row). K splits raise the
  program count P to fill whole waves of num_cores programs (default: the device's SM
  count, else 132): the split count maximises P / (num_cores * ceil(P / num_cores)), the
  fewest splits on a tie, with at least `SPLIT_MIN_CHUNKS` K chunks a split (the load
  pipeline needs a few to fill) and f32 partial sums (written, then read back) within 1/8
  of the weight bytes. block_n narrows to 64 or 32 only where 128-wide blocks with their
  splits would use less than `NARROW_BELOW_BALANCE` of their waves' program slots
  (M = 64, where partial sums cost too much): narrower blocks stream slower, so they are
  the last resort. At 16 rows and N=4096 that is 32 N blocks x 4 splits = 128 programs
  on 132 SMs. num_stages 4 at block_m 16, else 3.
  TPU: all rows in one block (up to 256, padded to 16); block_n 512/256/128 dividing N;
  block_k the largest of 2048..128 that divides K and divides or is a multiple of K // S
  (whole K up to 2048). Untuned: no TPU was available.
  """
  bk = k // max(s, 1)
  if backend == "tpu":
    block_m = min(256, -(-max(m, 1) // 16) * 16)
    block_n = first_divisor(n, (512, 256, 128)) or n
    fits = [c for c in (2048, 1024, 512, 256, 128)
            if k % c == 0 and (bk % c == 0 or c % bk == 0)]
    block_k = k if k <= 2048 else (fits[0] if fits else k)
    return BlockConfig(block_m=block_m, block_n=block_n, block_k=block_k)
  if num_cores is None:
    num_cores = getattr(jax.devices()[0], "core_count", None) or 132
  if m == 1:
    return _gemv_block_config(k, n, bk, num_cores, values_dtype)
  block_m = min(64, max(16, next_pow2(m)))
  block_k = first_divisor(bk, (128, 64, 32)) or 16
  m_blocks = -(-max(m, 1) // block_m)
  # Partial sums: splits * M * N * 4 bytes written and read <= K * N / 8 weight bytes.
  max_splits = max(1, min(k // block_k // SPLIT_MIN_CHUNKS, k // (64 * max(m, 1)), 16))

  def balance(p):
    return p / (num_cores * -(-p // num_cores))

  for block_n in [bn for bn in (128, 64, 32) if n % bn == 0] or [16]:
    programs = m_blocks * (n // block_n)
    splits = max(range(1, max_splits + 1), key=lambda sp: (balance(programs * sp), -sp))
    if balance(programs * splits) >= NARROW_BELOW_BALANCE:
      break
  return BlockConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_splits=splits,
                     num_stages=4 if block_m == 16 else 3)


def _gemv_block_config(k, n, bk, num_cores, values_dtype=None) -> BlockConfig:
  """One row on CUDA cores (GPU): weight chunks (`GEMV_FP8_CHUNK`, `GEMV_INT8_CHUNK`) of
  32 rows, 256 columns with 8 warps (fp8, where 256 divides N) or 128 columns with 4 warps
  (int8, and fp8 where 256 does not divide N); 4 stages; K splits of at most
  `GEMV_SPLIT_MAX_ROWS` rows each, raised until the grid holds `GEMV_TARGET_WAVES` waves
  of 256-column blocks (128-column blocks make twice as many programs). Products with few
  column blocks need the splits to fill the SMs; past that, more programs only add
  partial sums and pipeline fills. See docs/DECISIONS.md, "Quantized weights"."""
  narrow = values_dtype is not None and jnp.dtype(values_dtype) == jnp.dtype(jnp.int8)
  warps = 8
  if not narrow and n % GEMV_FP8_CHUNK[0] == 0 and bk % GEMV_FP8_CHUNK[1] == 0:
    block_n, block_k, warps = GEMV_FP8_CHUNK
  elif n % GEMV_INT8_CHUNK[0] == 0 and bk % GEMV_INT8_CHUNK[1] == 0:
    block_n, block_k, warps = GEMV_INT8_CHUNK
  else:
    for block_n in (64, 32, 16):
      block_k = 8192 // block_n
      if n % block_n == 0 and bk % block_k == 0:
        break
    else:
      block_n = first_divisor(n, (256, 128, 64, 32)) or 16
      block_k = first_divisor(bk, (128, 64, 32)) or 16
  chunks = k // block_k
  wide_blocks = -(-n // max(block_n, 256))
  splits = -(-k // GEMV_SPLIT_MAX_ROWS)
  splits = max(splits, -(-GEMV_TARGET_WAVES * num_cores // wide_blocks))
  splits = max(1, min(splits, chunks // 2 or 1, 64))
  return BlockConfig(block_m=1, block_n=block_n, block_k=block_k, num_splits=splits,
                     num_warps=warps, num_stages=4)


def fits(m, k, n, s, backend, values_dtype=None) -> bool:
  """Whether `backend`'s kernel tiles x [m, k] @ values [k, n] with s scale rows under its
  default blocks (the wrappers raise ValueError otherwise); the reference always does."""
  if backend == "reference":
    return True
  if k % s:
    return False
  block = default_block_config(m, k, n, s, backend, values_dtype=values_dtype)
  if backend == "gpu":
    from pallas_kernels.quant_matmul_gpu import check_blocks
  else:
    from pallas_kernels.quant_matmul_tpu import check_blocks
  try:
    check_blocks(k, n, s, block)
  except ValueError:
    return False
  return True


def _dtype_names(dtypes):
  return ", ".join(jnp.dtype(d).name for d in dtypes)


def check_quantized(x_dtype, values, scale, what="values", scale_what="scale"):
  """Check dtypes and the [.., S, N] scale of 1-byte weights [.., K, N]; return S.

  Shared with the grouped matmul's quantized experts (w [E, K, M], w_scale [E, S, M]).
  """
  if jnp.dtype(x_dtype) not in [jnp.dtype(d) for d in X_DTYPES]:
    raise ValueError(f"x dtype {jnp.dtype(x_dtype).name} is not supported; expected one "
                     f"of {_dtype_names(X_DTYPES)}.")
  if values.dtype not in [jnp.dtype(d) for d in VALUE_DTYPES]:
    raise ValueError(f"{what} dtype {values.dtype.name} is not supported; expected one of "
                     f"{_dtype_names(VALUE_DTYPES)}.")
  if scale.dtype != jnp.float32:
    raise ValueError(f"{scale_what} dtype {scale.dtype.name} is not supported; expected "
                     "float32.")
  *lead, k, n = values.shape
  if scale.ndim != values.ndim or tuple(scale.shape[:-2]) != tuple(lead) or \
      scale.shape[-1] != n or scale.shape[-2] < 1:
    want = ", ".join([str(d) for d in lead] + ["S", f"N={n}"])
    raise ValueError(f"{scale_what} must be [{want}] for {what} of shape {values.shape}, "
                     f"got {scale.shape}.")
  s = scale.shape[-2]
  if k % s:
    raise ValueError(f"K={k} must be a multiple of the {s} scale rows of {scale_what} "
                     "(scale blocks of K // S rows).")
  return s


def _check_inputs(x, values, scale):
  if x.ndim != 2:
    raise ValueError(f"x must be [M, K], got shape {x.shape}.")
  if values.ndim != 2 or values.shape[0] != x.shape[1]:
    raise ValueError(f"values must be [K={x.shape[1]}, N], got shape {values.shape}.")
  if scale.ndim != 2:
    raise ValueError(f"scale must be [S, N], got shape {scale.shape}.")
  check_quantized(x.dtype, values, scale)


def _precision(dtype):
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


@jax.jit
def _reference(x, values, scale):
  m, k = x.shape
  s, n = scale.shape
  precision = _precision(x.dtype)
  w = values.astype(x.dtype)                               # exact: 1-byte values fit
  if s == 1:
    out = jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32) * scale
  else:
    bk = k // s
    xs = x.reshape(m, s, bk).transpose(1, 0, 2)            # batch dim leading
    parts = jnp.einsum("smk,skn->smn", xs, w.reshape(s, bk, n), precision=precision,
                       preferred_element_type=jnp.float32)
    # A multiply and a sum, not a dot: an f32 dot may run at TF32 on a GPU.
    out = jnp.sum(parts * scale[:, None, :], axis=0)
  return out.astype(x.dtype)


def quant_matmul_reference(x, values, scale, *, backend=None, interpret=False,
                           block_config=None):
  """Pure-jnp quantized matmul (module docstring); backend, interpret and block_config
  are accepted and ignored. Returns [M, N] in x.dtype."""
  del backend, interpret, block_config
  _check_inputs(x, values, scale)
  return _reference(x, values, scale)


def quant_matmul(x, values, scale, *, backend=None, interpret=False, block_config=None):
  """out = x @ (values * scale per K block), [M, N] in x.dtype (module docstring).

  backend: None -> $MTP_JAX_QMATMUL_BACKEND or jax.default_backend() ('cpu' runs the
  reference); or 'gpu', 'tpu', 'reference'. Resolved here, outside jit.
  interpret: run the Pallas kernel in interpret mode (the TPU one with
  `pltpu.InterpretParams`), e.g. on CPU.
  block_config: a BlockConfig, default from the shapes (`default_block_config`).
  """
  backend = resolve_backend(backend, BACKEND_ENV_VAR, "quantized-matmul")
  _check_inputs(x, values, scale)
  if backend == "reference":
    return _reference(x, values, scale)
  if block_config is not None and not isinstance(block_config, BlockConfig):
    raise TypeError(f"block_config must be a BlockConfig, got "
                    f"{type(block_config).__name__}.")
  (m, k), (s, n) = x.shape, scale.shape
  if block_config is None:
    block_config = default_block_config(m, k, n, s, backend,
                                        num_cores=132 if interpret else None,
                                        values_dtype=values.dtype)
  return _quant_matmul(x, values, scale, backend=backend, block=block_config,
                       interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("backend", "block", "interpret"))
def _quant_matmul(x, values, scale, *, backend, block, interpret):
  m, n = x.shape[0], values.shape[1]
  if m == 0:
    return jnp.zeros((0, n), x.dtype)
  if backend == "gpu":
    from pallas_kernels.quant_matmul_gpu import quant_matmul_gpu
    return quant_matmul_gpu(x, values, scale, block=block, interpret=interpret)
  from pallas_kernels.quant_matmul_tpu import quant_matmul_tpu
  return quant_matmul_tpu(x, values, scale, block=block, interpret=interpret)
