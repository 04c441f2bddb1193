"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2, GLM-5): the lightning indexer's scores
over a paged index-key cache, their top-k selection, and sparse paged MLA over the
selected tokens.

Layouts (b batch, t query row, h indexer head, d index dim, s kv position):
  q            [B, T, Hi, di]          index queries, RoPE applied (bfloat16 or float32)
  w            [B, T, Hi] f32          per-head weights, every positive scale folded in:
                                       weights_proj(x) * Hi**-0.5 * di**-0.5
  k_pages      [num_pages, page_size, di]  one index key per token: bfloat16 / float32, or
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
are then selected). NaN scores (a NaN in a visible key) are not ordered meaningfully.

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
the chosen backend's Pallas kernels in interpret mode. The GPU top-k is an exact radix
threshold select (`radix_topk`); TPU takes lax.top_k. See the backends' docstrings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import FP8_DTYPE, check_positive_ints, resolve_backend
from pallas_kernels.paged_mla import scale_queries

BACKEND_ENV_VAR = "MTP_JAX_DSA_BACKEND"
TOPK_METHODS = ("radix", "lax")


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
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, H, Dk], got shape {q.shape}.")
  batch, q_len, _, head_dim = q.shape
  if kv_pages.ndim != 3:
    raise ValueError(f"kv_pages must be [num_pages, page_size, Dk], got shape "
                     f"{kv_pages.shape}.")
  if kv_pages.shape[2] != head_dim:
    raise ValueError(f"q's last dim (Dk = latent + rope) is {head_dim} but kv_pages' is "
                     f"{kv_pages.shape[2]}.")
  if not _is_int(v_dim) or not 0 < v_dim <= head_dim:
    raise ValueError(f"v_dim (kv_lora_rank) must be an int in [1, Dk={head_dim}], got "
                     f"{v_dim!r}.")
  if kv_pages.dtype == FP8_DTYPE:
    if q.dtype not in (jnp.bfloat16, jnp.float32):
      raise ValueError(f"float8_e4m3fn pages need a bfloat16 or float32 q (the compute "
                       f"dtype), got {q.dtype}.")
  elif q.dtype != kv_pages.dtype:
    raise ValueError(f"q and kv_pages dtypes differ: {q.dtype} and {kv_pages.dtype} (they "
                     "must match, or the pages be float8_e4m3fn).")
  if block_table.ndim != 2 or block_table.shape[0] != batch:
    raise ValueError(f"block_table must be [B={batch}, W], got {block_table.shape}.")
  if indices.ndim != 3 or indices.shape[:2] != (batch, q_len) or indices.shape[2] < 1:
    raise ValueError(f"indices must be [B={batch}, T={q_len}, topk >= 1], got "
                     f"{indices.shape}.")
  if block_table.dtype != jnp.int32 or indices.dtype != jnp.int32:
    raise ValueError("block_table and indices must be int32, got "
                     f"{block_table.dtype} and {indices.dtype}.")
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
  dots = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys,
                    precision=lax.Precision.HIGHEST)
  scores = jnp.einsum("bths,bth->bts", jnp.maximum(dots, 0.0), w.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)
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
  key = jnp.where(idx < 0, jnp.iinfo(jnp.int32).max, idx)
  return jnp.where(jnp.sort(key, axis=-1) == jnp.iinfo(jnp.int32).max, -1,
                   jnp.sort(key, axis=-1))


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
  logits = jnp.einsum("bthd,btkd->bthk", q, rows, precision=precision,
                      preferred_element_type=jnp.float32) * sm_scale
  mask = live[:, :, None, :]
  logits = jnp.where(mask, logits, -jnp.inf)
  m = logits.max(axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  l = p.sum(axis=-1)
  o = jnp.einsum("bthk,btkv->bthv", p, rows[..., :v_dim].astype(jnp.float32),
                 precision=precision)
  seen = l != 0.0
  o = jnp.where(seen[..., None], o / jnp.where(seen, l, 1.0)[..., None], 0.0)
  if kv_scale is not None:
    o = o * kv_scale[0].astype(jnp.float32)
  return o.astype(q.dtype)


# ------------------------------------------------------------------------ public ops
def indexer_topk(q, w, k_pages, block_table, kv_lens, *, topk, k_scale=None, backend=None,
                 interpret=False):
  """The indexer's top-k positions [B, T, topk] int32 (module docstring): ascending
  positions, ties towards the lower position, -1 padding last.

  backend: None ($MTP_JAX_DSA_BACKEND, else jax.default_backend(); cpu: reference),
  'gpu', 'tpu' or 'reference'. interpret=True runs the backend's Pallas kernel in
  interpret mode. Shapes a kernel cannot tile raise ValueError naming the dimension.
  """
  backend = _resolve_backend(backend)
  _check_topk(topk)
  topk = int(topk)
  if backend == "reference":
    return indexer_topk_reference(q, w, k_pages, block_table, kv_lens, topk=topk,
                                  k_scale=k_scale)
  return indexer_topk_reference(q, w, k_pages, block_table, kv_lens, topk=topk,
                                k_scale=k_scale)


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
  return sparse_mla_reference(q, kv_pages, block_table, indices, v_dim=v_dim,
                              sm_scale=sm_scale, kv_scale=kv_scale)
