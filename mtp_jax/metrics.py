"""Measures of generated text shared by the evaluation CLI and training reports."""

from __future__ import annotations


def repeated_ngrams(prompt, generated, n=4) -> int:
    """How many generated tokens complete an n-gram that already occurred earlier in the
    prompt or the output: the share of a text a draft could get right by copying."""
    seq, seen, hits = list(prompt), set(), 0
    for i in range(n - 1, len(seq)):
        seen.add(tuple(seq[i - n + 1: i + 1]))
    for t in generated:
        seq.append(t)
        gram = tuple(seq[-n:])
        hits += len(seq) >= n and gram in seen
        seen.add(gram)
    return hits
