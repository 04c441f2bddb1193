"""Paged attention: one op for decode (Q = 1), verify (Q = K + 1) and chunked prefill.

Layouts (einsum letters: b batch, q query row, h kv head, g query head within its kv
head, k kv position, d key head dim, v value head dim):
  q            [B, Q, Hq, D]                 Hq = KVH * G; query head h*G + g reads kv head h
  k_pages      [KVH, num_pages, page_size, D]
  v_pages      [KVH, num_pages, page_size, Dv]   Dv may differ from D (MiMo-V2-Flash:
                                             D = 192, Dv = 128)
  block_tables [B, max_pages_per_seq] int32  page ids into num_pages
  kv_lens      [B] int32                     KV length per row, counting the Q new tokens
  sinks        [Hq] float or None            per-query-head attention-sink logits
  k_scale      [KVH] f32 or None             per-kv-head dequantization scales (fp8 KV,
  v_scale      [KVH] f32 or None             below); None means 1.0
  out          [B, Q, Hq, Dv]
The page layout is fixed: each (kv head, page) is one contiguous page_size * D chunk, so
a page is a single DMA / a single run of coalesced loads, and tensor parallelism shards
the leading KVH axis without touching the rest. Pages are never padded in HBM (decode
reads every page byte on every step): a head dim the kernel cannot tile directly is
handled in the kernel's loads, see below.

Query row i of batch row b sees kv positions p < kv_lens[b] - Q + i + 1 and, with
`sliding_window` W, only p > kv_lens[b] - Q + i - W (at most W positions, itself
included). Rows that see nothing return exactly 0. Masked positions never contribute,
whatever the pages hold there (NaN included). Block-table entries past what kv_len needs
may be any in-range page id; the table itself is never read out of bounds.

Draft trees (`tree_mask`, [Q, T] or [B, Q, T] bool, T >= Q): the last T kv positions of
a row, base .. base + T - 1 (base = kv_lens[b] - T), hold the T nodes of a draft tree in
node order, ancestors before descendants, and the Q query rows are its last Q nodes (a
verify: T = Q, the whole tree; drafting one level of it: Q = that level's nodes, T = the
nodes through it). Query i is tree row T - Q + i. It sees every position p < base, and
base + j when tree_mask[b, i, j] with j <= T - Q + i (later entries are ignored): its
ancestors and itself. Its logical position is base + depth_i, depth_i = the tree rows
before its own that it sees, so with `sliding_window` W it sees only p > base + depth_i - W
before the tree; a window shorter than T is refused (every ancestor then lies inside it).
The lower triangle of ones (T = Q) is the causal mask: a chain of Q tokens as a tree gives
the causal result. The kernels get each packed row's ancestor set as bits (32 tree rows a
word) and its depth (`common.tree_rows`); without a tree_mask nothing of this is traced.

Attention sinks (gpt-oss, MiMo-V2): query head h's learned logit s_h = sinks[h] (f32,
not multiplied by sm_scale, not soft-capped) joins the softmax as one more column that
carries no value, as transformers computes it (append the column, softmax, drop it):
  out = sum_k e^(l_k - m) v_k / (sum_k e^(l_k - m) + e^(s_h - m)),  m = max(l, s_h).
A row that sees nothing still returns 0. The kernels put the sink into the online
softmax's initial state rather than fixing the output up afterwards: the running max
starts at s_h and the running sum at e^(s_h - s_h) = 1 (acc at 0), which is exactly a
zero-value column processed first, so there is no extra pass, output or rounding.
With split-K (GPU) only split 0 starts from the sink and the other splits start empty;
`combine_splits` weighs the partials by their log-sum-exps, so the sink is counted
once however many splits there are (split 0 with no blocks of its own contributes just
the sink: output 0, log-sum-exp s_h).

Key dim D that is not a power of two (Triton tiles must be): the GPU kernel splits the
key dim into a power-of-two head plus a tail, e.g. 192 = 128 + 64 or 48 = 32 + 16, and
sums one q . k^T dot per part; each part is its own [block_k, part] gather of the same
page rows, so the pages are read once and nothing is padded in HBM. A tail that is not
itself a power of two >= 16 (and Dv likewise) is padded up to one by masked loads that
read zeros without touching memory. Padding 192 to 256 instead would waste a third of
the QK matrix work and mask every load column-wise. The TPU kernel copies whole pages
and takes one dot over the full D: Mosaic lays a 192-wide minor dim out as two 128-lane
tiles in VMEM and masks the padding of the contracting dim in its matmul.

fp8 KV cache: k_pages and v_pages may both be float8_e4m3fn (1 byte a value: half the
bytes decode reads) while q stays bfloat16, float16 or float32 (the compute dtype);
otherwise all three dtypes match.
The logical key of kv head h at a slot is k_pages[h, ...].astype(f32) * k_scale[h], its
value v_pages[h, ...].astype(f32) * v_scale[h]. The scales mean the same whatever the page
dtype (bf16 pages with scales are scaled too), so a cache is one meaning, not one per dtype;
they are traced arrays, and a scale must be positive and finite. Nothing is dequantized in
HBM: a loaded block is converted to q's dtype right away (exact: every e4m3 value is a
bf16), k_scale[h] is folded into head h's logit scale (q . (s k) = s (q . k), applied
before the soft cap, as part of the key) and v_scale[h] multiplies head h's normalised
output (sum_k p_k s v_k = s sum_k p_k v_k). Split-K partials are normalised outputs that
already carry v_scale and log-sum-exps of the scaled logits; `combine_splits` is linear in
the partials, so the combine is unchanged. `kv_write.write_rows` stores the quantized
rows: clip(new / scale, -448, 448) in float8_e4m3fn.

Kernels pack the G query heads of one kv head times the Q rows into the rows of one tile
(row r = i * G + g), so a kv page is read once for all of them: verify with Q = K + 1
costs about what decode does. Backends: `paged_attention_gpu` (Pallas Triton, split-K
flash-decoding), `paged_attention_tpu` (Mosaic TPU, double-buffered page DMAs) and
`paged_attention_reference` (pure jnp, also the XLA baseline).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import invariant
from pallas_kernels.common import (FP8_DTYPE, check_positive_ints, head_scales, next_pow2,
                                   resolve_backend, tree_rows, unpack_rows)

BACKEND_ENV_VAR = "MTP_JAX_ATTENTION_BACKEND"

# GPU tiling thresholds; the measurements are in docs/DECISIONS.md, "Paged attention (GPU)".
# KV splits only while the grid is under SPLIT_BELOW_WAVES waves of programs (a wave: one
# program an SM), then enough for about SPLIT_TARGET_WAVES: from one wave on, a split's
# merge costs more than its extra programs give. Set by
# launch/bench_paged_attention.py --sweep-splits.
SPLIT_BELOW_WAVES = 1
SPLIT_TARGET_WAVES = 2
# fp8 pages switch to 2 warps / 3 stages from this many programs an SM: the 2-warp tiling
# wins only when many programs share each SM. Set by
# launch/bench_paged_attention.py --sweep-configs --kv fp8.
FP8_2WARP_PROGRAMS_PER_SM = 2.5
# Prefill chunks (at least PREFILL_MIN_QUERIES query tokens and PREFILL_ROWS_PER_BLOCK
# packed rows) take PREFILL_ROWS_PER_BLOCK-row tiles over PREFILL_KV_POSITIONS kv
# positions: prefill's large dots want tall tiles. Set by launch/bench_prefill_attention.py.
PREFILL_MIN_QUERIES = 32
PREFILL_ROWS_PER_BLOCK = 128
PREFILL_KV_POSITIONS = 64


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Tiling of one paged-attention call.

  pages_per_block: pages per compute block (block_k = pages_per_block * page_size).
  num_splits:      KV splits per row (flash-decoding; GPU only, 1 on TPU).
  rows_per_block:  packed (query row, query head) rows per tile.
  num_warps, num_stages: Triton launch parameters (GPU only).
  """

  pages_per_block: int = 8
  num_splits: int = 1
  rows_per_block: int = 16
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    check_positive_ints(self)
    for name in ("pages_per_block", "rows_per_block"):
      v = getattr(self, name)
      if v & (v - 1):
        raise ValueError(f"BlockConfig.{name} must be a power of two, got {v}.")
    if self.rows_per_block < 8:
      raise ValueError(f"BlockConfig.rows_per_block must be >= 8, got {self.rows_per_block}.")


def default_block_config(batch, q_len, num_q_heads, num_kv_heads, page_size, max_pages,
                         backend, num_cores=None, kv_dtype=None) -> BlockConfig:
  """Block sizes from the shapes.

  GPU: 128 kv positions per block, 4 warps, 2 stages, and, while the grid has fewer
  programs than the card has SMs, enough KV splits that it covers about two waves (the
  small-batch, long-context case; `SPLIT_BELOW_WAVES`, `SPLIT_TARGET_WAVES`). From one
  wave of programs on, splitting only adds the merge.
  Prefill chunks (at least `PREFILL_MIN_QUERIES` query tokens and `PREFILL_ROWS_PER_BLOCK`
  packed rows): `PREFILL_ROWS_PER_BLOCK`-row tiles over `PREFILL_KV_POSITIONS` kv
  positions, 4 warps, 3 stages, no split: the grid has programs enough, and prefill's
  large dots want tall tiles.
  fp8 pages (`kv_dtype`) in 16-row tiles with `FP8_2WARP_PROGRAMS_PER_SM` or more
  programs an SM: 64 kv positions, 2 warps, 3 stages (the 2-warp tiling wins only when
  many programs share each SM; bf16 pages gain nothing from it).
  TPU: ~512 kv positions per block (untuned: no TPU was available).
  See docs/DECISIONS.md, "Paged attention (GPU)".
  """
  rows = q_len * (num_q_heads // num_kv_heads)
  if backend == "tpu":
    return BlockConfig(
        pages_per_block=min(max(1, 512 // page_size), next_pow2(max_pages)),
        rows_per_block=min(max(next_pow2(rows), 16), 128))
  # A prefill chunk (rows = chunk x G; a verify's K + 1 rows never qualify, so a large
  # group keeps decode's KV splits) takes its own tall tiles, see the constants.
  def pages_for(positions):  # kv positions a block, within the table, block_k >= 16
    pages = min(max(1, positions // page_size), next_pow2(max_pages))
    return max(pages, next_pow2(-(-16 // page_size)))

  prefill = q_len >= PREFILL_MIN_QUERIES and rows >= PREFILL_ROWS_PER_BLOCK
  pages_per_block = pages_for(PREFILL_KV_POSITIONS if prefill else 128)
  if prefill:
    return BlockConfig(pages_per_block=pages_per_block, num_splits=1,
                       rows_per_block=PREFILL_ROWS_PER_BLOCK, num_warps=4, num_stages=3)
  rows_per_block = min(max(next_pow2(rows), 16), 64)
  programs = batch * num_kv_heads * -(-rows // rows_per_block)
  if num_cores is None:
    num_cores = getattr(jax.devices()[0], "core_count", None) or 132
  if (kv_dtype is not None and jnp.dtype(kv_dtype).itemsize == 1 and rows_per_block == 16
      and programs >= FP8_2WARP_PROGRAMS_PER_SM * num_cores):
    return BlockConfig(pages_per_block=pages_for(64), num_splits=1, rows_per_block=16,
                       num_warps=2, num_stages=3)
  num_splits = 1
  if programs < SPLIT_BELOW_WAVES * num_cores:  # less than a wave: split for about two
    blocks = -(-max_pages // pages_per_block)
    num_splits = min(-(-SPLIT_TARGET_WAVES * num_cores // programs), blocks, 64)
  return BlockConfig(pages_per_block=pages_per_block, num_splits=num_splits,
                     rows_per_block=rows_per_block,
                     num_warps=8 if rows_per_block >= 64 else 4)


def _resolve_backend(backend):
  return resolve_backend(backend, BACKEND_ENV_VAR, "paged-attention")


def _check_inputs(q, k_pages, v_pages, block_tables, kv_lens, sliding_window, soft_cap,
                  sinks=None, k_scale=None, v_scale=None, tree_mask=None):
  if q.ndim != 4:
    raise ValueError(f"q must be [B, Q, Hq, D], got shape {q.shape}.")
  batch, _, num_q_heads, head_dim = q.shape
  if k_pages.ndim != 4 or v_pages.ndim != 4 or k_pages.shape[:3] != v_pages.shape[:3]:
    raise ValueError("k_pages and v_pages must be [KVH, num_pages, page_size, D] and "
                     "[KVH, num_pages, page_size, Dv] (same KVH, num_pages and page_size); "
                     f"got {k_pages.shape} and {v_pages.shape}.")
  num_kv_heads, _, _, kv_dim = k_pages.shape
  if kv_dim != head_dim:
    raise ValueError(f"q head dim {head_dim} != key head dim {kv_dim}.")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"Hq={num_q_heads} must be a multiple of KVH={num_kv_heads}.")
  if k_pages.dtype == v_pages.dtype == FP8_DTYPE:
    if not (jnp.issubdtype(q.dtype, jnp.floating) and q.dtype.itemsize >= 2):
      raise ValueError(f"float8_e4m3fn pages need a bfloat16 / float16 / float32 q (the "
                       f"compute dtype), got {q.dtype}.")
  elif not (q.dtype == k_pages.dtype == v_pages.dtype):
    raise ValueError(f"q, k_pages, v_pages dtypes differ: {q.dtype}, {k_pages.dtype}, "
                     f"{v_pages.dtype} (they must match, or both pages be float8_e4m3fn).")
  if block_tables.ndim != 2 or block_tables.shape[0] != batch:
    raise ValueError(f"block_tables must be [B={batch}, max_pages], got {block_tables.shape}.")
  if kv_lens.shape != (batch,):
    raise ValueError(f"kv_lens must be [B={batch}], got {kv_lens.shape}.")
  if block_tables.dtype != jnp.int32 or kv_lens.dtype != jnp.int32:
    raise ValueError("block_tables and kv_lens must be int32, got "
                     f"{block_tables.dtype} and {kv_lens.dtype}.")
  if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
    raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}.")
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"soft_cap must be positive or None, got {soft_cap!r}.")
  if sinks is not None:
    if getattr(sinks, "shape", None) != (num_q_heads,):
      raise ValueError(f"sinks must be [Hq={num_q_heads}] (one logit per query head) or "
                       f"None, got shape {getattr(sinks, 'shape', type(sinks).__name__)}.")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
      raise ValueError(f"sinks must be a float array, got {sinks.dtype}.")
  for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
    if scale is None:
      continue
    if getattr(scale, "shape", None) != (num_kv_heads,):
      raise ValueError(f"{name} must be [KVH={num_kv_heads}] (one scale per kv head) or "
                       f"None, got shape {getattr(scale, 'shape', type(scale).__name__)}.")
    if not jnp.issubdtype(scale.dtype, jnp.floating):
      raise ValueError(f"{name} must be a float array, got {scale.dtype}.")
  if tree_mask is not None:
    q_len = q.shape[1]
    shape = getattr(tree_mask, "shape", None)
    if (shape is None or len(shape) not in (2, 3) or shape[-2] != q_len
        or shape[-1] < q_len or (len(shape) == 3 and shape[0] != batch)):
      raise ValueError(f"tree_mask must be [Q={q_len}, T] or [B={batch}, Q, T] with T >= Q "
                       f"(query row i sees tree row j), got shape {shape}.")
    if tree_mask.dtype != jnp.bool_:
      raise ValueError(f"tree_mask must be bool, got {tree_mask.dtype}.")
    if sliding_window is not None and sliding_window < shape[-1]:
      raise ValueError(f"a tree_mask under a sliding window needs the window ({sliding_window})"
                       f" to span the tree's T={shape[-1]} rows, so that every ancestor lies "
                       "in it.")


@functools.partial(jax.jit, static_argnames=("sliding_window", "soft_cap", "sm_scale",
                                             "block_config"))
def paged_attention_reference(q, k_pages, v_pages, block_tables, kv_lens, *,
                              sliding_window=None, soft_cap=None, sm_scale=None, sinks=None,
                              k_scale=None, v_scale=None, tree_mask=None, block_config=None):
  """Pure-jnp paged attention: gather every table page, dense masked softmax.

  Same signature and result as `paged_attention` (block_config is accepted and ignored).
  Scales are applied as the kernels apply them: k_scale to the logits, v_scale to the
  normalised output, with the pages converted to q's dtype (exact for fp8).
  """
  del block_config
  _check_inputs(q, k_pages, v_pages, block_tables, kv_lens, sliding_window, soft_cap, sinks,
                k_scale, v_scale, tree_mask)
  batch, q_len, num_q_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  v_dim = v_pages.shape[3]
  group = num_q_heads // num_kv_heads
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

  # [KVH, B, max_pages, page_size, D] -> [KVH, B, K, D] with K = max_pages * page_size.
  k = k_pages[:, block_tables].reshape(num_kv_heads, batch, -1, head_dim).astype(q.dtype)
  v = v_pages[:, block_tables].reshape(num_kv_heads, batch, -1, v_dim).astype(q.dtype)
  qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
  if k_scale is not None:  # per kv head, folded into the logit scale
    sm_scale = sm_scale * k_scale.astype(jnp.float32).reshape(1, num_kv_heads, 1, 1, 1)
  logits = invariant.einsum("bqhgd,hbkd->bhgqk", qg, k, rows="q", precision=precision,
                      preferred_element_type=jnp.float32) * sm_scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)

  pos = jnp.arange(k.shape[2])                                    # [K]
  if tree_mask is None:
    q_pos = kv_lens[:, None] - q_len + jnp.arange(q_len)          # [B, Q]
    mask = pos[None, None, :] <= q_pos[:, :, None]                # [B, Q, K]
    if sliding_window is not None:
      mask &= pos[None, None, :] > q_pos[:, :, None] - sliding_window
  else:
    mask = _tree_mask(tree_mask, pos, kv_lens, q_len, sliding_window)
  # Positions no row sees may hold anything (NaN included); 0 * NaN would leak
  # through the einsum, so zero V there rather than relying on p == 0.
  v = jnp.where(mask.any(axis=1)[None, :, :, None], v, 0)
  mask = mask[:, None, None]                                      # [B, 1, 1, Q, K]

  logits = jnp.where(mask, logits, -jnp.inf)
  m = logits.max(axis=-1, keepdims=True)
  if sinks is not None:
    # The sink column: a logit s_h with no value, in the max and the denominator.
    sink = sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1, 1)
    m = jnp.maximum(m, sink)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(logits - m), 0.0)
  l = p.sum(axis=-1)                                              # [B, H, G, Q]
  if sinks is not None:
    l += jnp.exp(sink - m)[..., 0]
  o = invariant.einsum("bhgqk,hbkd->bhgqd", p, v.astype(jnp.float32), rows="q",
                       precision=precision)
  # Without sinks, l == 0 exactly when the row sees nothing (else the max term
  # contributes 1); a NaN key or value in a visible position must come out as NaN, not
  # be swallowed as 0. With sinks, such a row has o == 0 and l > 0: also 0.
  seen = l != 0.0
  o = jnp.where(seen[..., None], o / jnp.where(seen, l, 1.0)[..., None], 0.0)
  if v_scale is not None:
    o = o * v_scale.astype(jnp.float32).reshape(1, num_kv_heads, 1, 1, 1)
  return o.transpose(0, 3, 1, 2, 4).reshape(
      batch, q_len, num_q_heads, v_dim).astype(q.dtype)


def _tree_mask(tree_mask, pos, kv_lens, q_len, window):
  """[B, Q, K] visibility of kv positions `pos` [K] under a tree (module docstring): every
  position before the tree's first row, within a window the `window` positions up to the
  query's own logical one (the tree's first position + its depth), and the tree rows up
  to its own that `tree_mask` names."""
  batch, tree_len = kv_lens.shape[0], tree_mask.shape[-1]
  seen = jnp.broadcast_to(tree_mask, (batch, q_len, tree_len))
  own = tree_len - q_len + jnp.arange(q_len)[:, None]            # [Q, 1]: its tree row
  seen &= jnp.arange(tree_len)[None, :] <= own
  rel = pos[None, None, :] - (kv_lens - tree_len)[:, None, None]  # [B, 1, K]: tree row
  in_tree = jnp.take_along_axis(seen, jnp.broadcast_to(jnp.clip(rel, 0, tree_len - 1),
                                                       (batch, q_len, pos.shape[0])), axis=2)
  before = rel < 0
  mask = before | (in_tree & (rel < tree_len))
  if window is not None:
    depth = jnp.sum(seen & (jnp.arange(tree_len)[None, :] < own), axis=-1)  # its ancestors
    mask &= ~before | (rel > depth[:, :, None] - window)
  return mask


def paged_attention(q, k_pages, v_pages, block_tables, kv_lens, *, sliding_window=None,
                    soft_cap=None, sm_scale=None, sinks=None, k_scale=None, v_scale=None,
                    tree_mask=None, backend=None, interpret=False, block_config=None):
  """Paged GQA attention over the pages named by `block_tables` (module docstring).

  sm_scale: default 1 / sqrt(D) (the key head dim). sinks: None or [Hq] per-query-head
  sink logits (a traced array, computed in f32; module docstring).
  k_scale, v_scale: None (1.0) or [KVH] float traced arrays, kv head h's dequantization
  scales: its logical keys are k_pages[h] * k_scale[h], likewise values; for fp8
  (float8_e4m3fn) pages, and applied to pages of any dtype (module docstring).
  tree_mask: None (causal), or [Q, T] / [B, Q, T] bool (T >= Q): the last T positions are
  a draft tree's rows, the queries its last Q; query row i sees the positions before the
  tree and the tree rows j <= T - Q + i it names (module docstring).
  backend: None -> $MTP_JAX_ATTENTION_BACKEND or jax.default_backend() ('cpu' runs the
  reference); or 'gpu', 'tpu', 'reference'. Resolved here, outside jit, so the env var
  is read on every call. interpret=True runs the chosen Pallas kernel in interpret mode
  (on CPU). block_config: a BlockConfig, default from the shapes.
  Returns [B, Q, Hq, Dv] in q.dtype (accumulated in f32). Shapes a kernel cannot tile
  raise ValueError naming the dimension and the reason.
  """
  backend = _resolve_backend(backend)
  kwargs = dict(sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=sm_scale,
                sinks=sinks, k_scale=k_scale, v_scale=v_scale, tree_mask=tree_mask)
  if backend == "reference":
    return paged_attention_reference(q, k_pages, v_pages, block_tables, kv_lens, **kwargs)
  if block_config is not None and not isinstance(block_config, BlockConfig):
    raise TypeError(f"block_config must be a BlockConfig, got {type(block_config).__name__}.")
  return _paged_attention_kernel(q, k_pages, v_pages, block_tables, kv_lens, **kwargs,
                                 backend=backend, interpret=interpret,
                                 block_config=block_config)


@functools.partial(jax.jit, static_argnames=("sliding_window", "soft_cap", "sm_scale",
                                             "backend", "interpret", "block_config"))
def _paged_attention_kernel(q, k_pages, v_pages, block_tables, kv_lens, *, sliding_window,
                            soft_cap, sm_scale, sinks, k_scale, v_scale, tree_mask, backend,
                            interpret, block_config):
  """The packed rows' sinks (and tree rows) and the backend's kernel: the GPU kernel
  gathers its packed query rows from q and stores them back unpacked; the TPU kernel
  takes them packed."""
  _check_inputs(q, k_pages, v_pages, block_tables, kv_lens, sliding_window, soft_cap, sinks,
                k_scale, v_scale, tree_mask)
  batch, q_len, num_q_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  v_dim = v_pages.shape[3]
  group = num_q_heads // num_kv_heads
  cfg = block_config or default_block_config(
      batch, q_len, num_q_heads, num_kv_heads, page_size, block_tables.shape[1], backend,
      num_cores=132 if interpret else None, kv_dtype=k_pages.dtype)

  # Packed rows: kv head h's query rows r = i*G + g (query i, head h*G + g), padded to the
  # tile. The GPU kernel gathers them from q itself; the TPU kernel takes them packed.
  rows = q_len * group
  padded = -(-rows // cfg.rows_per_block) * cfg.rows_per_block
  sink_rows = None
  if sinks is not None:
    # Packed row r = i*G + g of kv head h takes query head h*G + g's sink: [KVH, R].
    sink_rows = jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group),
                         (1, q_len, 1)).reshape(num_kv_heads, rows)
    sink_rows = jnp.pad(sink_rows, ((0, 0), (0, padded - rows)))
  tree, tree_len = None, 0
  if tree_mask is not None:  # per packed row: its ancestor bit words and depth
    tree_len = tree_mask.shape[-1]
    tree = tree_rows(jnp.broadcast_to(tree_mask, (batch, q_len, tree_len)), group, padded)
  # Always passed (ones when None): multiplying by 1.0 changes no bit, and one kernel
  # signature serves quantized and plain pages.
  scales = head_scales(k_scale, v_scale, num_kv_heads=num_kv_heads)
  common = dict(q_len=q_len, group=group, soft_cap=soft_cap, window=sliding_window,
                sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale,
                pages_per_block=cfg.pages_per_block, rows_per_block=cfg.rows_per_block,
                interpret=interpret, tree_len=tree_len)
  if backend == "gpu":
    from pallas_kernels.paged_attention_gpu import paged_attention_gpu
    out = paged_attention_gpu(q, k_pages, v_pages, block_tables, kv_lens, scales, sink_rows,
                              tree, **common, num_splits=cfg.num_splits,
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out if out.shape[-1] == v_dim else out[..., :v_dim]
  if cfg.num_splits != 1:
    raise ValueError("The TPU kernel runs one KV split; set BlockConfig.num_splits=1.")
  from pallas_kernels.paged_attention_tpu import paged_attention_tpu
  qp = q.reshape(batch, q_len, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
  qp = qp.reshape(batch, num_kv_heads, rows, head_dim)
  qp = jnp.pad(qp, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
  out = paged_attention_tpu(qp, k_pages, v_pages, block_tables, kv_lens, scales, sink_rows,
                            tree, **common)
  return unpack_rows(out[..., :v_dim], q_len, group)
