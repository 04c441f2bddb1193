"""Adaptive K against `none` and every fixed K on the same job, through the Engine.

  PYTHONPATH=. python launch/bench_adaptive.py [--batches 1,64] [--prompt-len 1024]
      [--new-tokens 256] [--ks auto,1,2,3] [--tiny]

The MiMo-7B shape of launch/bench_decode.py with its oracle weights (every draft agrees
with the target, so the drafts' worth is known: the best fixed K is the largest one that
the step costs allow). For each batch B: B requests of `prompt-len` random tokens and
`new-tokens` new tokens each, on engines of max_batch B (method `none`, then `chain` at
each K of --ks), each compiled and warmed up first (compile time reported apart); the
time is `Engine.generate` wall time, prefill included, best of --reps. Reports tokens/s,
each run against `none`, `auto` against the best of the others, and the kinds `auto`
ran per dispatch. With $OUT set, writes bench_adaptive.json and bench_adaptive.md there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import MIMO_7B, TINY, oracle_model  # noqa: E402

from mtp_jax.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig  # noqa: E402
from mtp_jax.config import parse_num_speculative_tokens  # noqa: E402
from mtp_jax.engine import Engine, Request  # noqa: E402


def log(*a):
    print(*a, flush=True)


def run_job(model, method, k, b, prompts, new_tokens, reps):
    eng_cfg = EngineConfig(max_batch=b, max_model_len=len(prompts[0]) + new_tokens + 8,
                           prefill_chunk=256)
    t0 = time.perf_counter()
    eng = Engine(model, SpecConfig(method, num_speculative_tokens=k), eng_cfg)
    eng.warmup()
    compile_s = time.perf_counter() - t0
    reqs = [Request(i, p, SamplingParams(max_tokens=new_tokens)) for i, p in enumerate(prompts)]
    best, out, schedule, detail = None, None, None, None
    for _ in range(reps):
        eng.reset_control()  # every repetition adapts from scratch
        before = dict(eng.stats)
        t0 = time.perf_counter()
        res = eng.generate(reqs)
        wall = time.perf_counter() - t0
        if best is None or wall < best:
            best, out = wall, res
            schedule = eng.control.counts() if eng.control is not None else None
            detail = {"dispatches": eng.stats["dispatches"] - before.get("dispatches", 0),
                      "dispatch_s": eng.stats["dispatch_seconds"]
                      - before.get("dispatch_seconds", 0.0)}
            if eng.control is not None:  # what the controller knew: seconds per step
                detail.update(order=eng.control.summary(), cost=eng.control.cost,
                              prior=eng.control.prior_cost)
    gen = sum(len(r.token_ids) for r in out)
    del eng
    return {"method": method, "k": k, "compile_s": compile_s, "wall_s": best,
            "generated_tokens": gen, "tokens_per_s": gen / best,
            "k_dispatches": schedule, "detail": detail, "tokens": [r.token_ids for r in out]}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--ks", default="auto,1,2,3")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    args = ap.parse_args(argv)
    cfg = ModelConfig(**(TINY if args.tiny else MIMO_7B))
    ks = [parse_num_speculative_tokens(x) for x in args.ks.split(",")]
    dev = jax.devices()[0]
    log(f"device {dev.device_kind}, jax {jax.__version__}")
    model = oracle_model(cfg, jnp.dtype(cfg.dtype))
    rng = np.random.default_rng(0)
    table = []
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = rng.integers(0, cfg.vocab_size, (b, args.prompt_len)).tolist()
        runs = [run_job(model, "none", 1, b, prompts, args.new_tokens, args.reps)]
        runs += [run_job(model, "chain", k, b, prompts, args.new_tokens, args.reps) for k in ks]
        plain, want = runs[0], runs[0]["tokens"]
        for r in runs:
            r["vs_none"] = r["tokens_per_s"] / plain["tokens_per_s"]
            r["same_tokens_as_none"] = r.pop("tokens") == want
            log(f"B={b} {r['method']} K={r['k']}: {r['tokens_per_s']:.1f} tok/s "
                f"({r['vs_none']:.2f}x none), compile {r['compile_s']:.1f}s"
                + (f", dispatches per K {r['k_dispatches']}" if r["k_dispatches"] else "")
                + f"\n  {r['detail']}")
        auto = [r for r in runs if r["k"] == "auto"]
        if auto:
            best_other = max(r["tokens_per_s"] for r in runs if r["k"] != "auto" or
                             r["method"] == "none")
            auto[0]["vs_best"] = auto[0]["tokens_per_s"] / best_other
            log(f"B={b} auto / best of none and fixed K: {auto[0]['vs_best']:.3f}")
        table.append({"batch": b, "runs": runs})
    out = os.environ.get("OUT")
    if out:
        report = {"device": dev.device_kind, "jax": jax.__version__, "args": vars(args),
                  "table": table}
        with open(os.path.join(out, "bench_adaptive.json"), "w") as f:
            json.dump(report, f, indent=1)
        lines = ["| B | run | tokens/s | vs none | auto vs best | dispatches per K |",
                 "|---|---|---|---|---|---|"]
        for row in table:
            for r in row["runs"]:
                name = "none" if r["method"] == "none" else f"chain K={r['k']}"
                lines.append(f"| {row['batch']} | {name} | {r['tokens_per_s']:.0f} | "
                             f"{r['vs_none']:.2f}x | {r.get('vs_best', float('nan')):.3f} | "
                             f"{r['k_dispatches'] or ''} |")
        with open(os.path.join(out, "bench_adaptive.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
