"""One logical-axis sharding table for params, decode state and the kernels.

Mesh axes: `tp` (tensor parallel: attention heads, MLP, vocabulary; the MTP modules too),
`dp` (data parallel over decode slots) and, for MoE models, `ep` (expert parallel: the
routed experts are split over it; attention and dense parts are replicated over it).
`mesh=None` means one device and no constraints anywhere. The `ep` axis exists only in
meshes that ask for it (`make_mesh("ep=2,tp=2")`); `axis_size` reads 1 for a missing axis.

Every parameter's logical axes are derived from its name and rank (the layouts are
documented in attention.py, layers.py, mla.py and moe.py); `RULES` maps logical axes to
mesh axes. An axis whose size does not divide by its mesh axis stays replicated. XLA's
SPMD partitioner shards the einsums from these parameter shardings (Megatron pattern:
qkv / gate_up by head and MLP column, o / down contracting the sharded axis with one
all-reduce; lm_head by vocabulary).

The Pallas kernels cannot be partitioned by XLA, so they run per shard under
`jax.shard_map` (`shard_kernel`): paged attention and KV writes per kv-head shard (and
per slot shard over `dp`; MLA's one latent row per token is replicated over `tp` and its
query heads split); the KV pages are sharded by kv head over `tp` and replicated
over `dp`, each dp shard writing the new KV rows of every slot (all-gathered over `dp`,
a few KiB per step) so the replicas stay identical. The MoE expert compute runs per shard
too (moe.py); model code finds the mesh through `use_mesh` / `active_mesh`, set around
tracing by whoever jits the forward (step.Programs), not through module attributes.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import ConfigError
from .qarray import QArray, is_quantized

RULES = {"vocab": "tp", "kv_heads": "tp", "q_heads": "tp", "mlp": "tp", "batch": "dp",
         "expert": "ep", "embed": None}
# Logical axes that must divide their mesh axis (replicating them instead would silently
# multiply memory: the routed experts are most of an MoE model's bytes).
STRICT = ("expert",)

# parameter name -> logical axes (by the last path element; rank checked)
_PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "head": ("embed", "vocab"),
    "qkv": ("embed", "kv_heads", None, None),
    "qkv_bias": ("kv_heads", None, None),
    "qk": ("embed", "kv_heads", None, None),  # q and k when v has its own head dim
    "v": ("embed", "kv_heads", None),
    "gate": ("embed", "kv_heads", None),  # head-wise attention gate [d, k, g]
    "sinks": ("kv_heads", None),  # attention sink logits [k, g]
    "o": ("q_heads", None, "embed"),
    "gate_up": ("embed", None, "mlp"),
    "down": ("mlp", "embed"),
    "proj": (None, "embed"),
    "weight": (None,),
    "experts_gate_up": ("expert", "embed", None, "mlp"),
    "experts_down": ("expert", "mlp", "embed"),
    "router": ("embed", None),
    "router_bias": (None,),
    # MLA (mla.py): heads over tp; the latent projections replicated
    "q": ("embed", "q_heads", None),
    "q_a": ("embed", None),
    "q_b": (None, "q_heads", None),
    "kv_a": ("embed", None),
    "w_uk": ("q_heads", None, None),
    "w_uv": ("q_heads", None, None),
}

_ACTIVE_MESH: contextvars.ContextVar = contextvars.ContextVar("mtp_jax_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: Optional[Mesh]):
    """Make `mesh` the one model code shards over while tracing inside this block."""
    token = _ACTIVE_MESH.set(mesh)
    try:
        yield mesh
    finally:
        _ACTIVE_MESH.reset(token)


def active_mesh() -> Optional[Mesh]:
    return _ACTIVE_MESH.get()


def one_device() -> bool:
    """No multi-device mesh is active. XLA cannot partition a Pallas call, so the model's
    kernels that are not wrapped in `shard_kernel` run only then."""
    mesh = active_mesh()
    return mesh is None or mesh.devices.size == 1


def axis_size(mesh: Optional[Mesh], name: str) -> int:
    """Size of a mesh axis; 1 for no mesh or an axis the mesh does not have."""
    return 1 if mesh is None else dict(mesh.shape).get(name, 1)


def make_mesh(spec: Optional[str], devices=None) -> Optional[Mesh]:
    """A mesh from "tp=N,dp=M,ep=E" (each may be omitted), or None.

    Axes ('dp', 'tp'), or ('dp', 'ep', 'tp') when `ep` is given: tp innermost, so the
    devices of one tensor-parallel group are neighbours (one host, one NVLink domain).
    """
    if not spec:
        return None
    sizes = {"tp": 1, "dp": 1}
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(tp|dp|ep)\s*=\s*(\d+)\s*", part)
        if not m:
            raise ValueError(f"mesh spec {spec!r}: expected 'tp=N,dp=M,ep=E'")
        sizes[m.group(1)] = int(m.group(2))
    names = ("dp", "ep", "tp") if "ep" in sizes else ("dp", "tp")
    devices = list(devices if devices is not None else jax.devices())
    n = int(np.prod([sizes[a] for a in names]))
    if n > len(devices) or n < 1:
        raise ValueError(f"mesh {spec!r} needs {n} devices, {len(devices)} available")
    left_out = sorted({d.process_index for d in devices} - {d.process_index
                                                           for d in devices[:n]})
    if left_out:  # their arrays would have no shard here: every process must take part
        raise ValueError(f"mesh {spec!r} takes {n} of the {len(devices)} devices of "
                         f"{jax.process_count()} processes and leaves process(es) "
                         f"{left_out} out: a mesh of several processes spans all "
                         f"{len(devices)} devices")
    return Mesh(np.asarray(devices[:n]).reshape([sizes[a] for a in names]), names)


def check_mesh(cfg, mesh: Optional[Mesh]) -> None:
    """ConfigError for a mesh the model cannot be split over (before anything is placed)."""
    ep = axis_size(mesh, "ep")
    if ep == 1:
        return
    if cfg.moe is None:
        raise ConfigError(f"mesh axis ep={ep} splits experts, but this model has none "
                          "(use tp / dp for a dense model)")
    if cfg.moe.num_experts % ep:
        raise ConfigError(f"n_routed_experts={cfg.moe.num_experts} does not divide over the "
                          f"ep={ep} mesh axis")


def _spec(mesh: Mesh, axes, shape) -> P:
    out = []
    for ax, dim in zip(axes, shape):
        name = RULES.get(ax) if ax else None
        size = axis_size(mesh, name) if name else 1
        if ax in STRICT and size > 1 and dim % size:
            raise ValueError(f"{dim} experts do not divide over the {name}={size} mesh axis")
        out.append(name if size > 1 and dim % size == 0 else None)
    return P(*out)


def param_spec(mesh: Mesh, path: tuple, shape) -> P:
    axes = _PARAM_AXES.get(path[-1])
    if axes is None or len(axes) != len(shape):
        axes = (None,) * len(shape)
    return _spec(mesh, axes, shape)


def param_value_sharding(mesh: Mesh, path: tuple, v):
    """NamedShardings for a parameter's value: an array, or a QArray (values and scale)."""
    spec = spec_like(v, param_spec(mesh, tuple(path), v.shape), mesh)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), spec,
                                  is_leaf=lambda x: isinstance(x, P))


def spec_like(w, spec, mesh=None):
    """The sharding spec pytree for a parameter: `spec` itself, or for a QArray the spec
    for its values and, for its scale, the same spec on every axis held per element or in
    blocks that divide over the mesh axis (each shard then holds its own rows' scales);
    a whole-axis scale (size 1) or blocks that do not divide stay replicated."""
    if not is_quantized(w):
        return spec
    mesh = mesh if mesh is not None else active_mesh()
    parts = list(spec) + [None] * (w.ndim - len(spec))

    def scale_part(p, s, v):
        if p is None or s == v:
            return p
        names = p if isinstance(p, tuple) else (p,)
        size = math.prod(axis_size(mesh, a) for a in names)
        return p if s > 1 and s % size == 0 else None

    return QArray(P(*parts), P(*[scale_part(p, s, v) for p, s, v in
                                 zip(parts, w.scale.shape, w.shape)]))


def param_sharding(mesh: Optional[Mesh]):
    """`shardings(path, shape)` for checkpoint restore (None -> None)."""
    if mesh is None:
        return None
    return lambda path, shape: NamedSharding(mesh, param_spec(mesh, tuple(path), shape))


def shard_params(params, mesh: Optional[Mesh]):
    """Place an nnx.State of params on the mesh by the table."""
    if mesh is None:
        return params
    for path, var in params.flat_state():
        v = var.get_value()
        var.set_value(jax.device_put(v, param_value_sharding(mesh, tuple(path), v)))
    return params


def state_shardings(state, mesh: Mesh, max_batch: int, linear_layers=()):
    """NamedShardings for a DecodeState: per-slot fields by `dp`, KV pages by `tp`; the
    per-slot states of the linear-attention layers (indices `linear_layers` of `caches`)
    by `dp`."""
    dp = mesh.shape["dp"]
    by_slot = NamedSharding(mesh, P("dp")) if max_batch % dp == 0 else NamedSharding(mesh, P())

    def one(path, x):
        names = [getattr(k, "name", getattr(k, "key", getattr(k, "idx", None))) for k in path]
        if "caches" in names:
            if names[names.index("caches") + 1] in linear_layers:  # [slots, ...]
                return by_slot
            # [kv_heads, pages, page_size, head_dim]
            return NamedSharding(mesh, _spec(mesh, ("kv_heads", None, None, None), x.shape))
        if names and names[0] in ("prefill_tokens", "prefill_hidden") or x.ndim == 0:
            return NamedSharding(mesh, P())
        if x.shape[0] == max_batch and max_batch % dp == 0:
            return NamedSharding(mesh, P("dp", *([None] * (x.ndim - 1))))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, state)


def shard_kernel(fn, mesh: Optional[Mesh], in_specs, out_specs):
    """Run `fn` per shard (kernels XLA cannot partition); identity when mesh is None."""
    if mesh is None:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def kv_heads_axis(mesh: Optional[Mesh], kv_heads: int):
    if mesh is None or mesh.shape["tp"] == 1 or kv_heads % mesh.shape["tp"]:
        return None
    return "tp"


def batch_axis(mesh: Optional[Mesh], batch: int):
    if mesh is None or mesh.shape["dp"] == 1 or batch % mesh.shape["dp"]:
        return None
    return "dp"
