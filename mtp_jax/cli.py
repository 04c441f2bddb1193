"""What the command lines share (generate.py, evaluate.py): the model folder default,
input lines as requests, and the options for quantization, prefill batching and what the
draft reads."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Optional

from . import draft_vocab
from .chat import ChatError
from .checkpoint import with_draft_head
from .config import ConfigError, SamplingParams
from .quant import MODES

DEFAULT_MODEL_ENV = "MTP_JAX_DEFAULT_MODEL"  # overrides the shipped model's folder
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed")
PROMPT_KEYS = ("prompt", "prompt_ids", "messages")
INT32_MAX = 2**31 - 1  # top_k travels to the device as int32
# Every key an input line may hold. Any other is an error for its line (a warning in its
# record with --lenient): a misspelt field (`max_token`) must not run with the default.
KNOWN_KEYS = frozenset({"id", "prompt", "prompt_ids", "messages", "chat_template_kwargs",
                        *SAMPLING_FIELDS, "stop"})


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


def check_keys(obj, lenient: bool = False) -> Optional[str]:
    """None when every key of the line is known; else LineError naming the others, or with
    `lenient` the warning for its record."""
    unknown = sorted(set(obj) - KNOWN_KEYS) if isinstance(obj, dict) else []
    if not unknown:
        return None
    msg = f"unknown keys {unknown} (known: {', '.join(sorted(KNOWN_KEYS))})"
    if not lenient:
        raise LineError(msg + "; --lenient runs the line without them")
    return msg + ": ignored"


def build_request(obj, tokenizer, defaults: SamplingParams, chat=None):
    """(prompt ids, SamplingParams) for one parsed line, or LineError saying why not.
    `chat`: the chat template (mtp_jax.chat.ChatTemplate) that renders `messages`."""
    if not isinstance(obj, dict):
        raise LineError(f"a line must be a JSON object, got {type(obj).__name__}")
    if obj.get("id") is not None and not _is_scalar(obj["id"]):
        raise LineError("id must be a string, a number or a boolean")
    given = [k for k in PROMPT_KEYS if k in obj]
    if len(given) > 1:
        raise LineError(f"give one of prompt (text), prompt_ids (token ids) or messages "
                        f"(a chat), not both {given[0]} and {given[1]}")
    if not given:
        raise LineError("missing prompt: give prompt (text), prompt_ids (token ids) or "
                        "messages (a chat)")
    if "chat_template_kwargs" in obj and "messages" not in obj:
        raise LineError("chat_template_kwargs applies to messages only")
    if "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise LineError("prompt_ids must be a list of integers")
        if not ids:
            raise LineError("empty prompt_ids")
    else:
        ids = _encode(obj, tokenizer, chat)
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


def _encode(obj, tokenizer, chat) -> list:
    """The token ids of a line's `prompt`, or of its `messages` rendered by the chat
    template (the text carries its own special tokens, so none are added)."""
    if "prompt" in obj:
        text, special = obj["prompt"], True
        if not isinstance(text, str):
            raise LineError(f"prompt must be a string, got {type(text).__name__}")
        if not text:
            raise LineError("empty prompt")
    if tokenizer is None:
        raise LineError(f"{'text prompt' if 'prompt' in obj else 'messages'}, but the model "
                        "has no tokenizer.json: give prompt_ids")
    if "messages" in obj:
        if chat is None:
            raise LineError("messages, but the model has no chat template (tokenizer_config."
                            "json's chat_template or chat_template.jinja): give prompt, or "
                            "a template with --chat-template FILE")
        try:
            text = chat.render(obj["messages"], obj.get("chat_template_kwargs"))
        except ChatError as e:
            raise LineError(str(e)) from None
        special = False
    try:
        # a text prompt is encoded as the tokenizer does by default; rendered messages
        # already hold their special tokens
        ids = (tokenizer.encode(text) if special else
               tokenizer.encode(text, add_special_tokens=False)).ids
    except Exception as e:  # the tokenizer raises its own types
        raise LineError(f"the prompt could not be tokenized: {e}") from None
    if not ids:
        raise LineError("the prompt encodes to no tokens")
    return ids


GENERATION_FIELDS = ("temperature", "top_p", "top_k")  # a checkpoint may set their defaults


def sampling_defaults(cli: dict, checkpoint: dict, origin: str, **fixed):
    """(SamplingParams, one summary line): each of GENERATION_FIELDS from `cli` (the
    options given), else `checkpoint` (its generation config, read from `origin`), else
    the built-in default; `fixed`: the other fields."""
    built_in = SamplingParams()
    values, where = {}, {}
    for k in GENERATION_FIELDS:
        for src, vals in (("command line", cli), (origin, checkpoint)):
            if vals.get(k) is not None:
                values[k], where[k] = vals[k], src
                break
        else:
            values[k], where[k] = getattr(built_in, k), "built-in"
    parts = {}
    for k in GENERATION_FIELDS:
        parts.setdefault(where[k], []).append(f"{k}={values[k]}")
    line = "sampling defaults: " + "; ".join(f"{' '.join(v)} ({src})"
                                             for src, v in parts.items())
    return SamplingParams(**values, **fixed), line


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


def load_error(e: Exception, verbose: bool = False) -> str:
    """The message of a load error. One that names only the first few of a long list of
    tensors (CheckpointError.full holds them all) gets the whole list under `verbose`, else
    the name of a file holding it."""
    full = getattr(e, "full", None)
    if full is None or full == str(e):
        return str(e)
    if verbose:
        return full
    fd, path = tempfile.mkstemp(prefix="mtp_jax-load-error-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(full + "\n")
    return f"{e} (the full list: {path}, or run with --verbose)"


def add_verbose_option(p) -> None:
    p.add_argument("--verbose", action="store_true",
                   help="print a load error's long lists of tensors whole (by default the "
                        "first few and a count, the whole list in a file it names)")


def add_healing_option(p) -> None:
    p.add_argument("--no-token-healing", dest="token_healing", action="store_false",
                   help="encode text prompts as they are: by default a prompt ending on a "
                        "token that could merge with what follows (a bare newline before "
                        "indentation) drops that token and the first generated token "
                        "re-chooses it (mtp_jax.healing)")


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


def add_prefix_cache_option(p) -> None:
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="prefill every prompt whole instead of reading the KV of prompt "
                        "blocks an earlier request with the same first tokens computed "
                        "(output unchanged either way)")


def add_deterministic_option(p) -> None:
    p.add_argument("--deterministic", action="store_true",
                   help="a token's logits do not depend on the rows computed beside it "
                        "(decode, verify, prefill, batch): greedy speculative output equals "
                        "plain decoding bitwise in bf16 too, and a seeded request gives the "
                        "same tokens at any batch; slower (README)")


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
