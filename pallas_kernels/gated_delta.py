"""Gated DeltaNet (GDN): the gated delta rule, the linear attention of Qwen3-Next and
Qwen3.5, for decode and verify (a few tokens: recurrent) and prefill (chunked).

Layouts (b batch, t position, h value head, d key head dim, e value head dim):
  q, k   [B, T, Hk, dk]   bf16 or f32; value head h reads key head h // (Hv // Hk)
                          (transformers' repeat_interleave of q and k over the heads)
  v      [B, T, Hv, dv]   bf16 or f32
  g      [B, T, Hv] f32   log of the per-step decay (<= 0)
  beta   [B, T, Hv] f32   the step's write strength, in (0, 1)
  state  [B, Hv, dk, dv] f32, the recurrent state S: out_t = S_t^T q_t
Returns (out [B, T, Hv, dv] in v.dtype, the final state [B, Hv, dk, dv] f32), or with
all_states=True the state after every position, [B, T, Hv, dk, dv] f32, in its place:
speculative verify keeps the state after each of its K + 1 tokens and resumes from the
last accepted one.

The math, in f32 on every backend, as transformers' `torch_recurrent_gated_delta_rule`
with use_qk_l2norm_in_kernel=True computes it: q and k are L2-normalised over dk
(x * rsqrt(sum(x * x) + 1e-6)) and q is scaled by dk ** -0.5; then per position
  S = S * exp(g_t);  delta = beta_t * (v_t - S^T k_t);  S = S + k_t delta^T;  out_t = S^T q_t.
A position with g = 0 and beta = 0 leaves the state exactly as it was (S * 1 + k * 0):
the engine masks padding tokens that way. Such a position's q, k and v must still be
finite (zeros will do): NaN * 0 is NaN, and would reach the state.

The chunked form (transformers' `torch_chunk_gated_delta_rule`, chunk C = 64) computes
the same thing with matmuls. Within a chunk, with c the cumulative sum of g from the
chunk's start and S0 the state entering it, the deltas solve a unit lower-triangular
system (the WY / UT transform):
  (I + A) delta = beta v - (beta exp(c) k) S0,  A_ij = beta_i exp(c_i - c_j) k_i . k_j (i > j)
so with T = (I + A)^-1, U = T (beta v) and W = T (beta exp(c) k):
  delta = U - W S0
  out   = (exp(c) q) S0 + (exp(c_i - c_j) q_i . k_j)_{i >= j} delta
  S     = exp(c_last) S0 + (exp(c_last - c) k)^T delta.
Padding T up to a multiple of C with g = 0, beta = 0 and zero q, k, v changes nothing.

Backends (`gated_delta`): T <= RECURRENT_MAX_T runs the recurrent kernel, whose
programs hold their states on chip for all T steps (decode T = 1, verify T = K + 1; GPU:
a program a (batch row, value head, block of value columns), TPU: a program a (batch
row, block of value heads)); longer T runs the chunked kernel (prefill), which carries
the state across the chunks of a head and cannot return the per-position states. See RECURRENT_MAX_T for the
threshold. 'reference' (what CPU resolves to) runs `gated_delta_reference` for short T
and `gated_delta_chunked_reference` for long T.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import solve_triangular

from pallas_kernels.common import resolve_backend

BACKEND_ENV_VAR = "MTP_JAX_GDN_BACKEND"
L2_EPS = 1e-6
CHUNK = 64
# Longest T that runs the recurrent kernel. Verify is K + 1 <= 16 tokens; the recurrent
# kernel reads and writes its state once whatever T is and does T rank-1 updates of it
# (VPU / CUDA-core work, memory bound for T this small), while a chunk of 64 would pad
# such a T four-fold or more and spend its matmuls and triangular solve on padding.
# all_states (verify) needs the recurrent kernel anyway.
RECURRENT_MAX_T = 16

_HIGHEST = lax.Precision.HIGHEST


def l2norm(x, eps=L2_EPS):
  """x * rsqrt(sum(x * x) + eps) over the last axis, in f32 (transformers' `l2norm`)."""
  x = x.astype(jnp.float32)
  return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _check_inputs(q, k, v, g, beta, state):
  """ValueError naming the argument whose shape or dtype does not fit."""
  for name, x, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3),
                      ("state", state, 4)):
    if getattr(x, "ndim", None) != nd:
      raise ValueError(f"{name} must have {nd} dims, got shape {getattr(x, 'shape', None)}.")
  if q.shape != k.shape:
    raise ValueError(f"q and k must both be [B, T, Hk, dk], got {q.shape} and {k.shape}.")
  batch, seq, kh, dk = q.shape
  if v.shape[:2] != (batch, seq):
    raise ValueError(f"v must be [B={batch}, T={seq}, Hv, dv], got {v.shape}.")
  hv, dv = v.shape[2:]
  if hv % kh:
    raise ValueError(f"v's head count Hv={hv} must be a multiple of q/k's Hk={kh}.")
  for name, x in (("g", g), ("beta", beta)):
    if x.shape != (batch, seq, hv):
      raise ValueError(f"{name} must be [B={batch}, T={seq}, Hv={hv}], got {x.shape}.")
    if x.dtype != jnp.float32:
      raise ValueError(f"{name} must be float32, got {x.dtype}.")
  if state.shape != (batch, hv, dk, dv):
    raise ValueError(f"state must be [B={batch}, Hv={hv}, dk={dk}, dv={dv}], got "
                     f"{state.shape}.")
  if state.dtype != jnp.float32:
    raise ValueError(f"state must be float32, got {state.dtype}.")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.dtype not in (jnp.float32, jnp.bfloat16):
      raise ValueError(f"{name} must be bfloat16 or float32, got {x.dtype}.")


def _prepared(q, k, v, g, beta):
  """f32 inputs head-major over the value heads: q (normalised, scaled) and k
  (normalised) repeated to [B, Hv, T, dk], v [B, Hv, T, dv], g and beta [B, Hv, T]."""
  group = v.shape[2] // q.shape[2]
  dk = q.shape[3]
  q = jnp.repeat(l2norm(q) * dk ** -0.5, group, axis=2)
  k = jnp.repeat(l2norm(k), group, axis=2)
  q, k, v = (x.astype(jnp.float32).transpose(0, 2, 1, 3) for x in (q, k, v))
  return q, k, v, g.transpose(0, 2, 1), beta.transpose(0, 2, 1)


@functools.partial(jax.jit, static_argnames=("all_states",))
def gated_delta_reference(q, k, v, g, beta, state, *, all_states=False):
  """The gated delta rule step by step (a lax.scan over T), in f32: the recurrent form
  the module docstring states. Returns (out [B, T, Hv, dv] in v.dtype, final state
  [B, Hv, dk, dv] f32), or with all_states the states after every position
  [B, T, Hv, dk, dv] as the second output."""
  _check_inputs(q, k, v, g, beta, state)
  qf, kf, vf, gf, bf = _prepared(q, k, v, g, beta)

  def step(s, x):
    q_t, k_t, v_t, g_t, b_t = x                          # [B, H, d], ..., [B, H]
    s = s * jnp.exp(g_t)[..., None, None]
    kv_mem = jnp.einsum("bhde,bhd->bhe", s, k_t, precision=_HIGHEST)
    delta = (v_t - kv_mem) * b_t[..., None]
    s = s + k_t[..., :, None] * delta[..., None, :]
    out = jnp.einsum("bhde,bhd->bhe", s, q_t, precision=_HIGHEST)
    return s, (out, s if all_states else None)

  xs = tuple(jnp.moveaxis(x, 2, 0) for x in (qf, kf, vf, gf, bf))
  final, (out, states) = lax.scan(step, state, xs)
  out = out.transpose(1, 0, 2, 3).astype(v.dtype)        # [T, B, H, e] -> [B, T, H, e]
  return out, (states.transpose(1, 0, 2, 3, 4) if all_states else final)


@functools.partial(jax.jit, static_argnames=("chunk",))
def gated_delta_chunked_reference(q, k, v, g, beta, state, *, chunk=CHUNK):
  """The gated delta rule in chunks of `chunk` positions (the WY / UT-transform form of
  the module docstring, transformers' `torch_chunk_gated_delta_rule`): the triangular
  solves of every chunk at once, then a lax.scan over the chunks carrying the state.
  Returns (out [B, T, Hv, dv] in v.dtype, final state [B, Hv, dk, dv] f32)."""
  _check_inputs(q, k, v, g, beta, state)
  if not isinstance(chunk, int) or chunk < 1:
    raise ValueError(f"chunk must be a positive int, got {chunk!r}.")
  batch, seq, hv, dv = v.shape
  qf, kf, vf, gf, bf = _prepared(q, k, v, g, beta)
  pad = -seq % chunk
  n = (seq + pad) // chunk

  def chunked(x):  # [B, H, T, ...] -> [B, H, n, C, ...], zero padded
    x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
    return x.reshape(batch, hv, n, chunk, *x.shape[3:])

  qc, kc, vc, gc, bc = (chunked(x) for x in (qf, kf, vf, gf, bf))
  c = jnp.cumsum(gc, axis=-1)                                    # [B, H, n, C]
  lower = jnp.tril(jnp.ones((chunk, chunk), bool))
  # exp(c_i - c_j) for j <= i; masked before the exp, where it would overflow.
  decay = jnp.exp(jnp.where(lower, c[..., :, None] - c[..., None, :], -jnp.inf))
  k_beta = kc * bc[..., None]
  a = jnp.einsum("...id,...jd->...ij", k_beta, kc, precision=_HIGHEST) * decay
  system = jnp.where(jnp.tril(lower, -1), a, 0.0) + jnp.eye(chunk, dtype=jnp.float32)
  u = solve_triangular(system, vc * bc[..., None], lower=True, unit_diagonal=True)
  w = solve_triangular(system, k_beta * jnp.exp(c)[..., None], lower=True,
                       unit_diagonal=True)
  attn = jnp.einsum("...id,...jd->...ij", qc, kc, precision=_HIGHEST) * decay
  q_decayed = qc * jnp.exp(c)[..., None]
  k_decayed = kc * jnp.exp(c[..., -1:] - c)[..., None]
  chunk_decay = jnp.exp(c[..., -1])                              # [B, H, n]

  def step(s, x):
    u_c, w_c, attn_c, q_c, k_c, decay_c = x
    delta = u_c - jnp.einsum("bhcd,bhde->bhce", w_c, s, precision=_HIGHEST)
    out = (jnp.einsum("bhcd,bhde->bhce", q_c, s, precision=_HIGHEST)
           + jnp.einsum("bhij,bhje->bhie", attn_c, delta, precision=_HIGHEST))
    s = s * decay_c[..., None, None] + jnp.einsum("bhcd,bhce->bhde", k_c, delta,
                                                  precision=_HIGHEST)
    return s, out

  xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, attn, q_decayed, k_decayed, chunk_decay))
  final, out = lax.scan(step, state, xs)                         # out [n, B, H, C, e]
  out = out.transpose(1, 0, 3, 2, 4).reshape(batch, n * chunk, hv, dv)[:, :seq]
  return out.astype(v.dtype), final


def _resolve_backend(backend):
  return resolve_backend(backend, BACKEND_ENV_VAR, "gated-delta")


def gated_delta(q, k, v, g, beta, state, *, all_states=False, backend=None, interpret=False):
  """The gated delta rule over T positions from `state` (module docstring): the
  recurrent kernel for T <= RECURRENT_MAX_T, the chunked kernel (chunk CHUNK) above.

  backend: None -> $MTP_JAX_GDN_BACKEND or jax.default_backend() ('cpu' runs the
  references); or 'gpu', 'tpu', 'reference'. Resolved here, outside jit, so the env var
  is read on every call. interpret=True runs the chosen Pallas kernel in interpret mode
  (on CPU). all_states=True returns the state after every position in place of the
  final state; only for T <= RECURRENT_MAX_T (ValueError above: the chunked form never
  materialises the per-position states).
  Returns (out [B, T, Hv, dv] in v.dtype, final state [B, Hv, dk, dv] f32 or the states
  [B, T, Hv, dk, dv] f32). Inputs that do not fit, and head dims the chosen kernel
  cannot tile, raise ValueError naming the argument.
  """
  backend = _resolve_backend(backend)
  _check_inputs(q, k, v, g, beta, state)
  seq = q.shape[1]
  recurrent = seq <= RECURRENT_MAX_T
  if all_states and not recurrent:
    raise ValueError(f"all_states=True needs T <= RECURRENT_MAX_T={RECURRENT_MAX_T} (the "
                     f"recurrent form), got T={seq}: the chunked form does not produce the "
                     "per-position states.")
  if backend == "reference":
    if recurrent:
      return gated_delta_reference(q, k, v, g, beta, state, all_states=all_states)
    return gated_delta_chunked_reference(q, k, v, g, beta, state)
  if backend == "gpu":
    from pallas_kernels import gated_delta_gpu as kernels
  else:
    from pallas_kernels import gated_delta_tpu as kernels
  if recurrent:
    return kernels.gated_delta_recurrent(q, k, v, g, beta, state, all_states=all_states,
                                         interpret=interpret)
  return kernels.gated_delta_chunked(q, k, v, g, beta, state, chunk=CHUNK,
                                     interpret=interpret)
