"""Checkpoints: strict HF safetensors import and export, orbax save / restore, `load`.

The HF key map is derived from the config: every parameter of `MTPModel` lists the HF
tensors it is built from (fused q/k/v and gate/up are joined on load, split on export;
the per-expert `mlp.experts.{e}.*_proj` tensors of an MoE layer are stacked into one
[experts, ...] parameter). Import is strict: a missing, unexpected, duplicate (in two
shards), mis-shaped or non-float tensor is an error naming every offending tensor, raised
from the file headers before any data is read or anything is compiled.

Import streams: tensors are memory-mapped, each parameter is built, converted to its
dtype and placed on its devices before the next one is read, and with shardings each
device's piece is cut from the files directly (an expert-sharded parameter reads only
the experts of that device), so a model larger than host memory loads onto a mesh.
Safetensors files are read and written here directly (header + raw bytes, bf16 and fp8
through ml_dtypes), so truncated files are caught with a clear message.

Block-scaled checkpoints (`quantization_config`: DeepSeek-V3's FP8, or this project's
fp8 / int8 exports): every quantized weight must come with its `<name>_scale_inv` of the
config's block shape. On a GPU or TPU the weights stay quantized on the device (a
`qarray.QArray` per parameter, scales expanded per output channel, the contraction blocks
kept), so a model published in FP8 takes FP8 bytes; on CPU, or with `dequantize=True`,
they are dequantized as they are read (`BlockScaled`) to the load dtype. `load(path,
quantize="int8" | "fp8" | "fp8-block")` quantizes an unquantized checkpoint parameter by
parameter as it loads; `save_hf` / `save_orbax` write a quantized model as it is held, so
quantizing is done once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import re
import struct
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from . import quant
from .config import ConfigError, ModelConfig
from .mtp import MTPModel
from .qarray import QArray, expand_scale, is_quantized, value


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or is unreadable."""


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64, "I64": np.int64, "I32": np.int32, "I16": np.int16,
              "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_FLOAT_CODES = {"F32", "F16", "BF16", "F64"}
_FP8_CODES = {"F8_E4M3", "F8_E5M2"}
_QUANT_CODES = {"e4m3": "F8_E4M3", "int8": "I8"}  # quantization_config.fmt -> stored dtype
SCALE_SUFFIX = "_scale_inv"  # DeepSeek's name for a weight's per-block dequantization scale
_NP_TO_ST = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


# ------------------------------------------------------------------ safetensors I/O
def read_safetensors_header(path: str) -> dict:
    """{name: (dtype_code, shape, (begin, end))} with offsets checked against the file size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 2**20:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors header "
                                  f"(header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: "
                                  f"{type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header")
    out, problems = {}, []
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (b, e) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            problems.append(f"{name}: malformed header entry")
            continue
        ints = all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                   for x in shape + (b, e))
        if not ints:
            problems.append(f"{name}: shape and data offsets must be non-negative integers")
            continue
        if not isinstance(code, str) or code not in _ST_DTYPES:
            problems.append(f"{name}: unsupported dtype {code!r}")
            continue
        nbytes = np.dtype(_ST_DTYPES[code]).itemsize
        for x in shape:  # Python ints: no overflow however large the header claims
            nbytes *= x
        if e - b != nbytes or b < 0:
            problems.append(f"{name}: data offsets {b}..{e} do not match shape {shape} {code}")
        elif e > data_size:
            problems.append(f"{name}: data ends at byte {e} but the file holds {data_size} "
                            "(truncated file)")
        out[name] = (code, shape, (b, e))
    spans = sorted((b, e, name) for name, (_, _, (b, e)) in out.items())
    end, last = 0, None
    for b, e, name in spans:
        if b < end:
            problems.append(f"{name} and {last}: data bytes overlap ({b}..{e})")
        elif b > end:
            problems.append(f"{name}: a gap of {b - end} bytes before its data")
        if e > end:
            end, last = e, name
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    return out


def read_tensor(path: str, header_len_and_entry) -> np.ndarray:
    base, (code, shape, (b, e)) = header_len_and_entry
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=base + b, shape=(e - b,))
    return np.frombuffer(mm, dtype=_ST_DTYPES[code]).reshape(shape)


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata=None) -> None:
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        code = _NP_TO_ST.get(arr.dtype)
        if code is None:
            raise CheckpointError(f"cannot write dtype {arr.dtype} for {name}")
        blob = arr.tobytes()
        header[name] = {"dtype": code, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


# -------------------------------------------------------------- block-scaled weights
class BlockScaled:
    """A quantized weight [out, in] (fp8 or int8) with its per-block scales, read as
    float32 (dequantized).

    weight_scale_inv [ceil(out / bo), ceil(in / bi)]: the real weight is the stored value
    * the scale of its (bo, bi) block (edge blocks partial). Indexing with slices
    dequantizes only that piece, so an expert-sharded parameter still reads only its own
    experts. `scales_only`: the per-element scales of the piece instead (for weights kept
    quantized: the same joins that lay the weight out lay its scales out).
    """

    dtype = np.dtype(np.float32)

    def __init__(self, weight, scale, block, scales_only: bool = False):
        self.weight, self.scale, self.block = weight, scale, block
        self.shape = weight.shape
        self.scales_only = scales_only

    def __getitem__(self, index):
        index = tuple(index) + (slice(None),) * (2 - len(tuple(index)))
        rows, cols = (np.arange(n)[i] for n, i in zip(self.shape, index))
        s = np.asarray(self.scale, np.float32)[np.ix_(np.atleast_1d(rows) // self.block[0],
                                                      np.atleast_1d(cols) // self.block[1])]
        s = s.reshape(np.shape(rows) + np.shape(cols))
        return s if self.scales_only else np.asarray(self.weight[index], np.float32) * s

    def __array__(self, dtype=None, copy=None):
        out = self[:, :]
        return out if dtype is None else out.astype(dtype)


def check_quantized(cfg: ModelConfig, found: dict) -> tuple[dict, list[str]]:
    """Quantized weights and their scales in a checkpoint's headers: ({weight name: scale
    name}, problems). found: {name: (file, base, (code, shape, offsets))}."""
    q = cfg.quantization
    code = _QUANT_CODES[q.fmt] if q is not None else None
    fp8 = sorted(k for k, v in found.items() if v[2][0] in _FP8_CODES or v[2][0] == code)
    scales = sorted(k for k in found if k.endswith(SCALE_SUFFIX))
    if not fp8 and not scales:
        return {}, []
    if q is None:
        return {}, [f"FP8 tensors or scales but config.json has no quantization_config: "
                    f"{(fp8 + scales)[:8]}{' ...' if len(fp8) + len(scales) > 8 else ''}"]
    pairs, problems = {}, []
    no_scale, bad_shape, not_2d, e5m2 = [], [], [], []
    for name in fp8:
        shape = found[name][2][1]
        scale = name + SCALE_SUFFIX
        if found[name][2][0] != code:
            e5m2.append(name)
        if len(shape) != 2:
            not_2d.append(f"{name} {list(shape)}")
        elif scale not in found:
            no_scale.append(name)
        else:
            want = tuple(-(-x // b) for x, b in zip(shape, q.block))
            got = found[scale][2][1]
            if got != want or found[scale][2][0] not in _FLOAT_CODES:
                bad_shape.append(f"{scale} is {list(got)} {found[scale][2][0]}, expected "
                                 f"{list(want)} float for {list(shape)} in {list(q.block)} "
                                 "blocks")
            pairs[name] = scale
    orphan = [s for s in scales if s[:-len(SCALE_SUFFIX)] not in fp8]
    what = "FP8" if q.fmt == "e4m3" else "int8"
    for msg, items in ((f"{what} tensors without scales", no_scale),
                       ("scales of the wrong block shape", bad_shape),
                       (f"scales without an {what} tensor", orphan),
                       (f"{what} tensors that are not 2-D weights", not_2d),
                       (f"quantized tensors not stored as {code} (quantization_config.fmt is "
                        f"{q.fmt})", e5m2)):
        if items:
            problems.append(f"{msg}: {items}")
    return pairs, problems


def keep_quantized(q, dequantize: Optional[bool]) -> bool:
    """Whether a quantized checkpoint stays quantized on the device: as asked, else on a
    GPU (fp8: compute capability 8.9 or newer) or TPU, never on CPU (float32 math there is
    fastest)."""
    if dequantize is not None:
        return not dequantize
    if q is None or jax.default_backend() == "cpu":
        return False
    try:
        quant.check_backend("fp8" if q.fmt == "e4m3" else "int8")
    except quant.QuantizationError:
        return False  # dequantized to the load dtype: the fallback
    return True


# --------------------------------------------------------------------------- key map
@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter: its path in the NNX state and the HF tensors it is made of."""

    path: tuple
    names: tuple  # HF tensor names
    shapes: tuple  # their HF shapes
    join: Callable  # list of HF arrays -> parameter array
    split: Callable  # parameter array -> list of HF arrays
    # (HF arrays, index tuple of slices) -> parameter[index], reading only what it needs;
    # None: join the whole parameter, then slice.
    slice_join: Optional[Callable] = None
    # Several parameters cut from one HF tensor (MLA's kv_b_proj): the first exports it
    # from all of them with `export(flat params)`, the others set `exported` False.
    export: Optional[Callable] = None
    exported: bool = True


def _t(a):
    return np.ascontiguousarray(np.asarray(a).T)


def _linear(path, name, out_dim, in_dim):
    return Entry(path, (name,), ((out_dim, in_dim),), lambda a: _t(a[0]), lambda p: [_t(p)])


def _vector(path, name, dim):
    return Entry(path, (name,), ((dim,),), lambda a: np.asarray(a[0]), lambda p: [np.asarray(p)])


def _block_entries(cfg: ModelConfig, layer: int, path: tuple, prefix: str, *,
                   post_attn_norm: str = "post_attention_layernorm") -> list[Entry]:
    """Attention and FFN tensors of one decoder layer (target or MTP), from its spec."""
    spec = cfg.layer_spec(layer)
    att = spec.attention
    d = cfg.hidden_size
    es = [_vector(path + ("input_norm", "weight"), prefix + "input_layernorm.weight", d),
          _vector(path + ("post_attn_norm", "weight"), prefix + post_attn_norm + ".weight", d)]
    if att.kind == "mla":
        es += _mla_entries(att, d, path + ("attn",), prefix + "self_attn.")
    else:
        es += _gqa_entries(att, d, path + ("attn",), prefix + "self_attn.")
    return es + _ffn_entries(cfg.layout, spec, d, path, prefix)


def _gqa_entries(att, d: int, path: tuple, a: str) -> list[Entry]:
    """q/k/v/o projections (fused as attention.Attention lays them out), biases, q/k norms,
    the head-wise gate `g_proj` and the sink logits of a GQA layer."""
    k, g, h, u = att.num_kv_heads, att.group_size, att.head_dim, att.v_dim
    n = k * g
    fused = u == h  # v in the same parameter as q and k

    def join_qkv(arrs):  # q [n*h, d], k [k*h, d](, v [k*h, d]) -> [d, k, g+2 (g+1), h]
        q, kk, *v = (np.asarray(x) for x in arrs)
        parts = [q.reshape(k, g, h, d), kk.reshape(k, 1, h, d)] + [
            x.reshape(k, 1, h, d) for x in v]
        return np.ascontiguousarray(np.concatenate(parts, axis=1).transpose(3, 0, 1, 2))

    def split_qkv(p):
        w = np.asarray(p).transpose(1, 2, 3, 0)  # [k, g+2 (g+1), h, d]
        out = [w[:, :g].reshape(n * h, d), w[:, g].reshape(k * h, d)]
        return out + ([w[:, g + 1].reshape(k * h, d)] if fused else [])

    def join_bias(arrs):
        q, kk, v = (np.asarray(x) for x in arrs)
        return np.concatenate([q.reshape(k, g, h), kk.reshape(k, 1, h), v.reshape(k, 1, h)], 1)

    def split_bias(p):
        p = np.asarray(p)
        return [p[:, :g].reshape(n * h), p[:, g].reshape(k * h), p[:, g + 1].reshape(k * h)]

    proj = ("q_proj", "k_proj", "v_proj") if fused else ("q_proj", "k_proj")
    es = [Entry(path + ("qkv" if fused else "qk",), tuple(a + x + ".weight" for x in proj),
                ((n * h, d), (k * h, d), (k * h, d))[: len(proj)], join_qkv, split_qkv),
          Entry(path + ("o",), (a + "o_proj.weight",), ((d, n * u),),
                lambda arrs: np.ascontiguousarray(np.asarray(arrs[0]).T.reshape(n, u, d)),
                lambda p: [_t(np.asarray(p).reshape(n * u, d))])]
    if not fused:
        es.append(Entry(path + ("v",), (a + "v_proj.weight",), ((k * u, d),),
                        lambda arrs: np.ascontiguousarray(_t(arrs[0]).reshape(d, k, u)),
                        lambda p: [_t(np.asarray(p).reshape(d, k * u))]))
    if att.qkv_bias:
        es.append(Entry(path + ("qkv_bias",), (a + "q_proj.bias", a + "k_proj.bias",
                                              a + "v_proj.bias"),
                        ((n * h,), (k * h,), (k * h,)), join_bias, split_bias))
    if att.qk_norm:
        es.append(_vector(path + ("q_norm", "weight"), a + "q_norm.weight", h))
        es.append(_vector(path + ("k_norm", "weight"), a + "k_norm.weight", h))
    if att.gate:  # Step-3.5 g_proj [n, d] -> [d, k, g]
        es.append(Entry(path + ("gate",), (a + "g_proj.weight",), ((n, d),),
                        lambda arrs: np.ascontiguousarray(_t(arrs[0]).reshape(d, k, g)),
                        lambda p: [_t(np.asarray(p).reshape(d, n))]))
    if att.sinks:  # MiMo-V2 attention_sink_bias [n] -> [k, g]
        es.append(Entry(path + ("sinks",), (a + "attention_sink_bias",), ((n,),),
                        lambda arrs: np.asarray(arrs[0]).reshape(k, g),
                        lambda p: [np.asarray(p).reshape(n)]))
    return es


def _ffn_entries(layout: str, spec, d: int, path: tuple, prefix: str) -> list[Entry]:
    if spec.is_moe and layout == "step3p5":
        return _stacked_moe_entries(spec.ffn, d, path + ("mlp",), prefix)
    if spec.is_moe:
        return _moe_entries(spec.ffn, d, path + ("mlp",), prefix + "mlp.")
    return _swiglu_entries(d, spec.ffn.intermediate_size, path + ("mlp",), prefix + "mlp.")


def _rope_order(e: int, interleaved: bool) -> np.ndarray:
    """Where each stored rope dim comes from: DeepSeek publishes the rope dims of q and
    k_pe as interleaved pairs (x0, x1), (x2, x3), ...; the model rotates halves, so pair i
    becomes dims (i, i + e/2). Permuting q and k alike leaves every score unchanged."""
    if not interleaved:
        return np.arange(e)
    return np.concatenate([np.arange(0, e, 2), np.arange(1, e, 2)])


def _mla_entries(att, d: int, path: tuple, a: str) -> list[Entry]:
    """MLA projections (mla.py layouts) from DeepSeek's q(_a/_b)_proj, kv_a_proj_with_mqa,
    kv_b_proj (split into w_uk / w_uv) and o_proj."""
    m, n = att.mla, att.num_heads
    p, e, r, v, qk = m.qk_nope_dim, m.qk_rope_dim, m.kv_lora_rank, m.v_head_dim, m.qk_head_dim
    order = _rope_order(e, m.rope_interleave)
    inverse = np.argsort(order)

    def q_join(arrs):  # [n * qk, in] -> [in, n, qk], rope dims reordered
        w = np.asarray(arrs[0]).reshape(n, qk, -1)
        w = np.concatenate([w[:, :p], w[:, p:][:, order]], axis=1)
        return np.ascontiguousarray(w.transpose(2, 0, 1))

    def q_split(w):
        w = np.asarray(w).transpose(1, 2, 0)
        w = np.concatenate([w[:, :p], w[:, p:][:, inverse]], axis=1)
        return [w.reshape(n * qk, -1)]

    def kv_a_join(arrs):  # [r + e, d] -> [d, r + e]
        w = np.asarray(arrs[0])
        return _t(np.concatenate([w[:r], w[r:][order]], axis=0))

    def kv_a_split(w):
        w = _t(w)
        return [np.concatenate([w[:r], w[r:][inverse]], axis=0)]

    kv_b = a + "kv_b_proj.weight"

    def kv_b_export(flat):
        uk = np.asarray(flat[path + ("w_uk",)], np.float32)             # [n, p, r]
        uv = np.asarray(flat[path + ("w_uv",)], np.float32).transpose(0, 2, 1)  # [n, v, r]
        return [np.concatenate([uk, uv], axis=1).reshape(n * (p + v), r)]

    es = []
    if m.q_lora_rank is None:
        es.append(Entry(path + ("q",), (a + "q_proj.weight",), ((n * qk, d),), q_join, q_split))
    else:
        c = m.q_lora_rank
        es += [_linear(path + ("q_a",), a + "q_a_proj.weight", c, d),
               _vector(path + ("q_a_norm", "weight"), a + "q_a_layernorm.weight", c),
               Entry(path + ("q_b",), (a + "q_b_proj.weight",), ((n * qk, c),), q_join,
                     q_split)]
    es += [
        Entry(path + ("kv_a",), (a + "kv_a_proj_with_mqa.weight",), ((r + e, d),), kv_a_join,
              kv_a_split),
        _vector(path + ("kv_a_norm", "weight"), a + "kv_a_layernorm.weight", r),
        Entry(path + ("w_uk",), (kv_b,), ((n * (p + v), r),),
              lambda arrs: np.ascontiguousarray(np.asarray(arrs[0]).reshape(n, p + v, r)[:, :p]),
              None, export=kv_b_export),
        Entry(path + ("w_uv",), (kv_b,), ((n * (p + v), r),),
              lambda arrs: np.ascontiguousarray(
                  np.asarray(arrs[0]).reshape(n, p + v, r)[:, p:].transpose(0, 2, 1)),
              None, exported=False),
        Entry(path + ("o",), (a + "o_proj.weight",), ((d, n * v),),
              lambda arrs: np.ascontiguousarray(np.asarray(arrs[0]).T.reshape(n, v, d)),
              lambda w: [_t(np.asarray(w).reshape(n * v, d))]),
    ]
    return es


def _swiglu_entries(d: int, f: int, path: tuple, prefix: str) -> list[Entry]:
    """A SwiGLU MLP: gate_proj / up_proj [f, d] -> gate_up [d, 2, f]; down_proj [d, f]."""
    def join_gu(arrs):
        return np.ascontiguousarray(np.stack([np.asarray(arrs[0]).T, np.asarray(arrs[1]).T], 1))

    def split_gu(p):
        p = np.asarray(p)
        return [_t(p[:, 0]), _t(p[:, 1])]

    return [Entry(path + ("gate_up",), (prefix + "gate_proj.weight", prefix + "up_proj.weight"),
                  ((f, d), (f, d)), join_gu, split_gu),
            _linear(path + ("down",), prefix + "down_proj.weight", d, f)]


def _moe_entries(moe, d: int, path: tuple, prefix: str) -> list[Entry]:
    """Router, per-expert tensors stacked over experts, shared experts (DeepSeek / GLM)."""
    e_n, f = moe.num_experts, moe.intermediate_size
    ex = [f"{prefix}experts.{e}." for e in range(e_n)]

    def experts_of(index):
        return range(*index[0].indices(e_n))

    # Each filled into one preallocated array, so building a parameter (or a device's
    # piece of it) holds it once in host memory, converted as it is read.
    def gate_up_slice(arrs, index, dtype=None):  # arrs: gate_e, then up_e, each [f, d]
        _, dsl, csl, fsl = index
        es = experts_of(index)
        gate_up = (0, 1)[csl]
        probe = arrs[0][fsl, dsl]
        out = np.empty((len(es), probe.shape[1], len(gate_up), probe.shape[0]),
                       dtype or probe.dtype)
        for i, e in enumerate(es):
            for j, c in enumerate(gate_up):
                out[i, :, j] = np.asarray(arrs[c * e_n + e][fsl, dsl]).T
        return out

    def down_slice(arrs, index, dtype=None):  # arrs: down_e [d, f] -> parameter [e, f, d]
        _, fsl, dsl = index
        es = experts_of(index)
        probe = arrs[0][dsl, fsl]
        out = np.empty((len(es), probe.shape[1], probe.shape[0]), dtype or probe.dtype)
        for i, e in enumerate(es):
            out[i] = np.asarray(arrs[e][dsl, fsl]).T
        return out

    full4, full3 = (slice(None),) * 4, (slice(None),) * 3

    def split_gate_up(p):
        p = np.asarray(p)
        return [_t(p[e, :, 0]) for e in range(e_n)] + [_t(p[e, :, 1]) for e in range(e_n)]

    es = [
        _linear(path + ("router",), prefix + "gate.weight", e_n, d),
        Entry(path + ("experts_gate_up",),
              tuple(x + "gate_proj.weight" for x in ex) + tuple(x + "up_proj.weight" for x in ex),
              ((f, d),) * (2 * e_n), lambda arrs: gate_up_slice(arrs, full4), split_gate_up,
              gate_up_slice),
        Entry(path + ("experts_down",), tuple(x + "down_proj.weight" for x in ex),
              ((d, f),) * e_n, lambda arrs: down_slice(arrs, full3),
              lambda p: [_t(q) for q in np.asarray(p)], down_slice),
    ]
    if moe.score_bias:
        es.append(_vector(path + ("router_bias",), prefix + "gate.e_score_correction_bias", e_n))
    if moe.shared_size:
        es += _swiglu_entries(d, moe.shared_size, path + ("shared",),
                              prefix + "shared_experts.")
    return es


def _stacked_moe_entries(moe, d: int, path: tuple, prefix: str) -> list[Entry]:
    """Step-3.5's MoE tensors: the experts stacked per layer, `moe.{gate,up}_proj.weight`
    [e, f, d] and `moe.down_proj.weight` [e, d, f], the router `moe.gate.weight` and its
    `moe.router_bias`, the shared expert `share_expert.*` beside `moe.` (not inside)."""
    e_n, f = moe.num_experts, moe.intermediate_size
    m = prefix + "moe."

    def gate_up_slice(arrs, index, dtype=None):  # parameter [e, d, 2, f]
        esl, dsl, csl, fsl = index
        parts = [np.asarray(arrs[c][esl, fsl, dsl]) for c in (0, 1)[csl]]
        out = np.stack([p.transpose(0, 2, 1) for p in parts], axis=2)
        return out if dtype is None else out.astype(dtype, copy=False)

    def down_slice(arrs, index, dtype=None):  # parameter [e, f, d] from [e, d, f]
        esl, fsl, dsl = index
        out = np.asarray(arrs[0][esl, dsl, fsl]).transpose(0, 2, 1)
        return out if dtype is None else out.astype(dtype, copy=False)

    full4, full3 = (slice(None),) * 4, (slice(None),) * 3
    es = [
        _linear(path + ("router",), m + "gate.weight", e_n, d),
        Entry(path + ("experts_gate_up",), (m + "gate_proj.weight", m + "up_proj.weight"),
              ((e_n, f, d), (e_n, f, d)), lambda arrs: gate_up_slice(arrs, full4),
              lambda p: [np.ascontiguousarray(np.asarray(p)[:, :, c].transpose(0, 2, 1))
                         for c in (0, 1)], gate_up_slice),
        Entry(path + ("experts_down",), (m + "down_proj.weight",), ((e_n, d, f),),
              lambda arrs: down_slice(arrs, full3),
              lambda p: [np.ascontiguousarray(np.asarray(p).transpose(0, 2, 1))], down_slice),
    ]
    if moe.score_bias:
        es.append(_vector(path + ("router_bias",), m + "router_bias", e_n))
    if moe.shared_size:
        es += _swiglu_entries(d, moe.shared_size, path + ("shared",), prefix + "share_expert.")
    return es


def hf_key_map(cfg: ModelConfig) -> list[Entry]:
    """Every parameter of the model with the HF tensors it is built from."""
    d, v = cfg.hidden_size, cfg.vocab_size
    es = [Entry(("target", "embed"), ("model.embed_tokens.weight",), ((v, d),),
                lambda a: np.asarray(a[0]), lambda p: [np.asarray(p)]),
          _vector(("target", "final_norm", "weight"), "model.norm.weight", d)]
    if not cfg.tie_word_embeddings:
        es.append(_linear(("target", "lm_head"), "lm_head.weight", v, d))
    for i in range(cfg.num_layers):
        es += _block_entries(cfg, i, ("target", "layers", i), f"model.layers.{i}.")

    def mtp_input(path, enorm, hnorm, proj, final):
        return [_vector(path + ("enorm", "weight"), enorm, d),
                _vector(path + ("hnorm", "weight"), hnorm, d),
                _linear(path + ("proj",), proj, d, 2 * d),
                _vector(path + ("final_norm", "weight"), final, d)]

    for k in range(cfg.num_mtp_modules):
        path = ("mtp", k)
        if cfg.layout == "mimo":
            p = f"model.mtp_layers.{k}."
            es += mtp_input(path + ("input",), p + "token_layernorm.weight",
                            p + "hidden_layernorm.weight", p + "input_proj.weight",
                            p + "final_layernorm.weight")
        elif cfg.layout in ("deepseek_v3", "glm4_moe"):
            p = f"model.layers.{cfg.num_layers + k}."
            es += mtp_input(path + ("input",), p + "enorm.weight", p + "hnorm.weight",
                            p + "eh_proj.weight", p + "shared_head.norm.weight")
        elif cfg.layout == "step3p5":  # the head under `transformer.shared_head`
            p = f"model.layers.{cfg.num_layers + k}."
            es += mtp_input(path + ("input",), p + "enorm.weight", p + "hnorm.weight",
                            p + "eh_proj.weight", p + "transformer.shared_head.norm.weight")
        elif cfg.layout == "mimo_v2_flash":
            p = f"model.mtp.layers.{k}."
            es += mtp_input(path + ("input",), p + "enorm.weight", p + "hnorm.weight",
                            p + "eh_proj.weight", p + "final_layernorm.weight")
        else:  # qwen3_next
            p = f"mtp.layers.{k}."
        # MiMo-V2's MTP block names its post-attention norm pre_mlp_layernorm.
        post = "pre_mlp_layernorm" if cfg.layout == "mimo_v2_flash" else "post_attention_layernorm"
        es += _block_entries(cfg, cfg.num_layers + k, path + ("block",), p, post_attn_norm=post)
        if cfg.mtp_own_head:
            head = ("transformer.shared_head.output.weight" if cfg.layout == "step3p5"
                    else "shared_head.head.weight")
            es.append(_linear(path + ("head",), p + head, v, d))
        if cfg.mtp_own_embed:
            es.append(Entry(path + ("embed",), (p + "embed_tokens.weight",), ((v, d),),
                            lambda a: np.asarray(a[0]), lambda q: [np.asarray(q)]))
    if cfg.mtp_shared_input and cfg.num_mtp_modules:
        es += mtp_input(("mtp_shared",), "mtp.pre_fc_norm_embedding.weight",
                        "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight", "mtp.norm.weight")
    return es


# ----------------------------------------------------------------------------- Model
@dataclasses.dataclass
class Model:
    """A loaded model: config, NNX graph definition, parameters and tokenizer (if any)."""

    config: ModelConfig
    graphdef: Any
    params: Any  # nnx.State
    tokenizer: Any = None  # tokenizers.Tokenizer
    eos_token_ids: tuple = ()
    path: Optional[str] = None
    # fp8 KV cache scales per layer ((k [H], v [H]) floats), from kv_scales.json beside
    # the weights or set with calibration.calibrate_kv_scales; None: calibrated when needed
    kv_scales: Optional[tuple] = None

    def module(self) -> MTPModel:
        return nnx.merge(self.graphdef, self.params)

    @property
    def dtype(self):
        """The model's compute dtype (that of its unquantized parameters, the norms')."""
        return self.params["target"]["final_norm"]["weight"][...].dtype


def abstract_model(cfg: ModelConfig, dtype):
    return nnx.eval_shape(lambda: MTPModel(cfg, dtype=dtype, rngs=nnx.Rngs(params=0)))


def from_params(cfg: ModelConfig, flat: dict, dtype, **extra) -> Model:
    """Build a Model from {state path: array}; every parameter must be present.

    Each parameter takes the dtype the module gives it: `dtype`, except the few kept in
    float32 whatever the model dtype (the MoE router)."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    missing = []
    for path, var in state.flat_state():
        if tuple(path) not in flat:
            missing.append("/".join(map(str, path)))
            continue
        v = flat[tuple(path)]
        var.set_value(v if is_quantized(v) else jnp.asarray(v, var.get_value().dtype))
    if missing:
        raise CheckpointError(f"parameters not provided: {missing}")
    return Model(cfg, graphdef, state, **extra)


def with_params(model: Model, cfg: ModelConfig, flat: dict) -> Model:
    """`model` rebuilt from {state path: array} under config `cfg` (its dtype, tokenizer,
    eos ids, path and KV scales kept): for transforms that add or replace parameters."""
    extra = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
             if f.name not in ("config", "graphdef", "params")}
    return from_params(cfg, flat, model.dtype, **extra)


def to_flat(params) -> dict:
    return {tuple(p): v.get_value() for p, v in params.flat_state()}


def _hf_files(path: str) -> tuple[list[str], Optional[dict]]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        missing = [x for x in files if not os.path.exists(os.path.join(path, x))]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return [os.path.join(path, x) for x in files], weight_map
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single], None
    found = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
    if not found:
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    raise CheckpointError(f"{path}: found {found} but no model.safetensors.index.json to "
                          "say how they form one checkpoint")


def load_hf(path: str, *, dtype=None, config: Optional[ModelConfig] = None,
            shardings: Optional[Callable] = None, quantize: Optional[str] = None,
            dequantize: Optional[bool] = None) -> Model:
    """Strict import of an HF-layout folder (config.json + safetensors, single or sharded).

    shardings: `shardings(param path, shape) -> jax.sharding.Sharding`, or None for the
    first device. Parameters are streamed onto their devices one at a time (module doc).
    quantize: None, or a `quant.MODES` mode: each matmul weight is quantized on its
    devices as soon as it is placed. dequantize: for a block-scaled checkpoint, True
    dequantizes to `dtype`, False keeps the weights quantized, None decides by device
    (`keep_quantized`).
    """
    mode = quant.check_mode(quantize)
    cfg = config or ModelConfig.from_hf(path)
    if mode is not None and cfg.quantization is not None:
        raise quant.QuantizationError(
            f"{path} is already quantized ({cfg.quantization.fmt} in "
            f"{list(cfg.quantization.block)} blocks): load it without quantize=, or quantize "
            "its unquantized checkpoint")
    quant.check_backend(mode)
    dtype = jnp.dtype(dtype or cfg.dtype)
    files, weight_map = _hf_files(path)
    found: dict[str, tuple] = {}
    dup: dict[str, list] = {}
    for fpath in files:
        with open(fpath, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8)) if os.path.getsize(fpath) >= 8 else (0,)
        for name, entry in read_safetensors_header(fpath).items():
            if name in found:
                dup.setdefault(name, [found[name][0]]).append(fpath)
            found[name] = (fpath, 8 + n, entry)
    found = _canonical_names(cfg.layout, found)
    if config is None:
        cfg = _mtp_tensors_present(cfg, found)
        cfg = _count_mtp_layers(path, cfg, found)
    fp8, problems = check_quantized(cfg, found)
    scale_of = {w: found.pop(sc) for w, sc in fp8.items()}
    entries = hf_key_map(cfg)
    expected = {nm: shp for e in entries for nm, shp in zip(e.names, e.shapes)}
    if dup:
        problems.append("duplicate tensors (in several files): " + ", ".join(
            f"{k} in {[os.path.basename(x) for x in v]}" for k, v in sorted(dup.items())))
    missing = sorted(set(expected) - set(found))
    if missing:
        problems.append(f"missing tensors: {missing}")
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected}")
    shaped = sorted(f"{k} has shape {list(found[k][2][1])}, expected {list(expected[k])}"
                    for k in set(found) & set(expected) if found[k][2][1] != tuple(expected[k]))
    if shaped:
        problems.append("mis-shaped tensors: " + "; ".join(shaped))
    typed = sorted(f"{k} has dtype {found[k][2][0]}" for k in set(found) & set(expected)
                   if found[k][2][0] not in _FLOAT_CODES and k not in fp8)
    if typed:
        problems.append("non-float tensors where weights are expected: " + "; ".join(typed))
    if weight_map is not None:
        wrong = sorted(k for k, (fp, _, _) in found.items()
                       if k in weight_map and os.path.basename(fp) != weight_map[k])
        unindexed = sorted(k for k in found if k not in weight_map)
        if wrong:
            problems.append(f"tensors stored in a different shard than the index says: {wrong}")
        if unindexed:
            problems.append(f"tensors missing from the index: {unindexed}")
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match its config "
                              f"({cfg.layout}): " + " | ".join(problems))
    abstract = abstract_model(cfg, dtype)
    axes = quant.quant_axes(abstract)
    _, state = nnx.split(abstract)
    want = {tuple(p): v.get_value() for p, v in state.flat_state()}
    keep = bool(scale_of) and keep_quantized(cfg.quantization, dequantize)
    flat, nonfinite, inflight = {}, [], []
    for e in entries:
        # device_put is asynchronous and holds its host array until the copy is done: at
        # most one parameter's copy runs behind this read, else a disk faster than the
        # copies would pile up host arrays (host memory stays near one parameter)
        while len(inflight) > 1:
            jax.block_until_ready(flat[inflight.pop(0)])
        inflight.append(e.path)
        raw = [read_tensor(found[name][0], found[name][1:]) for name in e.names]
        if keep and e.path in axes and all(nm in scale_of for nm in e.names):
            scales = [BlockScaled(a, read_tensor(scale_of[nm][0], scale_of[nm][1:]),
                                  cfg.quantization.block, scales_only=True)
                      for nm, a in zip(e.names, raw)]
            flat[e.path] = _place_quantized(e, raw, scales, axes[e.path],
                                            cfg.quantization.block[1], want[e.path],
                                            shardings, nonfinite)
            continue
        arrs = [BlockScaled(a, read_tensor(scale_of[nm][0], scale_of[nm][1:]),
                            cfg.quantization.block) if nm in scale_of else a
                for nm, a in zip(e.names, raw)]
        flat[e.path] = _place(e, arrs, want[e.path], shardings, nonfinite)
        if mode is not None and e.path in axes:
            flat[e.path] = quant.quantize_array(flat[e.path], axes[e.path], mode)
        del arrs, raw
    if nonfinite:
        raise CheckpointError(f"{path}: tensors holding NaN or Inf: {sorted(nonfinite)}")
    return from_params(cfg, flat, dtype, eos_token_ids=_eos_ids(path), path=path,
                       tokenizer=load_tokenizer(path), kv_scales=load_kv_scales(path, cfg))


def _mtp_tensors_present(cfg: ModelConfig, found: dict) -> ModelConfig:
    """GLM-4.5 publishes each MTP layer's own embed_tokens and shared_head.head; GLM-4.6
    and later leave them out and share the target's. Which one this checkpoint is comes
    from its tensor names (all MTP layers alike, else the strict check names the odd ones)."""
    if cfg.layout != "glm4_moe" or not cfg.num_mtp_modules:
        return cfg
    layers = [f"model.layers.{cfg.num_layers + k}." for k in range(cfg.num_mtp_modules)]
    return dataclasses.replace(
        cfg, mtp_own_embed=all(p + "embed_tokens.weight" in found for p in layers),
        mtp_own_head=all(p + "shared_head.head.weight" in found for p in layers))


# Other spellings of published tensor names, rewritten to the one hf_key_map uses:
# Step-3.5's MTP head with or without the `transformer.` level (vLLM accepts both), and
# MiMo-V2's sinks under transformers' name.
_ALIASES = {
    "step3p5": [(re.compile(r"^(model\.layers\.\d+\.)shared_head\."),
                 r"\1transformer.shared_head.")],
    "mimo_v2_flash": [(re.compile(r"\.self_attn\.sinks$"), ".self_attn.attention_sink_bias")],
}


def _canonical_names(layout: str, found: dict) -> dict:
    rules = _ALIASES.get(layout)
    if not rules:
        return found
    out = {}
    for name, where in found.items():
        for pattern, repl in rules:
            name = pattern.sub(repl, name)
        if name in out:
            raise CheckpointError(f"tensor {name} is stored twice (under two spellings)")
        out[name] = where
    return out


def _count_mtp_layers(path: str, cfg: ModelConfig, found: dict) -> ModelConfig:
    """MiMo-V2-Flash's config.json does not say how many MTP layers the checkpoint holds:
    count the `model.mtp.layers.{k}.` prefixes (the strict check then wants each whole)."""
    if cfg.layout != "mimo_v2_flash" or cfg.num_mtp_modules:
        return cfg
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    if "num_nextn_predict_layers" in raw:
        return cfg
    ks = {int(m.group(1)) for m in map(re.compile(r"^model\.mtp\.layers\.(\d+)\.").match,
                                       found) if m}
    if not ks:
        return cfg
    return ModelConfig.from_hf(raw, mtp_layers=max(ks) + 1)


def _place(e: Entry, arrs, want, shardings, nonfinite: list):
    """One parameter from its (memory-mapped) HF arrays, converted and on its devices."""
    def finite(piece):
        if not np.all(np.isfinite(piece)):  # name the tensors that hold them
            nonfinite.extend(n for n, a in zip(e.names, arrs)
                             if n not in nonfinite and not np.all(np.isfinite(np.asarray(a))))
        return piece

    sh = shardings(e.path, want.shape) if shardings else None
    if e.slice_join is not None:  # each device reads only its own piece from the files
        def piece(idx):
            return finite(e.slice_join(arrs, _full_index(idx, want.shape), want.dtype))
        if sh is None:  # uncommitted, on the default device, like every jnp array
            return _to_device(piece(()))
        return jax.make_array_from_callback(want.shape, sh, lambda idx: _owned(piece(idx)))
    full = finite(e.join(arrs).astype(want.dtype, copy=False))
    if sh is None:
        return _to_device(full)
    return jax.make_array_from_callback(want.shape, sh, lambda idx: _owned(full[idx]))


def _place_quantized(e: Entry, values, scales, contract, block_in: int, want, shardings,
                     nonfinite: list):
    """One parameter kept quantized: its stored values laid out by the entry's join, and
    its per-element scales laid out the same way, then compressed to blocks along the
    contraction axes (`quant.compress_scale`). An entry that reads experts piecewise
    (slice_join) takes every `block_in`-th scale along its contraction axis directly, so
    the per-element scales of a whole expert stack are never built."""
    full = (slice(None),) * len(want.shape)
    if e.slice_join is not None:
        vals = e.slice_join(values, full, None)
        c = contract[0]
        step = tuple(slice(None, None, block_in) if a == c else slice(None)
                     for a in range(len(want.shape)))
        scale = quant.compress_scale(e.slice_join(scales, step, np.float32), contract)
    else:
        vals = e.join(values)
        scale = quant.compress_scale(e.join(scales), contract)
    if vals.shape != want.shape:
        raise CheckpointError(f"{'/'.join(map(str, e.path))}: quantized values laid out as "
                              f"{vals.shape}, expected {want.shape}")
    if not (np.all(np.isfinite(scale)) and np.all(np.isfinite(vals.astype(np.float32)))):
        nonfinite.extend(n for n in e.names if n not in nonfinite)
    sh = shardings(e.path, want.shape) if shardings else None
    if sh is None:
        return QArray(_to_device(vals), _to_device(scale))
    # the scale is small: replicated on the value's devices until the engine places the
    # parameter by the sharding table (sharding.param_value_sharding)
    rep = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec())
    return QArray(jax.make_array_from_callback(vals.shape, sh, lambda i: _owned(vals[i])),
                        jax.device_put(scale, rep))


def _to_device(host):
    """A device copy of a host array (never an alias of the memory-mapped file), made
    without compiling anything: a broken checkpoint fails before any XLA compile."""
    return jax.device_put(_owned(host), may_alias=False)


def _owned(host: np.ndarray) -> np.ndarray:
    """`host`, or a copy of it where it is a view of a memory-mapped checkpoint file.
    On CPU the runtime may keep a host array's memory as the device buffer instead of
    copying it, `may_alias=False` notwithstanding (jaxlib 0.10), and a loaded parameter
    must neither change nor fault when its file is rewritten."""
    base = host
    while base is not None:
        if isinstance(base, (np.memmap, mmap.mmap)):
            return np.array(host)
        base = getattr(base, "base", None)
    return host


def _full_index(index, shape) -> tuple:
    """A device's index as one slice per dimension."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
    return tuple(x if isinstance(x, slice) else slice(x, x + 1) for x in index)


def _refuse_run_time_options(model: Model) -> None:
    if model.config.draft_vocab_size:
        raise CheckpointError("this model drafts over a reduced vocabulary, a run-time "
                              "option: save the model it was made from and pass the ids "
                              "file with --draft-vocab")
    if model.config.draft_head:
        raise CheckpointError("this model's draft reads a quantized copy of its head, a "
                              "run-time option: save the model it was made from and pass "
                              f"--draft-head {model.config.draft_head}")


def save_hf(model: Model, path: str, *, dtype=None, max_shard_bytes: Optional[int] = None,
            extra_config: Optional[dict] = None) -> None:
    """Export in the HF layout of `model.config.layout` (sharded if max_shard_bytes is set)."""
    _refuse_run_time_options(model)
    os.makedirs(path, exist_ok=True)
    cfg = model.config
    dt = np.dtype(ml_dtypes.bfloat16) if (dtype or cfg.dtype) == "bfloat16" else np.dtype(
        dtype or cfg.dtype)
    flat = to_flat(model.params)
    tensors, scales = {}, {}
    for e in hf_key_map(cfg):
        # The router bias is published in float32 whatever the weights' dtype.
        if not e.exported:
            continue
        v = flat[e.path]
        if is_quantized(v):  # stored as held: values and per-element scales
            vals = np.asarray(v.values)
            full = expand_scale(np.asarray(v.scale), vals.shape)
            for name, arr, sc in zip(e.names, e.split(vals), e.split(full)):
                tensors[name], scales[name] = np.asarray(arr), np.asarray(sc, np.float32)
            continue
        to = np.float32 if e.path[-1] == "router_bias" else dt
        arrays = (e.export(flat) if e.export is not None
                  else e.split(np.asarray(v, np.float32)))
        for name, arr in zip(e.names, arrays):
            tensors[name] = np.asarray(arr).astype(to)
    quant_config = _block_scales(tensors, scales)
    hf = cfg.to_hf()
    hf["torch_dtype"] = str(dt) if dt != np.dtype(ml_dtypes.bfloat16) else "bfloat16"
    if model.eos_token_ids:
        hf["eos_token_id"] = list(model.eos_token_ids)
    if quant_config:
        hf["quantization_config"] = quant_config
    hf.update(extra_config or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    save_kv_scales(model, path)
    if not max_shard_bytes:
        write_safetensors(os.path.join(path, "model.safetensors"), tensors)
        return
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        nb = tensors[name].nbytes
        if cur and size + nb > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += nb
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(path, fname), shard)
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                   "weight_map": weight_map}, f, indent=2)


def _block_scales(tensors: dict, scales: dict) -> Optional[dict]:
    """Add `<name>_scale_inv` [out, in / B] beside every quantized tensor of `tensors`
    (scales: their per-element [out, in] scales) and return the quantization_config: one
    block [1, B] for the whole checkpoint, B the largest input block every tensor's
    scales are constant over (per-channel tensors: any divisor of their input dim)."""
    if not scales:
        return None
    blocks = [sc.shape[1] // quant.compress_scale(sc, (1,)).shape[1] for sc in scales.values()]
    b = math.gcd(*blocks)
    for name, sc in scales.items():
        tensors[name + SCALE_SUFFIX] = np.ascontiguousarray(sc[:, ::b])
    if all(tensors[n].dtype == np.int8 for n in scales):
        return {"quant_method": "mtp_jax", "fmt": "int8", "weight_block_size": [1, b]}
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [1, b]}


KV_SCALES_FILE = "kv_scales.json"


def save_kv_scales(model: Model, path: str) -> None:
    if model.kv_scales is not None:
        with open(os.path.join(path, KV_SCALES_FILE), "w") as f:
            json.dump({"format": "per layer (target, then MTP): [k scales, v scales] per "
                                 "kv head", "scales": [list(map(list, x))
                                                       for x in model.kv_scales]}, f)


def load_kv_scales(path: str, cfg: ModelConfig) -> Optional[tuple]:
    """fp8 KV scales saved beside a model (CheckpointError if they do not fit it)."""
    f = os.path.join(path, KV_SCALES_FILE)
    if not os.path.exists(f):
        return None
    try:
        with open(f) as fh:
            raw = json.load(fh)["scales"]
        scales = tuple((tuple(float(x) for x in k), tuple(float(x) for x in v))
                       for k, v in raw)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{f}: unreadable: {type(e).__name__}: {e}") from None
    want = cfg.num_layers + cfg.num_mtp_modules
    # per layer (k, v) scale counts: a latent (MLA) row has two parts and no v
    shape = [(2, 0) if cfg.mla is not None else (cfg.heads_of(i)[1],) * 2
             for i in range(want)]
    if len(scales) != want or any((len(k), len(v)) != s for (k, v), s in zip(scales, shape)):
        raise CheckpointError(f"{f}: {len(scales)} layers of scales, the model has {want} "
                              f"layers with (k, v) scale counts {shape}")
    if not all(x > 0 and np.isfinite(x) for kv in scales for s in kv for x in s):
        raise CheckpointError(f"{f}: scales must be positive and finite")
    return scales


def _eos_ids(path: str) -> tuple:
    try:
        with open(os.path.join(path, "config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return ()
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def load_tokenizer(path: str):
    """The `tokenizers` tokenizer in `path/tokenizer.json`, or None (imported lazily)."""
    tok = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok):
        return None
    from tokenizers import Tokenizer  # the one heavy import, only when needed

    try:
        return Tokenizer.from_file(tok)
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise CheckpointError(f"{tok}: unreadable tokenizer: {str(e)[:300]}") from None


# ----------------------------------------------------------------------------- orbax
ORBAX_MARKER = "mtp_jax_orbax.json"


def _str_keys(flat: dict) -> dict:
    """{"a/b/c": array}; a quantized parameter as "a/b/c.values" and "a/b/c.scale"."""
    out = {}
    for k, v in flat.items():
        key = "/".join(map(str, k))
        if is_quantized(v):
            out[key + ".values"], out[key + ".scale"] = v.values, v.scale
        else:
            out[key] = v
    return out


def save_orbax(model: Model, path: str) -> None:
    """Save converted params with orbax, plus config.json and tokenizer.json beside them."""
    _refuse_run_time_options(model)
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(path, "params"), _str_keys(to_flat(model.params)), force=True)
    ckptr.wait_until_finished()
    hf = model.config.to_hf()
    if model.eos_token_ids:
        hf["eos_token_id"] = list(model.eos_token_ids)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    quantized = {"/".join(map(str, k)): {"values": str(v.values.dtype),
                                         "scale": list(v.scale.shape)}
                 for k, v in to_flat(model.params).items() if is_quantized(v)}
    with open(os.path.join(path, ORBAX_MARKER), "w") as f:
        json.dump({"format": "mtp_jax orbax params", "dtype": str(model.dtype),
                   "quantized": quantized}, f)
    if model.tokenizer is not None:
        model.tokenizer.save(os.path.join(path, "tokenizer.json"))
    save_kv_scales(model, path)


def load_orbax(path: str, *, dtype=None, shardings: Optional[Callable] = None,
               quantize: Optional[str] = None) -> Model:
    """Restore params saved by `save_orbax` into `dtype` and, if given, `shardings(path,
    shape) -> jax.sharding.Sharding` (each shard read directly onto its device); quantized
    parameters come back quantized. quantize: quantize an unquantized save after restoring."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    cfg = ModelConfig.from_hf(path)
    try:
        with open(os.path.join(path, ORBAX_MARKER)) as f:
            marker = json.load(f)
        saved_dtype = jnp.dtype(marker.get("dtype", "float32"))
        quantized = {k: (jnp.dtype(v["values"]), tuple(v["scale"]))
                     for k, v in marker.get("quantized", {}).items()}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError,
            KeyError) as e:
        raise CheckpointError(f"{path}: unreadable {ORBAX_MARKER}: {type(e).__name__}: "
                              f"{e}") from None
    if not jnp.issubdtype(saved_dtype, jnp.floating):
        raise CheckpointError(f"{path}: {ORBAX_MARKER} names dtype {saved_dtype}, not a "
                              "float type")
    if quantized and quant.check_mode(quantize) is not None:
        raise quant.QuantizationError(f"{path} holds a quantized model: load it without "
                                      "quantize=")
    dtype = jnp.dtype(dtype or saved_dtype)
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    target = {}
    for p, var in state.flat_state():
        shape, pdt = var.get_value().shape, var.get_value().dtype
        sh = shardings(tuple(p), shape) if shardings else jax.sharding.SingleDeviceSharding(
            jax.devices()[0])
        key = "/".join(map(str, p))
        if key in quantized:
            vdt, sshape = quantized[key]
            rep = sh if not shardings else jax.sharding.NamedSharding(
                sh.mesh, jax.sharding.PartitionSpec())
            target[key + ".values"] = jax.ShapeDtypeStruct(shape, vdt, sharding=sh)
            target[key + ".scale"] = jax.ShapeDtypeStruct(sshape, jnp.float32, sharding=rep)
        else:
            target[key] = jax.ShapeDtypeStruct(shape, pdt, sharding=sh)
    params_dir = os.path.join(path, "params")
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"{path}: no orbax params folder")
    try:
        restored = ocp.StandardCheckpointer().restore(params_dir, target)
    except Exception as e:  # orbax raises many types for corrupt folders
        raise CheckpointError(f"{path}: orbax restore failed: {type(e).__name__}: "
                              f"{str(e)[:500]}") from None
    flat = {}
    for p, var in state.flat_state():
        key, pdt = "/".join(map(str, p)), var.get_value().dtype
        if key in quantized:
            flat[tuple(p)] = QArray(restored[key + ".values"], restored[key + ".scale"])
            continue
        arr = restored[key]
        flat[tuple(p)] = arr if arr.dtype == pdt else arr.astype(pdt)
    model = from_params(cfg, flat, dtype, eos_token_ids=_eos_ids(path), path=path,
                        tokenizer=load_tokenizer(path), kv_scales=load_kv_scales(path, cfg))
    return quantize_model(model, quantize) if quantize else model


def default_dtype(cfg_dtype) -> str:
    """float32 on CPU (no native bf16 math there: f32 is faster, and bf16 rounding makes
    K+1-token verify and 1-token decode disagree at near-ties), else the checkpoint's."""
    return "float32" if jax.default_backend() == "cpu" else cfg_dtype


def load(path: str, *, dtype=None, shardings=None, quantize: Optional[str] = None,
         dequantize: Optional[bool] = None) -> Model:
    """Load an HF-layout folder or an orbax folder written by `save_orbax`.

    dtype: the compute dtype (and that of unquantized parameters); default
    `default_dtype(checkpoint dtype)`. quantize: "int8", "fp8" or "fp8-block" quantizes
    the matmul weights as they load (`quant.MODES`; an already quantized checkpoint is a
    QuantizationError). dequantize: for a quantized checkpoint (DeepSeek's FP8, or a
    quantized save), True / False / None = by device (`keep_quantized`).
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"model path {path!r} is not a directory")
    if os.path.exists(os.path.join(path, ORBAX_MARKER)):
        if dtype is None and jax.default_backend() == "cpu":
            dtype = "float32"
        return load_orbax(path, dtype=dtype, shardings=shardings, quantize=quantize)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path}: no config.json (not an HF or mtp_jax orbax folder)")
    if dtype is None:
        dtype = default_dtype(ModelConfig.from_hf(path).dtype)
    return load_hf(path, dtype=dtype, shardings=shardings, quantize=quantize,
                   dequantize=dequantize)


def quantize_model(model: Model, mode: str) -> Model:
    """A copy of `model` with its matmul weights quantized (`quant.MODES`); QuantizationError
    for a model that is already quantized."""
    mode = quant.check_mode(mode)
    if mode is None:
        return model
    held = quant.mode_of(model.params)
    if held is not None:
        raise quant.QuantizationError(f"the model is already quantized ({held}): quantize "
                                      "its unquantized checkpoint instead")
    quant.check_backend(mode)
    return dataclasses.replace(model, params=quant.quantize_params(model.graphdef,
                                                                   model.params, mode))


def with_draft_head(model: Model, mode: str) -> Model:
    """A copy of `model` whose draft reads a quantized copy (`quant.MODES`) of its head
    where few rows go through it: small batches, whose head products the quantized-matmul
    kernel streams in fewer bytes (`MTPModel.draft_logits`). The target keeps its head,
    so verification, and with it the output, is unchanged; the copy adds the head's
    quantized bytes to the model. With a draft vocabulary the reduced heads are copied.
    ConfigError without MTP modules or when applied twice; QuantizationError for a model
    whose head is already quantized, an unknown mode, or fp8 where it cannot run."""
    mode = quant.check_mode(mode)
    if mode is None:
        return model
    cfg = model.config
    if not cfg.num_mtp_modules:
        raise ConfigError("a draft head needs MTP modules; this model has none")
    if cfg.draft_head:
        raise ConfigError(f"the draft already reads a quantized ({cfg.draft_head}) copy of "
                          "its head")
    heads = [value(w) for w in model.module().draft_head_weights()]
    if any(is_quantized(w) for w in heads):
        raise quant.QuantizationError("the draft's head is already quantized (the model's "
                                      "weights are): a quantized copy would gain nothing")
    quant.check_backend(mode)
    flat = to_flat(model.params)
    for i, w in enumerate(heads):
        flat[("draft_heads", i, "head")] = quant.quantize_array(w, (0,), mode)
    return with_params(model, dataclasses.replace(cfg, draft_head=mode), flat)


__all__ = ["CheckpointError", "ConfigError", "Model", "load", "load_hf", "save_hf",
           "quantize_model", "with_draft_head",
           "save_orbax", "load_orbax", "hf_key_map", "write_safetensors",
           "read_safetensors_header"]
