"""The files beside the weights that a run reads: the tokenizer (`tokenizer.json`, through
the `tokenizers` library, the one heavy import and a lazy one) and the eos ids of
config.json."""

from __future__ import annotations

import json
import os

from .safetensors_io import CheckpointError


def eos_ids(path: str) -> tuple:
    try:
        with open(os.path.join(path, "config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return ()
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def load_tokenizer(path: str):
    """The `tokenizers` tokenizer in `path/tokenizer.json`, or None (imported lazily)."""
    tok = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok):
        return None
    from tokenizers import Tokenizer  # the one heavy import, only when needed

    try:
        return Tokenizer.from_file(tok)
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise CheckpointError(f"{tok}: unreadable tokenizer: {str(e)[:300]}") from None
