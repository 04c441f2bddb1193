"""Paged multi-head latent attention (DeepSeek-V3 MLA, absorbed form) for decode, verify
and chunked prefill.

Layouts (einsum letters: b batch, q query row, h head, k kv position, d latent + rope
dim, v latent dim):
  q            [B, Q, H, Dk]          absorbed queries: q[..., :v_dim] = q_nope @ W_uk (the
                                      latent part), q[..., v_dim:] the RoPE part
  kv_pages     [num_pages, page_size, Dk]   one entry per token: [..., :v_dim] the normed
                                      latent c_kv (kv_lora_rank), [..., v_dim:] the rope key
  block_tables [B, max_pages] int32   page ids into num_pages
  kv_lens      [B] int32              KV length per row, counting the Q new tokens
  kv_scale     [2] f32 or None        dequantization scales (fp8 cache, below): the latent
                                      part's and the rope part's; None means 1.0
  out          [B, Q, H, v_dim]       latent outputs (the caller applies W_uv)

scores = q . kv (all Dk dims) * sm_scale and values = kv[..., :v_dim]: the latent cache is
both the K and the V, and the kernels read each page once for both. All H heads share
that one latent "kv head", so the kernels pack the H heads times the Q query rows of a
batch row into the rows of one tile (row r = i * H + h, a plain reshape of q), and a
page is loaded once for every row of the tile.

Query row i of batch row b sees kv positions p < kv_lens[b] - Q + i + 1 (the rule of
`pallas_kernels.paged_attention`, whose masking helpers the kernels share). Rows that
see nothing return exactly 0. Masked positions never contribute, whatever the pages
hold there (NaN included). Block-table entries past what kv_len needs may be any
in-range page id; the table itself is never read out of bounds.

fp8 latent cache: kv_pages may be float8_e4m3fn (1 byte a value: half the bytes decode
reads) while q stays bfloat16 or float32 (the compute dtype); otherwise q and kv_pages
dtypes match. The logical cache row is concat(kv_pages[..., :v_dim] * kv_scale[0],
kv_pages[..., v_dim:] * kv_scale[1]): two scales because the normed latent and the rope
key have different magnitudes. The scales mean the same whatever the page dtype (bf16
pages with scales are scaled too); they are a traced array, and each must be positive
and finite. Nothing is dequantized in HBM: the scales are folded into q (small) and the
output. q . row = (q[..., :v_dim] * s0) . lat + (q[..., v_dim:] * s1) . rope, so the
wrapper scales q's two parts (in f32, back to q's dtype), and the values are s0 * lat,
so it multiplies the normalised latent output by s0 (sum_k p_k s0 lat_k = s0 sum_k p_k
lat_k). The kernels see only q' and the stored pages, converting a loaded fp8 block to
the compute dtype right away (exact: every e4m3 value is a bf16 and an f16); split-K
partials and their combine never meet a scale. The reference applies the scales the
same way.

Cost: with H * Q packed rows, every kv entry costs 2 * H * Q * (Dk + v_dim) flops for
Dk * itemsize bytes, about 2 * H * Q flops per byte. An H100's ridge point is about 220
flops per byte (XLA's bf16 matmul rate over the copy bandwidth, both measured: see
docs/BENCHMARKS.md, "Kernels"), so at H = 128 decode (Q = 1) is already at the ridge and
verify (Q = 4) is compute bound: four times the matrix work of decode for the same bytes,
which no kernel can hide. fp8 pages halve the bytes for the same flops (about 4 * H * Q
flops a byte), so at H = 128 they shorten only what the page reads cost, not the matrix
work.

Backends: `paged_mla_gpu` (Pallas Triton, split-K flash-decoding), `paged_mla_tpu`
(Mosaic TPU, double-buffered page DMAs) and `paged_mla_reference` (pure jnp, also the
XLA baseline).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import invariant
from pallas_kernels.common import FP8_DTYPE, check_positive_ints, next_pow2, resolve_backend

BACKEND_ENV_VAR = "MTP_JAX_MLA_BACKEND"

# GPU tiling; the measurements are in docs/DECISIONS.md, "MoE and MLA kernels".
# Shared memory a program's q tile plus two kv stages may take: under the 227 KiB an
# H100 program may have.
SHARED_MEMORY_BYTES = 224 << 10
# KV splits only while the grid fills less than SPLIT_BELOW_WAVES of a wave (a wave: one
# program an SM), then enough for about SPLIT_TARGET_WAVES waves: two waves matched or
# beat one at small batches, four lost. Set by launch/bench_paged_mla.py --sweep.
SPLIT_BELOW_WAVES = 0.5
SPLIT_TARGET_WAVES = 2
# A grid of at most this many 64-row tiles takes 32-row tiles instead: so few tiles leave
# most SMs to KV splits, and half-height tiles double the programs. Set by
# launch/bench_paged_mla.py --sweep-small.
SMALL_GRID_MAX_TILES = 8


@dataclasses.dataclass(frozen=True)
class MLABlockConfig:
  """Tiling of one paged-MLA call.

  block_k:        kv positions per compute block. GPU: a power of two >= 16 (any page
                  size; a block may span several pages or part of one). TPU: a multiple
                  of page_size (whole pages are copied).
  rows_per_block: packed (query row, head) rows per tile; a multiple of 8.
  num_splits:     KV splits per row tile (flash-decoding; GPU only, 1 on TPU).
  num_warps, num_stages: Triton launch parameters (GPU only).
  """

  block_k: int = 64
  rows_per_block: int = 64
  num_splits: int = 1
  num_warps: int = 8
  num_stages: int = 2

  def __post_init__(self):
    check_positive_ints(self)
    if self.rows_per_block % 8:
      raise ValueError("MLABlockConfig.rows_per_block must be a multiple of 8, got "
                       f"{self.rows_per_block}.")


def default_block_config(batch, q_len, num_heads, page_size, max_pages, head_dim, dtype,
                         backend, num_cores=None) -> MLABlockConfig:
  """Block sizes from the shapes. dtype: q's (the compute dtype). fp8 pages take their
  q's sizes, and dtype=float8_e4m3fn gives bf16's (not tuned for fp8 pages: the bench's
  --sweep-fp8 times the candidates).

  GPU (swept at H = 128, Dk = 576, bf16, B = 64, 4k context; `launch/bench_paged_mla.py
  --sweep`): 64-row tiles on 8 warps (at H = 128 a tile is 64 heads of one query row) and
  64 kv positions per block; smaller tiles or blocks were slower and 128 rows do not
  compile (registers). The block shrinks (to >= 16) until the q tile plus two kv stages
  fit in `SHARED_MEMORY_BYTES` (the bf16 64 x 64 tiles above take 221 KiB by that count);
  f32 tiles stop at 32 rows. KV splits only when B * tiles would leave more than half the
  SMs idle (`SPLIT_BELOW_WAVES`), then enough for about two waves of programs
  (`SPLIT_TARGET_WAVES`), at least one block each. A grid of at most
  `SMALL_GRID_MAX_TILES` such 64-row tiles (B = 1 up to Q = 4, B = 4 at Q = 1) takes
  32-row tiles on 4 warps instead, split the same way: so few tiles leave most SMs to
  splits, and half-height tiles double the programs. See docs/DECISIONS.md, "MoE and MLA
  kernels".
  TPU: tiles of up to 256 rows and ~256 kv positions per block (untuned: no TPU was
  available).
  """
  rows = q_len * num_heads
  kv_capacity = max_pages * page_size
  if backend == "tpu":
    pages = max(1, min(256 // page_size, max_pages))
    return MLABlockConfig(block_k=pages * page_size, num_splits=1, num_warps=4,
                          rows_per_block=min(max(next_pow2(rows), 16), 256))
  itemsize = jnp.dtype(dtype).itemsize
  rows_per_block = min(max(next_pow2(rows), 16), 64 if itemsize <= 2 else 32)
  if rows_per_block == 64 and batch * -(-rows // rows_per_block) <= SMALL_GRID_MAX_TILES:
    rows_per_block = 32  # a grid of few 64-row tiles: half-height tiles
  row_bytes = itemsize * head_dim
  block_k = 64
  while block_k > 16 and (rows_per_block + 2 * block_k) * row_bytes > SHARED_MEMORY_BYTES:
    block_k //= 2
  block_k = max(16, min(block_k, next_pow2(kv_capacity)))
  programs = batch * -(-rows // rows_per_block)
  if num_cores is None:
    num_cores = getattr(jax.devices()[0], "core_count", None) or 132
  num_splits = 1
  if programs < SPLIT_BELOW_WAVES * num_cores:
    blocks = -(-kv_capacity // block_k)
    num_splits = max(1, min(SPLIT_TARGET_WAVES * num_cores // programs, blocks, 64))
  return MLABlockConfig(block_k=block_k, rows_per_block=rows_per_block,
                        num_splits=num_splits, num_warps=8 if rows_per_block >= 64 else 4)


def _resolve_backend(backend):
  return resolve_backend(backend, BACKEND_ENV_VAR, "paged-MLA")


def check_latent_inputs(q, kv_pages, block_tables, v_dim, sm_scale, kv_scale=None):
  """The checks paged MLA and sparse MLA (dsa.py) share: q [B, Q, H, Dk] against the
  latent pages, v_dim, the dtypes, the block table, sm_scale and the fp8 scales."""
  if q.ndim != 4:
    raise ValueError(f"q must be [B, Q, H, Dk], got shape {q.shape}.")
  batch, _, _, head_dim = q.shape
  if kv_pages.ndim != 3:
    raise ValueError(f"kv_pages must be [num_pages, page_size, Dk], got shape "
                     f"{kv_pages.shape}.")
  if kv_pages.shape[2] != head_dim:
    raise ValueError(f"q's last dim (Dk = latent + rope) is {head_dim} but kv_pages' is "
                     f"{kv_pages.shape[2]}.")
  if (not isinstance(v_dim, numbers.Integral) or isinstance(v_dim, bool)
      or not 0 < v_dim <= head_dim):
    raise ValueError(f"v_dim (kv_lora_rank) must be an int in [1, Dk={head_dim}], got "
                     f"{v_dim!r}.")
  if kv_pages.dtype == FP8_DTYPE:
    if q.dtype not in (jnp.bfloat16, jnp.float32):
      raise ValueError(f"float8_e4m3fn pages need a bfloat16 or float32 q (the compute "
                       f"dtype), got {q.dtype}.")
  elif q.dtype != kv_pages.dtype:
    raise ValueError(f"q and kv_pages dtypes differ: {q.dtype} and {kv_pages.dtype} (they "
                     "must match, or the pages be float8_e4m3fn).")
  if block_tables.ndim != 2 or block_tables.shape[0] != batch:
    raise ValueError(f"block_tables must be [B={batch}, max_pages], got {block_tables.shape}.")
  if block_tables.dtype != jnp.int32:
    raise ValueError(f"block_tables must be int32, got {block_tables.dtype}.")
  if (not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool)
      or not math.isfinite(sm_scale) or sm_scale <= 0):
    raise ValueError(f"sm_scale must be a positive finite Python number, got {sm_scale!r}.")
  if kv_scale is not None:
    shape = getattr(kv_scale, "shape", type(kv_scale).__name__)
    if shape != (2,):
      raise ValueError("kv_scale must be [2] (the latent part's and the rope part's scale) "
                       f"or None, got shape {shape}.")
    if not jnp.issubdtype(kv_scale.dtype, jnp.floating):
      raise ValueError(f"kv_scale must be a float array, got {kv_scale.dtype}.")


def _check_inputs(q, kv_pages, block_tables, kv_lens, v_dim, sm_scale, kv_scale=None):
  check_latent_inputs(q, kv_pages, block_tables, v_dim, sm_scale, kv_scale)
  batch = q.shape[0]
  if kv_lens.shape != (batch,):
    raise ValueError(f"kv_lens must be [B={batch}], got {kv_lens.shape}.")
  if kv_lens.dtype != jnp.int32:
    raise ValueError(f"kv_lens must be int32, got {kv_lens.dtype}.")


def scale_queries(q, kv_scale, v_dim):
  """q with the cache's scales folded in: q[..., :v_dim] * kv_scale[0] and q[..., v_dim:]
  * kv_scale[1], multiplied in f32 and returned in q's dtype (module docstring)."""
  s = kv_scale.astype(jnp.float32)
  per_dim = jnp.where(jnp.arange(q.shape[-1]) < v_dim, s[0], s[1])
  return (q.astype(jnp.float32) * per_dim).astype(q.dtype)


def check_tiling(backend, *, v_dim, head_dim, page_size, dtype, cfg: MLABlockConfig,
                 q_dtype=None):
  """Raise ValueError when `backend`'s kernel cannot tile these shapes with `cfg`.

  dtype: the pages'. q_dtype: the queries'; None means dtype, or bfloat16 for fp8 pages
  (the narrowest q they take, so the strictest row tiling).
  """
  rope_dim = head_dim - v_dim
  if q_dtype is None:
    q_dtype = jnp.bfloat16 if jnp.dtype(dtype).itemsize == 1 else dtype
  if backend == "gpu":
    for name, n in (("block_k", cfg.block_k), ("rows_per_block", cfg.rows_per_block)):
      if n < 16 or n & (n - 1):
        raise ValueError(f"GPU paged MLA needs MLABlockConfig.{name} to be a power of two "
                         f">= 16 (Triton tiles are powers of two; tensor-core dots need "
                         f">= 16), got {n}.")
    return
  # TPU (Mosaic): lane width 128, sublane tile 8 rows of 32 bits (16 of 16 bits, 32 of 8).
  sublanes = 8 * (4 // jnp.dtype(dtype).itemsize)
  q_sublanes = 8 * (4 // jnp.dtype(q_dtype).itemsize)
  if v_dim % 128:
    raise ValueError(
        f"TPU paged MLA needs v_dim (kv_lora_rank) to be a multiple of 128, got {v_dim}: "
        "the latent part and the output are lane-dim (128-wide) tiles, and the rope part "
        f"(Dk - v_dim = {rope_dim}) must start on a lane-tile boundary.")
  if page_size % sublanes:
    raise ValueError(f"TPU paged MLA needs page_size to be a multiple of {sublanes} for "
                     f"{jnp.dtype(dtype).name} (one sublane tile per page copy), got "
                     f"{page_size}.")
  if cfg.block_k % page_size:
    raise ValueError(f"TPU paged MLA copies whole pages: MLABlockConfig.block_k "
                     f"({cfg.block_k}) must be a multiple of page_size ({page_size}).")
  if cfg.rows_per_block % q_sublanes:
    raise ValueError(f"TPU paged MLA needs MLABlockConfig.rows_per_block to be a multiple "
                     f"of {q_sublanes} for {jnp.dtype(q_dtype).name} queries, got "
                     f"{cfg.rows_per_block}.")
  if cfg.num_splits != 1:
    raise ValueError("The TPU kernel runs one KV split; set MLABlockConfig.num_splits=1.")


@functools.partial(jax.jit, static_argnames=("v_dim", "sm_scale", "block_config"))
def paged_mla_reference(q, kv_pages, block_tables, kv_lens, *, v_dim, sm_scale,
                        kv_scale=None, block_config=None):
  """Pure-jnp paged MLA: gather every table page, dense masked softmax.

  Same signature and result as `paged_mla` (block_config is accepted and ignored).
  kv_scale is applied as the kernels apply it: folded into q and the output, with the
  pages converted to q's dtype (exact for fp8).
  """
  del block_config
  _check_inputs(q, kv_pages, block_tables, kv_lens, v_dim, sm_scale, kv_scale)
  batch, q_len, _, head_dim = q.shape
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  if kv_scale is not None:
    q = scale_queries(q, kv_scale, v_dim)

  kv = kv_pages[block_tables].reshape(batch, -1, head_dim).astype(q.dtype)  # [B, K, Dk]
  pos = jnp.arange(kv.shape[1])                                    # [K]
  q_pos = kv_lens[:, None] - q_len + jnp.arange(q_len)             # [B, Q]
  mask = pos[None, None, :] <= q_pos[:, :, None]                   # [B, Q, K]
  # Positions no row sees may hold anything (NaN included); 0 * NaN would leak through
  # the value einsum, so zero them rather than relying on p == 0.
  kv = jnp.where(mask.any(axis=1)[:, :, None], kv, 0)
  logits = invariant.einsum("bqhd,bkd->bqhk", q, kv, precision=precision,
                      preferred_element_type=jnp.float32) * sm_scale
  mask = mask[:, :, None, :]                                       # [B, Q, 1, K]
  logits = jnp.where(mask, logits, -jnp.inf)
  m = logits.max(axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  l = p.sum(axis=-1)                                               # [B, Q, H]
  o = invariant.einsum("bqhk,bkv->bqhv", p, kv[..., :v_dim].astype(jnp.float32),
                 precision=precision)
  # l == 0 exactly when the row sees nothing (else the max term contributes 1); a NaN
  # in a visible position must come out as NaN, not be swallowed as 0.
  seen = l != 0.0
  o = jnp.where(seen[..., None], o / jnp.where(seen, l, 1.0)[..., None], 0.0)
  if kv_scale is not None:  # the values are the latent part times its scale
    o = o * kv_scale[0].astype(jnp.float32)
  return o.astype(q.dtype)


def paged_mla(q, kv_pages, block_tables, kv_lens, *, v_dim, sm_scale, kv_scale=None,
              backend=None, interpret=False, block_config=None):
  """Paged MLA attention over the pages named by `block_tables` (module docstring).

  v_dim: the latent width (kv_lora_rank); Dk - v_dim is the rope width. sm_scale: the
  softmax scale (DeepSeek: 1 / sqrt(qk_nope + qk_rope head dim), times its mscale^2).
  kv_scale: None (1.0) or a [2] float traced array, (latent scale, rope scale): the
  logical cache row is concat(kv_pages[..., :v_dim] * kv_scale[0], kv_pages[..., v_dim:]
  * kv_scale[1]); for fp8 (float8_e4m3fn) pages, and applied to pages of any dtype.
  backend: None -> $MTP_JAX_MLA_BACKEND or jax.default_backend() ('cpu' runs the
  reference); or 'gpu', 'tpu', 'reference'. Resolved here, outside jit, so the env var
  is read on every call. interpret=True runs the chosen Pallas kernel in interpret mode
  (on CPU). block_config: an MLABlockConfig, default from the shapes.
  Returns [B, Q, H, v_dim] in q.dtype (accumulated in f32). Shapes a kernel cannot tile
  raise ValueError naming the dimension and the reason.
  """
  backend = _resolve_backend(backend)
  # Normalise the static arguments (numpy scalars included) so equal values share a
  # compiled program; anything else is refused by the input checks.
  if isinstance(v_dim, numbers.Integral) and not isinstance(v_dim, bool):
    v_dim = int(v_dim)
  if isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool):
    sm_scale = float(sm_scale)
  if backend == "reference":
    return paged_mla_reference(q, kv_pages, block_tables, kv_lens, v_dim=v_dim,
                               sm_scale=sm_scale, kv_scale=kv_scale)
  if block_config is not None and not isinstance(block_config, MLABlockConfig):
    raise TypeError("block_config must be an MLABlockConfig, got "
                    f"{type(block_config).__name__}.")
  return _paged_mla_kernel(q, kv_pages, block_tables, kv_lens, v_dim=v_dim,
                           sm_scale=sm_scale, kv_scale=kv_scale, backend=backend,
                           interpret=interpret, block_config=block_config)


@functools.partial(jax.jit, static_argnames=("v_dim", "sm_scale", "backend", "interpret",
                                             "block_config"))
def _paged_mla_kernel(q, kv_pages, block_tables, kv_lens, *, v_dim, sm_scale, kv_scale,
                      backend, interpret, block_config):
  """Fold the scales into q, pack the query rows, run the backend's kernel, unpack and
  scale the output."""
  _check_inputs(q, kv_pages, block_tables, kv_lens, v_dim, sm_scale, kv_scale)
  batch, q_len, num_heads, head_dim = q.shape
  _, page_size, _ = kv_pages.shape
  cfg = block_config or default_block_config(
      batch, q_len, num_heads, page_size, block_tables.shape[1], head_dim, q.dtype, backend,
      num_cores=132 if interpret else None)
  check_tiling(backend, v_dim=v_dim, head_dim=head_dim, page_size=page_size,
               dtype=kv_pages.dtype, q_dtype=q.dtype, cfg=cfg)
  if kv_scale is not None:
    q = scale_queries(q, kv_scale, v_dim)

  # Pack rows: [B, Q, H, Dk] -> [B, Q*H, Dk] (row = i*H + h), padded to the tile.
  rows = q_len * num_heads
  padded = -(-rows // cfg.rows_per_block) * cfg.rows_per_block
  qp = q.reshape(batch, rows, head_dim)
  if padded != rows:
    qp = jnp.pad(qp, ((0, 0), (0, padded - rows), (0, 0)))
  common = dict(q_len=q_len, num_heads=num_heads, v_dim=v_dim, sm_scale=float(sm_scale),
                block_k=cfg.block_k, rows_per_block=cfg.rows_per_block, interpret=interpret)
  if backend == "gpu":
    from pallas_kernels.paged_mla_gpu import paged_mla_gpu
    out = paged_mla_gpu(qp, kv_pages, block_tables, kv_lens, **common,
                        num_splits=cfg.num_splits, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages)
  else:
    from pallas_kernels.paged_mla_tpu import paged_mla_tpu
    out = paged_mla_tpu(qp, kv_pages, block_tables, kv_lens, **common)
  out = out[:, :rows, :v_dim].reshape(batch, q_len, num_heads, v_dim)
  if kv_scale is not None:  # the values are the latent part times its scale
    out = (out.astype(jnp.float32) * kv_scale[0].astype(jnp.float32)).astype(q.dtype)
  return out
