"""Writes a reduced draft vocabulary file (draft_vocab.py): the N tokens most frequent in
text, or in the model's own greedy outputs on a prompt file, the end-of-sequence ids
always included.

    python -m mtp_jax.build_draft_vocab --model PATH --size N --output F --text DIR_OR_FILE ...
    python -m mtp_jax.build_draft_vocab --model PATH --size N --output F --outputs prompts.jsonl

`--draft-vocab F [--draft-vocab-size N]` on generate / evaluate then uses it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterable

import numpy as np

from .checkpoint import load
from .config import ConfigError, EngineConfig, SamplingParams, SpecConfig
from .draft_vocab import count_text, most_frequent, save_ids
from .engine import Engine, Request

TEXT_SUFFIXES = (".py", ".txt", ".md", ".json", ".jsonl")


def _texts(paths: list) -> Iterable[str]:
    """The text of each file named, and of each text file under each folder named."""
    for p in paths:
        files = sorted(os.path.join(r, f) for r, _, fs in os.walk(p) for f in fs
                       if f.endswith(TEXT_SUFFIXES)) if os.path.isdir(p) else [p]
        for f in files:
            with open(f, encoding="utf-8", errors="replace") as fh:
                yield fh.read()


def count_outputs(model, prompts: list, max_tokens: int, max_batch: int = 16) -> np.ndarray:
    """Counts of the tokens the model generates greedily (plain decoding) from prompts."""
    tok = model.tokenizer
    reqs = [Request(i, list(tok.encode(p).ids) if isinstance(p, str) else list(p),
                    SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    longest = max(len(r.prompt_ids) for r in reqs)
    eng = Engine(model, SpecConfig("none"),
                 EngineConfig(max_batch=max_batch, max_model_len=longest + max_tokens + 8))
    counts = np.zeros((model.config.vocab_size,), np.int64)
    for res in eng.generate(reqs):
        if res.error:
            raise ConfigError(f"prompt {res.id}: {res.error}")
        counts += np.bincount(np.asarray(res.token_ids, np.int64),
                              minlength=model.config.vocab_size)
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtp_jax.build_draft_vocab",
                                 description="Write a reduced draft vocabulary file.")
    ap.add_argument("--model", default="checkpoints")
    ap.add_argument("--size", type=int, required=True, help="tokens in the set")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", nargs="+", help="files or folders of text to count")
    src.add_argument("--outputs", help="a prompts .jsonl (`prompt` fields): count the "
                                       "model's greedy outputs")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    model = load(args.model)
    if model.tokenizer is None:
        print("the model has no tokenizer", file=sys.stderr)
        return 2
    v = model.config.vocab_size
    if args.text:
        counts = count_text(model.tokenizer, _texts(args.text), v)
        source = "text: " + ", ".join(os.path.basename(p.rstrip("/")) for p in args.text)
    else:
        with open(args.outputs) as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
        counts = count_outputs(model, prompts, args.max_tokens)
        source = f"greedy outputs on {os.path.basename(args.outputs)} ({len(prompts)} prompts)"
    ids = most_frequent(counts, args.size, model.eos_token_ids)
    cover = save_ids(args.output, ids, source=source, counts=counts)
    print(f"{len(ids)} of {v} tokens cover {cover:.4f} of {int(counts.sum())} counted -> "
          f"{args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
