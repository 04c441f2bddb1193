"""Reduced draft vocabulary: the MTP heads score only the N most frequent tokens.

Drafting with K modules costs K passes of the lm_head over the whole vocabulary, d x V
weights each: for a 7B model with a 152k vocabulary that is 1.2 GB per module per step
in bf16, as much as six of its decoder layers. Most drafts that get accepted are frequent
tokens, so (as FR-Spec and EAGLE-3 do) the draft may score only a fixed set of N frequent
tokens: `with_draft_vocab(model, ids)` copies those N columns of the head into the model
(`mtp.DraftVocab`) and every other token gets logit -inf in the draft. The target still
verifies over the whole vocabulary, so greedy output is unchanged (a token outside the set
is never drafted, only verified), and sampled output keeps its distribution: the draft's
real probabilities, zero outside the set, go into the acceptance test.

The set comes from token counts over text (the training corpus) or over the model's own
greedy outputs on a prompt file, the model's end-of-sequence ids always in it. The command
that counts and writes the file, `python -m mtp_jax.build_draft_vocab`, runs the engine,
so it sits above this module; `--draft-vocab F [--draft-vocab-size N]` on generate /
evaluate uses the file (the N most frequent ids of it; default all).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Iterable, Optional

import numpy as np

from .config import ConfigError

FORMAT = "mtp_jax.draft_vocab/1"


# ------------------------------------------------------------------ the model side
def with_draft_vocab(model, ids):
    """A copy of `model` whose MTP heads score only `ids` (distinct token ids)."""
    from .checkpoint import to_flat, with_params
    from .qarray import is_quantized, value

    cfg = model.config
    if not cfg.num_mtp_modules:
        raise ConfigError("a draft vocabulary needs MTP modules; this model has none")
    if cfg.draft_vocab_size:
        raise ConfigError(f"the model already drafts over {cfg.draft_vocab_size} tokens")
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError("draft vocabulary ids must be a non-empty list of integers")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ConfigError(f"draft vocabulary ids must lie in [0, {cfg.vocab_size})")
    if len(np.unique(ids)) != ids.size:
        raise ConfigError("draft vocabulary ids must be distinct")
    if cfg.draft_head:
        raise ConfigError("choose the draft vocabulary first, then the draft head's "
                          "quantization (it quantizes the reduced heads)")
    dtype = model.dtype
    heads = [value(w) for w in model.module().draft_head_weights()]
    flat = to_flat(model.params)
    for i, w in enumerate(heads):  # [d, V] -> [d, n]: the rows of w.T
        cols = w.T.rows(ids, dtype) if is_quantized(w) else w.T[ids]
        flat[("draft_vocab", "heads", i, "head")] = cols.T
    flat[("draft_vocab", "ids")] = ids.astype(np.int32)
    return with_params(model, dataclasses.replace(cfg, draft_vocab_size=int(ids.size)), flat)


# -------------------------------------------------------------- choosing the set
def most_frequent(counts, n: int, always: Iterable[int] = ()) -> np.ndarray:
    """The n ids with the highest counts (ties: lower id first), `always` included."""
    counts = np.asarray(counts, np.int64)
    if not 0 < n <= counts.size:
        raise ConfigError(f"draft vocabulary size must be in [1, {counts.size}], got {n}")
    order = np.lexsort((np.arange(counts.size), -counts))
    keep = [int(i) for i in always if 0 <= int(i) < counts.size]
    chosen = list(dict.fromkeys(keep))[:n]
    taken = set(chosen)
    for i in order:
        if len(chosen) == n:
            break
        if int(i) not in taken:
            chosen.append(int(i))
    return np.asarray(chosen, np.int32)


def count_text(tokenizer, texts: Iterable[str], vocab_size: int) -> np.ndarray:
    counts = np.zeros((vocab_size,), np.int64)
    for text in texts:
        ids = np.asarray(tokenizer.encode(text).ids, np.int64)
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


# ------------------------------------------------------------------------ files
def save_ids(path: str, ids, *, source: str, counts=None) -> Optional[float]:
    """Write the ids file; returns the share of `counts` the ids cover (None without)."""
    ids = [int(i) for i in ids]
    doc = {"format": FORMAT, "size": len(ids), "source": source, "ids": ids}
    if counts is not None:
        counts = np.asarray(counts)
        doc["coverage"] = float(counts[ids].sum() / max(counts.sum(), 1))
    with open(path, "w") as f:
        json.dump(doc, f)
    return doc.get("coverage")


def load_ids(path: str, size: Optional[int] = None) -> np.ndarray:
    """The ids of a draft vocabulary file, the `size` most frequent of them if given."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"draft vocabulary {path!r}: unreadable ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or \
            not isinstance(doc.get("ids"), list):
        raise ConfigError(f"draft vocabulary {path!r}: not a {FORMAT} file")
    ids = doc["ids"]
    if size is not None:
        if not 0 < size <= len(ids):
            raise ConfigError(f"--draft-vocab-size {size}: the file holds {len(ids)} ids")
        ids = ids[:size]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"draft vocabulary {path!r}: ids must be integers")
    return np.asarray(ids, np.int64)


def apply(model, path: Optional[str], size: Optional[int] = None):
    """`model` with the draft vocabulary of file `path` (None: unchanged)."""
    if path is None:
        if size is not None:
            raise ConfigError("--draft-vocab-size needs --draft-vocab FILE")
        return model
    return with_draft_vocab(model, load_ids(path, size))


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--draft-vocab", default=None, metavar="FILE",
                    help="draft over a reduced vocabulary (a file written by "
                         "`python -m mtp_jax.build_draft_vocab`); output unchanged")
    ap.add_argument("--draft-vocab-size", type=int, default=None, metavar="N",
                    help="use the N most frequent ids of --draft-vocab (default: all)")


__all__ = ["with_draft_vocab", "most_frequent", "count_text", "save_ids",
           "load_ids", "apply"]
