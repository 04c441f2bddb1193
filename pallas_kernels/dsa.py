"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2, GLM-5): the lightning indexer's scores
over a paged index-key cache, their top-k selection, and sparse paged MLA over the
selected tokens.

Layouts (b batch, t query row, h indexer head, d index dim, s kv position):
  q            [B, T, Hi, di]          index queries, RoPE applied (bfloat16 or float32)
  w            [B, T, Hi] f32          per-head weights, every positive scale folded in:
                                       weights_proj(x) * Hi**-0.5 * di**-0.5
  k_pages      [num_pages, page_size, di]  one index key per token: q's dtype, or
                                       float8_e4m3fn with k_scale
  k_scale      [num_pages, page_size] f32 or None   per-token dequantization scale: the
                                       key is k_pages[p, s] * k_scale[p, s] (positive)
  block_table  [B, W] int32            page ids; position s of row b is in page
                                       block_table[b, s // page_size], slot s % page_size
  kv_lens      [B] int32               KV length per row, counting the T new tokens

  score[b, t, s] = sum_h w[b, t, h] * relu(q[b, t, h, :] . k[s, :])     (f32)

Query row t of request b sits at position kv_lens[b] - T + t and sees the positions 0 ..
that position (causal: each of a verify's T rows selects its own tokens), capped at the
table's capacity W * page_size; the other scores are -inf. A per-token scale factors out
of the sum (relu(c x) = c relu(x) for c > 0), so kernels apply it to the summed score.

`indexer_topk` returns [B, T, topk] int32 positions: the topk highest visible scores,
ties broken towards the lower position, listed in ascending position order with -1
padding at the end where fewer than topk positions are visible (all visible positions
are then selected). Scores are ordered as IEEE total order ranks them, with one
exception: a zero score is always +0.0 (a sum of negative weights times relu's zeros may
come out -0.0 by summation order; every backend stores it as +0.0), so zero scores tie
and break by position on every backend. NaN scores (a NaN in a visible key) rank above
+inf.

`sparse_mla` takes q, kv_pages and kv_scale exactly as `pallas_kernels.paged_mla` does
(absorbed latent query + rope part; pages [num_pages, page_size, v_dim + rope], fp8 with
[2] scales) and indices [B, T, topk] int32 from `indexer_topk`: query row t attends only
over the positions indices[b, t] (-1 entries ignored; duplicates would count twice;
entries must be -1 or < W * page_size), softmax over them with sm_scale. A row that
selects nothing returns 0. With the indices of all visible positions it equals
`paged_mla` (the causal rule lives in the indices: sparse_mla itself has no kv_lens).
Returns [B, T, H, v_dim] in q.dtype.

Backends: "gpu" (Pallas Triton), "tpu" (Mosaic TPU), "reference" (pure jnp); None reads
$MTP_JAX_DSA_BACKEND, else jax.default_backend() (cpu: reference). interpret=True runs
the chosen backend's Pallas kernels in interpret mode. Both kernel backends run Pallas
kernels for the scores (`index_scores`) and for sparse MLA; the top-k between them is
XLA plus, on GPU, a Pallas compaction kernel: an exact radix threshold select
(`radix_topk`); on TPU lax.top_k. See the
backends' docstrings (dsa_gpu.py, dsa_tpu.py) for the kernels.

Cost and choices. Decode reads each visible index key once (256 bytes a token in bf16,
132 in fp8 with its scale) and writes 4 * T bytes of f32 scores a token; the scores are
materialised at the table's full width W * page_size (-inf past each row's context), so
the top-k costs as much for a short request as for a full table. The top-k is over up
to 128k scores a row with topk = 2048. lax.top_k lowers to a sort of the row on GPU
(XLA has no partial top-k for large k): several passes over the scores and their
indices. `radix_topk` instead finds the k-th largest score with 8 counting passes (4-bit
digits, 15 compares an element) and compacts: on GPU (method 'radix') the passes are
Pallas launches (`dsa_gpu.radix_threshold_gpu`), then one XLA reduction and the Pallas
kernel `dsa_gpu.compact_topk_gpu`, about 10 reads of 4 * T bytes a token in all against the
indexer's 256, i.e. about 16 % of the score kernel's bytes at T = 1 and 31 % at T = 2
when every pass goes to device memory (less where the scores stay in L2: 33 MB at
B = 32, T = 2, 128k); 'radix_xla' does the same with XLA ops only (fused reductions
for the counts, a bf16 matmul for the prefix counts and a scatter; more temporaries).
Each pass is a launch that waits for the one before (about 12 on the 'radix' path,
several XLA kernels a round more on 'radix_xla'), so small batches (B = 1: a 512 KB
row) pay about a dozen kernel latencies whatever the bytes: there the top-k cannot stay
under a quarter of a score kernel of a few microseconds; the target holds, if anywhere,
at large batch times context. 'radix' is the GPU default on that
estimate; launch/bench_dsa.py times all three on the same scores and reports each as a
share of the score kernel's time, which is what should settle it. TPU keeps lax.top_k
(XLA's TPU sort-based top-k; the GPU compaction kernel does not run there; untimed).
Prefill (large T) scores 4 query rows a program on GPU, 8 on TPU, so the keys are
re-read T / 4 times there, still below the tile's matrix work; the [B, T, W * page_size]
scores are the memory bound of a long chunk. A fused score-and-select kernel, which
would not write the scores, is not built.

Verification: the references against plain numpy loops, the kernels in interpret mode
against the references (tests/test_dsa_kernels.py), and every kernel lowered for cuda
(Pallas to Triton IR) and tpu (Pallas to Mosaic) at DeepSeek-V3.2 shapes. Neither
kernel set has been compiled by Triton or Mosaic nor run on a GPU or TPU here.
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
from pallas_kernels.paged_mla import check_latent_inputs, scale_queries

BACKEND_ENV_VAR = "MTP_JAX_DSA_BACKEND"
TOPK_METHODS = ("radix", "radix_xla", "lax")


def _resolve_backend(backend):
  return resolve_backend(backend, BACKEND_ENV_VAR, "DSA")


def _is_int(x):
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


# --------------------------------------------------------------------------- checks
def _check_indexer_inputs(q, w, k_pages, block_table, kv_lens, k_scale):
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, Hi, di], got shape {q.shape}.")
  batch, q_len, heads, dim = q.shape
  if q.dtype not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"q must be bfloat16 or float32, got {q.dtype}.")
  if w.shape != (batch, q_len, heads):
    raise ValueError(f"w must be [B={batch}, T={q_len}, Hi={heads}], got {w.shape}.")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"w must be a float array (f32), got {w.dtype}.")
  if k_pages.ndim != 3 or k_pages.shape[2] != dim:
    raise ValueError(f"k_pages must be [num_pages, page_size, di={dim}], got "
                     f"{k_pages.shape}.")
  if k_pages.dtype not in (jnp.bfloat16, jnp.float32, FP8_DTYPE):
    raise ValueError(f"k_pages must be bfloat16, float32 or float8_e4m3fn, got "
                     f"{k_pages.dtype}.")
  if k_pages.dtype != FP8_DTYPE and k_pages.dtype != q.dtype:
    raise ValueError(f"q and k_pages dtypes differ: {q.dtype} and {k_pages.dtype} (they "
                     "must match, or the keys be float8_e4m3fn).")
  if k_pages.dtype == FP8_DTYPE and k_scale is None:
    raise ValueError("float8_e4m3fn k_pages need k_scale [num_pages, page_size].")
  if k_scale is not None:
    if getattr(k_scale, "shape", None) != k_pages.shape[:2]:
      raise ValueError(f"k_scale must be [num_pages, page_size] = {k_pages.shape[:2]}, "
                       f"got {getattr(k_scale, 'shape', type(k_scale).__name__)}.")
    if not jnp.issubdtype(k_scale.dtype, jnp.floating):
      raise ValueError(f"k_scale must be a float array (f32), got {k_scale.dtype}.")
  if block_table.ndim != 2 or block_table.shape[0] != batch:
    raise ValueError(f"block_table must be [B={batch}, W], got {block_table.shape}.")
  if kv_lens.shape != (batch,):
    raise ValueError(f"kv_lens must be [B={batch}], got {kv_lens.shape}.")
  if block_table.dtype != jnp.int32 or kv_lens.dtype != jnp.int32:
    raise ValueError("block_table and kv_lens must be int32, got "
                     f"{block_table.dtype} and {kv_lens.dtype}.")


def _check_topk(topk):
  if not _is_int(topk) or topk < 1:
    raise ValueError(f"topk must be a positive int, got {topk!r}.")


def _check_sparse_inputs(q, kv_pages, block_table, indices, v_dim, sm_scale, kv_scale):
  check_latent_inputs(q, kv_pages, block_table, v_dim, sm_scale, kv_scale)
  batch, q_len = q.shape[:2]
  if indices.ndim != 3 or indices.shape[:2] != (batch, q_len) or indices.shape[2] < 1:
    raise ValueError(f"indices must be [B={batch}, T={q_len}, topk >= 1], got "
                     f"{indices.shape}.")
  if indices.dtype != jnp.int32:
    raise ValueError(f"indices must be int32, got {indices.dtype}.")


# ----------------------------------------------------------------------- references
def visible_positions(kv_lens, q_len, capacity):
  """[B, T, capacity] bool: the positions each query row sees (module docstring)."""
  last = kv_lens[:, None] - q_len + jnp.arange(q_len)                # [B, T]
  return jnp.arange(capacity)[None, None, :] <= last[:, :, None]


@jax.jit
def index_scores_reference(q, w, k_pages, block_table, kv_lens, *, k_scale=None):
  """Pure-jnp indexer scores [B, T, W * page_size] f32 (-inf where not visible)."""
  _check_indexer_inputs(q, w, k_pages, block_table, kv_lens, k_scale)
  batch, q_len, _, dim = q.shape
  keys = k_pages[block_table].astype(jnp.float32)                    # [B, W, P, di]
  if k_scale is not None:
    keys = keys * k_scale[block_table].astype(jnp.float32)[..., None]
  keys = keys.reshape(batch, -1, dim)                                # [B, S, di]
  visible = visible_positions(kv_lens, q_len, keys.shape[1])         # [B, T, S]
  # Keys no row sees may hold anything (NaN included): zero them before the dot.
  keys = jnp.where(visible.any(axis=1)[..., None], keys, 0.0)
  dots = invariant.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys, rows="th",
                          precision=lax.Precision.HIGHEST)
  scores = invariant.einsum("bths,bth->bts", jnp.maximum(dots, 0.0), w.astype(jnp.float32),
                            rows="t", precision=lax.Precision.HIGHEST)
  scores = jnp.where(scores == 0.0, 0.0, scores)   # -0.0 -> +0.0 (module docstring)
  return jnp.where(visible, scores, -jnp.inf)


def _lax_topk(scores, topk):
  """Exact top-k of [..., S] scores by lax.top_k (ties: lower position first), as
  ascending positions with -1 padding (-inf scores are not selected)."""
  size = scores.shape[-1]
  if size < topk:
    pad = [(0, 0)] * (scores.ndim - 1) + [(0, topk - size)]
    scores = jnp.pad(scores, pad, constant_values=-jnp.inf)
  values, idx = lax.top_k(scores, topk)
  idx = jnp.where(values == -jnp.inf, -1, idx).astype(jnp.int32)
  # Ascending positions, the -1 padding last.
  big = jnp.iinfo(jnp.int32).max
  idx = jnp.sort(jnp.where(idx < 0, big, idx), axis=-1)
  return jnp.where(idx == big, -1, idx)


@functools.partial(jax.jit, static_argnames=("topk",))
def indexer_topk_reference(q, w, k_pages, block_table, kv_lens, *, topk, k_scale=None):
  """Pure-jnp indexer top-k: [B, T, topk] int32 positions (module docstring)."""
  _check_topk(topk)
  scores = index_scores_reference(q, w, k_pages, block_table, kv_lens, k_scale=k_scale)
  return _lax_topk(scores, topk)


def gather_rows(kv_pages, block_table, indices):
  """[B, T, K, Dk]: the page rows of the positions `indices` (-1 reads position 0)."""
  page_size = kv_pages.shape[1]
  pos = jnp.maximum(indices, 0)
  batch = jnp.arange(block_table.shape[0])[:, None, None]
  page = block_table[batch, jnp.minimum(pos // page_size, block_table.shape[1] - 1)]
  return kv_pages[page, pos % page_size]


@functools.partial(jax.jit, static_argnames=("v_dim", "sm_scale"))
def sparse_mla_reference(q, kv_pages, block_table, indices, *, v_dim, sm_scale,
                         kv_scale=None):
  """Pure-jnp sparse MLA: gather the selected rows, masked softmax over them.

  Scales are applied as `paged_mla_reference` applies them: folded into q and the
  output, the pages converted to q's dtype (exact for fp8).
  """
  _check_sparse_inputs(q, kv_pages, block_table, indices, v_dim, sm_scale, kv_scale)
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  if kv_scale is not None:
    q = scale_queries(q, kv_scale, v_dim)
  live = indices >= 0                                                # [B, T, K]
  rows = gather_rows(kv_pages, block_table, indices).astype(q.dtype)  # [B, T, K, Dk]
  rows = jnp.where(live[..., None], rows, 0)
  logits = invariant.einsum("bthd,btkd->bthk", q, rows, rows="t", precision=precision,
                            preferred_element_type=jnp.float32) * sm_scale
  mask = live[:, :, None, :]
  logits = jnp.where(mask, logits, -jnp.inf)
  m = logits.max(axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  l = p.sum(axis=-1)
  o = invariant.einsum("bthk,btkv->bthv", p, rows[..., :v_dim].astype(jnp.float32),
                       rows="t", precision=precision)
  seen = l != 0.0
  o = jnp.where(seen[..., None], o / jnp.where(seen, l, 1.0)[..., None], 0.0)
  if kv_scale is not None:
    o = o * kv_scale[0].astype(jnp.float32)
  return o.astype(q.dtype)


# -------------------------------------------------------------------------------- top-k
def _ordered_keys(scores):
  """uint32 keys in the order of the f32 scores (-inf lowest; NaN above +inf)."""
  bits = lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.uint32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _exclusive_counts(masks, chunk=128):
  """[X, R, N] bool -> [X, R, N] int32: how many of masks[x, r, :n] are set (exclusive
  prefix counts), as one tensor-core matmul within chunks of `chunk` (0/1 inputs and
  sums <= 128 are exact in bf16 with f32 accumulation) plus a cumsum over the
  [X, R, N / chunk] chunk totals: no log-depth scan over the whole row."""
  num, rows, size = masks.shape
  padded = -(-size // chunk) * chunk
  m = jnp.pad(masks, ((0, 0), (0, 0), (0, padded - size)))
  m = m.reshape(num, rows, padded // chunk, chunk).astype(jnp.bfloat16)
  strict_upper = (jnp.arange(chunk)[:, None] < jnp.arange(chunk)[None, :]).astype(
      jnp.bfloat16)
  within = jnp.einsum("xrgc,cd->xrgd", m, strict_upper, preferred_element_type=jnp.float32)
  totals = m.astype(jnp.int32).sum(axis=-1)                          # [X, R, G]
  offsets = jnp.cumsum(totals, axis=-1) - totals                     # exclusive
  out = within.astype(jnp.int32) + offsets[..., None]
  return out.reshape(num, rows, padded)[..., :size]


COMPACT_CHUNK = 1024  # scores a program of the GPU compaction kernel
COUNT_CHUNK = 512     # scores a step of a GPU radix round (a [512, 16] compare)


def radix_threshold(count, rows, topk, digit_bits=4):
  """[R] uint32: the topk-th largest ordered key of each row, digit by digit: 32 /
  digit_bits rounds, each counting per row how many keys are >= each of the
  2**digit_bits - 1 candidates for the next digit (`count(cand [R, D]) -> [R, D]`); the
  largest candidate whose count still reaches topk fixes the digit."""
  digits = jnp.arange(1, 1 << digit_bits, dtype=jnp.uint32)          # [D]
  prefix = jnp.zeros((rows,), jnp.uint32)
  for shift in range(32 - digit_bits, -1, -digit_bits):
    cand = prefix[:, None] | (digits[None, :] << shift)              # [R, D]
    best = jnp.sum(count(cand) >= topk, axis=-1, dtype=jnp.uint32)   # counts fall with d
    prefix = prefix | (best << shift)
  return prefix


def _count_segment(rows, size):
  """Scores a program of the GPU counting kernel: enough programs for two a core (132
  SMs) where the rows allow, 512 .. 16384 scores each."""
  per = -(-rows * size // (2 * GPU_CORES))
  return max(COUNT_CHUNK, min(16384, next_pow2(per), next_pow2(size)))


def radix_topk(scores, topk, digit_bits=4, compact="xla", interpret=False):
  """Exact top-k of scores [..., S] f32 without a sort: ascending positions of the topk
  highest (ties towards the lower position), -1 padding last where fewer than topk
  scores are finite; the same result as `_lax_topk`.

  `radix_threshold` finds the k-th largest score: 8 counting rounds at 4-bit digits,
  each one read of the scores with 15 compares an element. Then the scores above it plus
  the first (topk - count above) equal to it are compacted to their positions.
  compact='xla': the rounds are fused XLA reductions, the compaction one pass of two
  prefix counts (`_exclusive_counts`, a bf16 matmul within 128-score chunks) and a
  scatter: portable, but with [R, S] temporaries and a few XLA kernels a round.
  compact='gpu': the rounds are `dsa_gpu.radix_threshold_gpu`, one Pallas launch a
  round (coalesced streaming, the compares in registers, each round fixing the previous
  digit itself), then per-chunk counts above / equal to the threshold (one fused XLA
  reduction) and the Pallas kernel `dsa_gpu.compact_topk_gpu`, which reads each score
  once more and scatters only the topk chosen positions: about 10 reads of the scores
  and about 12 launches in all. Either way no sort of the row.
  """
  lead = scores.shape[:-1]
  size = scores.shape[-1]
  scores = scores.reshape(-1, size).astype(jnp.float32)
  if size < topk:
    scores = jnp.pad(scores, ((0, 0), (0, topk - size)), constant_values=-jnp.inf)
    size = topk
  rows = scores.shape[0]
  if compact == "gpu":
    from pallas_kernels.dsa_gpu import compact_topk_gpu, radix_threshold_gpu
    if digit_bits != 4:
      raise ValueError("the GPU radix rounds take 4-bit digits.")
    segment = _count_segment(rows, size)
    # A multiple of both (powers of two: the larger one).
    padded = -(-size // max(segment, COMPACT_CHUNK)) * max(segment, COMPACT_CHUNK)
    if padded != size:
      scores = jnp.pad(scores, ((0, 0), (0, padded - size)), constant_values=-jnp.inf)
    size = padded
    threshold = radix_threshold_gpu(scores, topk=topk, segment=segment, chunk=COUNT_CHUNK,
                                    interpret=interpret)
    keys = lax.bitcast_convert_type(scores, jnp.int32)
    keys = jnp.where(keys < 0, keys ^ 0x7FFFFFFF, keys)
    above = keys > threshold[:, None]
    equal = (keys == threshold[:, None]) & (scores != -jnp.inf)
    chunks = size // COMPACT_CHUNK
    per_a = above.reshape(rows, chunks, COMPACT_CHUNK).sum(-1, dtype=jnp.int32)
    per_e = equal.reshape(rows, chunks, COMPACT_CHUNK).sum(-1, dtype=jnp.int32)
    out = compact_topk_gpu(scores, threshold, per_a, per_e, topk=topk, chunk=COMPACT_CHUNK,
                           interpret=interpret)
    return out.reshape(*lead, topk)
  if compact != "xla":
    raise ValueError(f"unknown compaction {compact!r}; expected 'xla' or 'gpu'.")
  keys = _ordered_keys(scores)                                       # [R, S]

  def count(cand):
    return jnp.sum(keys[:, :, None] >= cand[:, None, :], axis=1, dtype=jnp.int32)
  threshold = radix_threshold(count, rows, topk, digit_bits)[:, None]
  above = keys > threshold
  # -inf is never picked (where the threshold is -inf, fewer than topk are finite: the
  # slots left stay -1, after the others).
  equal = (keys == threshold) & (scores != -jnp.inf)
  need = topk - above.sum(axis=-1, dtype=jnp.int32)[:, None]         # >= 1
  before_above, before_equal = _exclusive_counts(jnp.stack([above, equal]))
  chosen = above | (equal & (before_equal < need))
  slot = jnp.where(chosen, before_above + jnp.minimum(before_equal, need), topk)
  pos = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (rows, size))
  row = jnp.broadcast_to(jnp.arange(rows)[:, None], (rows, size))
  out = jnp.full((rows, topk), -1, jnp.int32).at[row, slot].set(pos, mode="drop")
  return out.reshape(*lead, topk)


def select_topk(scores, topk, method, interpret=False):
  """Top-k positions of scores [..., S] (module docstring's order) by `method`: 'radix'
  (`radix_topk` with the GPU compaction kernel; interpret=True runs it in interpret
  mode), 'radix_xla' (`radix_topk` in XLA only) or 'lax' (lax.top_k, then a sort of the
  topk positions)."""
  if method == "radix":
    return radix_topk(scores, topk, compact="gpu", interpret=interpret)
  if method == "radix_xla":
    return radix_topk(scores, topk, compact="xla")
  if method == "lax":
    return _lax_topk(scores, topk)
  raise ValueError(f"unknown top-k method {method!r}; expected one of {TOPK_METHODS}.")


# ------------------------------------------------------------------------ block configs
# Launch sizing (GPU): programs per SM the score kernel aims at, and the sparse MLA's
# split-K rule (as paged MLA's: splits only below half a wave, then about two waves).
SCORE_TARGET_WAVES = 4
SPLIT_BELOW_WAVES = 0.5
SPLIT_TARGET_WAVES = 2
SHARED_MEMORY_BYTES = 224 << 10
GPU_CORES = 132  # H100 SXM; the default when the device does not say


@dataclasses.dataclass(frozen=True)
class IndexerBlockConfig:
  """Tiling of the indexer's score kernel.

  block_k:     kv positions a block (GPU: a power of two >= 16; TPU: a multiple of
               page_size and of 128).
  query_rows:  query rows a program scores together (they share every key block).
  num_splits:  programs a (batch row, row tile) is split into (GPU; 1 on TPU).
  num_warps, num_stages: Triton launch parameters (GPU only).
  """

  block_k: int = 128
  query_rows: int = 1
  num_splits: int = 1
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    check_positive_ints(self)


@dataclasses.dataclass(frozen=True)
class SparseBlockConfig:
  """Tiling of the sparse MLA kernel.

  block_k:        selected positions a block (GPU: power of two >= 16; TPU: multiple of
                  128).
  rows_per_block: heads a program (GPU: power of two >= 16; TPU: multiple of 8 / 16).
  num_splits:     programs the indices of a (query row, head tile) are split into (GPU).
  num_warps, num_stages: Triton launch parameters (GPU only).
  """

  block_k: int = 64
  rows_per_block: int = 64
  num_splits: int = 1
  num_warps: int = 8
  num_stages: int = 2

  def __post_init__(self):
    check_positive_ints(self)


def _cores(interpret):
  if interpret:
    return GPU_CORES
  return getattr(jax.devices()[0], "core_count", None) or GPU_CORES


def padded_heads(heads):
  """GPU: the indexer heads padded to a power of two >= 16 (tensor-core dot rows)."""
  return max(16, next_pow2(heads))


def default_indexer_config(batch, q_len, heads, dim, page_size, max_pages, backend,
                           num_cores=GPU_CORES) -> IndexerBlockConfig:
  """GPU: 128-position blocks (32 KiB of bf16 keys at di = 128) on 4 warps, up to 4
  query rows a program (verify's rows share every key block), and KV splits for about
  SCORE_TARGET_WAVES programs an SM, so that enough loads are in flight to stream the
  keys at full bandwidth (not tuned on hardware: launch/bench_dsa.py times it).
  TPU: blocks of whole pages, 512 positions or the next multiple of 128 above a page;
  all T query rows in one tile up to T = 8, else tiles of 8."""
  capacity = max_pages * page_size
  query_rows = min(q_len, 4)
  if backend == "tpu":
    query_rows = q_len if q_len <= 8 else 8  # a row tile is the whole T or 8 sublanes
    unit = math.lcm(page_size, 128)
    block_k = max(unit, (512 // unit) * unit)
    return IndexerBlockConfig(block_k=block_k, query_rows=query_rows)
  block_k = max(16, min(128, next_pow2(capacity)))
  tiles = -(-q_len // query_rows)
  blocks = -(-capacity // block_k)
  splits = max(1, min(-(-SCORE_TARGET_WAVES * num_cores // (batch * tiles)), blocks))
  return IndexerBlockConfig(block_k=block_k, query_rows=query_rows, num_splits=splits,
                            num_warps=4)


def default_sparse_config(batch, q_len, heads, head_dim, topk, dtype, backend,
                          num_cores=GPU_CORES) -> SparseBlockConfig:
  """GPU: as paged MLA's (64-head tiles on 8 warps, 64 positions a block, shrunk until
  the q tile and two kv stages fit SHARED_MEMORY_BYTES; f32: 32 rows), with split-K over
  the indices when the grid fills less than half a wave. TPU: 128 positions a block,
  tiles of up to 256 heads."""
  itemsize = jnp.dtype(dtype).itemsize
  if backend == "tpu":
    unit = 8 * (4 // itemsize)
    rows = min(-(-heads // unit) * unit, 256)
    return SparseBlockConfig(block_k=128, rows_per_block=rows, num_splits=1)
  rows = min(max(next_pow2(heads), 16), 64 if itemsize <= 2 else 32)
  row_bytes = itemsize * head_dim
  block_k = 64
  while block_k > 16 and (rows + 2 * block_k) * row_bytes > SHARED_MEMORY_BYTES:
    block_k //= 2
  block_k = max(16, min(block_k, next_pow2(topk)))
  programs = batch * q_len * -(-heads // rows)
  splits = 1
  if programs < SPLIT_BELOW_WAVES * num_cores:
    splits = max(1, min(SPLIT_TARGET_WAVES * num_cores // programs, -(-topk // block_k), 64))
  return SparseBlockConfig(block_k=block_k, rows_per_block=rows, num_splits=splits,
                           num_warps=8 if rows >= 64 else 4)


def _pow2_at_least_16(name, n, what):
  if n < 16 or n & (n - 1):
    raise ValueError(f"GPU {what} needs {name} to be a power of two >= 16 (Triton tiles "
                     f"are powers of two; tensor-core dots need >= 16), got {n}.")


def check_indexer_tiling(backend, *, dim, page_size, dtype, cfg: IndexerBlockConfig,
                         q_len=None):
  """ValueError when `backend`'s score kernel cannot tile these shapes with `cfg`."""
  if backend == "gpu":
    _pow2_at_least_16("the index head dim di", dim, "DSA indexer")
    _pow2_at_least_16("IndexerBlockConfig.block_k", cfg.block_k, "DSA indexer")
    return
  sublanes = 8 * (4 // jnp.dtype(dtype).itemsize)
  if dim % 128:
    raise ValueError(f"TPU DSA indexer needs the index head dim di to be a multiple of "
                     f"128 (the lane width), got {dim}.")
  if page_size % sublanes:
    raise ValueError(f"TPU DSA indexer needs page_size to be a multiple of {sublanes} for "
                     f"{jnp.dtype(dtype).name} keys, got {page_size}.")
  if cfg.block_k % page_size or cfg.block_k % 128:
    raise ValueError(f"TPU DSA indexer needs IndexerBlockConfig.block_k ({cfg.block_k}) to "
                     f"be a multiple of page_size ({page_size}) and of 128.")
  if cfg.num_splits != 1:
    raise ValueError("The TPU indexer kernel runs one split; set num_splits=1.")
  if q_len is not None and cfg.query_rows != q_len and cfg.query_rows % 8:
    raise ValueError(f"TPU DSA indexer needs IndexerBlockConfig.query_rows to be T "
                     f"({q_len}) or a multiple of 8 (sublane tiles), got {cfg.query_rows}.")


def check_sparse_tiling(backend, *, v_dim, head_dim, q_dtype, cfg: SparseBlockConfig):
  """ValueError when `backend`'s sparse MLA kernel cannot tile these shapes with `cfg`."""
  if backend == "gpu":
    _pow2_at_least_16("SparseBlockConfig.block_k", cfg.block_k, "sparse MLA")
    _pow2_at_least_16("SparseBlockConfig.rows_per_block", cfg.rows_per_block, "sparse MLA")
    return
  q_sublanes = 8 * (4 // jnp.dtype(q_dtype).itemsize)
  if v_dim % 128:
    raise ValueError(f"TPU sparse MLA needs v_dim (kv_lora_rank) to be a multiple of 128, "
                     f"got {v_dim}.")
  if cfg.rows_per_block % q_sublanes:
    raise ValueError(f"TPU sparse MLA needs SparseBlockConfig.rows_per_block to be a "
                     f"multiple of {q_sublanes} for {jnp.dtype(q_dtype).name} queries, got "
                     f"{cfg.rows_per_block}.")
  if cfg.block_k % 128:
    raise ValueError(f"TPU sparse MLA needs SparseBlockConfig.block_k to be a multiple of "
                     f"128 (a lane-aligned slice of the index vector), got {cfg.block_k}.")
  if cfg.num_splits != 1:
    raise ValueError("The TPU sparse MLA kernel runs one split; set num_splits=1.")


# ------------------------------------------------------------------------ kernel paths
def _check_config(block_config, kind):
  if block_config is not None and not isinstance(block_config, kind):
    raise TypeError(f"block_config must be an {kind.__name__} or None, got "
                    f"{type(block_config).__name__}.")


def index_scores(q, w, k_pages, block_table, kv_lens, *, k_scale=None, backend="gpu",
                 interpret=False, block_config=None):
  """The score kernel of `backend` ('gpu' or 'tpu'): [B, T, Sp] f32, Sp >= W * page_size
  (-inf past it); the same scores as `index_scores_reference` where Sp overlaps it.
  block_config: an IndexerBlockConfig, None for the default."""
  _check_config(block_config, IndexerBlockConfig)
  return _index_scores(q, w, k_pages, block_table, kv_lens, k_scale=k_scale,
                       backend=backend, interpret=interpret, block_config=block_config)


@functools.partial(jax.jit, static_argnames=("backend", "interpret", "block_config"))
def _index_scores(q, w, k_pages, block_table, kv_lens, *, k_scale, backend, interpret,
                  block_config):
  _check_indexer_inputs(q, w, k_pages, block_table, kv_lens, k_scale)
  batch, q_len, heads, dim = q.shape
  _, page_size, _ = k_pages.shape
  cfg = block_config or default_indexer_config(
      batch, q_len, heads, dim, page_size, block_table.shape[1], backend,
      num_cores=_cores(interpret) if backend == "gpu" else GPU_CORES)
  check_indexer_tiling(backend, dim=dim, page_size=page_size, dtype=k_pages.dtype, cfg=cfg,
                       q_len=q_len)
  rows = cfg.query_rows
  t_pad = -(-q_len // rows) * rows
  if backend == "gpu":
    hp = padded_heads(heads)
  else:  # whole sublane tiles of q's dtype
    unit = 8 * (4 // jnp.dtype(q.dtype).itemsize)
    hp = -(-heads // unit) * unit
  qp = jnp.pad(q, ((0, 0), (0, t_pad - q_len), (0, hp - heads), (0, 0)))
  wp = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, t_pad - q_len), (0, hp - heads)))
  qp = qp.reshape(batch, t_pad * hp, dim)
  if backend == "gpu":
    from pallas_kernels.dsa_gpu import index_scores_gpu
    out = index_scores_gpu(qp, wp, k_pages, k_scale, block_table, kv_lens, q_len=q_len,
                           heads=hp, query_rows=rows, block_k=cfg.block_k,
                           num_splits=cfg.num_splits, num_warps=cfg.num_warps,
                           num_stages=cfg.num_stages, interpret=interpret)
  else:
    from pallas_kernels.dsa_tpu import index_scores_tpu
    out = index_scores_tpu(qp, wp, k_pages, k_scale, block_table, kv_lens, q_len=q_len,
                           heads=hp, query_rows=rows, block_k=cfg.block_k,
                           interpret=interpret)
  return out[:, :q_len]


DEFAULT_TOPK_METHOD = {"gpu": "radix", "tpu": "lax"}


def indexer_topk_kernel(q, w, k_pages, block_table, kv_lens, *, topk, k_scale=None,
                        backend="gpu", interpret=False, method=None, block_config=None):
  """`indexer_topk` through `backend`'s score kernel ('gpu' or 'tpu') with a chosen top-k
  `method` (None: the backend's default) and IndexerBlockConfig (None: the default);
  for tests and the benchmark."""
  _check_topk(topk)
  _check_config(block_config, IndexerBlockConfig)
  method = method or DEFAULT_TOPK_METHOD[backend]
  if method not in TOPK_METHODS:
    raise ValueError(f"unknown top-k method {method!r}; expected one of {TOPK_METHODS}.")
  return _indexer_topk_kernel(q, w, k_pages, block_table, kv_lens, topk=int(topk),
                              k_scale=k_scale, backend=backend, interpret=interpret,
                              method=method, block_config=block_config)


@functools.partial(jax.jit, static_argnames=("topk", "backend", "interpret", "method",
                                             "block_config"))
def _indexer_topk_kernel(q, w, k_pages, block_table, kv_lens, *, topk, k_scale, backend,
                         interpret, method, block_config):
  scores = _index_scores(q, w, k_pages, block_table, kv_lens, k_scale=k_scale,
                         backend=backend, interpret=interpret, block_config=block_config)
  return select_topk(scores, topk, method, interpret=interpret)


def sparse_mla_kernel(q, kv_pages, block_table, indices, *, v_dim, sm_scale, kv_scale=None,
                      backend="gpu", interpret=False, block_config=None):
  """`sparse_mla` through `backend`'s kernel ('gpu' or 'tpu') with a chosen
  SparseBlockConfig (None: the default); for tests and the benchmark."""
  _check_config(block_config, SparseBlockConfig)
  if _is_int(v_dim):
    v_dim = int(v_dim)
  if isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool):
    sm_scale = float(sm_scale)
  return _sparse_mla_kernel(q, kv_pages, block_table, indices, v_dim=v_dim,
                            sm_scale=sm_scale, kv_scale=kv_scale, backend=backend,
                            interpret=interpret, block_config=block_config)


@functools.partial(jax.jit, static_argnames=("v_dim", "sm_scale", "backend", "interpret",
                                             "block_config"))
def _sparse_mla_kernel(q, kv_pages, block_table, indices, *, v_dim, sm_scale, kv_scale,
                       backend, interpret, block_config):
  _check_sparse_inputs(q, kv_pages, block_table, indices, v_dim, sm_scale, kv_scale)
  batch, q_len, heads, head_dim = q.shape
  topk = indices.shape[2]
  cfg = block_config or default_sparse_config(
      batch, q_len, heads, head_dim, topk, q.dtype, backend,
      num_cores=_cores(interpret) if backend == "gpu" else GPU_CORES)
  check_sparse_tiling(backend, v_dim=v_dim, head_dim=head_dim, q_dtype=q.dtype, cfg=cfg)
  if kv_scale is not None:
    q = scale_queries(q, kv_scale, v_dim)
  hp = -(-heads // cfg.rows_per_block) * cfg.rows_per_block
  kp = -(-topk // cfg.block_k) * cfg.block_k
  qp = jnp.pad(q, ((0, 0), (0, 0), (0, hp - heads), (0, 0)))
  ip = jnp.pad(indices, ((0, 0), (0, 0), (0, kp - topk)), constant_values=-1)
  common = dict(v_dim=v_dim, sm_scale=sm_scale, block_k=cfg.block_k,
                rows_per_block=cfg.rows_per_block, interpret=interpret)
  if backend == "gpu":
    from pallas_kernels.dsa_gpu import sparse_mla_gpu
    out = sparse_mla_gpu(qp, kv_pages, block_table, ip, **common,
                         num_splits=cfg.num_splits, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages)
  else:
    from pallas_kernels.dsa_tpu import sparse_mla_tpu
    out = sparse_mla_tpu(qp, kv_pages, block_table, ip, **common)
  out = out[:, :, :heads, :v_dim]
  if kv_scale is not None:
    out = (out.astype(jnp.float32) * kv_scale[0].astype(jnp.float32)).astype(q.dtype)
  return out


# ------------------------------------------------------------------------ public ops
def indexer_topk(q, w, k_pages, block_table, kv_lens, *, topk, k_scale=None, backend=None,
                 interpret=False):
  """The indexer's top-k positions [B, T, topk] int32 (module docstring): ascending
  positions, ties towards the lower position, -1 padding last.

  backend: None ($MTP_JAX_DSA_BACKEND, else jax.default_backend(); cpu: reference),
  'gpu', 'tpu' or 'reference'. interpret=True runs the backend's Pallas score kernel in
  interpret mode (the top-k is XLA: `radix_topk` on GPU, lax.top_k on TPU). Shapes a
  kernel cannot tile raise ValueError naming the dimension.
  """
  backend = _resolve_backend(backend)
  _check_topk(topk)
  topk = int(topk)
  if backend == "reference":
    return indexer_topk_reference(q, w, k_pages, block_table, kv_lens, topk=topk,
                                  k_scale=k_scale)
  return indexer_topk_kernel(q, w, k_pages, block_table, kv_lens, topk=topk,
                             k_scale=k_scale, backend=backend, interpret=interpret)


def sparse_mla(q, kv_pages, block_table, indices, *, v_dim, sm_scale, kv_scale=None,
               backend=None, interpret=False):
  """MLA over the selected positions only (module docstring): [B, T, H, v_dim] in q.dtype.

  backend / interpret as for `indexer_topk`.
  """
  backend = _resolve_backend(backend)
  if _is_int(v_dim):
    v_dim = int(v_dim)
  if isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool):
    sm_scale = float(sm_scale)
  if backend == "reference":
    return sparse_mla_reference(q, kv_pages, block_table, indices, v_dim=v_dim,
                                sm_scale=sm_scale, kv_scale=kv_scale)
  return sparse_mla_kernel(q, kv_pages, block_table, indices, v_dim=v_dim,
                           sm_scale=sm_scale, kv_scale=kv_scale, backend=backend,
                           interpret=interpret)
