"""Prefill FLOP rate by chunk shape: how many prompt tokens one target forward should carry.

  PYTHONPATH=. python launch/bench_prefill.py [--shape mimo-7b] [--chunks 256,512,1024,2048]
      [--rows 1,2,4,8] [--max-tokens 8192] [--methods none,chain] [--tiny]

The 7-8B shape of launch/bench_decode.py (its oracle weights), the engine's prefill
computation over `rows` requests x `chunk` prompt tokens in one forward: the target over
the chunk (paged attention over the chunk's own keys, KV written), the logits of each
row's last position, and for `chain` the 3 MTP modules' history prefill over the same
positions (drafting.mtp_prefill). Timed in a jitted fori_loop (N forwards per call).

FLOPs per forward: 2 x (matmul params a token passes through) x tokens plus causal
attention (2 x 2 x layers x q-heads x head_dim x C^2 / 2 per row), the count of
launch/bench_batch_job.py. Beside it, the ceiling of the matmuls themselves: one bf16
[tokens, hidden] x [hidden, 2 x intermediate] product (the gate/up shape) timed alone.
With $OUT set, writes bench_prefill.json there.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_batch_job import PEAK_BF16, prefill_flops  # noqa: E402
from bench_decode import SHAPES, TINY, bench_programs, fresh_state, oracle_model  # noqa: E402

from mtp_jax.config import EngineConfig, ModelConfig  # noqa: E402
from mtp_jax.drafting import mtp_prefill  # noqa: E402
from mtp_jax.strategies import CHAIN  # noqa: E402
from mtp_jax.kv_cache import PagedKV  # noqa: E402

K = 3


def prefill_loop(model, layout, rows: int, chunk: int, mtp: bool):
    """Jitted f(params, caches, st, n): n prefill forwards of rows x chunk tokens."""
    cfg = model.config

    @functools.partial(jax.jit, donate_argnums=(1,))
    def f(params, caches, st, n):
        m = nnx.merge(model.graphdef, params)
        pos = jnp.broadcast_to(jnp.arange(chunk), (rows, chunk))
        lens = jnp.full((rows,), chunk, jnp.int32)

        def body(i, carry):
            caches, tok = carry
            kv = PagedKV(layout, caches, st.block_tables, st.limit)
            toks = (tok[:, None] + jnp.arange(chunk)[None] * 7919) % cfg.vocab_size
            normed, pre = m.target(toks, pos, kv.attend(pos, lens))
            logits = m.target.head(normed[:, -1])
            if mtp:
                hid = m.target.mtp_hidden(normed, pre)
                ext = jnp.pad(hid, ((0, 0), (0, K), (0, 0)))
                mtp_prefill(m, CHAIN, K, kv, jnp.pad(toks, ((0, 0), (0, K))), ext, pos, lens)
            return tuple(kv.caches), jnp.argmax(logits, -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, n, body, (caches, st.last_token))
    return f


def matmul_rate(tokens: int, d: int, f: int, dtype, reps: int) -> float:
    """FLOP/s of one [tokens, d] x [d, 2f] product (best of reps, 8 per call)."""
    x = jnp.ones((tokens, d), dtype)
    w = jnp.ones((d, 2 * f), dtype) * 0.01

    @jax.jit
    def g(x, w):
        return jax.lax.fori_loop(0, 8, lambda i, a: a + (x @ w)[:, :d] * 1e-3, x)

    jax.block_until_ready(g(x, w))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(g(x, w))
        best = min(best, (time.perf_counter() - t0) / 8)
    return 2 * tokens * d * 2 * f / best


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mimo-7b")
    ap.add_argument("--chunks", default="256,512,1024,2048")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=8192, help="skip rows x chunk above")
    ap.add_argument("--methods", default="none,chain")
    ap.add_argument("--iters", type=int, default=4, help="forwards per timed call")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    cfg = ModelConfig(**(TINY if args.tiny else SHAPES[args.shape]))
    dtype = jnp.dtype(cfg.dtype)
    dev = jax.devices()[0]
    peak = next((v for name, v in PEAK_BF16.items() if name in dev.device_kind), None)
    print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
    model = oracle_model(cfg, dtype)
    methods = args.methods.split(",")
    out = []
    for chunk in map(int, args.chunks.split(",")):
        for rows in map(int, args.rows.split(",")):
            if rows * chunk > args.max_tokens:
                continue
            eng = EngineConfig(max_batch=rows, max_model_len=chunk + 64, page_size=16,
                               prefill_chunk=min(chunk, 2048))
            progs = bench_programs(model, eng, dtype, methods=tuple(methods))
            ceiling = matmul_rate(rows * chunk, cfg.hidden_size, cfg.intermediate_size, dtype,
                                  args.reps)
            row = {"chunk": chunk, "rows": rows, "tokens": rows * chunk,
                   "matmul_flop_per_s": ceiling}
            for method in methods:
                prog = progs[method]
                st = fresh_state(prog, model, rows, chunk, dtype)
                f = prefill_loop(model, prog.static.layout, rows, chunk, method != "none")
                caches, tok = f(model.params, st.caches, st, 1)  # compile
                jax.block_until_ready(tok)
                best = float("inf")
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    caches, tok = f(model.params, caches, st, args.iters)
                    jax.block_until_ready(tok)
                    best = min(best, (time.perf_counter() - t0) / args.iters)
                flops = rows * prefill_flops(cfg, chunk, method != "none")
                row[method] = {"seconds": best, "tokens_per_s": rows * chunk / best,
                               "flop_per_s": flops / best}
                del caches, st
            out.append(row)
            pct = (lambda x: f" ({100 * x / peak:.0f} %)") if peak else (lambda x: "")
            print(f"chunk {chunk:5d} x rows {rows}: "
                  + "; ".join(f"{m} {row[m]['seconds'] * 1e3:.2f} ms, "
                              f"{row[m]['tokens_per_s']:.0f} tok/s, "
                              f"{row[m]['flop_per_s'] / 1e12:.0f} TFLOP/s"
                              + pct(row[m]['flop_per_s']) for m in methods)
                  + f"; gate/up matmul alone {ceiling / 1e12:.0f} TFLOP/s" + pct(ceiling),
                  flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_prefill.json"), "w") as f:
            json.dump({"device": dev.device_kind, "jax": jax.__version__, "args": vars(args),
                       "peak_bf16_flop_per_s": peak, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
