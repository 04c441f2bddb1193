"""Decode benchmark of MoE models at their published dimensions: GLM-4.5-Air (whole, experts
split over GPUs) and DeepSeek-V3 (a slice of its layers on one GPU, extrapolated).

  PYTHONPATH=. python launch/bench_moe_decode.py [--mesh tp=2] [--batches 1,8,32]
      [--ctx 4096] [--qs 2,4] [--tiny]
  PYTHONPATH=. python launch/bench_moe_decode.py --arch deepseek_v3 --slices 1,3 ...

DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): 61 layers (3 dense, 58 MoE), hidden
7168, MLA with 128 heads (q_lora_rank 1536, kv_lora_rank 512, nope 128 / rope 64 / v 128
head dims; a token caches 576 values per layer), 256 routed experts of 2048 with top-8 of
the 4 best of 8 groups and one shared expert, vocabulary 129280, one MTP layer; 671 B
parameters, 1.34 TB in bf16, so it cannot run whole on one GPU. `--slices 1,3` builds the 3
dense layers + 3 MoE layers + the MTP layer (bf16, about 100 GB: what fits an H200) and
times it, then the same weights cut to 3 dense + 1 MoE layer; the difference over the 2
layers is the cost of one MoE layer, from which every step time is extrapolated to 61
layers: t61 = t(3 + 3) + 55 * (t(3 + 3) - t(3 + 1)) / 2 (the printed table shows it).

GLM-4.5-Air (zai-org/GLM-4.5-Air config.json): 46 layers (1 dense, 45 MoE), hidden 4096,
96 query / 8 KV heads of 128, partial RoPE 0.5, QKV bias, 128 routed experts of 1408 with
top-8 sigmoid routing and one shared expert, vocabulary 151552, one MTP layer (MoE), bf16:
about 110 B parameters, 220 GB. Random weights arranged as launch/bench_decode.py does for
the dense shape (an oracle draft that always agrees): every output projection (attention
o, dense / shared / expert down) is zero, so each costs its full bytes but the residual
stream stays the token's embedding; the lm_heads map a token to a fixed permutation of it,
and the MTP layer's projection passes its embedding half, so its draft always agrees. The
router is random, so each token routes to its own 8 experts per layer, as in a real model.
Weights are generated on the devices in their final sharding (never gathered on one).

Per batch B at context `ctx` (every slot active at kv_len = ctx; prefill not timed), in
one process with the copy bandwidth measured beside them:
- plain step (`method=none`, the engine's `run_steps` loop, per step) against its bytes
  limit: what one GPU reads (its shards of the attention, dense, shared, router and
  lm_head weights; the distinct routed experts its expert shard holds, the busiest
  shard's count under ep, counted per layer from the router itself; its KV heads) over
  the copy bandwidth of one GPU;
- verify over q = K+1 tokens per slot (jitted `fori_loop`) / plain, beside the ratio of
  distinct experts B*q tokens route to over those B tokens route to;
- the draft (the MTP layer over a K+1 window + its head, `fori_loop`) against its bytes;
- `chain` (K = 1: GLM's one MTP layer) speculative step, and the projected speed-up at
  the shipped model's depth-1 acceptance: (1 + a_1) * plain step / chain step.
With $OUT set, rows go to bench_moe_decode.jsonl as they are measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import (bench_programs, draft_loop, fresh_state, timed,  # noqa: E402
                          verify_loop)
from bench_paged_attention import copy_bandwidth  # noqa: E402

from mtp_jax.checkpoint import Model, abstract_model  # noqa: E402
from mtp_jax.config import (PER_LAYER_FIELDS, EngineConfig, MLAConfig,  # noqa: E402
                            ModelConfig, MoEConfig, RopeScaling)
from mtp_jax.model import cache_entry  # noqa: E402
from mtp_jax.moe import route  # noqa: E402
from mtp_jax.sharding import axis_size, make_mesh, param_spec  # noqa: E402
from mtp_jax.step import step_compiler_options  # noqa: E402

GLM_AIR = dict(
    layout="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944,
    num_layers=46, num_heads=96, num_kv_heads=8, head_dim=128, num_mtp_modules=1,
    attention_bias=True, partial_rotary_factor=0.5, rope_theta=1e6, rms_norm_eps=1e-5,
    max_position_embeddings=131072, mtp_concat_order="embed_first",
    mtp_output_hidden="pre_norm", mtp_own_head=True, mtp_own_embed=True, dtype="bfloat16",
    moe=MoEConfig(num_experts=128, top_k=8, intermediate_size=1408, num_shared=1,
                  first_dense=1))
TINY = dict(GLM_AIR, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3,
            num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32",
            moe=MoEConfig(num_experts=16, top_k=4, intermediate_size=32, num_shared=1,
                          first_dense=1))
DEEPSEEK_V3 = dict(
    layout="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    num_layers=61, num_heads=128, num_kv_heads=128, head_dim=192, num_mtp_modules=1,
    rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=163840,
    rope_scaling=RopeScaling("yarn", 40.0, 4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                             mscale_all_dim=1.0),
    mtp_concat_order="embed_first", mtp_output_hidden="pre_norm", mtp_own_head=True,
    mtp_own_embed=True, dtype="bfloat16",
    mla=MLAConfig(kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
                  q_lora_rank=1536),
    moe=MoEConfig(num_experts=256, top_k=8, intermediate_size=2048, num_shared=1,
                  n_group=8, topk_group=4, routed_scaling_factor=2.5, first_dense=3))
DEEPSEEK_TINY = dict(DEEPSEEK_V3, vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_layers=4, num_heads=4, num_kv_heads=4, head_dim=24, dtype="float32",
                     mla=MLAConfig(kv_lora_rank=16, qk_nope_dim=16, qk_rope_dim=8,
                                   v_head_dim=16, q_lora_rank=32),
                     moe=MoEConfig(num_experts=16, top_k=4, intermediate_size=32, num_shared=1,
                                   n_group=4, topk_group=2, first_dense=1))
# MiMo-V2-Flash (XiaomiMiMo/MiMo-V2-Flash config.json): 48 layers, hidden 4096, 64 query
# heads of 192 (values 128, scaled by 0.707); 9 full-attention layers (4 kv heads, theta 5e6)
# at 0, 5, 11, 17, ..., 47 and 39 sliding layers (window 128, 8 kv heads, sinks, theta 1e4);
# partial RoPE 0.334; layer 0 a dense FFN of 16384, the rest 256 routed experts of 2048, top-8
# sigmoid; vocabulary 152576; 3 MTP layers (sliding, sinks, dense FFN of 16384) fed the target
# hidden. 309 B parameters, so a slice of its first layers is timed and extrapolated.
_MIMO_FULL = {0, 5, 11, 17, 23, 29, 35, 41, 47}
MIMO_V2_FLASH = dict(
    layout="mimo_v2_flash", vocab_size=152576, hidden_size=4096, intermediate_size=16384,
    num_layers=48, num_heads=64, num_kv_heads=4, head_dim=192, v_head_dim=128,
    num_mtp_modules=3, rope_theta=5e6, partial_rotary_factor=0.334, rms_norm_eps=1e-5,
    max_position_embeddings=262144, attention_value_scale=0.707,
    sliding_windows=tuple(None if i in _MIMO_FULL else 128 for i in range(48)),
    mtp_sliding_windows=(128,) * 3,
    layer_num_kv_heads=tuple(None if i in _MIMO_FULL else 8 for i in range(51)),
    layer_rope_theta=tuple(None if i in _MIMO_FULL else 1e4 for i in range(51)),
    layer_sinks=tuple(i not in _MIMO_FULL for i in range(51)),
    mtp_concat_order="embed_first", mtp_zero_embed_at_pos0=False, mtp_hidden_source="target",
    dtype="bfloat16",
    moe=MoEConfig(num_experts=256, top_k=8, intermediate_size=2048,
                  layers=tuple(0 < i < 48 for i in range(51))))
_TINY_FULL = {0, 3}
MIMO_TINY = dict(
    MIMO_V2_FLASH, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
    num_heads=4, num_kv_heads=1, head_dim=24, v_head_dim=16, dtype="float32",
    sliding_windows=tuple(None if i in _TINY_FULL else 8 for i in range(4)),
    mtp_sliding_windows=(8,) * 3,
    layer_num_kv_heads=tuple(None if i in _TINY_FULL else 2 for i in range(7)),
    layer_rope_theta=tuple(None if i in _TINY_FULL else 1e4 for i in range(7)),
    layer_sinks=tuple(i not in _TINY_FULL for i in range(7)),
    moe=MoEConfig(num_experts=16, top_k=4, intermediate_size=32,
                  layers=tuple(0 < i < 4 for i in range(7))))
ARCHS = {"glm45_air": (GLM_AIR, TINY), "deepseek_v3": (DEEPSEEK_V3, DEEPSEEK_TINY),
         "mimo_v2_flash": (MIMO_V2_FLASH, MIMO_TINY)}
K = 1  # GLM-4.5 and DeepSeek-V3 publish one MTP layer: chain with K = 1 (MiMo-V2: 3)


def log(*a):
    print(*a, flush=True)


def oracle_moe_model(cfg: ModelConfig, dtype, mesh, seed=0) -> Model:
    """Random weights (see the module doc), each generated in its final sharding."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    key = jax.random.PRNGKey(seed)
    v, d = cfg.vocab_size, cfg.hidden_size
    perm = jax.random.permutation(jax.random.fold_in(key, 1), v)
    inv = jnp.argsort(perm)

    def sharding(path, shape):
        if mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return NamedSharding(mesh, param_spec(mesh, path, shape))

    def embed_and_head(k):
        e = jax.random.normal(k, (v, d), jnp.float32)
        n = e * jax.lax.rsqrt(jnp.mean(e * e, -1, keepdims=True))
        return e.astype(dtype), (n[inv].T / np.sqrt(d) * 30.0).astype(dtype)

    emb_sh, head_sh = sharding(("embed",), (v, d)), sharding(("head",), (d, v))
    emb, head = jax.jit(embed_and_head, out_shardings=(emb_sh, head_sh))(
        jax.random.fold_in(key, 2))
    for i, (path, var) in enumerate(state.flat_state()):
        path = tuple(path)
        shape, pdt = var.get_value().shape, var.get_value().dtype
        name = path[-1] if path[-1] != "weight" else path[-2]
        if path[-1] == "embed":
            val = emb
        elif path[-1] in ("lm_head", "head"):
            val = head
        else:
            kind = ("ones" if path[-1] == "weight" else
                    "zeros" if name in ("o", "down", "experts_down", "qkv_bias", "router_bias")
                    else "proj" if name == "proj" else "normal")
            fan_in = shape[1] if name == "experts_gate_up" else shape[0]
            val = _maker(kind, shape, jnp.dtype(pdt).name, sharding(path, shape), fan_in)(
                jax.random.fold_in(key, 100 + i))
        var.set_value(val)
        jax.block_until_ready(val)
    return Model(cfg, graphdef, state)


@functools.lru_cache(maxsize=None)
def _maker(kind, shape, dtype, sharding, fan_in):
    """One jitted generator per (kind, shape, dtype, sharding): layers share compiles."""
    def make(k):
        if kind == "ones":
            return jnp.ones(shape, dtype)
        if kind == "zeros":
            return jnp.zeros(shape, dtype)
        if kind == "proj":  # embedding first in the GLM concat: pass the embedding half
            d = shape[1]
            return jnp.concatenate([jnp.eye(d, dtype=dtype), jnp.zeros((d, d), dtype)], 0)
        return (jax.random.normal(k, shape, jnp.float32) * fan_in ** -0.5).astype(dtype)
    return jax.jit(make, out_shardings=sharding)


def byte_counts(model: Model):
    """Bytes one GPU (device 0) reads of: the target's non-expert weights (no embedding
    table), one expert of one layer, the MTP layer's non-expert weights + its head."""
    cfg = model.config
    first_moe = next(i for i in range(cfg.num_layers) if cfg.layer_spec(i).is_moe)
    dense, mtp, expert = 0, 0, 0
    for path, var in model.params.flat_state():
        path, arr = tuple(path), var.get_value()
        nbytes = arr.addressable_shards[0].data.nbytes  # this GPU's piece
        if path[-1] in ("experts_gate_up", "experts_down"):
            if path[:3] == ("target", "layers", first_moe):
                expert += nbytes // arr.addressable_shards[0].data.shape[0]
        elif path[-1] == "embed":
            continue
        elif path[0] == "target":
            dense += nbytes
        else:
            mtp += nbytes
    return dense, expert, mtp


def distinct_experts(model: Model, n_tokens: int, ep: int = 1, samples=8, seed=0):
    """(mean distinct experts n_tokens route to, mean over layers and samples of the most
    distinct experts any one of the `ep` expert shards holds: what its GPU reads). The
    oracle's residual stream at every layer is the token's embedding."""
    cfg = model.config
    layers = [i for i in range(cfg.num_layers) if cfg.layer_spec(i).is_moe]
    emb = model.params["target"]["embed"][...]
    counts, busiest = [], []
    rng = np.random.default_rng(seed)
    per_shard = cfg.moe.num_experts // ep

    @jax.jit
    def ids_for(emb, tokens, router, bias):  # emb an argument: never a baked-in constant
        x = emb[tokens].astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps)
        return route(x, router, bias, cfg.moe)[0]

    for layer in layers:
        mlp = model.params["target"]["layers"][layer]["mlp"]
        for _ in range(samples):
            toks = jnp.asarray(rng.integers(0, cfg.vocab_size, n_tokens), jnp.int32)
            ids = np.unique(np.asarray(ids_for(emb, toks, mlp["router"][...],
                                               mlp["router_bias"][...])))
            counts.append(len(ids))
            busiest.append(np.bincount(ids // per_shard, minlength=ep).max())
    return float(np.mean(counts)), float(np.mean(busiest))


def bench_batch(model, b, ctx, steps, qs, dtype, mesh, acceptance, bw, sizes):
    cfg = model.config
    dense_b, expert_b, mtp_b = sizes
    max_len = ctx + steps * (max(qs) + 1) * 4 + 64
    eng = EngineConfig(max_batch=b, max_model_len=max_len, page_size=16, prefill_chunk=16)
    k = cfg.num_mtp_modules
    methods = ("none", "chain") + (("per_step",) if k > 1 else ())
    progs = bench_programs(model, eng, dtype, mesh, k=k, methods=methods)
    layout = progs["chain"].static.layout
    p = model.params

    def fresh(method):
        return fresh_state(progs[method], model, b, ctx, dtype, mesh)

    row = dict(batch=b, ctx=ctx, mesh=str(dict(mesh.shape)) if mesh else None)
    n = jnp.int32(steps)
    for mth, pr in progs.items():
        t0 = time.perf_counter()
        holder = {"st": jax.block_until_ready(pr.run_steps(p, fresh(mth), jnp.int32(1)))}
        row[f"{mth}_compile_s"] = time.perf_counter() - t0

        def run():
            holder["st"] = jax.block_until_ready(pr.run_steps(p, holder["st"], n))
        best, med = timed(run)
        row[f"{mth}_step_ms"] = best / steps * 1e3
        row[f"{mth}_step_ms_median"] = med / steps * 1e3
        gen = np.asarray(jax.device_get(holder["st"].num_generated))
        row[f"{mth}_tokens_per_step"] = float(gen.mean()) / (3 * steps + 1)
        del holder
    static = progs["chain"].static  # each loop with its step program's GEMM backend
    loops = [(f"verify{q}_ms", verify_loop(model, layout, b, q, mesh, spread=True,
                                           options=step_compiler_options(static, q - 1)))
             for q in qs]
    loops.append(("draft_ms", draft_loop(model, layout, b, dtype, mesh, spread=True, k=k,
                                         options=step_compiler_options(static, k))))
    for name, fn in loops:
        st = fresh("chain")
        caches, st = st.caches, st.replace(caches=())
        t0 = time.perf_counter()
        holder = {"c": jax.block_until_ready(fn(p, caches, st, 1))[0]}
        row[name.replace("_ms", "_compile_s")] = time.perf_counter() - t0

        def run():
            holder["c"] = jax.block_until_ready(fn(p, holder["c"], st, steps))[0]
        best, _ = timed(run)
        row[name] = best / steps * 1e3
        del holder, caches
    # Bytes one GPU reads per step (its shards of the non-expert weights, the routed
    # experts its shard holds, its KV heads); the step waits for the busiest GPU.
    ep, tp = axis_size(mesh, "ep"), axis_size(mesh, "tp")
    moe_layers = sum(cfg.layer_spec(i).is_moe for i in range(cfg.num_layers))
    def kv_bytes(layers):  # what b slots at context ctx read of these layers' KV
        total = 0
        for i in layers:
            heads, dims, v_dims, latent = cache_entry(cfg, i)  # a latent row: replicated
            kv_heads = heads // tp if heads % tp == 0 and not latent else heads
            window = cfg.layer_spec(i).attention.window
            total += kv_heads * (dims + v_dims) * min(ctx, window or ctx)
        return b * total * jnp.dtype(dtype).itemsize

    kv_target = kv_bytes(range(cfg.num_layers))

    def step_bytes(n_tokens):
        distinct, busiest = distinct_experts(model, n_tokens, ep)
        return distinct, dense_b + moe_layers * busiest * expert_b + kv_target

    row["distinct_experts"], plain_bytes = step_bytes(b)
    row["plain_bytes_per_gpu_gb"] = plain_bytes / 1e9
    row["plain_limit_ms"] = plain_bytes / bw * 1e3
    row["plain_pct_of_limit"] = row["plain_limit_ms"] / row["none_step_ms"] * 100
    for q in qs:
        dq, vb = step_bytes(b * q)
        row[f"distinct_experts_q{q}"] = dq
        row[f"verify{q}_ratio"] = row[f"verify{q}_ms"] / row["none_step_ms"]
        row[f"verify{q}_bytes_ratio"] = vb / plain_bytes
        row[f"verify{q}_expert_ratio"] = dq / row["distinct_experts"]
        row[f"verify{q}_pct_of_limit"] = vb / bw * 1e3 / row[f"verify{q}_ms"] * 100
    mtp_layers = range(cfg.num_layers, cfg.num_layers_total)
    moe_mtp = sum(cfg.layer_spec(i).is_moe for i in mtp_layers)
    draft_experts = distinct_experts(model, b * (k + 1), ep)[1] if moe_mtp else 0
    # k modules over a k+1 window: their weights, the routed experts, their KV; modules
    # without a head of their own read the target lm_head once each.
    head_b = 0 if cfg.mtp_own_head else lm_head_bytes(model)
    draft_bytes = (mtp_b + k * head_b + moe_mtp * draft_experts * expert_b
                   + kv_bytes(mtp_layers))
    row["draft_limit_ms"] = draft_bytes / bw * 1e3
    row["draft_pct_of_limit"] = row["draft_limit_ms"] / row["draft_ms"] * 100
    row["chain_vs_plain"] = row["chain_step_ms"] / row["none_step_ms"]
    for mth in methods[1:]:
        acc = (acceptance or {}).get(mth)
        if acc:  # expected tokens per step at the shipped model's acceptance per depth
            key = "projected_speedup" if mth == "chain" else f"{mth}_projected_speedup"
            row[key] = (1 + sum(acc[:k])) * row["none_step_ms"] / row[f"{mth}_step_ms"]
    row["oracle_speedup"] = (k + 1) * row["none_step_ms"] / row["chain_step_ms"]
    return row


def lm_head_bytes(model: Model) -> int:
    head = model.params["target"]["lm_head"]
    arr = (model.params["target"]["embed"] if head is None else head).get_value()
    return arr.addressable_shards[0].data.nbytes


def sub_config(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    """The config cut to its first `num_layers` target layers; the MTP layers keep their
    specs (per-layer facts of the layers cut away are dropped)."""
    keep = list(range(num_layers)) + list(range(cfg.num_layers, cfg.num_layers_total))
    per_layer = {f: tuple(getattr(cfg, f)[i] for i in keep) for f in PER_LAYER_FIELDS
                 if getattr(cfg, f)}
    moe = cfg.moe
    if moe is not None and moe.layers:
        moe = dataclasses.replace(moe, layers=tuple(moe.layers[i] for i in keep))
    return dataclasses.replace(cfg, num_layers=num_layers, moe=moe,
                               sliding_windows=cfg.sliding_windows[:num_layers], **per_layer)


def sub_model(model: Model, num_layers: int) -> Model:
    """The same weights cut to the first `num_layers` target layers (plus the MTP layers,
    which keep their specs); no array is copied."""
    cfg = sub_config(model.config, num_layers)
    graphdef, state = nnx.split(abstract_model(cfg, model.dtype))
    flat = {tuple(p): v for p, v in model.params.flat_state()}
    for path, var in state.flat_state():
        var.set_value(flat[tuple(path)].get_value())
    return Model(cfg, graphdef, state)


TIMES = ("none_step_ms", "chain_step_ms", "draft_ms")


def extrapolate(lo: dict, hi: dict, layers: int, qs) -> dict:
    """Step times and bytes at `layers` layers from two slices that differ only in their
    number of MoE layers (linear in the layer count; the draft does not change)."""
    n_lo, n_hi = lo["layers"], hi["layers"]
    out = dict(batch=hi["batch"], ctx=hi["ctx"], layers=layers, extrapolated=True)
    keys = tuple(k for k in ("none_step_ms", "chain_step_ms", "per_step_step_ms") if k in hi)
    keys += tuple(f"verify{q}_ms" for q in qs) + ("plain_limit_ms",)
    for k in keys:
        per_layer = (hi[k] - lo[k]) / (n_hi - n_lo)
        out[k] = hi[k] + (layers - n_hi) * per_layer
        out[k.replace("_ms", "_per_moe_layer_ms")] = per_layer
    out["draft_ms"], out["draft_limit_ms"] = hi["draft_ms"], hi["draft_limit_ms"]
    out["draft_pct_of_limit"] = hi["draft_pct_of_limit"]
    out["distinct_experts"] = hi["distinct_experts"]
    out["plain_pct_of_limit"] = out["plain_limit_ms"] / out["none_step_ms"] * 100
    for q in qs:
        out[f"verify{q}_ratio"] = out[f"verify{q}_ms"] / out["none_step_ms"]
        out[f"verify{q}_expert_ratio"] = hi[f"verify{q}_expert_ratio"]
    out["chain_vs_plain"] = out["chain_step_ms"] / out["none_step_ms"]
    for key, step in (("projected_speedup", "chain_step_ms"),
                      ("per_step_projected_speedup", "per_step_step_ms")):
        if key in hi:  # the same expected tokens per step over the extrapolated times
            tokens = hi[key] * hi[step] / hi["none_step_ms"]
            out[key] = tokens * out["none_step_ms"] / out[step]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="glm45_air", choices=tuple(ARCHS))
    ap.add_argument("--slices", default="1,3",
                    help="deepseek_v3 / mimo_v2_flash: MoE layer counts of the slices timed "
                    "(two or more)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--qs", default="2,4", help="verify widths K+1 to time")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--mesh", default=None, help="e.g. tp=2 or ep=2 (default: one device)")
    ap.add_argument("--acceptance", default="checkpoints/acceptance_bf16.json")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    args = ap.parse_args(argv)
    slices = sorted(int(x) for x in args.slices.split(","))
    base = ARCHS[args.arch][1 if args.tiny else 0]
    sliced = args.arch != "glm45_air"
    full_layers = base["num_layers"]
    cfg = ModelConfig(**base)
    dense = next(i for i in range(full_layers) if cfg.layer_spec(i).is_moe)
    if sliced:
        cfg = sub_config(cfg, dense + slices[-1])
    dtype = jnp.dtype(cfg.dtype)
    acceptance = None
    if os.path.exists(args.acceptance):
        with open(args.acceptance) as f:
            data = json.load(f)  # evaluate's report, or `train accept`'s table
            acceptance = {m: r["acceptance_per_depth"]
                          for m, r in data.get("methods", data).items()
                          if isinstance(r, dict) and r.get("acceptance_per_depth")}
        log(f"shipped-model acceptance per depth: {acceptance}")
    log(f"devices {[d.device_kind for d in jax.devices()]}, jax {jax.__version__}")
    bw = copy_bandwidth() if jax.default_backend() == "gpu" else {"cpu": 1e10}
    best_bw = max(bw.values())
    log(f"copy bandwidth per GPU {bw}")
    mesh = make_mesh(args.mesh)
    t0 = time.perf_counter()
    model = oracle_moe_model(cfg, dtype, mesh)
    sizes = byte_counts(model)
    log(f"model {cfg.num_params / 1e9:.1f} B params built in {time.perf_counter() - t0:.1f}s; "
        f"per GPU: non-expert target {sizes[0] / 1e9:.2f} GB, one expert {sizes[1] / 1e6:.1f} "
        f"MB, MTP non-expert {sizes[2] / 1e9:.2f} GB; ep={axis_size(mesh, 'ep')} "
        f"tp={axis_size(mesh, 'tp')}")
    out = os.environ.get("OUT")
    qs = [int(q) for q in args.qs.split(",")]
    models = [model] if not sliced else [
        model if m == slices[-1] else sub_model(model, dense + m) for m in slices]
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        per_slice = []
        for mdl in models:
            row = bench_batch(mdl, b, args.ctx, args.steps, qs, dtype, mesh, acceptance,
                              best_bw, byte_counts(mdl))
            row["layers"] = mdl.config.num_layers
            per_slice.append(row)
            log(json.dumps(row))
            if out:
                with open(os.path.join(out, "bench_moe_decode.jsonl"), "a") as f:
                    f.write(json.dumps(dict(row, arch=args.arch, copy_bandwidth=bw,
                                            jax=jax.__version__,
                                            device=jax.devices()[0].device_kind)) + "\n")
        rows += per_slice
        if len(per_slice) > 1:
            ext = extrapolate(per_slice[0], per_slice[-1], full_layers, qs)
            rows.append(ext)
            log("extrapolated " + json.dumps(ext))
            if out:
                with open(os.path.join(out, "bench_moe_decode.jsonl"), "a") as f:
                    f.write(json.dumps(dict(ext, arch=args.arch)) + "\n")
    md = ("| B | layers | plain ms (limit, %) | distinct experts | " + " | ".join(
        f"verify({q}) / plain (expert ratio)" for q in qs) +
        " | draft ms (limit, %) | chain step ms | projected x |\n|" + "---|" * (7 + len(qs))
        + "\n")
    for r in rows:
        layers = f"{r.get('layers', cfg.num_layers)}{' (extrapolated)' if r.get('extrapolated') else ''}"
        md += (f"| {r['batch']} | {layers} | {r['none_step_ms']:.2f} ({r['plain_limit_ms']:.2f}, "
               f"{r['plain_pct_of_limit']:.0f} %) | {r['distinct_experts']:.1f} | " +
               " | ".join(f"{r[f'verify{q}_ratio']:.2f} ({r[f'verify{q}_expert_ratio']:.2f})"
                          for q in qs) +
               f" | {r['draft_ms']:.2f} ({r['draft_limit_ms']:.2f}, "
               f"{r['draft_pct_of_limit']:.0f} %) | {r['chain_step_ms']:.2f} | "
               f"{r.get('projected_speedup', float('nan')):.2f} |\n")
    log("\n" + md)
    if out:
        with open(os.path.join(out, "bench_moe_decode.md"), "a") as f:
            f.write(f"{args.arch}, mesh {args.mesh}, ctx {args.ctx}\n\n" + md + "\n")


if __name__ == "__main__":
    main()
