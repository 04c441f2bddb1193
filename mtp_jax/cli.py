"""What the command lines share (generate.py, evaluate.py): the model folder default,
input lines as requests, and the options for quantization, prefill batching and what the
draft reads."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Optional

from . import draft_vocab
from .checkpoint import with_draft_head
from .config import ConfigError, SamplingParams
from .quant import MODES

DEFAULT_MODEL_ENV = "MTP_JAX_DEFAULT_MODEL"  # overrides the shipped model's folder
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed")
INT32_MAX = 2**31 - 1  # top_k travels to the device as int32


class LineError(ValueError):
    """Why one input line cannot run."""


class Fatal(Exception):
    """Nothing can run (exit status 1)."""


def shipped_model_root() -> Path:
    """Where the shipped model is: inside the package when installed from a wheel (setup.py
    copies checkpoints/ there), else checkpoints/ of the checkout."""
    installed = Path(__file__).resolve().parent / "shipped_model"
    return installed if installed.is_dir() else \
        Path(__file__).resolve().parent.parent / "checkpoints"


def default_model_dir() -> tuple[Path, Optional[Path]]:
    """(the folder searched, the model in it): itself if it holds a config.json, else its
    single subfolder holding one, else None."""
    root = Path(os.environ.get(DEFAULT_MODEL_ENV) or shipped_model_root())
    if (root / "config.json").is_file():
        return root, root
    subs = [p for p in sorted(root.iterdir()) if (p / "config.json").is_file()] \
        if root.is_dir() else []
    return root, (subs[0] if len(subs) == 1 else None)


def _is_scalar(x) -> bool:
    return isinstance(x, (str, int)) or (isinstance(x, float) and math.isfinite(x))


def build_request(obj, tokenizer, defaults: SamplingParams):
    """(prompt ids, SamplingParams) for one parsed line, or LineError saying why not."""
    if not isinstance(obj, dict):
        raise LineError(f"a line must be a JSON object, got {type(obj).__name__}")
    if obj.get("id") is not None and not _is_scalar(obj["id"]):
        raise LineError("id must be a string, a number or a boolean")
    if "prompt" in obj and "prompt_ids" in obj:
        raise LineError("give prompt (text) or prompt_ids (token ids), not both")
    if "prompt" not in obj and "prompt_ids" not in obj:
        raise LineError("missing prompt: give prompt (text) or prompt_ids (token ids)")
    if "prompt" in obj:
        text = obj["prompt"]
        if not isinstance(text, str):
            raise LineError(f"prompt must be a string, got {type(text).__name__}")
        if not text:
            raise LineError("empty prompt")
        if tokenizer is None:
            raise LineError("text prompt, but the model has no tokenizer.json: give prompt_ids")
        try:
            ids = tokenizer.encode(text).ids
        except Exception as e:  # the tokenizer raises its own types
            raise LineError(f"the prompt could not be tokenized: {e}") from None
        if not ids:
            raise LineError("the prompt encodes to no tokens")
    else:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise LineError("prompt_ids must be a list of integers")
        if not ids:
            raise LineError("empty prompt_ids")
    stop = obj.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise LineError("stop must be a non-empty string or a list of them")
    stop = tuple(dict.fromkeys(defaults.stop + tuple(stop)))
    if stop and tokenizer is None:
        raise LineError("stop strings need a tokenizer (the model has no tokenizer.json)")
    try:
        sp = dataclasses.replace(defaults, stop=stop,
                                 **{k: obj[k] for k in SAMPLING_FIELDS if k in obj})
    except ConfigError as e:
        raise LineError(f"invalid sampling values: {e}") from None
    if sp.top_k > INT32_MAX:
        raise LineError(f"invalid sampling values: top_k must be <= {INT32_MAX}, got {sp.top_k}")
    return ids, sp


def read_lines(data: bytes, numbered: bool = False):
    """(parsed object or LineError, id) for every non-blank line of the input, plus its
    1-based line number when `numbered`."""
    data = data.removeprefix(b"\xef\xbb\xbf")  # a BOM some editors write first
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        bad = None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:  # still parse what we can, to find the id
            text = raw.decode("utf-8", errors="replace")
            bad = LineError(f"the line is not valid UTF-8 (byte {raw[e.start]:#04x} at "
                            f"offset {e.start})")
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as e:  # ValueError: also ints of > 4300 digits
            obj, bad = None, bad or LineError(f"malformed JSON: {e}")
        rid = obj.get("id") if isinstance(obj, dict) else None
        rid = rid if rid is not None and _is_scalar(rid) else f"line {n}"
        yield (bad or obj, rid, n) if numbered else (bad or obj, rid)


def add_quantize_option(p) -> None:
    p.add_argument("--quantize", choices=MODES,
                   help="quantize the weights as they load: int8 or fp8 per output channel, "
                        "fp8-block (one scale per 128 input rows); a checkpoint published "
                        "quantized (FP8) stays so on GPU / TPU without this")
    p.add_argument("--kv-dtype", choices=["fp8"],
                   help="store the KV cache in fp8 (float8_e4m3fn) with per-kv-head scales "
                        "(the model's kv_scales.json, else calibrated at start); default: "
                        "the model's dtype")


def add_prefill_batch_option(p) -> None:
    p.add_argument("--prefill-batch", type=int, metavar="R",
                   help="requests prefilled together, a row each of one forward (a power of "
                        "two; default 8 on GPU / TPU, 1 on CPU)")


def add_draft_options(p) -> None:
    """--draft-vocab / --draft-vocab-size and --draft-head: what the draft reads; output
    unchanged."""
    draft_vocab.add_args(p)
    p.add_argument("--draft-head", choices=MODES,
                   help="the draft reads a quantized copy of the head (int8 or fp8 per "
                        "output channel, fp8-block) at batches of up to 64 slots on one "
                        "device, where the quantized matmul streams it faster on GPU / TPU; "
                        "the target keeps its head, so output is unchanged")


def apply_draft_options(model, args):
    """`model` with the --draft-vocab and --draft-head of `args` (if any), or Fatal saying
    why not."""
    try:
        model = draft_vocab.apply(model, args.draft_vocab, args.draft_vocab_size)
    except ConfigError as e:
        raise Fatal(f"--draft-vocab: {e}") from None
    try:
        return with_draft_head(model, args.draft_head)
    except ConfigError as e:  # QuantizationError included
        raise Fatal(f"--draft-head: {e}") from None
