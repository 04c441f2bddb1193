"""Tensor entries: each parameter of `MTPModel` with the HF tensors it is built from.

An `Entry` names a parameter's path in the NNX state, the HF tensors it is made of and
their shapes, and converts both ways: `join` (HF arrays -> parameter, on import) and
`split` (parameter -> HF arrays, on export). Fused q/k/v and gate/up are joined on load and
split on export; the per-expert `mlp.experts.{e}.*_proj` tensors of an MoE layer are
stacked into one [experts, ...] parameter.

The builders here are the pieces a family's tensor map (models/base.py) is made of, and
any family may reuse them: `gqa_entries` (GQA with bias, q/k norm, head-wise gate and
sinks), `mla_entries` (DeepSeek's multi-head latent attention), `swiglu_entries` (a dense
MLP or a shared expert), `moe_entries` (a router, per-expert tensors, shared experts in
DeepSeek / GLM naming).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

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


def linear(path, name, out_dim, in_dim):
    return Entry(path, (name,), ((out_dim, in_dim),), lambda a: _t(a[0]), lambda p: [_t(p)])


def vector(path, name, dim):
    return Entry(path, (name,), ((dim,),), lambda a: np.asarray(a[0]), lambda p: [np.asarray(p)])



def embedding(path, name, vocab, dim):
    return Entry(path, (name,), ((vocab, dim),), lambda a: np.asarray(a[0]),
                 lambda p: [np.asarray(p)])


def gqa_entries(att, d: int, path: tuple, a: str) -> list[Entry]:
    """q/k/v/o projections (fused as model.Attention lays them out), biases, q/k norms,
    the head-wise gate `g_proj` and the sink logits of a GQA layer."""
    k, g, h, u = att.num_kv_heads, att.group_size, att.head_dim, att.v_dim
    n = k * g
    fused = u == h  # v in the same parameter as q and k
    # an element-wise gate: q_proj [n * 2h, d] holds each head's query, then its gate
    # (Qwen3-Next); the parameter keeps the g gates after the g queries of each kv head
    qg = 2 * g if att.gate == "element" else g

    def join_qkv(arrs):  # q [n*h (n*2h), d], k [k*h, d](, v [k*h, d]) -> [d, k, qg+2, h]
        q, kk, *v = (np.asarray(x) for x in arrs)
        if qg != g:
            q = q.reshape(k, g, 2, h, d)
            q = np.concatenate([q[:, :, 0], q[:, :, 1]], axis=1)  # [k, 2g, h, d]
        parts = [q.reshape(k, qg, h, d), kk.reshape(k, 1, h, d)] + [
            x.reshape(k, 1, h, d) for x in v]
        return np.ascontiguousarray(np.concatenate(parts, axis=1).transpose(3, 0, 1, 2))

    def split_qkv(p):
        w = np.asarray(p).transpose(1, 2, 3, 0)  # [k, qg+2 (qg+1), h, d]
        q = w[:, :qg]
        if qg != g:
            q = np.stack([q[:, :g], q[:, g:]], axis=2)  # [k, g, 2, h, d]
        out = [q.reshape(n * (qg // g) * h, d), w[:, qg].reshape(k * h, d)]
        return out + ([w[:, qg + 1].reshape(k * h, d)] if fused else [])

    def join_bias(arrs):
        q, kk, v = (np.asarray(x) for x in arrs)
        return np.concatenate([q.reshape(k, g, h), kk.reshape(k, 1, h), v.reshape(k, 1, h)], 1)

    def split_bias(p):
        p = np.asarray(p)
        return [p[:, :g].reshape(n * h), p[:, g].reshape(k * h), p[:, g + 1].reshape(k * h)]

    proj = ("q_proj", "k_proj", "v_proj") if fused else ("q_proj", "k_proj")
    es = [Entry(path + ("qkv" if fused else "qk",), tuple(a + x + ".weight" for x in proj),
                ((n * (qg // g) * h, d), (k * h, d), (k * h, d))[: len(proj)], join_qkv,
                split_qkv),
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
        es.append(vector(path + ("q_norm", "weight"), a + "q_norm.weight", h))
        es.append(vector(path + ("k_norm", "weight"), a + "k_norm.weight", h))
    if att.gate == "head":  # Step-3.5 g_proj [n, d] -> [d, k, g]
        es.append(Entry(path + ("gate",), (a + "g_proj.weight",), ((n, d),),
                        lambda arrs: np.ascontiguousarray(_t(arrs[0]).reshape(d, k, g)),
                        lambda p: [_t(np.asarray(p).reshape(d, n))]))
    if att.sinks:  # MiMo-V2 attention_sink_bias [n] -> [k, g]
        es.append(Entry(path + ("sinks",), (a + "attention_sink_bias",), ((n,),),
                        lambda arrs: np.asarray(arrs[0]).reshape(k, g),
                        lambda p: [np.asarray(p).reshape(n)]))
    return es



def _rope_order(e: int, interleaved: bool) -> np.ndarray:
    """Where each stored rope dim comes from: DeepSeek publishes the rope dims of q and
    k_pe as interleaved pairs (x0, x1), (x2, x3), ...; the model rotates halves, so pair i
    becomes dims (i, i + e/2). Permuting q and k alike leaves every score unchanged."""
    if not interleaved:
        return np.arange(e)
    return np.concatenate([np.arange(0, e, 2), np.arange(1, e, 2)])


def mla_entries(att, d: int, path: tuple, a: str) -> list[Entry]:
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
        es += [linear(path + ("q_a",), a + "q_a_proj.weight", c, d),
               vector(path + ("q_a_norm", "weight"), a + "q_a_layernorm.weight", c),
               Entry(path + ("q_b",), (a + "q_b_proj.weight",), ((n * qk, c),), q_join,
                     q_split)]
    es += [
        Entry(path + ("kv_a",), (a + "kv_a_proj_with_mqa.weight",), ((r + e, d),), kv_a_join,
              kv_a_split),
        vector(path + ("kv_a_norm", "weight"), a + "kv_a_layernorm.weight", r),
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


def swiglu_entries(d: int, f: int, path: tuple, prefix: str) -> list[Entry]:
    """A SwiGLU MLP: gate_proj / up_proj [f, d] -> gate_up [d, 2, f]; down_proj [d, f]."""
    def join_gu(arrs):
        return np.ascontiguousarray(np.stack([np.asarray(arrs[0]).T, np.asarray(arrs[1]).T], 1))

    def split_gu(p):
        p = np.asarray(p)
        return [_t(p[:, 0]), _t(p[:, 1])]

    return [Entry(path + ("gate_up",), (prefix + "gate_proj.weight", prefix + "up_proj.weight"),
                  ((f, d), (f, d)), join_gu, split_gu),
            linear(path + ("down",), prefix + "down_proj.weight", d, f)]


def moe_entries(moe, d: int, path: tuple, prefix: str) -> list[Entry]:
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
        linear(path + ("router",), prefix + "gate.weight", e_n, d),
        Entry(path + ("experts_gate_up",),
              tuple(x + "gate_proj.weight" for x in ex) + tuple(x + "up_proj.weight" for x in ex),
              ((f, d),) * (2 * e_n), lambda arrs: gate_up_slice(arrs, full4), split_gate_up,
              gate_up_slice),
        Entry(path + ("experts_down",), tuple(x + "down_proj.weight" for x in ex),
              ((d, f),) * e_n, lambda arrs: down_slice(arrs, full3),
              lambda p: [_t(q) for q in np.asarray(p)], down_slice),
    ]
    if moe.score_bias:
        es.append(vector(path + ("router_bias",), prefix + "gate.e_score_correction_bias", e_n))
    if moe.shared_size:
        es += swiglu_entries(d, moe.shared_size, path + ("shared",),
                              prefix + "shared_experts.")
    return es


def gdn_entries(spec, d: int, path: tuple, a: str, *, fused_qkvz: bool) -> list[Entry]:
    """A Gated DeltaNet layer (gdn.py layouts) under `a` (`...linear_attn.`): in_proj from
    Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` (grouped per key head: q, k, then the value
    and z rows of its value heads; b, a likewise) when `fused_qkvz`, else from Qwen3.5's
    `in_proj_qkv` (q, k, v of all heads) / `in_proj_z` / `in_proj_b` / `in_proj_a`; the
    depthwise `conv1d` [conv_dim, 1, taps]; `dt_bias`, `A_log`; the gated norm; `out_proj`."""
    c = spec.gdn
    hk, hv, dk, dv = c.num_k_heads, c.num_v_heads, c.k_head_dim, c.v_head_dim
    r = hv // hk
    kd, vd = c.key_dim, c.value_dim

    def join_fused(arrs):  # qkvz [hk*(2dk + 2r dv), d], ba [hk*2r, d] -> [d, cols]
        qkvz = np.asarray(arrs[0]).reshape(hk, 2 * dk + 2 * r * dv, d)
        ba = np.asarray(arrs[1]).reshape(hk, 2 * r, d)
        q, kk = qkvz[:, :dk], qkvz[:, dk: 2 * dk]
        v, z = qkvz[:, 2 * dk: 2 * dk + r * dv], qkvz[:, 2 * dk + r * dv:]
        rows = [q.reshape(kd, d), kk.reshape(kd, d), v.reshape(vd, d), z.reshape(vd, d),
                ba[:, :r].reshape(hv, d), ba[:, r:].reshape(hv, d)]
        return _t(np.concatenate(rows, axis=0))

    def split_fused(p):
        w = _t(p)  # [cols, d]
        q, kk, v, z, b, aa = np.split(w, np.cumsum([kd, kd, vd, vd, hv])[:5], axis=0)
        qkvz = np.concatenate([q.reshape(hk, dk, d), kk.reshape(hk, dk, d),
                               v.reshape(hk, r * dv, d), z.reshape(hk, r * dv, d)], axis=1)
        ba = np.concatenate([b.reshape(hk, r, d), aa.reshape(hk, r, d)], axis=1)
        return [qkvz.reshape(-1, d), ba.reshape(-1, d)]

    def join_apart(arrs):  # qkv [conv_dim, d], z [vd, d], b [hv, d], a [hv, d]
        return _t(np.concatenate([np.asarray(x) for x in arrs], axis=0))

    def split_apart(p):
        return list(np.split(_t(p), np.cumsum([c.conv_dim, vd, hv])[:3], axis=0))

    if fused_qkvz:
        proj = Entry(path + ("in_proj",), (a + "in_proj_qkvz.weight", a + "in_proj_ba.weight"),
                     ((2 * kd + 2 * vd, d), (2 * hv, d)), join_fused, split_fused)
    else:
        proj = Entry(path + ("in_proj",), tuple(a + f"in_proj_{x}.weight"
                                                for x in ("qkv", "z", "b", "a")),
                     ((c.conv_dim, d), (vd, d), (hv, d), (hv, d)), join_apart, split_apart)
    return [
        proj,
        Entry(path + ("conv",), (a + "conv1d.weight",), ((c.conv_dim, 1, c.conv_kernel),),
              lambda arrs: _t(np.asarray(arrs[0])[:, 0]),
              lambda p: [_t(p)[:, None, :]]),
        vector(path + ("dt_bias",), a + "dt_bias", hv),
        vector(path + ("A_log",), a + "A_log", hv),
        vector(path + ("norm",), a + "norm.weight", dv),
        Entry(path + ("out_proj",), (a + "out_proj.weight",), ((d, vd),),
              lambda arrs: np.ascontiguousarray(_t(arrs[0]).reshape(hv, dv, d)),
              lambda p: [_t(np.asarray(p).reshape(vd, d))]),
    ]


def stacked_experts_entries(moe, d: int, path: tuple, prefix: str) -> list[Entry]:
    """Experts stored stacked as transformers >= 5 holds them (`experts.gate_up_proj`
    [e, 2f, d]: gate rows, then up rows; `experts.down_proj` [e, d, f])."""
    e_n, f = moe.num_experts, moe.intermediate_size

    def join_gu(arrs):  # [e, 2f, d] -> [e, d, 2, f]
        w = np.asarray(arrs[0]).reshape(e_n, 2, f, d)
        return np.ascontiguousarray(w.transpose(0, 3, 1, 2))

    return [
        Entry(path + ("experts_gate_up",), (prefix + "experts.gate_up_proj",),
              ((e_n, 2 * f, d),), join_gu,
              lambda p: [np.ascontiguousarray(np.asarray(p).transpose(0, 2, 3, 1)
                                              .reshape(e_n, 2 * f, d))]),
        Entry(path + ("experts_down",), (prefix + "experts.down_proj",), ((e_n, d, f),),
              lambda arrs: np.ascontiguousarray(np.asarray(arrs[0]).transpose(0, 2, 1)),
              lambda p: [np.ascontiguousarray(np.asarray(p).transpose(0, 2, 1))]),
    ]


def qwen_moe_entries(moe, d: int, path: tuple, prefix: str, *, stacked: bool) -> list[Entry]:
    """A Qwen3-Next / Qwen3.5 MoE layer: router `mlp.gate`, the experts (per expert, or
    stacked), the shared expert `mlp.shared_expert.*` and its gate `mlp.shared_expert_gate`
    [1, d]."""
    if stacked:
        es = [linear(path + ("router",), prefix + "gate.weight", moe.num_experts, d)]
        es += stacked_experts_entries(moe, d, path, prefix)
    else:
        es = moe_entries(dataclasses.replace(moe, num_shared=0, shared_intermediate_size=0),
                         d, path, prefix)
    if moe.shared_size:
        es += swiglu_entries(d, moe.shared_size, path + ("shared",), prefix + "shared_expert.")
    if moe.shared_gate:
        es.append(Entry(path + ("shared_gate",), (prefix + "shared_expert_gate.weight",),
                        ((1, d),), lambda arrs: np.asarray(arrs[0]).reshape(d),
                        lambda p: [np.asarray(p).reshape(1, d)]))
    return es


def indexer_entries(att, d: int, path: tuple, a: str) -> list:
    """The indexer's tensors under `a` (`...self_attn.indexer.`): wq_b [Hi * di, c], wk
    [di, d], k_norm.{weight, bias} [di], weights_proj [Hi, d]. With interleaved RoPE (GLM-5)
    the first qk_rope dims of every index query head and of the key (before its norm, so
    the norm's weight and bias too) are permuted to halves, as `tensors.mla_entries` does
    for MLA's rope dims."""
    dsa, m = att.indexer, att.mla
    h, i, c, e = dsa.index_n_heads, dsa.index_head_dim, m.q_lora_rank, m.qk_rope_dim
    order = np.concatenate([_rope_order(e, dsa.rope_interleave), np.arange(e, i)])
    inverse = np.argsort(order)

    def wq_join(arrs):  # [h * i, c] -> [c, h, i]
        w = np.asarray(arrs[0]).reshape(h, i, c)[:, order]
        return np.ascontiguousarray(w.transpose(2, 0, 1))

    def wq_split(w):
        w = np.asarray(w).transpose(1, 2, 0)[:, inverse]
        return [np.ascontiguousarray(w.reshape(h * i, c))]

    def rows(name, shape, transpose):
        def join(arrs):
            w = np.asarray(arrs[0])[order]
            return _t(w) if transpose else np.ascontiguousarray(w)

        def split(w):
            w = _t(w) if transpose else np.asarray(w)
            return [np.ascontiguousarray(w[inverse])]
        return name, shape, join, split

    es = [Entry(path + ("wq_b",), (a + "wq_b.weight",), ((h * i, c),), wq_join, wq_split)]
    for key, (name, shape, join, split) in (
            (("wk",), rows(a + "wk.weight", (i, d), True)),
            (("k_norm", "weight"), rows(a + "k_norm.weight", (i,), False)),
            (("k_norm", "bias"), rows(a + "k_norm.bias", (i,), False))):
        es.append(Entry(path + key, (name,), (shape,), join, split))
    es.append(linear(path + ("weights_proj",), a + "weights_proj.weight", h, d))
    return es
