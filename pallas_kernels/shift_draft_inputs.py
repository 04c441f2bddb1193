"""Shift and back-fill the MTP drafter's input window after a verify step.

After the target verifies ``[last_token, d_1 .. d_K]`` at positions ``L-1 .. L+K-1``
of a request and accepts ``n`` drafts (``0 <= n <= K``), the rows ``0 .. n`` of the
verify are committed and row ``n`` is the anchor ``a = L + n - 1``: the last position
whose target output is valid. The MTP drafter consumes the ``K + 1`` most recent
committed (token, target hidden) pairs ending at the anchor. Per request this op

* concatenates the history carry (the ``K`` entries before the verify, positions
  ``L-K-1 .. L-2``) with the ``K + 1`` verify rows (positions ``L-1 .. L+K-1``),
* takes the window ``cat[n : n + K + 1]`` (positions ``a-K .. a``) of tokens and hidden
  states; rows past ``n`` of the verify (rejected drafts) never reach it,
* returns the window's positions and KV slot mapping (``DROP_SLOT`` for positions
  before the prompt start or at/after ``limit``), and
* returns ``window[1:]`` as the history carry of the next step.

Worked example, ``K = 3``, ``n = 1`` (anchor ``a = L``)::

    carry   h_{L-4} h_{L-3} h_{L-2}            (positions a-4 .. a-2)
    verify  h_{L-1} h_L     h_{L+1} h_{L+2}    (rows 2 and 3 rejected: garbage)
    cat     h_{L-4} h_{L-3} h_{L-2} h_{L-1} h_L h_{L+1} h_{L+2}
    window          h_{L-3} h_{L-2} h_{L-1} h_L                 = h_{a-3} .. h_a
    carry'                  h_{L-2} h_{L-1} h_L                 = h_{a-2} .. h_a

Seen from the verify rows, the window is the ``K + 1`` verify rows shifted right by
the number of rejected drafts ``K - n`` and back-filled from the carry: vLLM's MTP3
``adjust_input``; the carry is TensorRT-LLM's ``mtpUpdateHiddenStates`` pool and the
window its ``mtpPrepareDrafterInputs`` (names only: the behaviour, not the code, is
ported).

Why ``K + 1`` and not ``K``: a verify commits up to ``K + 1`` new positions
(``L-1 .. L+K-1`` when every draft is accepted), and each MTP module must rewrite its
KV for every newly committed position, because the KV it wrote while drafting was
computed from draft inputs. With a window of ``K``, position ``L-1`` would be skipped
when ``n = K``. The ``K - n`` rows before ``L-1`` repeat positions the previous step's
window already covered (harmless: the same inputs give the same KV).

Kernels. The hidden states are the bulk of the bytes (``(2K+1) * D`` elements per
request in, ``(2K+1) * D`` out); they are copied by a Pallas kernel, one program per
(request, block of D):

* GPU (Pallas Triton): each program reads exactly ``K + 1`` rows: row ``j`` comes from
  the carry when ``n + j < K``, else from the verify, as two masked loads of which one
  is masked off entirely (branch-free, so all rows' loads can be in flight together);
  each row is stored into the window and, for ``j >= 1``, into the next carry.
* TPU (Mosaic): ``num_accepted`` is scalar-prefetched; the ``[K, bd]`` carry block and
  the ``[K+1, bd]`` verify block are pipelined into VMEM and row ``j`` of the window is
  selected from the ``2K+1`` candidate rows with vector selects on ``n``, then the
  window and the next carry are stored as whole blocks. Single-row DMAs are avoided
  on purpose: the row axis is a tiled (sublane) axis in HBM, and for 16-bit types two
  rows share each 32-bit word, so one row is not a DMA-able unit, while the
  surrounding tiles are read whole anyway. Rows are selected in float32 (exact for
  bf16 and f32) so every vector op is 32-bit.

The small int outputs (tokens, positions, slots: about ``4 * (K+1)`` ints per request)
come from the jnp reference in the wrapper, for both kernels, so the TPU kernel
scalar-prefetches only ``num_accepted`` (``anchor`` and the block table feed nothing
but these ints). In the Triton kernel they would need ``[K+1]``-long vectors, which
Triton allows only for power-of-two lengths, and in the TPU kernel SMEM outputs with
scalar stores; XLA fuses the few int ops into one small fusion either way, and one
implementation keeps the three paths identical by construction.

``num_accepted`` is clamped to ``[0, K]`` so that a corrupt count can never read
outside a request's rows. Slots come from ``kv_write.slot_mapping``, the rule every KV
writer uses: a position gets ``DROP_SLOT`` when it is negative (short prompt), at or
past ``limit``, or past the last page of the block table (the table index is clamped,
so the table is never read out of bounds).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import BACKENDS
from pallas_kernels.common import resolve_backend as _resolve
from pallas_kernels.kv_write import DROP_SLOT, slot_mapping

__all__ = ["BACKEND_ENV_VAR", "BACKENDS", "DROP_SLOT", "BlockSizes", "resolve_backend",
           "shift_draft_inputs", "shift_draft_inputs_reference"]

BACKEND_ENV_VAR = "MTP_JAX_SHIFT_BACKEND"


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the hidden dimension D; each kernel picks its block from ``block_d``.

    block_d:   upper bound on the D elements one program copies per row. GPU uses the
               largest power of two dividing D (Triton vectors are power-of-two long);
               TPU the largest multiple of 128 dividing D (lane tiling), else all of D.
    num_warps: GPU warps per program.
    """

    block_d: int = 2048
    num_warps: int = 4

    def __post_init__(self):
        if self.block_d < 128 or self.block_d & (self.block_d - 1):
            raise ValueError(f"block_d must be a power of two >= 128, got {self.block_d}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two <= 32, got {self.num_warps}")

    def gpu_block_d(self, d: int) -> int:
        return min(d & -d, self.block_d)  # largest power of two dividing d, capped

    def tpu_block_d(self, d: int) -> int:
        for bd in range(min(self.block_d, d) // 128 * 128, 0, -128):
            if d % bd == 0:
                return bd
        return d  # no multiple of 128 divides d: one full-D block (always a legal block)


# ----------------------------------------------------------------------------- GPU


def _gpu_kernel(n_ref, hist_ref, new_ref, win_ref, next_ref, *, k):
    # n_ref [B] (whole array); hist_ref [K, bd]; new_ref, win_ref [K+1, bd]; next_ref [K, bd].
    bd = hist_ref.shape[-1]
    n = n_ref[pl.program_id(0)]
    for j in range(k + 1):
        s = n + j  # row of cat = concat(hist, new) that lands in window row j
        in_hist = jnp.full((bd,), s < k)
        # Two masked loads, one of them fully masked off (no memory traffic); no branches,
        # so the K+1 rows' loads can all be in flight at once. The clamps keep the
        # masked-off address in range.
        from_hist = plgpu.load(hist_ref.at[jnp.minimum(s, k - 1)], mask=in_hist)
        from_new = plgpu.load(new_ref.at[jnp.maximum(s - k, 0)], mask=~in_hist)
        row = jnp.where(in_hist, from_hist, from_new)  # never spreads an unpicked NaN
        win_ref[j, :] = row
        if j:
            next_ref[j - 1, :] = row


def _shift_hidden_gpu(hist_hidden, new_hidden, n, *, block_sizes, interpret):
    b, k, d = hist_hidden.shape
    bd = block_sizes.gpu_block_d(d)
    row = lambda rows: pl.BlockSpec((None, rows, bd), lambda i, c: (i, 0, c))
    return pl.pallas_call(
        functools.partial(_gpu_kernel, k=k),
        out_shape=(
            jax.ShapeDtypeStruct((b, k + 1, d), hist_hidden.dtype),
            jax.ShapeDtypeStruct((b, k, d), hist_hidden.dtype),
        ),
        grid=(b, d // bd),
        in_specs=[pl.BlockSpec((b,), lambda i, c: (0,)), row(k), row(k + 1)],
        out_specs=(row(k + 1), row(k)),
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=1),
        cost_estimate=_cost(hist_hidden, new_hidden),
        interpret=interpret,
        name="shift_draft_inputs_gpu",
    )(n, hist_hidden, new_hidden)


# ----------------------------------------------------------------------------- TPU


def _tpu_kernel(n_ref, hist_ref, new_ref, win_ref, next_ref, *, k):
    # n_ref [B] in SMEM; hist_ref [K, bd]; new_ref, win_ref [K+1, bd]; next_ref [K, bd].
    bd = hist_ref.shape[-1]
    n = jnp.full((1, bd), n_ref[pl.program_id(0)], jnp.int32)  # vector compare, not i1 splat
    # The 2K+1 rows of cat = concat(hist, new), static loads, widened (exactly) to f32.
    cat = [hist_ref[pl.ds(s, 1), :].astype(jnp.float32) for s in range(k)]
    cat += [new_ref[pl.ds(s, 1), :].astype(jnp.float32) for s in range(k + 1)]
    rows = []
    for j in range(k + 1):  # window row j = cat[n + j]; where() never spreads an unpicked NaN
        row = cat[k + j]
        for m in range(k):
            row = jnp.where(n == m, cat[m + j], row)
        rows.append(row)

    def stack(rs):  # [1, bd] rows -> [len(rs), bd] with iota selects (no unaligned concat)
        idx = lax.broadcasted_iota(jnp.int32, (len(rs), bd), 0)
        out = jnp.broadcast_to(rs[0], (len(rs), bd))
        for i, r in enumerate(rs[1:], 1):
            out = jnp.where(idx == i, r, out)
        return out

    win_ref[...] = stack(rows).astype(win_ref.dtype)
    next_ref[...] = stack(rows[1:]).astype(next_ref.dtype)


def _shift_hidden_tpu(hist_hidden, new_hidden, n, *, block_sizes, interpret):
    b, k, d = hist_hidden.shape
    bd = block_sizes.tpu_block_d(d)
    row = lambda rows: pl.BlockSpec((None, rows, bd), lambda i, c, n_ref: (i, 0, c))
    return pl.pallas_call(
        functools.partial(_tpu_kernel, k=k),
        out_shape=(
            jax.ShapeDtypeStruct((b, k + 1, d), hist_hidden.dtype),
            jax.ShapeDtypeStruct((b, k, d), hist_hidden.dtype),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, d // bd),
            in_specs=[row(k), row(k + 1)],
            out_specs=(row(k + 1), row(k)),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=_cost(hist_hidden, new_hidden),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="shift_draft_inputs_tpu",
    )(n, hist_hidden, new_hidden)


def _cost(hist_hidden, new_hidden):  # bytes: all rows in and out (GPU reads only K+1 rows in)
    moved = 2 * (hist_hidden.size + new_hidden.size) * hist_hidden.dtype.itemsize
    return pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=moved)


# ----------------------------------------------------------------------------- shared


def _check_shapes(hist_tokens, hist_hidden, new_tokens, new_hidden, num_accepted, anchor,
                  block_tables, page_size):
    if hist_hidden.ndim != 3:
        raise ValueError(f"hist_hidden must be [B, K, D], got {hist_hidden.shape}")
    b, k, d = hist_hidden.shape
    want = {
        "hist_tokens": (hist_tokens, (b, k)),
        "new_tokens": (new_tokens, (b, k + 1)),
        "new_hidden": (new_hidden, (b, k + 1, d)),
        "num_accepted": (num_accepted, (b,)),
        "anchor": (anchor, (b,)),
    }
    for name, (x, shape) in want.items():
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape} (B={b}, K={k}, D={d}), got {x.shape}")
    if k < 1:
        raise ValueError("K (hist_hidden.shape[1]) must be >= 1")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [B={b}, P], got {block_tables.shape}")
    if new_hidden.dtype != hist_hidden.dtype:
        raise ValueError(f"hidden dtypes differ: {hist_hidden.dtype} vs {new_hidden.dtype}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")


def _window_rows(num_accepted, k):
    """[B, K+1] rows of concat(carry, verify) forming the window."""
    n = jnp.clip(num_accepted.astype(jnp.int32), 0, k)
    return n, n[:, None] + jnp.arange(k + 1, dtype=jnp.int32)


def _positions_and_slots(anchor, block_tables, *, k, page_size, limit):
    pos = anchor.astype(jnp.int32)[:, None] - k + jnp.arange(k + 1, dtype=jnp.int32)
    return pos, slot_mapping(block_tables, pos, page_size, limit)  # the KV writer's own rule


def shift_draft_inputs_reference(hist_tokens, hist_hidden, new_tokens, new_hidden, num_accepted,
                                 anchor, block_tables, *, page_size, limit):
    """Pure-jnp shift_draft_inputs (see the module docstring); same contract as the op."""
    _check_shapes(hist_tokens, hist_hidden, new_tokens, new_hidden, num_accepted, anchor,
                  block_tables, page_size)
    k = hist_tokens.shape[1]
    _, rows = _window_rows(num_accepted, k)
    tokens = jnp.take_along_axis(jnp.concatenate([hist_tokens, new_tokens], 1), rows, axis=1)
    hidden = jnp.take_along_axis(jnp.concatenate([hist_hidden, new_hidden], 1),
                                 rows[:, :, None], axis=1)
    pos, slots = _positions_and_slots(anchor, block_tables, k=k, page_size=page_size, limit=limit)
    return tokens, hidden, pos, slots, tokens[:, 1:], hidden[:, 1:]


_HIDDEN_COPY = {"gpu": _shift_hidden_gpu, "tpu": _shift_hidden_tpu}


@functools.partial(jax.jit, static_argnames=("page_size", "backend", "interpret", "block_sizes"))
def _shift_draft_inputs(hist_tokens, hist_hidden, new_tokens, new_hidden, num_accepted, anchor,
                        block_tables, limit, *, page_size, backend, interpret, block_sizes):
    if backend == "reference":
        return shift_draft_inputs_reference(hist_tokens, hist_hidden, new_tokens, new_hidden,
                                            num_accepted, anchor, block_tables,
                                            page_size=page_size, limit=limit)
    # Int outputs from the reference (its hidden gather is unused, and XLA drops it);
    # the hidden states from the kernel.
    tokens, _, pos, slots, next_tokens, _ = shift_draft_inputs_reference(
        hist_tokens, hist_hidden, new_tokens, new_hidden, num_accepted, anchor, block_tables,
        page_size=page_size, limit=limit)
    n, _ = _window_rows(num_accepted, hist_tokens.shape[1])
    hidden, next_hidden = _HIDDEN_COPY[backend](hist_hidden, new_hidden, n,
                                                block_sizes=block_sizes, interpret=interpret)
    return tokens, hidden, pos, slots, next_tokens, next_hidden


def resolve_backend(backend: str | None = None) -> str:
    """Explicit argument, else $MTP_JAX_SHIFT_BACKEND, else by jax.default_backend()."""
    return _resolve(backend, BACKEND_ENV_VAR, "shift_draft_inputs")


def shift_draft_inputs(hist_tokens, hist_hidden, new_tokens, new_hidden, num_accepted, anchor,
                       block_tables, *, page_size, limit, backend=None, interpret=False,
                       block_sizes=BlockSizes()):
    """Draft-input window after a verify (module docstring has the worked example).

    hist_tokens  [B, K]      int32  carry: MTP input tokens of positions a_prev-K+1 .. a_prev
    hist_hidden  [B, K, D]   float  carry: target hidden states of the same positions
    new_tokens   [B, K+1]    int32  verify row j (position L-1+j) -> its MTP input token;
                                    rows > n are garbage
    new_hidden   [B, K+1, D] float  target hidden of the verify rows; rows > n are garbage
    num_accepted [B]         int32  n in [0, K] (clamped)
    anchor       [B]         int32  a = L + n - 1, position of the window's last entry
    block_tables [B, P]      int32  page ids of the (MTP) KV cache of each request
    page_size    int                tokens per page (static)
    limit        [B] or int  int32  positions >= limit get DROP_SLOT
    backend      None | 'gpu' | 'tpu' | 'reference' (None: $MTP_JAX_SHIFT_BACKEND, else
                 by jax.default_backend(), cpu -> reference)
    interpret    run the Pallas kernel in interpret mode (any host)
    block_sizes  BlockSizes: D tiling of the kernels

    The backend is resolved when the op is traced (inside a jitted step: at its trace).

    Returns (window_tokens [B, K+1], window_hidden [B, K+1, D], window_positions [B, K+1],
    window_slots [B, K+1], new_hist_tokens [B, K], new_hist_hidden [B, K, D]).
    Positions are returned as computed (negative for short prompts, possibly >= limit);
    only their slots are dropped.
    """
    return _shift_draft_inputs(hist_tokens, hist_hidden, new_tokens, new_hidden, num_accepted,
                               anchor, block_tables, limit, page_size=page_size,
                               backend=resolve_backend(backend), interpret=bool(interpret),
                               block_sizes=block_sizes)
