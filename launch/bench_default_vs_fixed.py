"""The default (`--num-speculative-tokens auto`) against `--method none` and every fixed K,
as a user runs them: whole `python -m mtp_jax.generate` processes, alternated.

  PYTHONPATH=. python launch/bench_default_vs_fixed.py [--jobs short,long] [--batches 1,16]
      [--sittings 3] [--ks 1,2,3] [--model DIR] [--prompts FILE]

Jobs (prompts: the first N lines of launch/data/heldout_package_prompts.jsonl, greedy):
  short: 16 prompts x 64 new tokens;  long: 64 prompts x 256 new tokens.
For each job and `--max-batch` B, every configuration runs once untimed (so the compile
cache holds its executables: the timed runs are warm starts), then `--sittings` times in
rotation (none, auto, K=1, ..., then again), so slow and fast stretches of a shared
machine fall on every configuration alike. A run's time is the wall time of the whole
process (start-up, model load, warm-up and the job). Per sitting it prints the ratios
auto / none and auto / best fixed K, and a markdown table of every time at the end; with
$OUT set, writes bench_default_vs_fixed.json there. Greedy tokens are compared between
the configurations: they must be identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

JOBS = {"short": (16, 64), "long": (64, 256)}


def log(*a):
    print(*a, flush=True)


def run(cfg: str, prompts: str, tokens: int, batch: int, model, folder: str):
    """(seconds, token lists by id) of one generate process for configuration `cfg`
    ("none" or a K for `chain`, "auto" the default)."""
    out = os.path.join(folder, f"out_{cfg}.jsonl")
    if os.path.exists(out):
        os.remove(out)
    cmd = [sys.executable, "-m", "mtp_jax.generate", "--input", prompts, "--output", out,
           "--max-tokens", str(tokens), "--max-batch", str(batch), "--temperature", "0"]
    cmd += ["--method", "none"] if cfg == "none" else ["--num-speculative-tokens", cfg]
    if model:
        cmd += ["--model", model]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    with open(out) as f:
        tokens_by_id = {r["id"]: r.get("token_ids") for r in map(json.loads, f)}
    return seconds, tokens_by_id


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", default="short,long")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--sittings", type=int, default=3)
    ap.add_argument("--ks", default="1,2,3", help="the fixed K compared")
    ap.add_argument("--model", help="model folder (default: the shipped model)")
    ap.add_argument("--prompts", default="launch/data/heldout_package_prompts.jsonl")
    ap.add_argument("--max-prompts", type=int, help="cut every job to this many prompts")
    ap.add_argument("--tokens", type=int, help="override every job's new tokens")
    args = ap.parse_args(argv)
    with open(args.prompts) as f:
        lines = f.readlines()
    configs = ["none", "auto"] + args.ks.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for job in args.jobs.split(","):
            n, tokens = JOBS[job]
            n = min(n, args.max_prompts or n, len(lines))
            tokens = args.tokens or tokens
            prompts = os.path.join(folder, f"{job}.jsonl")
            with open(prompts, "w") as f:
                f.writelines(lines[:n])
            for batch in [int(b) for b in args.batches.split(",")]:
                for cfg in configs:  # untimed: fills the compile cache
                    run(cfg, prompts, tokens, batch, args.model, folder)
                times = {cfg: [] for cfg in configs}
                outputs = {}
                for sitting in range(args.sittings):
                    for cfg in configs:
                        seconds, toks = run(cfg, prompts, tokens, batch, args.model, folder)
                        times[cfg].append(seconds)
                        outputs.setdefault(cfg, toks)
                    fixed = min(times[k][-1] for k in configs[2:])
                    log(f"{job} ({n} x {tokens}) B={batch} sitting {sitting}: "
                        + ", ".join(f"{c} {times[c][-1]:.2f} s" for c in configs)
                        + f" | auto / none {times['auto'][-1] / times['none'][-1]:.3f}, "
                        f"auto / best K {times['auto'][-1] / fixed:.3f}")
                same = all(outputs[c] == outputs["none"] for c in configs)
                rows.append(dict(job=job, prompts=n, tokens=tokens, batch=batch, times=times,
                                 tokens_identical=same))
                if not same:
                    log(f"{job} B={batch}: greedy tokens differ between configurations")
    log("\n| job | B | sitting | none s | auto s | " + " | ".join(
        f"K={k} s" for k in configs[2:]) + " | auto / none | auto / best K |")
    log("|---|---|---|---|---|" + "---|" * (len(configs) - 2) + "---|---|")
    for r in rows:
        t = r["times"]
        for i in range(len(t["none"])):
            best = min(t[k][i] for k in configs[2:])
            log(f"| {r['job']} | {r['batch']} | {i} | {t['none'][i]:.2f} | {t['auto'][i]:.2f} | "
                + " | ".join(f"{t[k][i]:.2f}" for k in configs[2:])
                + f" | {t['auto'][i] / t['none'][i]:.3f} | {t['auto'][i] / best:.3f} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_default_vs_fixed.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
