"""The files beside the weights that a run reads: the tokenizer (`tokenizer.json`, through
the `tokenizers` library, the one heavy import and a lazy one), the eos ids of
config.json, the chat template (mtp_jax.chat) and generation_config.json's eos ids and
sampling defaults."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from ..chat import ChatError, load_chat_template
from ..config import ConfigError, SamplingParams
from .safetensors_io import CheckpointError

GENERATION_CONFIG = "generation_config.json"
# read beside the weights besides tokenizer.json; a save copies them along
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              GENERATION_CONFIG)


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


def load_chat(path: str):
    """The chat template of the checkpoint in `path` (mtp_jax.chat.ChatTemplate), or None."""
    try:
        return load_chat_template(path)
    except ChatError as e:
        raise CheckpointError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """What a checkpoint's generation_config.json sets for a run: more eos ids, and the
    sampling defaults that apply where neither a request nor the command line sets them."""

    eos_token_ids: tuple = ()
    sampling: tuple = ()  # ((SamplingParams field, value), ...)
    origin: str = GENERATION_CONFIG


def load_generation_config(path: str) -> Optional[GenerationConfig]:
    """`path`/generation_config.json as a GenerationConfig (None without one). As in
    transformers, `do_sample: false` means greedy whatever the temperature says; with
    `do_sample: true` and no temperature, the temperature is 1. Otherwise the keys present
    (temperature, top_p, top_k; top_k 0 = off) are the defaults."""
    origin = os.path.join(path, GENERATION_CONFIG)
    try:
        with open(origin, encoding="utf-8") as f:
            gen = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{origin}: unreadable: {e}") from None
    if not isinstance(gen, dict):
        raise CheckpointError(f"{origin}: not a JSON object")
    eos = gen.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
        raise CheckpointError(f"{origin}: eos_token_id must be an integer or a list of them, "
                              f"got {gen.get('eos_token_id')!r}")
    if gen.get("do_sample") is False:
        sampling = {"temperature": 0.0}
    else:
        sampling = {k: gen[k] for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None}
        if gen.get("do_sample") is True:
            sampling.setdefault("temperature", 1.0)
    try:
        SamplingParams(**sampling)
    except ConfigError as e:
        raise CheckpointError(f"{origin}: {e}") from None
    return GenerationConfig(tuple(dict.fromkeys(eos)), tuple(sampling.items()), origin)


def copy_side_files(src: Optional[str], dst: str) -> None:
    """Copy SIDE_FILES from the folder `src` (if any) into `dst`."""
    import shutil

    if not src or os.path.abspath(src) == os.path.abspath(dst):
        return
    for name in SIDE_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
