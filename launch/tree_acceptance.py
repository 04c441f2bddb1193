"""Tokens per target pass of draft trees against the chain of K=3, on held-out prompts.

  PYTHONPATH=. python launch/tree_acceptance.py [--model DIR] [--dataset JSONL]
      [--limit 16] [--max-tokens 64] [--methods chain] [--trees "2,2,1;budget:8"]
      [--temperatures 0,0.7] [--seed 0] [--output report.json]

For each temperature, the same requests (the first --limit prompts of --dataset, default
the shipped model's held-out package prompts) run through `none`, each method at K=3
and each method with each tree (evaluate.run_methods, one warmed-up engine at a time).
Reports per run the generated tokens per target forward (each request's prefill counts
as one forward, as in evaluate's `mean_accepted_length`), the tokens per verify step
(the prefill's token and forward left out), the acceptance per depth and the ratios to
the method's chain of K=3. Greedy rows must equal `none`'s output (the
script fails otherwise); at a temperature above 0 each request draws with its own seed,
so the chain and the trees sample the same distribution by different draws. Runs on a
CPU (the shipped model is small); tokens/s on a CPU say nothing of a GPU's, see
launch/bench_tree_decode.py for that.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp_jax.config import EngineConfig, SamplingParams  # noqa: E402
from mtp_jax.evaluate import build_prompts, load_model, read_dataset, run_methods  # noqa: E402

HELDOUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                       "heldout_package_prompts.jsonl")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def measure(model, dataset: str, limit: int, max_tokens: int, temperature: float, seed: int,
            methods: tuple, trees: tuple, max_batch: int) -> dict:
    """evaluate.run_methods' rows for one temperature, with `vs_chain` (tokens per pass
    over the method's K=3 chain) added to each tree row."""
    from mtp_jax.engine import Request

    defaults = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)
    ids, prompts, skipped = build_prompts(read_dataset(dataset), model.tokenizer, defaults,
                                          limit, model.chat_template)
    for rid, why in skipped:
        log(f"skipping {rid}: {why}")
    # every request its own seed: rows of one job do not repeat one draw
    requests = [Request(i, p, SamplingParams(**{**sp.__dict__, "seed": seed + i}), heal)
                for i, (p, sp, heal) in enumerate(prompts)]
    longest = max(len(p) for p, _, _ in prompts) + max_tokens
    max_len = min(model.config.max_position_embeddings, -(-longest // 16) * 16)
    eng_cfg = EngineConfig(max_batch=max_batch, max_model_len=max_len,
                           prefill_chunk=min(256, max(16, 1 << (max_len - 1).bit_length())))
    rows = run_methods(model, requests, ids, methods, (3,), eng_cfg, temperature == 0, log,
                       trees=trees)
    for row in rows.values():
        steps = row["target_forwards"] - row["num_requests"]
        row["tokens_per_step"] = (row["generated_tokens"] - row["num_requests"]) / max(1, steps)
    for method in methods:
        chain = rows[f"{method}/3"]
        for tree in trees:
            row = rows[f"{method}/tree:{tree}"]
            row["vs_chain"] = row["mean_accepted_length"] / chain["mean_accepted_length"]
            row["step_vs_chain"] = row["tokens_per_step"] / chain["tokens_per_step"]
    return rows


def table(results: dict) -> str:
    head = (f"{'T':>4}  {'run':<22}{'tokens/pass':>12} {'vs K=3':>7} {'tokens/step':>12} "
            f"{'vs K=3':>7}  {'acceptance per depth':<20}{'lossless':>9}")
    lines = [head, "-" * len(head)]
    for t, rows in results.items():
        for name, r in rows.items():
            if name == "none":
                continue
            depth = " ".join(f"{a:.2f}" for a in r["acceptance_per_depth"])
            vs = f"{r['vs_chain']:.3f}" if "vs_chain" in r else "1"
            step_vs = f"{r['step_vs_chain']:.3f}" if "step_vs_chain" in r else "1"
            lossless = {None: "n/a", True: "yes", False: "NO"}[r["lossless"]]
            lines.append(f"{t:>4}  {name:<22}{r['mean_accepted_length']:>12.3f} {vs:>7} "
                         f"{r['tokens_per_step']:>12.3f} {step_vs:>7}  {depth:<20}"
                         f"{lossless:>9}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: the shipped model)")
    p.add_argument("--dataset", default=HELDOUT)
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--methods", default="chain", help="comma-separated: chain, eagle")
    p.add_argument("--trees", default="2,2,1;budget:8", help="';'-separated tree shapes")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write the JSON report here")
    args = p.parse_args(argv)
    _, model = load_model(args.model, "float32")
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    trees = tuple(t.strip() for t in args.trees.split(";") if t.strip())
    results = {}
    for t in (float(x) for x in args.temperatures.split(",")):
        results[f"{t:g}"] = measure(model, args.dataset, args.limit, args.max_tokens, t,
                                    args.seed, methods, trees, args.max_batch)
    print(table(results))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=1)
    bad = [(t, n) for t, rows in results.items() for n, r in rows.items()
           if r["lossless"] is False]
    if bad:
        log(f"greedy output differs from none's: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
