"""KV-cache writes: the GPU kernel (`pallas_kernels/kv_write_gpu.py`, K and V in one call)
against XLA's scatter (`write_rows`, one per array), at the engine's write shapes.

  PYTHONPATH=. python launch/bench_kv_write.py [--tokens 1,32,256,2048] [--reps 5]

MiMo-7B / Llama-2-7B attention (8 kv heads x 128, 16-token pages) over a pool of 16384
pages (B=64 x 4k): a layer's K and V rows for T tokens written at random distinct slots,
bf16 rows into bf16 or fp8 pages (per-head scales). T = 1 and 32: decode steps at batch
1 and 32; 256: a 4-token verify at batch 64; 2048: a prefill forward of 8 x 256 tokens.
Each write runs N times in one jitted program with the pages donated, as inside a step
program; us per write. The limit: the rows read plus the page rows written, at the copy
bandwidth measured in the same run (launch/bench_paged_attention.py). With $OUT set,
writes bench_kv_write.json there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_paged_attention import best_copy_bandwidth  # noqa: E402
from pallas_kernels.common import FP8_DTYPE  # noqa: E402
from pallas_kernels.kv_write import write_pages  # noqa: E402

KVH, D, PAGE, NUM_PAGES = 8, 128, 16, 16384


def time_write(backend, pages, new, slots, scales, n, reps, interpret=False):
    """(best, median) seconds per write of N chained writes in one jitted program (unrolled:
    a while loop would add its per-iteration predicate read, about 10 us on an H100)."""
    def chain(pages):
        for _ in range(n):
            pages = write_pages(pages, new, slots, scales, backend=backend,
                                interpret=interpret)
        return pages

    loop = jax.jit(chain, donate_argnums=(0,))
    pages = jax.block_until_ready(loop(pages))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        pages = jax.block_until_ready(loop(pages))
        times.append((time.perf_counter() - t) / n)
    return pages, min(times), statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,32,256,2048")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--n", type=int, default=32, help="writes per timed program")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="small pool, interpret mode (CPU)")
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    num_pages = NUM_PAGES if not args.tiny else 64
    bw, how = best_copy_bandwidth() if gpu else (float("nan"), "no GPU")
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s ({how})", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for dtype in args.dtypes.split(","):
        page_dtype = {"bf16": jnp.bfloat16, "fp8": FP8_DTYPE}[dtype]
        pages = tuple(jnp.zeros((KVH, num_pages, PAGE, D), page_dtype) for _ in range(2))
        scales = ((jnp.full((KVH,), 0.05, jnp.float32),) * 2 if dtype == "fp8"
                  else (None, None))
        for t in map(int, args.tokens.split(",")):
            new = tuple(jnp.asarray(rng.standard_normal((t, KVH, D)), jnp.bfloat16)
                        for _ in range(2))
            slots = jnp.asarray(rng.permutation(num_pages * PAGE)[:t], jnp.int32)
            nbytes = 2 * t * KVH * D * (2 + jnp.dtype(page_dtype).itemsize)
            row = {"pages": dtype, "tokens": t, "bytes": nbytes}
            for name, backend, interp in (("xla", "reference", False),
                                          ("kernel", "gpu", not gpu)):
                pages, best, med = time_write(backend, pages, new, slots, scales,
                                              args.n if gpu else 2,
                                              args.reps if gpu else 1, interp)
                row[f"{name}_us"], row[f"{name}_median_us"] = best * 1e6, med * 1e6
            row["limit_us"] = nbytes / bw * 1e6
            row["kernel_vs_xla"] = row["kernel_us"] / row["xla_us"]
            rows.append(row)
            print(f"{dtype} pages, T={t}: XLA scatter {row['xla_us']:.2f} us, kernel "
                  f"{row['kernel_us']:.2f} us ({row['kernel_vs_xla']:.2f}x), limit "
                  f"{row['limit_us']:.2f} us ({nbytes / 1e6:.2f} MB)", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_kv_write.json"), "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "copy_bandwidth": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
