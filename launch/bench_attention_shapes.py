"""The paged-attention kernel's default tiling at the engine's own call shapes, one line each.

  PYTHONPATH=<tree> python launch/bench_attention_shapes.py [--tag new] [--reps 7] [--tiny]

MiMo-7B attention (Hq 32, KVH 8, D 128, page 16, pages in a random permutation:
launch/bench_paged_attention.py's inputs and timing), bf16 queries, each shape with the
kernel's default `BlockConfig`:
- prefill: 8 chunks of 256 queries ending at kv 1024 and 4096 (an admission round's
  chunks; TFLOP/s of causal work, as launch/bench_prefill_attention.py counts it);
- decode and verify: B x ctx x Q of the decode steps, bf16 and fp8 pages.
Prints one JSON line per shape (tag, shape, kv, best / median us). To compare two trees,
run the script under each (`PYTHONPATH=<tree>`) in the same device call and alternate
them; launch/bench_paged_attention.py and launch/bench_prefill_attention.py hold the
full tables and tiling sweeps. With $OUT set, appends the lines to
$OUT/bench_attention_shapes.jsonl. --tiny: a CPU smoke run in interpret mode, small
shapes (figures mean nothing). --match / --kv keep only the shapes whose name contains
the text / whose pages are of that kind, e.g. one kernel under a profiler:

  ncu --kernel-name regex:paged_attention --launch-skip 2 --launch-count 1 \
      python launch/bench_attention_shapes.py --match "decode B 64 x 4k" --kv fp8 --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_paged_attention import (fp8_inputs, make_inputs, ours, scaled,  # noqa: E402
                                   time_per_call)
from bench_prefill_attention import causal_flops  # noqa: E402

# (name, batch, ctx, queries per row, pages)
SHAPES = [("prefill 8 x 256 @ 1024", 8, 1024, 256, "bf16"),
          ("prefill 8 x 256 @ 4096", 8, 4096, 256, "bf16"),
          ("decode B 64 x 4k, Q 1", 64, 4096, 1, "bf16"),
          ("decode B 64 x 4k, Q 1", 64, 4096, 1, "fp8"),
          ("verify B 64 x 4k, Q 4", 64, 4096, 4, "fp8"),
          ("decode B 64 x 1k, Q 1", 64, 1024, 1, "bf16"),
          ("verify B 32 x 1k, Q 4", 32, 1024, 4, "bf16"),
          ("decode B 1 x 1k, Q 1", 1, 1024, 1, "bf16")]
TINY_SHAPES = [("prefill 2 x 32 @ 64", 2, 64, 32, "bf16"),
               ("decode B 2 x 64, Q 1", 2, 64, 1, "fp8")]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="", help="names this tree in the output lines")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--match", default="", help="only shapes whose name contains this")
    ap.add_argument("--kv", choices=("bf16", "fp8"), help="only shapes with these pages")
    args = ap.parse_args(argv)
    shapes = [s for s in (TINY_SHAPES if args.tiny else SHAPES)
              if args.match in s[0] and args.kv in (None, s[4])]
    if not shapes:
        ap.error(f"no shape matches --match {args.match!r} --kv {args.kv}")
    import pallas_kernels
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, kernels from "
          f"{os.path.dirname(pallas_kernels.__file__)}", flush=True)
    out = os.environ.get("OUT")
    key = jax.random.key(0)
    for name, batch, ctx, q_len, kv in shapes:
        inputs, fn = make_inputs(batch, ctx, q_len, key), ours(interpret=args.tiny)
        if kv == "fp8":
            inputs, fn = fp8_inputs(inputs), scaled(fn)
        n = 1 if args.tiny else 10 if q_len > 64 else 50
        _, best, median = time_per_call(fn, inputs, n, 1 if args.tiny else args.reps)
        line = dict(tag=args.tag, shape=name, kv=kv, best_us=best * 1e6,
                    median_us=median * 1e6)
        if q_len > 16:
            line["tflop_per_s"] = causal_flops(batch, q_len, ctx) / best / 1e12
        print(json.dumps(line), flush=True)
        if out:
            with open(os.path.join(out, "bench_attention_shapes.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
