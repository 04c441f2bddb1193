"""Decode benchmark of the hybrid Gated DeltaNet models at their published dimensions:
Qwen3.5-27B (dense, whole on one GPU) and Qwen3-Next-80B-A3B (MoE; slices of its layers on
one GPU, extrapolated).

  PYTHONPATH=. python launch/bench_hybrid_decode.py [--shape qwen3.5-27b|qwen3-next-80b]
      [--batches 1,32] [--ctxs 4096,32768] [--slices 4,8] [--tiny]

Dimensions (their config.json files):
- Qwen3.5-27B: 64 layers, 3 of every 4 Gated DeltaNet (16 key heads, 48 value heads, key /
  value head dims 128, conv 4), every 4th gated full attention (24 query / 4 KV heads of
  256, partial RoPE 0.25), dense SwiGLU 17408, hidden 5120, vocabulary 248320, one MTP
  layer; 27 B parameters, 54 GB in bf16.
- Qwen3-Next-80B-A3B: 48 layers (the same 3:1 pattern; 16 key / 32 value heads), attention
  16 query / 2 KV heads of 256, 512 routed experts of 512 with top-10 softmax routing and a
  gated shared expert of 512, hidden 2048, vocabulary 151936, one MTP layer; 160 GB in bf16,
  so it does not fit one GPU: `--slices 4,8` builds 4 and 8 of its layers (one and two
  groups of three linear + one full layer) plus the MTP layer and extrapolates every time
  to 48 layers: t48 = t(4) + 11 * (t(8) - t(4)).

Random bf16 weights arranged as launch/bench_decode.py does (an oracle draft that always
agrees: output projections zero, so each costs its bytes but the residual stream stays
the token's embedding). Per batch B and context ctx, in one process with the copy bandwidth
measured beside them:
- plain step (`method=none`, the engine's step loop) against its bytes limit: weights
  (routed experts: the distinct ones the router picks, counted as bench_moe_decode.py
  does, bounded by top-k per token), KV of the full-attention layers, and the recurrent
  and conv states read and written once per linear layer;
- verify over q = 2 and 4 tokens per slot / plain (the verify keeps the state after each
  token: q states written);
- `chain` K = 1 (the model's one MTP layer) and `eagle` K = 3 (the layer reused) steps and
  their projected speed-up at the shipped model's acceptance per depth.
With $OUT set, rows go to bench_hybrid_decode.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import (bench_programs, fresh_state, oracle_model, timed,  # noqa: E402
                          verify_loop, weight_bytes)
from bench_paged_attention import copy_bandwidth  # noqa: E402

from mtp_jax.config import EngineConfig, GDNConfig, ModelConfig, MoEConfig  # noqa: E402
from mtp_jax.step import greedy_steps  # noqa: E402

HYBRID = dict(layout="qwen3_5", qk_norm=True, norm_offset=1.0, attention_gate="element",
              partial_rotary_factor=0.25, mtp_concat_order="embed_first",
              mtp_zero_embed_at_pos0=False, mtp_shared_input=True, num_mtp_modules=1,
              rope_theta=1e7, max_position_embeddings=262144, dtype="bfloat16")


def linear_flags(n):
    return tuple((i + 1) % 4 != 0 for i in range(n)) + (False,)


QWEN35_27B = dict(HYBRID, vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                  num_layers=64, num_heads=24, num_kv_heads=4, head_dim=256,
                  gdn=GDNConfig(16, 48, 128, 128, 4), linear_layers=linear_flags(64))
QWEN3_NEXT_80B = dict(HYBRID, layout="qwen3_next", vocab_size=151936, hidden_size=2048,
                      intermediate_size=5120, num_layers=48, num_heads=16, num_kv_heads=2,
                      head_dim=256, gdn=GDNConfig(16, 32, 128, 128, 4),
                      linear_layers=linear_flags(48),
                      moe=MoEConfig(num_experts=512, top_k=10, intermediate_size=512,
                                    router="softmax", score_bias=False,
                                    shared_intermediate_size=512, shared_gate=True))
TINY = dict(HYBRID, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
            num_heads=4, num_kv_heads=2, head_dim=32, gdn=GDNConfig(2, 4, 16, 16, 4),
            linear_layers=linear_flags(4), dtype="float32")
SHAPES = {"qwen3.5-27b": QWEN35_27B, "qwen3-next-80b": QWEN3_NEXT_80B}


def log(*a):
    print(*a, flush=True)


def sliced(cfg: dict, layers: int) -> ModelConfig:
    return ModelConfig(**dict(cfg, num_layers=layers, linear_layers=linear_flags(layers)))


def state_bytes(cfg: ModelConfig, b: int) -> int:
    """Recurrent (f32) and conv states of every linear layer for b slots, one copy."""
    g = cfg.gdn
    n = sum(cfg.is_linear(i) for i in range(cfg.num_layers))
    per = g.num_v_heads * g.k_head_dim * g.v_head_dim * 4 + (g.conv_kernel - 1) * g.conv_dim * 2
    return n * b * per


def kv_bytes(cfg: ModelConfig, b: int, ctx: int) -> int:
    full = sum(not cfg.is_linear(i) for i in range(cfg.num_layers))
    return full * b * ctx * 2 * cfg.num_kv_heads * cfg.head_dim * 2


def expert_bytes(cfg: ModelConfig, b: int, q: int) -> int:
    """Routed expert weights a step of b * q tokens reads, at most: top-k distinct experts
    per token, bounded by all experts (random routing)."""
    m = cfg.moe
    if m is None:
        return 0
    per = 3 * cfg.hidden_size * m.intermediate_size * 2
    moe_layers = sum(m.is_moe_layer(i) for i in range(cfg.num_layers))
    distinct = m.num_experts * (1 - (1 - 1 / m.num_experts) ** (m.top_k * b * q))
    return int(moe_layers * distinct * per)


def bench(model, b: int, ctxs, steps: int, acceptance, bw: float,
          methods=(("none", 0), ("chain", 1), ("eagle", 3)), qs=(1, 2, 4)) -> list:
    """Rows for batch b at each context: one set of programs for all."""
    cfg = model.config
    dtype = jnp.dtype(cfg.dtype)
    t0 = time.perf_counter()
    eng = EngineConfig(max_batch=b, max_model_len=max(ctxs) + steps * 16 + 64, page_size=16,
                       prefill_chunk=16)
    sampled = not greedy_steps(eng)
    p = model.params
    rows = {ctx: dict(layers=cfg.num_layers, batch=b, ctx=ctx) for ctx in ctxs}
    tw = weight_bytes(model, ("target",))
    if cfg.moe is not None:  # only the routed experts the step's tokens pick are read
        tw -= sum(weight_bytes(model, ("target", "layers", i, "mlp", name))
                  for i in range(cfg.num_layers) if cfg.moe.is_moe_layer(i)
                  for name in ("experts_gate_up", "experts_down"))
    for method, k in methods:
        progs = bench_programs(model, eng, dtype, methods=(method,), k=max(k, 1))
        prog = progs[method].steps(progs[method].static.k, sampled)
        loops = ({q: verify_loop(model, progs[method].static.layout, b, q) for q in qs}
                 if method == "none" else {})
        for ctx in ctxs:
            row = rows[ctx]
            holder = {"st": jax.block_until_ready(
                prog(p, fresh_state(progs[method], model, b, ctx, dtype), jnp.int32(1)))}

            def run():
                holder["st"] = jax.block_until_ready(prog(p, holder["st"], jnp.int32(steps)))
            row[f"{method}{k}_step_ms"] = timed(run)[0] / steps * 1e3
            del holder
            for q, loop in loops.items():
                st = fresh_state(progs[method], model, b, ctx, dtype)
                caches, st = st.caches, st.replace(caches=())
                h = {"c": jax.block_until_ready(loop(p, caches, st, 1))[0]}

                def run_v(loop=loop, st=st, h=h):
                    h["c"] = jax.block_until_ready(loop(p, h["c"], st, steps))[0]
                row[f"verify{q}_ms"] = timed(run_v)[0] / steps * 1e3
                del h
            log(f"  B={b} ctx={ctx} {method} K={k}: {row[f'{method}{k}_step_ms']:.3f} ms")
        del progs, loops
    out = []
    for ctx, row in rows.items():
        plain = tw + expert_bytes(cfg, b, 1) + kv_bytes(cfg, b, ctx) + 2 * state_bytes(cfg, b)
        row["plain_bytes"] = plain
        row["plain_limit_ms"] = plain / bw * 1e3
        row["plain_pct_of_limit"] = 100 * row["plain_limit_ms"] / row["none0_step_ms"]
        row["state_bytes_per_step"] = 2 * state_bytes(cfg, b)
        for q in qs[1:]:
            row[f"verify{q}_over_plain"] = row[f"verify{q}_ms"] / row["verify1_ms"]
        if acceptance and "chain1_step_ms" in row:
            row["projected_chain1_speedup"] = (1 + acceptance[0]) * row["none0_step_ms"] / row[
                "chain1_step_ms"]
        if acceptance and "eagle3_step_ms" in row:
            row["projected_eagle3_speedup"] = (1 + sum(acceptance[:3])) * row[
                "none0_step_ms"] / row["eagle3_step_ms"]
        row["seconds"] = time.perf_counter() - t0
        out.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.5-27b")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--ctxs", default="4096,32768")
    ap.add_argument("--slices", default="4,8",
                    help="qwen3-next-80b: the two layer counts timed and extrapolated from")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--skip", default="", help="comma list of BxCTX rows to leave out "
                    "(e.g. 32x32768 where it does not fit)")
    ap.add_argument("--small-memory-batches", default="",
                    help="batches run with the plain and K=1 steps and verify(2) only (the "
                         "K=3 verify keeps 4 states a slot and layer: 19 GB at B=32 for "
                         "Qwen3.5-27B, more than an 80 GB card has beside the weights)")
    ap.add_argument("--acceptance", default="checkpoints/acceptance_bf16.json")
    ap.add_argument("--methods", default="none:0,chain:1,eagle:3",
                    help="step programs timed, method:K (none:0 is the plain step)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    acceptance = None
    if os.path.exists(args.acceptance):
        data = json.load(open(args.acceptance))
        acc = data.get("methods", data)
        best = max(acc, key=lambda m: acc[m].get("mean_accepted_length", 0))
        acceptance = acc[best]["acceptance_per_depth"]
    dev = jax.devices()[0]
    bw = max(copy_bandwidth().values()) if jax.default_backend() == "gpu" else 1e12
    log(f"device {dev.device_kind}, jax {jax.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s, "
        f"acceptance {acceptance}")
    base = TINY if args.tiny else SHAPES[args.shape]
    slices = ([int(x) for x in args.slices.split(",")] if args.shape == "qwen3-next-80b"
              and not args.tiny else [base["num_layers"]])
    skip = set(args.skip.split(",")) - {""}
    big = {int(x) for x in args.small_memory_batches.split(",") if x}
    out = os.environ.get("OUT")
    rows = []
    methods = [(m, int(k)) for m, k in (x.split(":") for x in args.methods.split(","))]
    models = {}
    for n in slices:  # built once, on the device
        cfg = sliced(base, n)
        models[n] = oracle_model(cfg, jnp.dtype(cfg.dtype))
        jax.block_until_ready(models[n].params)
    for b in [int(x) for x in args.batches.split(",")]:
        ctxs = [int(x) for x in args.ctxs.split(",") if f"{b}x{x}" not in skip]
        if not ctxs:
            continue
        bm = methods if b not in big else [m for m in methods if m[1] <= 1]
        got = [bench(models[n], b, ctxs, args.steps, acceptance, bw, bm,
                     qs=(1, 2) if b in big else (1, 2, 4)) for n in slices]
        for i, ctx in enumerate(ctxs):
            row = dict(got[-1][i], shape="tiny" if args.tiny else args.shape,
                       device=dev.device_kind)
            if len(got) == 2:  # extrapolate each time and byte count to the whole model
                a, c, n0, n1 = got[0][i], got[1][i], slices[0], slices[1]
                full = ModelConfig(**base).num_layers
                for key in [x for x in a if x.endswith("_ms") or x.endswith("_bytes")
                            or x == "state_bytes_per_step"]:
                    row[key] = a[key] + (full - n0) * (c[key] - a[key]) / (n1 - n0)
                row["layers"] = full
                row["plain_limit_ms"] = row["plain_bytes"] / bw * 1e3
                row["plain_pct_of_limit"] = 100 * row["plain_limit_ms"] / row["none0_step_ms"]
                row["extrapolated_from_layers"] = slices
                for q in (2, 4):
                    if f"verify{q}_ms" in row:
                        row[f"verify{q}_over_plain"] = row[f"verify{q}_ms"] / row["verify1_ms"]
            log(json.dumps(row))
            rows.append(row)
            if out:
                with open(os.path.join(out, "bench_hybrid_decode.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
    log("| shape | B | ctx | plain ms (limit, %) | verify(2) / plain | verify(4) / plain | "
        "chain K=1 ms | eagle K=3 ms | projected x (chain1, eagle3) |")
    nan = float("nan")
    for r in rows:
        log(f"| {r['shape']} | {r['batch']} | {r['ctx']} | {r['none0_step_ms']:.2f} "
            f"({r['plain_limit_ms']:.2f}, {r['plain_pct_of_limit']:.0f} %) | "
            f"{r.get('verify2_over_plain', nan):.2f} | {r.get('verify4_over_plain', nan):.2f} | "
            f"{r.get('chain1_step_ms', nan):.2f} | {r.get('eagle3_step_ms', nan):.2f} | "
            f"{r.get('projected_chain1_speedup', nan):.2f}, "
            f"{r.get('projected_eagle3_speedup', nan):.2f} |")


if __name__ == "__main__":
    main()
