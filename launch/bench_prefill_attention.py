"""Paged attention over a prefill chunk: our kernel's tilings, the XLA reference, JAX's
bundled flash attention, all in one run.

  PYTHONPATH=. python launch/bench_prefill_attention.py [--rows 8] [--chunk 256]
      [--kv-lens 256,1024,4096] [--reps 5] [--tiny]

The engine's prefill attention: `rows` prompts, a chunk of `chunk` query tokens each, the
chunk's keys already written, kv_len = the chunk's end (the last chunk of a kv_len-token
prompt), bf16, Hq=32, KVH=8, D=128 (the MiMo-7B shape), page 16, pages in a random
permutation of the pool (inputs and timing: launch/bench_paged_attention.py's helpers).
FLOPs count the causal work only: query i of a chunk sees kv_len - chunk + i + 1 keys,
2 x D multiply-adds each for q . k and for p . v.
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

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_paged_attention import (D, HQ, KVH, PAGE, log, make_inputs, ours,  # noqa: E402
                                   reference, time_per_call)

from pallas_kernels.paged_attention import BlockConfig, default_block_config  # noqa: E402


def causal_flops(rows, chunk, kv_len, heads=HQ, d=D):
    seen = sum(kv_len - chunk + i + 1 for i in range(chunk))
    return rows * heads * seen * 2 * d * 2


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
    results = []
    for kv_len in kv_lens:
        inputs = make_inputs(rows, kv_len, chunk, jax.random.key(kv_len))
        q, k_pages, v_pages, tables, _ = inputs
        flops = causal_flops(rows, chunk, kv_len)
        row = {"rows": rows, "chunk": chunk, "kv_len": kv_len, "causal_flops": flops,
               "ours": {}}
        want = reference(*inputs).astype(jnp.float32)
        default = default_block_config(rows, chunk, HQ, KVH, PAGE, kv_len // PAGE, "gpu")
        configs = [default] + [
            BlockConfig(pages_per_block=ppb, rows_per_block=rpb, num_warps=w, num_stages=st)
            for rpb, ppb, w, st in itertools.product((64, 128), (4, 8), (4, 8), (2, 3))]
        for cfg in (configs[:2] if tiny else configs):
            tag = "default" if cfg is default else (
                f"rows {cfg.rows_per_block} x kv {cfg.pages_per_block * PAGE}, "
                f"{cfg.num_warps} warps, {cfg.num_stages} stages, {cfg.num_splits} splits")
            fn = ours(cfg, interpret=tiny)
            try:
                err = float(jnp.max(jnp.abs(fn(*inputs).astype(jnp.float32) - want)))
                _, s, _ = time_per_call(fn, inputs, n, args.reps)
            except Exception as e:  # a tiling the compiler refuses (e.g. shared memory)
                log(f"  kv {kv_len}: {tag}: failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            row["ours"][tag] = {"seconds": s, "tflop_per_s": flops / s / 1e12, "max_err": err}
            log(f"  kv {kv_len}: ours {tag}: {s * 1e3:.3f} ms, {flops / s / 1e12:.0f} "
                f"TFLOP/s, max err {err:.3g}")
        _, s, _ = time_per_call(reference, inputs, n, args.reps)
        row["xla_reference"] = {"seconds": s, "tflop_per_s": flops / s / 1e12}
        log(f"  kv {kv_len}: XLA reference: {s * 1e3:.3f} ms, {flops / s / 1e12:.0f} TFLOP/s")
        if not tiny:
            try:
                from jax.experimental.pallas.ops.gpu import attention as bundled
                kc, vc = (jnp.repeat(x[:, tables].reshape(KVH, rows, kv_len, D)
                                     .transpose(1, 2, 0, 3), HQ // KVH, axis=2)
                          for x in (k_pages, v_pages))
                mha = functools.partial(bundled.mha, segment_ids=None, causal=False)
                _, s, _ = time_per_call(mha, (q, kc, vc), n, args.reps)
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
