"""Draft trees against the chain of K=3 end to end through the Engine: step cost and
tokens/s, with a projection from measured acceptance.

  PYTHONPATH=. python launch/bench_tree_decode.py [--batches 1] [--prompt-len 1024]
      [--new-tokens 256] [--trees "2,2,1;budget:8"] [--method chain] [--reps 2]
      [--acceptance tree_acceptance.json] [--model DIR [--prompts FILE [--limit N]] | --tiny]

The MiMo-7B shape of launch/bench_decode.py with its oracle weights (every draft agrees
with the target: a tree's first path is always accepted, so every run commits K + 1
tokens a step and the comparison is the steps' cost), or --model's weights (the shipped
model: real acceptance, but too small for a GPU's step times to mean much). For each
batch B: B requests of --prompt-len random tokens and --new-tokens new tokens on engines
of max_batch B (with --prompts: the first --limit prompts of FILE, tokenized, as one job
per B, so the shipped model's own acceptance on real text shows; the steps are then the
passes over the B slots) (`none`, the method at K=3, the method with each tree), each compiled
and warmed up first; the time is `Engine.generate` wall time, prefill included, best of
--reps. Reports tokens/s, tokens per target pass, seconds per step (wall over the steps
of the longest request) and, with --acceptance (launch/tree_acceptance.py's JSON report),
each run's tokens/s projected with the acceptance measured there: the measured tokens
per pass over this step time. Greedy output must equal `none`'s. With $OUT set, writes
bench_tree_decode.json and bench_tree_decode.md there.
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
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_decode import MIMO_7B, TINY, oracle_model  # noqa: E402

from mtp_jax.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig  # noqa: E402
from mtp_jax.engine import Engine, Request  # noqa: E402


def log(*a):
    print(*a, flush=True)


def run_job(model, name: str, spec: SpecConfig, b: int, prompts, new_tokens: int, reps: int):
    eng_cfg = EngineConfig(max_batch=b, max_model_len=max(map(len, prompts)) + new_tokens + 8,
                           prefill_chunk=256)
    t0 = time.perf_counter()
    eng = Engine(model, spec, eng_cfg)
    eng.warmup()
    compile_s = time.perf_counter() - t0
    reqs = [Request(i, p, SamplingParams(max_tokens=new_tokens)) for i, p in enumerate(prompts)]
    best, out = None, None
    for _ in range(reps):
        t0 = time.perf_counter()
        res = eng.generate(reqs)
        wall = time.perf_counter() - t0
        if best is None or wall < best:
            best, out = wall, res
    del eng
    gen = sum(len(r.token_ids) for r in out)
    passes = sum(r.num_steps + 1 for r in out)
    # the slots' steps: the longest request's when all run at once, else the passes
    # spread over the b slots (a job of more prompts than slots)
    steps = max(r.num_steps for r in out) if len(prompts) <= b else -(-passes // b)
    return {"run": name, "draft_tree": spec.draft_tree, "compile_s": compile_s, "wall_s": best,
            "generated_tokens": gen, "tokens_per_s": gen / best,
            "tokens_per_pass": gen / passes, "steps": steps,
            "step_ms": 1e3 * best / max(1, steps), "tokens": [r.token_ids for r in out]}


def measured_passes(path: str, method: str) -> dict:
    """{run name: tokens per pass} of tree_acceptance.py's report, per temperature."""
    with open(path) as f:
        results = json.load(f)["results"]
    out = {}
    for t, rows in results.items():
        out[t] = {("none" if n == "none" else n.replace(f"{method}/3", f"{method} K=3")
                   .replace(f"{method}/tree:", "tree ")): r["mean_accepted_length"]
                  for n, r in rows.items()}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--method", default="chain", choices=("chain", "eagle"))
    ap.add_argument("--trees", default="2,2,1;budget:8", help="';'-separated tree shapes")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--acceptance", help="tree_acceptance.py's JSON report")
    ap.add_argument("--model", help="a model folder instead of the oracle MiMo-7B shape")
    ap.add_argument("--tiny", action="store_true", help="tiny oracle shapes (a CPU smoke run)")
    ap.add_argument("--prompts", help="with --model: a JSONL file of prompts (`prompt` text, "
                                      "e.g. launch/data/heldout_package_prompts.jsonl) run "
                                      "as one job per batch size instead of random tokens")
    ap.add_argument("--limit", type=int, default=16, help="--prompts: the first N (16)")
    args = ap.parse_args(argv)
    if args.prompts and not args.model:
        ap.error("--prompts needs --model (the oracle shape has no tokenizer)")
    dev = jax.devices()[0]
    log(f"device {dev.device_kind}, jax {jax.__version__}")
    if args.model:
        from mtp_jax.checkpoint import load
        model = load(args.model)
    else:
        cfg = ModelConfig(**(TINY if args.tiny else MIMO_7B))
        model = oracle_model(cfg, jnp.dtype(cfg.dtype))
    vocab = model.config.vocab_size
    trees = [t.strip() for t in args.trees.split(";") if t.strip()]
    specs = [("none", SpecConfig("none", num_speculative_tokens=1)),
             (f"{args.method} K=3", SpecConfig(args.method, num_speculative_tokens=3))]
    specs += [(f"tree {t}", SpecConfig(args.method, draft_tree=t)) for t in trees]
    passes = measured_passes(args.acceptance, args.method) if args.acceptance else {}
    rng = np.random.default_rng(0)
    table = []
    job = None
    if args.prompts:
        with open(args.prompts) as f:
            texts = [json.loads(line)["prompt"] for line in f if line.strip()][: args.limit]
        job = [model.tokenizer.encode(t).ids for t in texts]
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = job or rng.integers(0, vocab, (b, args.prompt_len)).tolist()
        runs = [run_job(model, name, spec, b, prompts, args.new_tokens, args.reps)
                for name, spec in specs]
        want = runs[0]["tokens"]
        for r in runs:
            r["same_tokens_as_none"] = r.pop("tokens") == want
            r["projected_tokens_per_s"] = {
                t: rows[r["run"]] / r["step_ms"] * 1e3 for t, rows in passes.items()
                if r["run"] in rows and r["run"] != "none"}
            log(f"B={b} {r['run']}: {r['tokens_per_s']:.1f} tok/s, {r['tokens_per_pass']:.2f} "
                f"tokens/pass, {r['step_ms']:.2f} ms/step, compile {r['compile_s']:.1f}s, "
                f"same tokens as none: {r['same_tokens_as_none']}"
                + "".join(f", projected at T={t}: {v:.1f} tok/s"
                          for t, v in r["projected_tokens_per_s"].items()))
        table.append({"batch": b, "runs": runs})
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_tree_decode.json"), "w") as f:
            json.dump({"device": dev.device_kind, "jax": jax.__version__, "args": vars(args),
                       "table": table}, f, indent=1)
        temps = sorted(passes)
        lines = ["| B | run | tokens/s | tokens/pass | ms/step | "
                 + " | ".join(f"projected tok/s T={t}" for t in temps) + " |",
                 "|---|---|---|---|---|" + "---|" * len(temps)]
        for row in table:
            for r in row["runs"]:
                proj = " | ".join(f"{r['projected_tokens_per_s'].get(t, float('nan')):.0f}"
                                  for t in temps)
                lines.append(f"| {row['batch']} | {r['run']} | {r['tokens_per_s']:.0f} | "
                             f"{r['tokens_per_pass']:.2f} | {r['step_ms']:.2f} | {proj} |")
        with open(os.path.join(out, "bench_tree_decode.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    if not all(r["same_tokens_as_none"] for row in table for r in row["runs"]):
        log("a run's tokens differ from none's")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
