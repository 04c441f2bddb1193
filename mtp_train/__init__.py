"""Trains the shipped small model: a byte-level BPE tokenizer, a dense MiMo-layout target
and K MTP modules, jointly, on Python source: a standard library and, optionally, the
permissively licensed packages installed beside an interpreter.

DeepSeek-V3 style joint training: the loss comes from `forward_train`, the same module
calls the engine drafts with (module k at anchor i takes module k-1's hidden and the
embedding of t_{i+k+1} and predicts t_{i+k+2}), so training and inference cannot drift.
Total loss = target loss + lambda * mean over modules of the module losses.

Corpus: every `*.py` under the standard library root (`--stdlib`, default `sysconfig`'s
stdlib path; site-packages excluded) and, with `--site-packages`, every `*.py` that an
installed distribution's RECORD lists, for distributions whose licence is permissive
(`PERMISSIVE`; the others are recorded and left out). Files are read as UTF-8
(unreadable ones skipped), files over `--max-file-bytes` (generated tables) dropped,
exact duplicates dropped by content hash (first in order kept), and every file sharing a
line with HumanEval removed (each prompt's signature line, and every stripped line of 20+
characters of a prompt or a canonical solution). Held-out split: standard-library files
by a hash of their path, packages whole by a hash of their name. File order, window order
and init follow one seed. f32 master weights, bf16 compute, AdamW with warmup + cosine
decay (optax). It sits outside the runtime package `mtp_jax`, which never imports it:
corpus.py (corpus, tokenizer, token streams), metrics.py (losses, held-out metrics,
acceptance table), train.py (optimizer, step, loop, export), cli.py and __main__.py (the commands):

    python -m mtp_train train --out DIR [--size small|smoke] [--steps N] ...
    python -m mtp_train heldout --model DIR   # teacher-forced metrics, held-out files
    python -m mtp_train prompts --out FILE    # HumanEval-like held-out package prompts
    python -m mtp_train accept --model DIR    # HumanEval acceptance table
"""
