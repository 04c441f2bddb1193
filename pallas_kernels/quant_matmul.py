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

Measured on an H100 (copy bandwidth 3.0 TB/s read + write; launch/bench_quant_matmul.py,
each figure including the timing loop's own 3.5 us a call) at the Llama-2-7B / MiMo-7B
decode shapes, batch 1: the int8 kernel took 0.63-0.81x the time of the bf16 XLA dot
(44-81 % of the copy bandwidth) and 0.57-0.96x that of XLA's fused int8 path; at 16 rows
XLA's int8 path is level with it (0.86-1.08x). fp8 per channel ran 3-53 % slower than
int8 (converting e4m3 to bf16 costs more than int8) and 0.66-1.24x XLA's time; fp8 with
128-row block scales ran 3.4-5.3x faster than XLA's batched path at batch 1, except at
MiMo's 151680-token vocabulary (16 % slower). Those figures predate two default changes
(128-wide N blocks for MiMo's 4096x6144 QKV, which ran with 64-wide ones at 1.06x the
bf16 time; 4 pipeline stages, 4-5 % faster in a sweep).

At one row the default is a CUDA-core kernel (no 16-row tensor-core tile): H100, bf16 x,
int8 per channel, same bench, against the 16-row tiling: MiMo / Llama gate+up 44-46 vs
48.6 us, MiMo QKV 15.5 vs 17.8, MiMo lm_head 256 vs 268, o_proj and down level; the
MiMo-7B int8 decode step at batch 1 went from 4.62 to 4.41 ms (3.9-4.0 ms after the
split, conversion and chunk changes of `_gemv_block_config` and `widen`). int8 still streams at
only 45-81 % of the copy bandwidth (timing loop included) where XLA's bf16 GEMV reaches
69-98 % (docs/BENCHMARKS.md).

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
  fewest splits on a tie, with at least 8 K chunks a split (the load pipeline needs a
  few to fill) and f32 partial sums (written, then read back) within 1/8 of the weight
  bytes. block_n narrows to 64 or 32 only where 128-wide blocks with their splits would
  leave more than half the SMs idle (M = 64, where partial sums cost too much): on an
  H100 at M = 1, 64-wide blocks streamed 25-30 % slower than 128-wide ones with the
  same splits. At 16 rows and N=4096 that is 32 N blocks x 4 splits = 128 programs on
  132 SMs (measured at M = 1 before the CUDA-core path: without splits it took twice as
  long). num_stages 4 at block_m 16 (4-5 % faster than 3 at M = 1), else 3.
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
  max_splits = max(1, min(k // block_k // 8, k // (64 * max(m, 1)), 16))

  def balance(p):
    return p / (num_cores * -(-p // num_cores))

  for block_n in [bn for bn in (128, 64, 32) if n % bn == 0] or [16]:
    programs = m_blocks * (n // block_n)
    splits = max(range(1, max_splits + 1), key=lambda sp: (balance(programs * sp), -sp))
    if balance(programs * splits) >= 0.5:
      break
  return BlockConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_splits=splits,
                     num_stages=4 if block_m == 16 else 3)


def _gemv_block_config(k, n, bk, num_cores, values_dtype=None) -> BlockConfig:
  """One row on CUDA cores (GPU): weight chunks of 32 rows, 256 columns with 8 warps
  (fp8, where 256 divides N) or 128 columns with 4 warps (int8, and fp8 where 256 does
  not divide N); 4 stages; K splits of at most 1024 rows each, raised until the grid
  holds three waves of 256-column blocks (128-column blocks make twice as many programs).

  H100, M = 1, bf16 x (launch/bench_quant_matmul.py): against the 16-row tensor-core
  tiling, int8 Llama / MiMo gate+up 44-46 vs 48.6 us, MiMo QKV 15.5 vs 17.8, MiMo lm_head
  256 vs 268, o_proj and down level (12.7 / 24.6 us). Splits swept 3..25: the shapes with
  few column blocks (QKV, o_proj, down: 16-48) are best at about three waves, as chosen;
  the wide ones lost with splits of 512 rows (int8 / fp8 gate+up 43.9 / 49.4 us at 8
  splits against 40.5 / 39.9 at 5, Llama lm_head 54.5 vs 52.5 at 4, MiMo lm_head 243 vs
  235 at 4): more programs than three waves only add partial sums and pipeline fills.
  Chunk shapes (128 / 256 / 512 columns x 16..128 rows, 4 / 8 / 16 warps, 3 / 4 stages)
  with the same splits: int8 128 x 32 with 4 warps against 256 x 32 with 8 warps, QKV
  14.2 vs 14.4 us, o_proj 11.4 vs 12.0, gate+up 39.4 vs 40.6, down 23.0 vs 25.1, Llama
  lm_head 54.0 vs 52.7; fp8 lost with it (QKV Llama 27.4 vs 24.6, gate+up 43.5 vs 40.1)
  except on MiMo's lm_head (N = 151680, where 256 does not divide N and the chunk was
  128 x 64 with 8 warps: int8 227.7 vs 235.5, fp8 235.2 vs 254.8)."""
  narrow = values_dtype is not None and jnp.dtype(values_dtype) == jnp.dtype(jnp.int8)
  warps = 8
  if not narrow and n % 256 == 0 and bk % 32 == 0:
    block_n, block_k = 256, 32
  elif n % 128 == 0 and bk % 32 == 0:
    block_n, block_k, warps = 128, 32, 4
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
  splits = -(-k // 1024)
  splits = max(splits, -(-3 * num_cores // wide_blocks))
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
