"""Weight-only quantization: int8 / fp8 weights with float32 scales, and the matmuls over them.

A quantized parameter is a `QArray(values, scale)` (qarray.py): values in the parameter's
own layout as int8 or float8_e4m3fn, float32 scales of the same rank, per element or per
block of a contraction axis. So one representation covers

- `int8`:      per output channel, symmetric, scale = max|w| / 127 (gpt-fast's int8);
- `fp8`:       per output channel, float8_e4m3fn, scale = max|w| / 448;
- `fp8-block`: float8_e4m3fn, one scale per 128 contraction rows and output channel;
- FP8 block-scaled checkpoints as DeepSeek publishes them ([128, 128] blocks of an
  [out, in] weight), whose scales are expanded per output channel as they load.

Each module says which of its parameters are matmul weights and which axes they contract
(`QUANT_AXES`, a class attribute); `quantize_module` walks a model and replaces those.
Norms, biases, sinks, the MoE router (float32 for its choices) and MLA's absorbed
per-head matrices (w_uk, w_uv) stay as they are. The embedding is quantized only when it
is also the lm_head (tied), since otherwise only its gathered rows are read.

`qeinsum(spec, x, w)` is `jnp.einsum` for a plain weight; for a QArray it converts the
1-byte values to x's dtype inside the product and applies the scale after it (per
channel: out * scale, exact) or per contraction block (block scales: the Pallas kernel of
`pallas_kernels.quant_matmul` at decode sizes on GPU / TPU, else the dequantized weight).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import invariant

from .config import QUANT_MODES, ConfigError
from .qarray import QArray, expand_scale, is_quantized, value
from .sharding import one_device

MODES = QUANT_MODES
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
BLOCK = 128  # contraction rows per scale in fp8-block mode (DeepSeek's block)
BACKEND_ENV_VAR = "MTP_JAX_QMATMUL_BACKEND"
# Rows (tokens) up to which a product runs in the Pallas kernel on GPU / TPU, set by
# launch/bench_quant_matmul.py (docs/DECISIONS.md, "Quantized weights").
# Block scales: XLA's per-block partials are far slower at decode sizes; above this
# (prefill) the dequantized weight and one dense matmul cost less.
KERNEL_MAX_ROWS = 64
# Per-channel scales: XLA's fused int8 dot catches up with the kernel by 16 rows.
PER_CHANNEL_KERNEL_MAX_ROWS = 8
# Rows up to which the draft reads its head's quantized copy, always through the kernel
# (`qeinsum(..., kernel_rows=)`): the copy must beat the bf16 head in programs of either
# GEMM backend, and XLA's int8 path writes the weights out in bf16 under cuBLAS (the
# decode steps' backend from 64 rows). Set by launch/bench_quant_matmul.py --ms
# 8,16,32,64 (docs/DECISIONS.md, "Draft").
DRAFT_HEAD_MAX_ROWS = 64


class QuantizationError(ConfigError):
    """A quantization request that cannot be honoured (mode, backend, already quantized)."""


def check_mode(mode: Optional[str]) -> Optional[str]:
    if mode in (None, "none", "off", ""):
        return None
    if mode not in MODES:
        raise QuantizationError(f"unknown quantization mode {mode!r}; expected one of "
                                f"{MODES} (or none)")
    return mode


def check_backend(mode: Optional[str], platform: Optional[str] = None) -> None:
    """QuantizationError for fp8 on a device that cannot compute with it, naming the
    fallback: NVIDIA GPUs before compute capability 8.9 have no fp8 conversion."""
    if mode is None or not mode.startswith("fp8"):
        return
    platform = platform or jax.default_backend()
    if platform != "gpu":
        return  # XLA converts float8 on CPU; TPUs since v5 hold fp8
    cap = getattr(jax.devices()[0], "compute_capability", None)
    try:
        ok = cap is None or tuple(int(x) for x in str(cap).split(".")) >= (8, 9)
    except ValueError:
        ok = True
    if not ok:
        raise QuantizationError(
            f"fp8 weights need an NVIDIA GPU of compute capability 8.9 or newer (this one: "
            f"{cap}); use --quantize int8 (same bytes, per-channel int8), or no --quantize "
            "(bfloat16)")


# ----------------------------------------------------------------------- quantizing
def quantize(w, contract: tuple, mode: str, block: int = BLOCK) -> QArray:
    """Quantize weight `w` whose `contract` axes are summed over in its matmul (jnp, so it
    runs where w lives; `quantize_module` jits it per shape)."""
    mode = check_mode(mode)
    w32 = jnp.asarray(w, jnp.float32)
    shape = w32.shape
    keep = [1 if a in contract else n for a, n in enumerate(shape)]
    if mode == "fp8-block":
        keep = _block_keep(shape, contract, block, keep)
    # amax over each block: every axis split into (scales, elements per scale)
    split = []
    for a, n in enumerate(shape):
        split += [keep[a], n // keep[a]]
    amax = jnp.max(jnp.abs(w32.reshape(split)), axis=tuple(range(1, 2 * len(shape), 2)))
    qmax = INT8_MAX if mode == "int8" else FP8_MAX
    scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)
    q = w32 / expand_scale(scale, shape)
    if mode == "int8":
        values = jnp.clip(jnp.round(q), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    else:
        values = jnp.clip(q, -FP8_MAX, FP8_MAX).astype(FP8)
    return QArray(values, scale)


def _block_keep(shape, contract, block, keep) -> list:
    """Scales per axis for blocks of `block` rows of the flattened contraction (innermost
    axis first: a head of 128 dims is one block, two heads of 64 share one)."""
    keep = list(keep)
    rest = block
    for a in sorted(contract, reverse=True):
        n = shape[a]
        if rest == 1:
            keep[a] = n
        elif rest >= n and rest % n == 0:
            rest //= n
        else:
            g = math.gcd(n, rest)
            keep[a] = n // g
            rest = 1
    return keep


def compress_scale(full: np.ndarray, contract: tuple) -> np.ndarray:
    """Per-element scales [values shape] -> the smallest block form (host numpy): along
    each contraction axis the block is the gcd of the axis length and every position
    where the scale changes; other axes stay per element."""
    out = np.asarray(full, np.float32)
    for a in contract:
        n = out.shape[a]
        moved = np.moveaxis(out, a, 0).reshape(n, -1)
        changes = np.nonzero(np.any(moved[1:] != moved[:-1], axis=1))[0] + 1
        b = math.gcd(n, *[int(c) for c in changes]) if len(changes) else n
        out = np.take(out, np.arange(0, n, b), axis=a)
    return out


def mode_of(params) -> Optional[str]:
    """"int8" or "fp8" when a model's params hold quantized weights, else None (the
    quantized copy of the head that only the draft reads, `draft_heads`, does not count)."""
    if "draft_heads" in params:
        params = {k: v for k, v in params.items() if k != "draft_heads"}
    for leaf in jax.tree_util.tree_leaves(params, is_leaf=is_quantized):
        if is_quantized(leaf):
            return "int8" if leaf.values.dtype == jnp.int8 else "fp8"
    return None


def quant_axes(module) -> dict:
    """{state path: contraction axes} of every quantizable parameter under `module`."""
    from flax import nnx

    out = {}
    for path, node in nnx.iter_graph(module):
        axes = getattr(type(node), "QUANT_AXES", None)
        if not axes:
            continue
        for name, contract in axes.items():
            if callable(contract):
                contract = contract(node)
            if contract is not None and getattr(node, name, None) is not None:
                out[tuple(path) + (name,)] = contract
    return out


def quantize_module(module, mode: str):
    """Replace every quantizable parameter of `module` (in place); returns the module."""
    mode = check_mode(mode)
    for path, contract in quant_axes(module).items():
        node = module
        for p in path[:-1]:
            node = node[p] if isinstance(p, int) else getattr(node, p)
        param = getattr(node, path[-1])
        w = param.get_value()
        if is_quantized(w):
            raise QuantizationError(f"parameter {'/'.join(map(str, path))} is already "
                                    "quantized: quantize the unquantized model")
        param.set_value(_quantize_jit(w, tuple(contract), mode))
    return module


def quantize_params(graphdef, params, mode: str):
    """A new params State with every quantizable parameter quantized (the given State is
    left as it is)."""
    from flax import nnx

    module = nnx.merge(graphdef, jax.tree_util.tree_map(lambda x: x, params))
    return nnx.split(quantize_module(module, mode))[1]


_quantize_jit = jax.jit(quantize, static_argnums=(1, 2, 3))


def quantize_array(w, contract, mode: str) -> QArray:
    """`quantize` jitted (one compile per weight shape), on w's devices."""
    return _quantize_jit(w, tuple(contract), check_mode(mode))


# ---------------------------------------------------------------------- the matmul
def qeinsum(spec: str, x, w, *, preferred_element_type=None, kernel_rows=None):
    """`jnp.einsum(spec, x, w)` where w may be a QArray (module docstring).

    Two operands, explicit output, w's letters unique, an ellipsis only leading x and the
    output; the result has x's dtype unless `preferred_element_type` says otherwise (as
    jnp.einsum). `kernel_rows`: the most rows the kernel takes (default by the scales:
    KERNEL_MAX_ROWS, PER_CHANNEL_KERNEL_MAX_ROWS)."""
    w = value(w)
    if not is_quantized(w):
        return invariant.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    ins, out = spec.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    out_dtype = preferred_element_type or x.dtype
    contract = [a for a, c in enumerate(ws) if c not in out]
    per_channel = all(w.scale.shape[a] == 1 for a in contract)
    mat = _as_matrix(xs, ws, out, x.shape, w, contract)
    if mat is not None and not invariant.enabled() and _use_kernel(
            mat, w.scale.size // mat[2], per_channel, w.values.dtype, kernel_rows):
        from pallas_kernels.quant_matmul import quant_matmul

        m, k, n = mat
        y = quant_matmul(x.reshape(m, k), w.values.reshape(k, n), w.scale.reshape(-1, n))
        return y.reshape(x.shape[: x.ndim - len(contract)] + w.shape[len(contract):]
                         ).astype(out_dtype)
    if per_channel:  # out * scale, exact
        y = invariant.einsum(spec, x, w.values.astype(x.dtype),
                             preferred_element_type=jnp.float32)
        keep = [c for a, c in enumerate(ws) if a not in contract]
        named = out.replace("...", "")  # the scale broadcasts over leading ellipsis dims
        s = w.scale.reshape([n for a, n in enumerate(w.scale.shape) if a not in contract])
        s = jnp.transpose(s, [keep.index(c) for c in named if c in keep])
        s = s.reshape([w.shape[ws.index(c)] if c in keep else 1 for c in named])
        return (y * s).astype(out_dtype)
    return invariant.einsum(spec, x, w.dequantize(x.dtype), preferred_element_type=out_dtype)


def _as_matrix(xs, ws, out, x_shape, w: QArray, contract):
    """(M, K, N) when the einsum is x[M, K] @ w[K, N] after reshapes that move no data
    and the scale flattens to [S, N] (uniform blocks of the flattened contraction); else
    None."""
    c = len(contract)
    if contract != list(range(c)) or xs[len(xs) - c:] != ws[:c]:
        return None
    if out != xs[: len(xs) - c] + ws[c:]:
        return None
    sizes, scales = w.shape[:c], w.scale.shape[:c]
    j = next((i for i, (n, s) in enumerate(zip(sizes, scales)) if s != n), c)
    if any(s != 1 for s in scales[j + 1:]):  # full axes, one split axis, then whole axes
        return None
    if any(s != n for s, n in zip(w.scale.shape[c:], w.shape[c:])):
        return None
    return (math.prod(x_shape[: len(x_shape) - c]), math.prod(sizes), math.prod(w.shape[c:]))


def reads_head_copy(rows: int) -> bool:
    """Whether a draft product of `rows` rows reads the quantized copy of its head
    (checkpoint.with_draft_head): up to DRAFT_HEAD_MAX_ROWS, through the kernel, on one
    device (under a multi-device mesh XLA runs every quantized product, and the bf16 head
    streams faster than XLA's path for it in a cuBLAS program)."""
    return rows <= DRAFT_HEAD_MAX_ROWS and one_device()


def _use_kernel(mkn: tuple, s: int, per_channel: bool, values_dtype=None,
                limit=None) -> bool:
    """Whether the Pallas kernel computes x [M, K] @ w [K, N] (S scale rows): a GPU / TPU
    backend (or $MTP_JAX_QMATMUL_BACKEND naming one; `reference` never), decode sizes
    (`limit` rows, else KERNEL_MAX_ROWS, PER_CHANNEL_KERNEL_MAX_ROWS), shapes its blocks
    tile, one device (XLA cannot partition a Pallas call: under a mesh the XLA path runs)."""
    from pallas_kernels.common import resolve_backend
    from pallas_kernels.quant_matmul import fits

    backend = resolve_backend(None, BACKEND_ENV_VAR, "quantized-matmul")
    if limit is None:
        limit = PER_CHANNEL_KERNEL_MAX_ROWS if per_channel else KERNEL_MAX_ROWS
    m, k, n = mkn
    if backend == "reference" or m > limit or not fits(m, k, n, s, backend, values_dtype):
        return False
    return one_device()


# ------------------------------------------------------------------- fp8 KV cache
FP8_KV_DTYPE = "float8_e4m3fn"  # scales per kv head: calibration.calibrate_kv_scales


def latent_row_scale(parts, dim: int, v_dim: int):
    """Per-element scale [dim] of a latent (MLA) cache row from its (latent, rope) scales:
    the first `v_dim` elements are the latent part, the rest the rope part."""
    return jnp.where(jnp.arange(dim) < v_dim, parts[0], parts[1])


__all__ = ["MODES", "QuantizationError", "quantize", "quantize_module", "quantize_params",
           "quantize_array", "quant_axes", "qeinsum", "compress_scale", "mode_of",
           "check_mode", "reads_head_copy", "check_backend", "latent_row_scale",
           "FP8_KV_DTYPE"]
