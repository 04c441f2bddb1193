"""Token healing: a text prompt that ends on a token the tokenizer would merge with what
follows is backed up over that token, and generation re-chooses it.

A BPE tokenizer merges a prompt's trailing `'\\n'` with the next line's indentation
(`'\\n    '` is one token), so a prompt ending in a bare `'\\n'` ends on a token the model
rarely saw there, and it starts over instead of continuing. Healing drops the prompt's
last token and constrains the first generated token to the vocabulary entries whose text
starts with the dropped token's text (the engine masks the other logits of that one
sample, `step.prefill_finish`). The result's text is the continuation of the original
prompt: the dropped text is cut from its start (`requests.finished`).

A token's text is its lone decoding; special tokens decode to nothing, so they neither
heal nor qualify. Host-side only; the allowed ids are computed once per dropped token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Healing:
    """What a healed request re-chooses."""

    text: str  # the dropped prompt token's text: the first generated token starts with it
    allowed: np.ndarray  # [n] int32, sorted: token ids whose text starts with `text`


class Healer:
    """Heals prompts for one tokenizer (a `tokenizers.Tokenizer`), caching the decoded
    vocabulary and the allowed ids of every token it has backed up over."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._allowed: dict = {}

    @functools.cached_property
    def vocab(self) -> list:
        """Each token id's text (special tokens: '')."""
        n = self.tokenizer.get_vocab_size(with_added_tokens=True)
        return self.tokenizer.decode_batch([[i] for i in range(n)])

    def allowed(self, token: int) -> Optional[np.ndarray]:
        """Sorted ids of the tokens whose text starts with `token`'s, or None when there
        is nothing to heal: no text (a special token), a partial character (a byte-level
        token decoding to U+FFFD), or no token but itself qualifies."""
        if token not in self._allowed:
            text = self.vocab[token] if 0 <= token < len(self.vocab) else ""
            ids = None
            if text and "\ufffd" not in text:
                ids = np.asarray([i for i, t in enumerate(self.vocab) if t.startswith(text)],
                                 np.int32)
                ids = ids if len(ids) > 1 else None  # itself only
            self._allowed[token] = ids
        return self._allowed[token]

    def heal(self, ids: list) -> tuple:
        """(prompt ids, Healing or None): `ids` less its last token where that heals (and
        the prompt keeps at least one token), else `ids` unchanged and None."""
        if len(ids) < 2:
            return ids, None
        allowed = self.allowed(int(ids[-1]))
        if allowed is None:
            return ids, None
        return ids[:-1], Healing(self.vocab[int(ids[-1])], allowed)


def heal_line(healer: Optional[Healer], obj: dict, ids: list) -> tuple:
    """(prompt ids, Healing or None) of an input line: a text `prompt` healed by `healer`
    (None: healing off); `prompt_ids` and chat `messages` (whose templates end on special
    tokens) as they are."""
    if healer is None or "prompt" not in obj:
        return ids, None
    return healer.heal(ids)


def strip_healed(text: str, healing: Optional[Healing]) -> str:
    """The generated text as the continuation of the original prompt: without the dropped
    token's text it starts with."""
    if healing is not None and text.startswith(healing.text):
        return text[len(healing.text):]
    return text


__all__ = ["Healer", "Healing", "heal_line", "strip_healed"]
