"""Row-invariant contractions: a row's result whatever the rows computed beside it.

XLA picks a matmul's blocking, and with it the order in which a row's sum is taken, from
the operand shapes: the same token's outputs differ in their last bits between a call of
1 row (a decode step), K + 1 rows (a verify), a prefill chunk and a batch of 32. Near-ties
then round either way, so a bf16 speculative run can differ from plain decoding.

Inside `row_invariant()` (a trace-time switch, as a mesh is), the contractions that take
rows go through `einsum(spec, x, w, rows=...)`: the rows are laid out in tiles of a fixed
count (zero-padded), and every tile is one contraction of one shape (`lax.map`), so a
row's result depends on its own values and the other operand only. Outside it, `einsum` is
`jnp.einsum`. Reductions over a fixed axis (a norm over the hidden size, a softmax over
the gathered pages) already take one order per row.
"""

from __future__ import annotations

import contextlib
import math
import threading

import jax
import jax.numpy as jnp

# rows per tile: a CPU computes every padded row, so few; elsewhere a decode-sized tile is
# still bound by the weight reads, so every decode and verify call is one tile
TILE_ROWS = {"cpu": 16}
DEFAULT_TILE_ROWS = 128

_STATE = threading.local()


@contextlib.contextmanager
def row_invariant(on: bool = True):
  """Trace the contractions inside with row-invariant tiles (`on` False: unchanged)."""
  before = enabled()
  _STATE.on = bool(on)
  try:
    yield
  finally:
    _STATE.on = before


def enabled() -> bool:
  return getattr(_STATE, "on", False)


def compiler_options() -> dict:
  """XLA options for a program traced under `row_invariant()`: on a GPU, GEMM autotuning
  off. Autotuning times candidate tilings per fused GEMM and keeps the fastest, so two
  fusions of one tile shape (a decode's and a batch's, which pad a different number of
  rows) can take different tilings, and with them different summation orders; without it
  a GEMM's configuration follows from its shapes alone."""
  return {"xla_gpu_autotune_level": 0} if jax.default_backend() == "gpu" else {}


def tile_rows() -> int:
  return TILE_ROWS.get(jax.default_backend(), DEFAULT_TILE_ROWS)


def _letters(spec: str, x, w) -> tuple:
  """(x letters, w letters, output letters) with an ellipsis spelled out."""
  ins, out = spec.replace(" ", "").split("->")
  xs, ws = ins.split(",")
  if "..." in xs:
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in spec]
    lead = "".join(free[: x.ndim - (len(xs) - 3)])
    xs, out = xs.replace("...", lead), out.replace("...", lead)
    ws = ws.replace("...", lead)
  return xs, ws, out


def einsum(spec: str, x, w, *, rows: str = None, **kw):
  """`jnp.einsum(spec, x, w, **kw)`; under `row_invariant()`, computed in fixed tiles of
  the `rows` letters of x (default: its letters that w lacks and the output keeps). A row
  letter w has too (a weight gathered per row) is tiled in w alike."""
  if not enabled():
    return jnp.einsum(spec, x, w, **kw)
  xs, ws, out = _letters(spec, x, w)
  rows = rows or "".join(c for c in xs if c not in ws and c in out)
  if not rows:
    return jnp.einsum(f"{xs},{ws}->{out}", x, w, **kw)
  rest = "".join(c for c in xs if c not in rows)
  shared = "".join(c for c in rows if c in ws)
  w_rest = "".join(c for c in ws if c not in shared)
  xt = jnp.transpose(x, [xs.index(c) for c in rows + rest])
  lead = xt.shape[: len(rows)]
  m, tile = math.prod(lead), tile_rows()
  n = -(-m // tile)

  def tiles(a, k):  # the first k axes flattened, padded and cut into [n, tile, ...]
    a = a.reshape((m,) + a.shape[k:])
    a = jnp.pad(a, [(0, n * tile - m)] + [(0, 0)] * (a.ndim - 1))
    return a.reshape((n, tile) + a.shape[1:])

  r = next(c for c in "ZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in xs + ws + out)
  kept = "".join(c for c in out if c not in rows)
  if shared:
    if shared != rows:
      raise ValueError(f"rows {rows!r}: a row letter w has must be the only one")
    wt = tiles(jnp.transpose(w, [ws.index(c) for c in shared + w_rest]), len(shared))
    part = f"{r}{rest},{r}{w_rest}->{r}{kept}"
    y = jax.lax.map(lambda t: jnp.einsum(part, t[0], t[1], **kw), (tiles(xt, len(rows)), wt))
  else:
    part = f"{r}{rest},{ws}->{r}{kept}"
    y = jax.lax.map(lambda t: jnp.einsum(part, t, w, **kw), tiles(xt, len(rows)))
  y = y.reshape((n * tile,) + y.shape[2:])[:m].reshape(lead + y.shape[2:])
  have = rows + kept
  return jnp.transpose(y, [have.index(c) for c in out])


def ordered_sum(x, axis: int):
  """`jnp.sum(x, axis)`; under `row_invariant()`, the entries added one after another in
  index order (for a short axis: the order of a reduction over an inner axis may follow
  the number of rows around it)."""
  if not enabled():
    return jnp.sum(x, axis=axis)
  parts = jnp.moveaxis(x, axis, 0)
  out = parts[0]
  for part in parts[1:]:
    out = out + part
  return out


__all__ = ["row_invariant", "enabled", "einsum", "ordered_sum", "tile_rows", "TILE_ROWS"]
