"""The mixture-of-experts FFN: router, routed experts (grouped matmul), shared experts.

`MoE` is the FFN module a block builds for a layer whose spec is a `MoEConfig`:

    ids, w  = route(x)                              # [.., top_k] experts and weights, f32
    routed  = sum_j w_j * SwiGLU_{ids_j}(x)         # only the routed experts' weights read
    out     = routed + SwiGLU_shared(x)             # if the config has shared experts

Routing follows the reference implementations (DeepSeek-V3 / GLM-4.5 `noaux_tc`, and the
softmax top-k of Qwen3-MoE / Mixtral), in float32: the score-correction bias enters the
choice of experts only, never the weights. The expert SwiGLU runs as two grouped matmuls
(pallas_kernels.grouped_matmul) over the (token, chosen expert) rows, so at decode only
the experts some row is routed to are read from memory.

Sharding: when a mesh is active (sharding.use_mesh) the experts are split over its `ep`
axis and each expert's FFN dim over `tp`; every device computes the rows routed to its
own experts for all tokens (tokens are replicated over ep and tp, so no all-to-all is
needed) and one psum over (ep, tp) adds the partial outputs. The router and the shared
experts are plain einsums that XLA partitions from their parameter shardings.

Parameter layouts: router [d, e] (f32), router_bias [e] (f32), experts_gate_up
[e, d, 2, f], experts_down [e, f, d]; the shared experts are an `MLP`, their optional
per-token gate `shared_gate` [d] (Qwen3-Next: out = routed + sigmoid(x . w) * shared).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import invariant
from pallas_kernels.common import resolve_backend, swiglu
from pallas_kernels.grouped_matmul import (BACKEND_ENV_VAR, EXTRA_BACKENDS, default_tile_rows,
                                           grouped_matmul, plan_groups)

from .config import MoEConfig
from .layers import MLP, _param
from .qarray import is_quantized, value
from .sharding import P, active_mesh, axis_size, batch_axis, shard_kernel, spec_like

# Router parameters stay float32 whatever the model dtype: the checkpoints keep the bias
# in float32 and a bf16 router could flip which experts are chosen.
FLOAT32_PARAMS = ("router", "router_bias")


class MoE(nnx.Module):
    QUANT_AXES = {"experts_gate_up": (1,), "experts_down": (1,)}  # shared: an MLP

    def __init__(self, spec: MoEConfig, d: int, *, dtype, rngs: nnx.Rngs):
        e, f = spec.num_experts, spec.intermediate_size
        self.spec = spec
        self.router = _param(rngs, (d, e), jnp.float32, d ** -0.5)
        self.router_bias = (nnx.Param(jnp.zeros((e,), jnp.float32)) if spec.score_bias
                            else None)
        self.experts_gate_up = _param(rngs, (e, d, 2, f), dtype, d ** -0.5)
        self.experts_down = _param(rngs, (e, f, d), dtype, f ** -0.5)
        self.shared = (MLP(d, spec.shared_size, dtype=dtype, rngs=rngs,
                           limit=spec.shared_swiglu_limit) if spec.shared_size else None)
        self.shared_gate = (_param(rngs, (d,), dtype, d ** -0.5)
                            if spec.shared_size and spec.shared_gate else None)

    def __call__(self, x):
        bias = None if self.router_bias is None else self.router_bias[...]
        ids, weights = route(x, self.router[...], bias, self.spec)
        out = routed_experts(x, ids, weights, value(self.experts_gate_up),
                             value(self.experts_down), self.spec.swiglu_limit)
        if self.shared is not None:
            shared = self.shared(x).astype(jnp.float32)
            if self.shared_gate is not None:  # a per-token sigmoid gate on the shared expert
                gate = invariant.einsum("...d,d->...", x, self.shared_gate[...],
                                        preferred_element_type=jnp.float32)
                shared = shared * jax.nn.sigmoid(gate)[..., None]
            out = out + shared
        return out.astype(x.dtype)


def route(x, router, bias, spec: MoEConfig):
    """Experts [.., top_k] int32 and their weights [.., top_k] f32 for tokens x [.., d]."""
    logits = invariant.einsum("...d,de->...e", x.astype(jnp.float32),
                              router.astype(jnp.float32))
    if spec.router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores if bias is None else scores + bias
        if spec.n_group > 1:
            per = spec.num_experts // spec.n_group
            grouped = choice.reshape(choice.shape[:-1] + (spec.n_group, per))
            # A group scores the sum of its two best experts (DeepSeek-V3 noaux_tc).
            group_score = jax.lax.top_k(grouped, min(2, per))[0].sum(-1)
            _, best = jax.lax.top_k(group_score, spec.topk_group)
            keep = jnp.any(jax.nn.one_hot(best, spec.n_group, dtype=bool), axis=-2)
            choice = jnp.where(jnp.repeat(keep, per, axis=-1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, spec.top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if spec.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * spec.routed_scaling_factor


def expert_swiglu(x, ids, weights, gate_up, down, first_expert=0, limit=None):
    """sum_j weights_j * SwiGLU_{ids_j}(x) over the experts held here, f32 [.., d].

    x [.., d]; ids, weights [.., top_k]; gate_up [e, d, 2, f], down [e, f, d] hold experts
    first_expert .. first_expert + e - 1 (arrays, or QArrays whose scales the grouped
    matmul applies per expert); rows routed elsewhere contribute 0 and read no weights.
    `limit`: clamped SwiGLU (pallas_kernels.common.swiglu).
    """
    lead, d = x.shape[:-1], x.shape[-1]
    e, _, _, f = gate_up.shape
    top_k = ids.shape[-1]
    rows = jnp.repeat(x.reshape(-1, d), top_k, axis=0)  # [(tokens * top_k), d]
    local = ids.reshape(-1) - first_expert
    group = jnp.where((local >= 0) & (local < e), local, -1)
    # One routing plan (rows sorted into one-expert tiles) serves both matmuls.
    backend = resolve_backend(None, BACKEND_ENV_VAR, "grouped_matmul", extra=EXTRA_BACKENDS)
    if invariant.enabled():  # one weight matrix a row: no tiles by routed row counts
        backend = "reference"
    if backend == "gpu" and (d % 16 or f % 16):
        # Triton tiles are powers of two >= 16 and partial blocks are not masked: expert
        # widths off that grid (tiny test models; no published MoE) take the jnp path.
        backend = "reference"
    plan = None if backend == "reference" else plan_groups(
        group, e, default_tile_rows(rows.shape[0], e, backend))
    w1, s1 = _matrix(gate_up, (e, d, 2 * f))
    h = grouped_matmul(rows, w1, group, backend=backend, plan=plan, **s1).reshape(-1, 2, f)
    act = swiglu(h[:, 0].astype(jnp.float32), h[:, 1].astype(jnp.float32), limit)
    w2, s2 = _matrix(down, down.shape)
    y = grouped_matmul(act.astype(x.dtype), w2, group, backend=backend, plan=plan,
                       **s2).astype(jnp.float32)
    y = y.reshape(-1, top_k, d) * weights.reshape(-1, top_k, 1)
    return invariant.ordered_sum(y, axis=1).reshape(lead + (d,))


def _matrix(w, shape):
    """(weights [E, K, M], grouped_matmul's scale argument {} or {"w_scale": [E, S, M]})
    of expert weights reshaped to `shape`."""
    if not is_quantized(w):
        return w.reshape(shape), {}
    e, _, m = shape
    return w.values.reshape(shape), {"w_scale": w.scale.reshape(e, -1, m)}


def routed_experts(x, ids, weights, gate_up, down, limit=None):
    """`expert_swiglu` over all experts, split over the active mesh's ep / tp axes."""
    mesh = active_mesh()
    ep, tp = axis_size(mesh, "ep"), axis_size(mesh, "tp")
    f = gate_up.shape[-1]
    e_axis = "ep" if ep > 1 else None
    f_axis = "tp" if tp > 1 and f % tp == 0 else None
    if e_axis is None and f_axis is None:
        return expert_swiglu(x, ids, weights, gate_up, down, limit=limit)
    dp = batch_axis(mesh, x.shape[0])
    sum_axes = tuple(a for a in (e_axis, f_axis) if a)

    def local(x, ids, weights, gate_up, down):
        first = jax.lax.axis_index("ep") * gate_up.shape[0] if e_axis else 0
        return jax.lax.psum(expert_swiglu(x, ids, weights, gate_up, down, first, limit),
                            sum_axes)

    rows = P(dp, *([None] * (x.ndim - 1)))
    fn = shard_kernel(local, mesh, (rows, rows, rows,
                                    spec_like(gate_up, P(e_axis, None, None, f_axis)),
                                    spec_like(down, P(e_axis, f_axis, None))), rows)
    return fn(x, ids, weights, gate_up, down)


__all__ = ["MoE", "route", "expert_swiglu", "routed_experts", "FLOAT32_PARAMS"]
