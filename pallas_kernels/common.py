"""What the kernels of this package share; every op module and backend builds on it.

- backend choice: `resolve_backend` (argument, else an op's environment variable, else
  `jax.default_backend()`), `BACKENDS`, and the block-config checks;
- fp8 pages: `FP8_DTYPE`, `FP8_MAX`, `stored` (what a page holds for a value and its
  scale, shared by the XLA write and the GPU write kernel);
- paged attention's row packing and masks (decode, verify and prefill; GQA and MLA):
  `MASK_VALUE`, `visible_mask`, `tile_kv_range`, `tile_full_range`, `unpack_rows`,
  `head_scales`; a tree verify's ancestor masks (`tree_rows`, `tree_visible_mask`);
- GPU tiling of head dims (`gpu_dim_tile`, `key_dim_parts`) and the split-K epilogue
  (`normalised`, `store_rows`, `combine_splits`); the TPU kernels' `to_compute`;
- `swiglu`, the clamped SwiGLU of the model, the reference and the GPU kernel's epilogue.

Op modules (paged_attention.py, kv_write.py, paged_mla.py, swiglu_matmul.py, ...) import
their backends (*_gpu.py, *_tpu.py); backends import only this module, never an op module.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from jax import lax


# ----------------------------------------------------------------------- backend choice
BACKENDS = ("gpu", "tpu", "reference")


def resolve_backend(backend, env_var: str, op: str, extra: tuple[str, ...] = ()) -> str:
  """Explicit argument, else $env_var, else by `jax.default_backend()` (cpu: reference).

  `extra` names further backends that this one op accepts on top of BACKENDS.
  """
  choice = backend or os.environ.get(env_var) or jax.default_backend()
  choice = {"cuda": "gpu", "rocm": "gpu", "cpu": "reference"}.get(choice, choice)
  allowed = BACKENDS + tuple(extra)
  if choice not in allowed:
    raise ValueError(f"unknown {op} backend {choice!r}; expected one of {allowed} "
            "(or None for jax.default_backend())")
  return choice


def next_pow2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, (n - 1).bit_length())


def first_divisor(n: int, candidates):
  """The first of `candidates` that divides n, or None."""
  return next((c for c in candidates if n % c == 0), None)


def check_positive_ints(config, skip: tuple[str, ...] = ()) -> None:
  """ValueError naming the field of a block-config dataclass that is not a positive int
  (fields named in `skip` are the caller's to check)."""
  for f in dataclasses.fields(config):
    if f.name in skip:
      continue
    v = getattr(config, f.name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise ValueError(f"{type(config).__name__}.{f.name} must be a positive int, got {v!r}.")


# ---------------------------------------------------------------------------- fp8 pages
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_F32_MAX = float(jnp.finfo(jnp.float32).max)


def stored(x, scale, dtype):
  """Values x as stored in pages of `dtype`: x / scale (scale None: 1.0; otherwise f32,
  broadcasting against x), saturated to +-FP8_MAX for fp8 with non-finite inputs kept NaN;
  other dtypes are a cast. Elementwise ops only (abs / compare / max / min rather than
  isfinite / clip), so the GPU write kernel stores through the same function."""
  if scale is None and dtype != FP8_DTYPE:
    return x.astype(dtype)
  y = x.astype(jnp.float32)
  if scale is not None:
    y = y / scale
  if dtype == FP8_DTYPE:
    # Saturate on the input's finiteness, not y's: a finite row over a tiny scale may
    # overflow y to inf, and that is still a large value, not a non-finite one.
    finite = jnp.abs(x.astype(jnp.float32)) <= _F32_MAX  # False for NaN and +-inf
    y = jnp.where(finite, jnp.minimum(jnp.maximum(y, -FP8_MAX), FP8_MAX), jnp.nan)
  return y.astype(dtype)


# ---------------------------------------------------------------- packed rows and masks
# Finite stand-in for -inf in the kernels' running max: (-inf) - (-inf) would be NaN.
MASK_VALUE = -1e30


def visible_mask(row, pos, *, kv_len, q_len, group, window, kv_capacity):
  """Which (packed row, kv position) pairs take part in attention (kernel helper).

  Packed row r holds query i = r // group; rows past q_len * group (padding) repeat the
  last query. Mosaic has no vector integer divide, so both tests are rewritten without
  it: p < kv_len - q_len + 1 + r // G  <=>  (p - kv_len + q_len) * G <= r, and
  p >= kv_len - q_len + 1 + r // G - W  <=>  r < (p - kv_len + q_len + W) * G.
  """
  row = jnp.minimum(row, q_len * group - 1)
  rel = pos - kv_len + q_len
  mask = (rel * group <= row) & (pos < kv_capacity)
  if window is not None:
    mask &= row < (rel + window) * group
  return mask


# A tree (paged attention's `tree_mask`) hands each packed row its ancestor set as bits,
# TREE_WORD_BITS tree rows a word, and its depth after them (`tree_rows`).
TREE_WORD_BITS = 32


def tree_words(tree_len: int) -> int:
  """Bit words that hold one query row's ancestor set over a tree of tree_len rows."""
  return -(-tree_len // TREE_WORD_BITS)


def tree_rows(tree_mask, group, rows):
  """A tree's per-query ancestor sets as per-packed-row integers: [B, rows, W + 1] int32.

  tree_mask [B, Q, T] bool (T >= Q): query i, the tree's row T - Q + i, sees tree row j
  (j <= T - Q + i; entries past that are ignored). Column w < W = tree_words(T) holds bit
  j of tree row 32 w + j; column W the query's depth, the tree rows it sees before its own
  (its ancestors), which places a sliding window. Packed row r = i * G + g takes query
  i's; padding rows (r >= Q * G) repeat the last query's, as `visible_mask` has them
  repeat its position.
  """
  batch, q_len, tree_len = tree_mask.shape
  words = tree_words(tree_len)
  own = tree_len - q_len + jnp.arange(q_len)[:, None]  # each query's own tree row
  col = jnp.arange(tree_len)[None, :]
  seen = tree_mask & (col <= own)
  depth = jnp.sum(seen & (col < own), axis=-1, dtype=jnp.int32)
  padded = jnp.pad(seen, ((0, 0), (0, 0), (0, words * TREE_WORD_BITS - tree_len)))
  weights = jnp.left_shift(jnp.uint32(1), jnp.arange(TREE_WORD_BITS, dtype=jnp.uint32))
  bits = jnp.sum(padded.reshape(batch, q_len, words, TREE_WORD_BITS) * weights, axis=-1,
                 dtype=jnp.uint32)  # distinct powers of two: the sum is their OR
  cols = jnp.concatenate([lax.bitcast_convert_type(bits, jnp.int32), depth[..., None]], -1)
  query = jnp.minimum(jnp.arange(rows) // group, q_len - 1)
  return cols[:, query]


def tree_visible_mask(bits, depth, pos, *, kv_len, tree_len, window, kv_capacity):
  """`visible_mask` under a tree of tree_len rows, the last tree_len positions of kv_len
  (kernel helper): a row sees every cached position before the tree, within a window
  only the `window` positions up to its own logical one (the tree's first position + its
  depth), and the tree rows its ancestor bits name. bits: one [rows, 1] int32 array per
  word (`tree_rows`' columns), depth [rows, 1]; pos [rows, block_k] or broadcastable.
  The tree's rows all lie in the window (paged_attention refuses a shorter window)."""
  rel = pos - (kv_len - tree_len)  # the tree row a position holds; negative: before it
  mask = rel < 0
  for w, word in enumerate(bits):
    start = w * TREE_WORD_BITS
    shift = jnp.clip(rel - start, 0, TREE_WORD_BITS - 1)
    hit = (lax.shift_right_logical(word, shift) & 1) != 0
    mask |= hit & (rel >= start) & (rel < min(start + TREE_WORD_BITS, tree_len))
  mask &= pos < kv_capacity
  if window is not None:
    mask &= (rel >= 0) | (rel > depth - window)
  return mask


def _tile_queries(tile, rows_per_block, group, q_len):
  """The first and last query of a row tile's packed rows (padding rows repeat the last
  query). All operands are non-negative, so lax.div is floor division."""
  first = jnp.minimum(lax.div(tile * rows_per_block, group), q_len - 1)
  last = jnp.minimum(lax.div(tile * rows_per_block + rows_per_block - 1, group), q_len - 1)
  return first, last


def _kv_range(start_query, end_query, *, kv_len, q_len, window, kv_capacity):
  """[lo, hi): from the first kv position `start_query` sees (its window's start) to the
  end of what `end_query` sees; lo <= hi."""
  hi = jnp.clip(kv_len - q_len + end_query + 1, 0, kv_capacity)
  lo = jnp.zeros_like(hi)
  if window is not None:
    lo = jnp.clip(kv_len - q_len + start_query + 1 - window, 0, hi)
  return lo, hi


def tile_kv_range(tile, *, kv_len, rows_per_block, q_len, group, window, kv_capacity,
                  tree_len=0):
  """[lo, hi): the kv positions seen by any row of a row tile (kernel helper, scalars).
  tree_len > 0: rows see by `tree_visible_mask` over a tree of that many rows; a query
  sees no tree row after its own (as causally), and its window starts at its depth past
  the tree's first position, so the tree's first row bounds lo."""
  first, last = _tile_queries(tile, rows_per_block, group, q_len)
  if tree_len:
    first = jnp.full_like(first, q_len - tree_len)
  return _kv_range(first, last, kv_len=kv_len, q_len=q_len, window=window,
                   kv_capacity=kv_capacity)


def tile_full_range(tile, *, kv_len, rows_per_block, q_len, group, window, kv_capacity,
                    tree_len=0):
  """[lo, hi): the kv positions seen by every row of a row tile (kernel helper, scalars;
  empty when none is). Blocks inside it need no mask: every (row, position) pair of them
  takes part. The tile's first query bounds hi, its last one lo. tree_len > 0: only
  positions before the tree (no tree row is seen by every row), past the window of the
  deepest possible row (depth tree_len - 1)."""
  first, last = _tile_queries(tile, rows_per_block, group, q_len)
  if tree_len:
    first = jnp.full_like(first, q_len - tree_len - 1)
    last = jnp.full_like(last, q_len - 1)
  return _kv_range(last, first, kv_len=kv_len, q_len=q_len, window=window,
                   kv_capacity=kv_capacity)


def head_scales(*scales, num_kv_heads):
  """[KVH, len(scales)] f32: each [KVH] scale (here k_scale, v_scale) per kv head, 1.0
  where a scale is None."""
  ones = jnp.ones((num_kv_heads,), jnp.float32)
  return jnp.stack([ones if s is None else s.astype(jnp.float32) for s in scales], axis=1)


def unpack_rows(out, q_len, group):
  """A kernel's packed output [B, KVH, R, W] (row r = i*G + g, padded past Q*G) as
  [B, Q, KVH*G, W]: query i's head h*G + g."""
  batch, kv_heads, _, width = out.shape
  out = out[:, :, :q_len * group].reshape(batch, kv_heads, q_len, group, width)
  return out.transpose(0, 2, 1, 3, 4).reshape(batch, q_len, kv_heads * group, width)


# ---------------------------------------------------------------- GPU tiles and split-K
def gpu_dim_tile(n: int) -> int:
  """Tile width the GPU kernel uses for a head-dim part of width n (0: no such part).

  Triton tiles are powers of two and tensor-core dots need >= 16, so a part is padded
  up to the next such width by masked loads; padded columns are read as zeros.
  """
  return 0 if n == 0 else max(16, next_pow2(n))


def key_dim_parts(head_dim: int) -> tuple[tuple[int, int, int], ...]:
  """(start, width, tile) of each key-dim part: one part when head_dim is a power of two
  or below 16, else its largest power-of-two prefix and the rest (192 = 128 + 64,
  48 = 32 + 16; a tail that is not a power of two >= 16 is padded up by masked loads).
  Each part is its own gather and q . k^T dot (the pages are read once either way)."""
  head = 1 << (head_dim.bit_length() - 1)
  if head == head_dim or head < 16:
    return ((0, head_dim, gpu_dim_tile(head_dim)),)
  return ((0, head, head), (head, head_dim - head, gpu_dim_tile(head_dim - head)))


def normalised(acc, l, v_scale=None):
  """A tile's output rows: acc / l, 0 where a row saw nothing (l == 0), times v_scale (a
  scalar, or None)."""
  seen = l != 0.0
  out = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0)
  return out if v_scale is None else out * v_scale


def store_rows(out_refs, acc, m, l, v_scale=None):
  """Normalise a tile's f32 accumulator and store it: the output alone (one split), or
  the normalised partial and its log-sum-exp for `combine_splits` (several). Rows that
  saw nothing store 0 (lse -inf); a NaN in a visible position stays NaN. v_scale (a
  scalar, or None) multiplies the output, not the lse: the combine is linear in it."""
  seen = l != 0.0
  out = normalised(acc, l, v_scale)
  if len(out_refs) == 1:
    (o_ref,) = out_refs
    o_ref[...] = out.astype(o_ref.dtype)
  else:
    o_ref, lse_ref = out_refs
    o_ref[...] = out
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def combine_splits(o_parts, lse):
  """Merge split-K partials: o_parts [S, ..., D] (normalised), lse [S, ...] (-inf: empty)."""
  top = lse.max(axis=0)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - top), 0.0)
  den = w.sum(axis=0)
  o = (w[..., None] * o_parts).sum(axis=0)
  return o / jnp.where(den > 0.0, den, 1.0)[..., None]


# ---------------------------------------------------------------------------------- TPU
def to_compute(x, dtype):
  """x in dtype; a different float type (fp8) goes through f32, which Mosaic converts."""
  if x.dtype == dtype:
    return x
  return x.astype(jnp.float32).astype(dtype)


# ------------------------------------------------------------------------------- SwiGLU
def swiglu(gate, up, limit=None):
  """silu(gate) * up in the inputs' dtype, clamped as Step-3.5 does when `limit` is set:
  min(silu(gate), L) * clip(up, -L, L). The model's SwiGLU, the reference's and the GPU
  kernel's epilogue (min / max rather than clip, which is the same value)."""
  act = jax.nn.silu(gate)
  if limit is not None:
    act = jnp.minimum(act, limit)
    up = jnp.minimum(jnp.maximum(up, -limit), limit)
  return act * up
