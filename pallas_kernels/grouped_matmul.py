"""Grouped (per-expert) matmul: the expert compute of a mixture-of-experts FFN.

  x [N, K], w [E, K, M], group_ids [N] int32  ->  out [N, M] in x.dtype (f32 accumulation)
  out[n] = x[n] @ w[group_ids[n]]   if 0 <= group_ids[n] < E
  out[n] = 0 (exactly)              otherwise (-1: a row routed to an expert elsewhere)

Rows are (token, chosen expert) pairs. At decode there are few rows and many experts,
so the cost is reading weights: the kernels read only the experts some row is routed to,
each once per row tile, never the others (their weights may hold anything, NaN
included).

Layout (MegaBlocks / GMM style), computed once by `plan_groups` into a `GroupPlan`:
rows are sorted by expert (invalid ids last) and each expert's rows are padded to a
multiple of `tile_rows`, so every row tile belongs to exactly one expert. `tile_expert[t]`
names it; tiles from `num_valid_tiles` on are empty, repeat the last valid expert (so the
TPU pipeline issues no new weight DMA for them) and are skipped. The static tile count
is bounded by min(N, ceil(N / tile_rows) + min(E, N) - 1): each non-empty expert wastes
less than one tile, and every valid tile holds at least one row. x rows are gathered
into the padded order (by the GPU kernel itself, by XLA for the TPU one), the kernel
runs over (tile, M block), and the result is gathered back per row; rows with invalid
ids read no slot and come out as 0.

The GPU kernel streams the routed experts close to the device's copy bandwidth
(launch/bench_moe_kernels.py; docs/BENCHMARKS.md, "Kernels").

Backends (`grouped_matmul(backend=...)`, else $MTP_JAX_MOE_BACKEND, else the platform):
  gpu         Pallas Triton kernel (grouped_matmul_gpu.py)
  tpu         Mosaic TPU kernel, expert ids scalar-prefetched (grouped_matmul_tpu.py)
  reference   pure jnp: gather w[group_ids] and one einsum (what CPU runs; reads N
              weight matrices, so only for small N)
  ragged_dot  rows sorted by expert, `jax.lax.ragged_dot` with group sizes, unsorted;
              what it reads is XLA's choice (jax's generic lowering is a masked dot
              over all E experts: unrouted experts are read, and their NaN leaks)
An MoE layer that runs two matmuls on the same routing (gate/up, then down) can call
`plan_groups` once and pass the plan to both.

Quantized experts: w may hold 1-byte values (int8, float8_e4m3fn, float8_e5m2) with
w_scale [E, S, M] float32, K % S == 0, meaning expert e's weight
w[e, k, m] * w_scale[e, k // (K // S), m], as in `pallas_kernels.quant_matmul` (S == 1:
per output channel; S = K / 128: 128-row blocks along K). x stays bfloat16 or float32.
The GPU and TPU kernels read the 1-byte values, convert them to x's dtype after the load
and scale each scale block's partial sum, so only 1 byte a weight moves (block_k must
divide K // S on the GPU, divide it or be a multiple of it on the TPU). The reference
gathers and scales per row; ragged_dot first dequantizes every expert into an x-dtype
copy (reading all E experts and writing E * K * M values, rounded to x's dtype) and
then runs as above. An unrouted expert's values and scales may hold anything, as its
weights do unquantized.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import invariant
from pallas_kernels.common import (check_positive_ints, first_divisor, next_pow2,
                                   resolve_backend)
from pallas_kernels.quant_matmul import VALUE_DTYPES, check_quantized

BACKEND_ENV_VAR = "MTP_JAX_MOE_BACKEND"
EXTRA_BACKENDS = ("ragged_dot",)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Tiling of one grouped-matmul call.

  tile_rows:  rows per tile; every tile's rows share one expert (power of two >= 8;
              GPU needs >= 16, the smallest Triton dot).
  block_m:    output columns per program (GPU) / grid step (TPU).
  block_k:    contraction chunk per loop step (GPU) / grid step (TPU).
  num_splits: K splits per (tile, M block), partial f32 sums added after the kernel
              (GPU only: fills the SMs when few experts are routed).
  num_warps, num_stages: Triton launch parameters (GPU only).
  Backend-specific limits (powers of two, divisibility, TPU (8, 128) tiles) are checked
  by the kernel wrappers with the shapes in hand.
  """

  tile_rows: int = 16
  block_m: int = 128
  block_k: int = 128
  num_splits: int = 1
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    check_positive_ints(self)
    if self.tile_rows < 8 or self.tile_rows & (self.tile_rows - 1):
      raise ValueError(f"BlockConfig.tile_rows must be a power of two >= 8, got "
                       f"{self.tile_rows}.")


def default_tile_rows(num_rows: int, num_experts: int, backend: str) -> int:
  """About the rows one routed expert gets, as a power of two: 16..64 (GPU), 16..128 (TPU).

  At decode (a few rows per expert) the smallest tile wastes the least compute; the
  weights are read once per tile whatever its height.
  """
  per_expert = -(-max(num_rows, 1) // max(1, min(num_experts, num_rows)))
  return min(max(next_pow2(per_expert), 16), 128 if backend == "tpu" else 64)


def default_block_config(num_rows, num_experts, k, m, backend, num_cores=None,
                         scale_rows=1) -> BlockConfig:
  """Block sizes from the shapes; scale_rows is S of quantized experts' w_scale.

  GPU: block_m 128, block_k 64 (smaller powers of two where M or K need them), one K
  split, 4 warps, 3 stages, set by launch/bench_moe_kernels.py --sweep at the GLM-4.5-Air
  shapes: narrower M blocks lose at many rows, and K splits never helped, so the defaults
  do not split (docs/DECISIONS.md, "MoE and MLA kernels").
  TPU: K in one step up to 2048 (else the largest 128-multiple divisor), 512-wide M
  blocks where M allows (untuned: no TPU was available).
  Quantized experts (scale_rows S > 1): block_k as above but dividing the scale block
  K // S (GPU), or dividing it or a multiple of it (TPU), so no K step straddles two
  scale blocks; with S == 1 the defaults are the unquantized ones.
  num_cores is accepted for symmetry with the other ops' defaults and unused.
  """
  del num_cores
  bk = k // max(scale_rows, 1)
  tile_rows = default_tile_rows(num_rows, num_experts, backend)
  if backend == "tpu":
    fits = [c for c in (2048, 1024, 512, 256, 128)
            if k % c == 0 and (bk % c == 0 or c % bk == 0)]
    block_k = k if k <= 2048 else (fits[0] if fits else k)
    block_m = first_divisor(m, (512, 256, 128)) or m
    return BlockConfig(tile_rows=tile_rows, block_m=block_m, block_k=block_k)
  return BlockConfig(tile_rows=tile_rows,
                     block_m=first_divisor(m, (128, 64, 32)) or 16,
                     block_k=first_divisor(bk, (64, 32)) or 16)


def num_tiles(num_rows: int, num_experts: int, tile_rows: int) -> int:
  """Static bound on the row tiles of any routing (module docstring)."""
  if num_rows == 0:
    return 0
  return min(num_rows, -(-num_rows // tile_rows) + min(num_experts, num_rows) - 1)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["sorted_rows", "row_rank", "group_sizes", "row_slot", "slot_row",
                 "tile_expert", "num_valid_tiles"],
    meta_fields=["tile_rows", "num_experts"])
@dataclasses.dataclass(frozen=True)
class GroupPlan:
  """Where each row goes, for one routing (N rows, E experts, T tiles, P = T * tile_rows).

  sorted_rows     [N] row ids ordered by expert, invalid ids last (stable)
  row_rank        [N] position of each row in sorted_rows
  group_sizes     [E] rows per expert
  row_slot        [N] padded slot of each row; P for invalid ids
  slot_row        [P] row held by each padded slot; N for padding
  tile_expert     [T] expert of each tile; tiles past the valid ones repeat the last
  num_valid_tiles [1] tiles holding rows
  """

  sorted_rows: jax.Array
  row_rank: jax.Array
  group_sizes: jax.Array
  row_slot: jax.Array
  slot_row: jax.Array
  tile_expert: jax.Array
  num_valid_tiles: jax.Array
  tile_rows: int
  num_experts: int

  @property
  def valid_rows(self) -> jax.Array:
    """[N] bool: the row's id names an expert."""
    return self.row_slot < self.slot_row.shape[0]


def plan_groups(group_ids, num_experts: int, tile_rows: int, *, method=None) -> GroupPlan:
  """Sort rows by expert and lay them out in one-expert tiles (module docstring).

  method: 'compare' ranks rows with [N, N], [E, N] and [slots, N] comparisons, each one
  fused reduction: at decode sizes a handful of small kernels, where a sort, a scan and
  a scatter take more (every kernel on this path is latency). 'sort' sorts: O(N log N)
  for large N. Both give the same plan. None: 'compare' while N * (N + E) <= 2**22.
  """
  if group_ids.ndim != 1 or not jnp.issubdtype(group_ids.dtype, jnp.integer):
    raise ValueError(f"group_ids must be a 1-D integer array, got {group_ids.dtype} "
                     f"{group_ids.shape}.")
  n, e, tm = group_ids.shape[0], num_experts, tile_rows
  t = num_tiles(n, e, tm)
  p = t * tm
  if method is None:
    method = "compare" if n * (n + e) <= 1 << 22 else "sort"
  if method not in ("sort", "compare"):
    raise ValueError(f"unknown plan method {method!r}; expected 'sort' or 'compare'.")
  ids = group_ids.astype(jnp.int32)
  valid = (ids >= 0) & (ids < e)
  key = jnp.where(valid, ids, e)                       # invalid ids sort last
  rows = jnp.arange(n, dtype=jnp.int32)
  experts = jnp.arange(e + 1, dtype=jnp.int32)
  if method == "sort":
    if (e + 1) * n < 2**31:
      # One single-operand sort of key * N + row (unique, so order is stable).
      packed = lax.sort(key * n + rows)
      sorted_key, sorted_rows = packed // max(n, 1), packed % max(n, 1)
    else:
      sorted_key, sorted_rows = lax.sort((key, rows), num_keys=2)
    # group_start[g]: first sorted position of expert g; group_start[E]: valid rows.
    group_start = jnp.searchsorted(sorted_key, experts, side="left",
                                   method="compare_all").astype(jnp.int32)
    row_rank = jnp.zeros((n,), jnp.int32).at[sorted_rows].set(rows)
    local_rank = row_rank - group_start[key]           # rank among the expert's rows
  else:
    group_start = jnp.sum(key[None, :] < experts[:, None], axis=1, dtype=jnp.int32)
    earlier_same = (key[None, :] == key[:, None]) & (rows[None, :] < rows[:, None])
    local_rank = jnp.sum(earlier_same, axis=1, dtype=jnp.int32)
    row_rank = group_start[key] + local_rank
    # Only the ragged_dot backend reads these two; unused, they compile away.
    sorted_rows = jnp.sum(jnp.where(row_rank[None, :] == rows[:, None], rows[None, :], 0),
                          axis=1, dtype=jnp.int32)
  group_sizes = group_start[1:] - group_start[:-1]
  group_tiles = (group_sizes + tm - 1) // tm
  # tile_start[g] = tiles of the experts before g; entry E is the valid tile count.
  tile_start = jnp.sum(jnp.where(experts[:e][None, :] < experts[:, None], group_tiles[None, :],
                                 0), axis=1, dtype=jnp.int32)
  num_valid = tile_start[e]
  tile_end = tile_start[:e] + group_tiles

  # Expert g covers tiles [tile_start[g], tile_end[g]): tile t's expert is the number
  # of experts ending at or before t (empty ones included). Tiles past the valid ones
  # take tile num_valid - 1's expert.
  tiles = jnp.minimum(jnp.arange(t, dtype=jnp.int32), num_valid - 1)
  tile_expert = jnp.sum(tile_end[None, :] <= tiles[:, None], axis=1, dtype=jnp.int32)

  g = jnp.minimum(key, e - 1)
  row_slot = jnp.where(valid, tile_start[g] * tm + local_rank, p)
  slots = jnp.arange(p, dtype=jnp.int32)
  if method == "sort":
    slot_expert = tile_expert[slots // tm] if p else slots
    local = slots - tile_start[slot_expert] * tm
    real = (slots // tm < num_valid) & (local < group_sizes[slot_expert])
    src = jnp.clip(group_start[slot_expert] + local, 0, max(n - 1, 0))
    slot_row = jnp.where(real, sorted_rows[src] if n else src, n)
  else:
    slot_row = jnp.min(jnp.where(row_slot[None, :] == slots[:, None], rows[None, :], n),
                       axis=1, initial=n)
  return GroupPlan(sorted_rows=sorted_rows, row_rank=row_rank, group_sizes=group_sizes,
                   row_slot=row_slot, slot_row=slot_row, tile_expert=tile_expert,
                   num_valid_tiles=jnp.reshape(num_valid, (1,)),
                   tile_rows=tm, num_experts=e)


def _check_inputs(x, w, group_ids, w_scale):
  if x.ndim != 2:
    raise ValueError(f"x must be [N, K], got shape {x.shape}.")
  if w.ndim != 3 or w.shape[1] != x.shape[1]:
    raise ValueError(f"w must be [E, K={x.shape[1]}, M], got shape {w.shape}.")
  if w_scale is not None:
    check_quantized(x.dtype, w, w_scale, "w", "w_scale")
  elif w.dtype in [jnp.dtype(d) for d in VALUE_DTYPES]:
    raise ValueError(f"w is {w.dtype.name} (quantized experts): pass w_scale "
                     f"[E={w.shape[0]}, S, M={w.shape[2]}] float32.")
  elif x.dtype != w.dtype:
    raise ValueError(f"x and w dtypes differ: {x.dtype} and {w.dtype}.")
  if group_ids.shape != (x.shape[0],) or not jnp.issubdtype(group_ids.dtype, jnp.integer):
    raise ValueError(f"group_ids must be [N={x.shape[0]}] integer, got {group_ids.dtype} "
                     f"{group_ids.shape}.")


def _precision(dtype):
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _scale_rows(w_scale):
  return 0 if w_scale is None else w_scale.shape[1]


def dequantize(w, w_scale, dtype):
  """[E, K, M] values * their scale blocks, in dtype (what ragged_dot multiplies)."""
  e, k, m = w.shape
  s = w_scale.shape[1]
  w = w.astype(jnp.float32).reshape(e, s, k // s, m) * w_scale[:, :, None, :]
  return w.reshape(e, k, m).astype(dtype)


@jax.jit
def _reference(x, w, group_ids, w_scale):
  e = w.shape[0]
  valid = (group_ids >= 0) & (group_ids < e)
  expert = jnp.where(valid, group_ids, 0)
  wg = w[expert]                                                  # [N, K, M]
  if w_scale is None:
    out = invariant.einsum("nk,nkm->nm", x, wg, rows="n", precision=_precision(x.dtype),
                           preferred_element_type=jnp.float32)
  else:
    (n, k), s, m = x.shape, w_scale.shape[1], w.shape[2]
    parts = jnp.einsum("nsk,nskm->nsm", x.reshape(n, s, k // s),
                       wg.astype(x.dtype).reshape(n, s, k // s, m),
                       precision=_precision(x.dtype), preferred_element_type=jnp.float32)
    out = jnp.sum(parts * w_scale[expert], axis=1)                # [N, S, M] -> [N, M]
  # where, not a multiply: the stand-in expert 0 of invalid rows may hold NaN.
  return jnp.where(valid[:, None], out, 0.0).astype(x.dtype)


def grouped_matmul_reference(x, w, group_ids, *, backend=None, block=None, interpret=None,
                             plan=None, w_scale=None):
  """Pure-jnp grouped matmul: gather w[group_ids], one einsum (N weight matrices read).

  Same signature and result as `grouped_matmul`; backend, block, interpret and plan are
  accepted and ignored.
  """
  del backend, block, interpret, plan
  _check_inputs(x, w, group_ids, w_scale)
  return _reference(x, w, group_ids, w_scale)


def _resolve_backend(backend):
  return resolve_backend(backend, BACKEND_ENV_VAR, "grouped_matmul", extra=EXTRA_BACKENDS)


def grouped_matmul(x, w, group_ids, *, backend=None, block=None, interpret=None, plan=None,
                   w_scale=None):
  """out[n] = x[n] @ w[group_ids[n]], 0 for ids outside [0, E) (module docstring).

  backend: None -> $MTP_JAX_MOE_BACKEND or jax.default_backend() ('cpu' runs the
  reference); or 'gpu', 'tpu', 'reference', 'ragged_dot'. Resolved here, outside jit.
  block: a BlockConfig, default from the shapes (`default_block_config`).
  interpret: run the Pallas kernel in interpret mode; None: when jax runs on CPU.
  plan: a GroupPlan from `plan_groups(group_ids, E, block.tile_rows)` to share one
  routing between calls (it must describe these group_ids); None: planned here.
  w_scale: [E, S, M] float32 scales of 1-byte w (quantized experts, module docstring);
  None for bfloat16 / float32 w.
  Returns [N, M] in x.dtype.
  """
  backend = _resolve_backend(backend)
  _check_inputs(x, w, group_ids, w_scale)
  if backend == "reference":
    return _reference(x, w, group_ids, w_scale)
  if block is not None and not isinstance(block, BlockConfig):
    raise TypeError(f"block must be a BlockConfig, got {type(block).__name__}.")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  n, k = x.shape
  e, _, m = w.shape
  if block is None:
    block = default_block_config(n, e, k, m, "tpu" if backend == "tpu" else "gpu",
                                 num_cores=132 if interpret else None,
                                 scale_rows=max(1, _scale_rows(w_scale)))
    if plan is not None:
      block = dataclasses.replace(block, tile_rows=plan.tile_rows)
  if plan is not None:
    if not isinstance(plan, GroupPlan):
      raise TypeError(f"plan must be a GroupPlan, got {type(plan).__name__}.")
    if plan.num_experts != e or plan.row_slot.shape != (n,):
      raise ValueError(f"plan is for {plan.row_slot.shape[0]} rows and {plan.num_experts} "
                       f"experts; this call has {n} and {e}.")
    if backend != "ragged_dot" and plan.tile_rows != block.tile_rows:
      raise ValueError(f"plan.tile_rows={plan.tile_rows} != block.tile_rows="
                       f"{block.tile_rows}.")
  return _grouped_matmul(x, w, group_ids, plan, w_scale, backend=backend, block=block,
                         interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("backend", "block", "interpret"))
def _grouped_matmul(x, w, group_ids, plan, w_scale, *, backend, block, interpret):
  """Plan (unless given), gather rows, run the backend, gather the results back."""
  n, _ = x.shape
  e, _, m = w.shape
  if n == 0:
    return jnp.zeros((0, m), x.dtype)
  if plan is None:
    plan = plan_groups(group_ids, e, block.tile_rows)
  if backend == "ragged_dot":
    if w_scale is not None:
      w = dequantize(w, w_scale, x.dtype)                       # every expert (docstring)
    # Invalid rows sort last, past sum(group_sizes): ragged_dot gives them no group.
    ys = lax.ragged_dot(x[plan.sorted_rows], w, plan.group_sizes,
                        precision=_precision(x.dtype), preferred_element_type=jnp.float32)
    out = ys[plan.row_rank]
    return jnp.where(plan.valid_rows[:, None], out, 0.0).astype(x.dtype)

  if backend == "gpu":
    from pallas_kernels.grouped_matmul_gpu import grouped_matmul_gpu
    ys = grouped_matmul_gpu(x, plan.slot_row, w, plan.tile_expert, plan.num_valid_tiles,
                            block=block, interpret=interpret, w_scale=w_scale)
  else:
    if block.num_splits != 1:
      raise ValueError("The TPU kernel runs one K split; set BlockConfig.num_splits=1.")
    from pallas_kernels.grouped_matmul_tpu import grouped_matmul_tpu
    # Padding slots read a zero row; slots past the valid tiles are never computed.
    xs = jnp.take(x, plan.slot_row, axis=0, mode="fill", fill_value=0)
    ys = grouped_matmul_tpu(xs, w, plan.tile_expert, plan.num_valid_tiles, block=block,
                            interpret=interpret, w_scale=w_scale)
  # Invalid rows point one past the end: 'fill' makes them exactly 0 and never reads
  # the uncomputed tiles.
  return jnp.take(ys, plan.row_slot, axis=0, mode="fill", fill_value=0)
