"""Paged attention over a prefill chunk: our kernel's tilings, the XLA reference, JAX's
bundled flash attention, all in one run.

  PYTHONPATH=. python launch/bench_prefill_attention.py [--rows 8] [--chunk 256]
      [--kv-lens 256,1024,4096] [--reps 5] [--tiny]

The engine's prefill attention: `rows` prompts, a chunk of `chunk` query tokens each, the
chunk's keys already written, kv_len = the chunk's end (the last chunk of a kv_len-token
prompt), bf16, Hq=32, KVH=8, D=128 (the MiMo-7B shape), page 16, pages in a random
permutation of the pool. FLOPs count the causal work only: query i of a chunk sees
kv_len - chunk + i + 1 keys, 2 x D multiply-adds each for q . k and for p . v.
Timed: `paged_attention` with the default tiling and every tiling of a small grid
(query rows per tile, kv positions per block, warps, stages), the XLA reference
(`paged_attention_reference`, which gathers the pages), and JAX's bundled Pallas GPU flash
attention (`jax.experimental.pallas.ops.gpu.attention.mha`) on contiguous K / V repeated to
the 32 query heads, non-causal over the same kv_len: its FLOPs are the full square
(it has no mask for a chunk that starts mid-sequence), which is the rate to compare.
Each figure: N calls in one jitted fori_loop (the output feeds the next q), best of
--reps. With $OUT set, writes bench_prefill_attention.json there. --tiny: a CPU smoke
run in interpret mode (figures mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels.paged_attention import (BlockConfig, default_block_config,  # noqa: E402
                                            paged_attention, paged_attention_reference)

HQ, KVH, D, PAGE = 32, 8, 128, 16


def log(*a):
    print(*a, flush=True)


def causal_flops(rows, chunk, kv_len, heads=HQ, d=D):
    seen = sum(kv_len - chunk + i + 1 for i in range(chunk))
    return rows * heads * seen * 2 * d * 2


def timed(fn, q, reps, n):
    """Best seconds per call of fn(q) -> q-shaped output, n calls per jitted loop."""
    @jax.jit
    def loop(q):
        return jax.lax.fori_loop(0, n, lambda i, x: fn(x).astype(x.dtype), q)

    jax.block_until_ready(loop(q))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(q))
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--kv-lens", default="256,1024,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    tiny = args.tiny
    rows, chunk = (2, 16) if tiny else (args.rows, args.chunk)
    kv_lens = [16, 32] if tiny else [int(x) for x in args.kv_lens.split(",")]
    n = 1 if tiny else 10
    dev = jax.devices()[0]
    log(f"device {dev.device_kind}, jax {jax.__version__}")
    backend = "gpu"
    rng = np.random.default_rng(0)
    results = []
    for kv_len in kv_lens:
        pages_per_seq = -(-kv_len // PAGE)
        num_pages = rows * pages_per_seq + 1
        key = jax.random.PRNGKey(kv_len)
        k1, k2, k3 = jax.random.split(key, 3)
        dt = jnp.bfloat16
        k_pages = jax.random.normal(k1, (KVH, num_pages, PAGE, D), dt)
        v_pages = jax.random.normal(k2, (KVH, num_pages, PAGE, D), dt)
        q = jax.random.normal(k3, (rows, chunk, HQ, D), dt)
        tables = jnp.asarray(1 + rng.permutation(rows * pages_per_seq).reshape(
            rows, pages_per_seq), jnp.int32)
        lens = jnp.full((rows,), kv_len, jnp.int32)
        flops = causal_flops(rows, chunk, kv_len)
        row = {"rows": rows, "chunk": chunk, "kv_len": kv_len, "causal_flops": flops,
               "ours": {}}

        def ours(cfg):
            return lambda x: paged_attention(x, k_pages, v_pages, tables, lens,
                                             backend=backend, interpret=tiny,
                                             block_config=cfg)

        want = paged_attention_reference(q, k_pages, v_pages, tables, lens)
        default = default_block_config(rows, chunk, HQ, KVH, PAGE, pages_per_seq, backend)
        configs = [default] + [
            BlockConfig(pages_per_block=ppb, rows_per_block=rpb, num_warps=w, num_stages=st)
            for rpb, ppb, w, st in itertools.product((64, 128), (4, 8), (4, 8), (2, 3))]
        for cfg in (configs[:2] if tiny else configs):
            name = (f"rows {cfg.rows_per_block} x kv {cfg.pages_per_block * PAGE}, "
                    f"{cfg.num_warps} warps, {cfg.num_stages} stages, {cfg.num_splits} splits")
            try:
                err = float(jnp.max(jnp.abs(ours(cfg)(q).astype(jnp.float32)
                                            - want.astype(jnp.float32))))
                s = timed(ours(cfg), q, args.reps, n)
            except Exception as e:  # a tiling the compiler refuses (e.g. shared memory)
                log(f"  kv {kv_len}: {name}: failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            tag = "default" if cfg is default else name
            row["ours"][tag if cfg is default else name] = {
                "seconds": s, "tflop_per_s": flops / s / 1e12, "max_err": err}
            log(f"  kv {kv_len}: ours {tag}: {s * 1e3:.3f} ms, {flops / s / 1e12:.0f} "
                f"TFLOP/s, max err {err:.3g}")
        s = timed(lambda x: paged_attention_reference(x, k_pages, v_pages, tables, lens), q,
                  args.reps, n)
        row["xla_reference"] = {"seconds": s, "tflop_per_s": flops / s / 1e12}
        log(f"  kv {kv_len}: XLA reference: {s * 1e3:.3f} ms, {flops / s / 1e12:.0f} TFLOP/s")
        if not tiny:
            try:
                from jax.experimental.pallas.ops.gpu import attention as bundled
                kc = jnp.repeat(k_pages[:, tables].reshape(KVH, rows, kv_len, D)
                                .transpose(1, 2, 0, 3), HQ // KVH, axis=2)
                vc = jnp.repeat(v_pages[:, tables].reshape(KVH, rows, kv_len, D)
                                .transpose(1, 2, 0, 3), HQ // KVH, axis=2)
                fn = functools.partial(bundled.mha, segment_ids=None, causal=False)
                s = timed(lambda x: fn(x, kc, vc), q, args.reps, n)
                full = rows * HQ * chunk * kv_len * 2 * D * 2
                row["bundled_mha_noncausal"] = {"seconds": s, "tflop_per_s": full / s / 1e12}
                log(f"  kv {kv_len}: bundled mha (non-causal, full square): {s * 1e3:.3f} "
                    f"ms, {full / s / 1e12:.0f} TFLOP/s")
            except Exception as e:
                log(f"  kv {kv_len}: bundled mha failed: {type(e).__name__}: {str(e)[:160]}")
        results.append(row)
        best = max(row["ours"].items(), key=lambda x: x[1]["tflop_per_s"])
        log(f"kv {kv_len}: default {row['ours'].get('default', {}).get('tflop_per_s', 0):.0f} "
            f"TFLOP/s, best {best[1]['tflop_per_s']:.0f} ({best[0]})")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_prefill_attention.json"), "w") as f:
            json.dump({"device": dev.device_kind, "jax": jax.__version__,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
