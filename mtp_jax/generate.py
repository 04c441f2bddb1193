"""Offline batch generation: `python -m mtp_jax.generate --input in.jsonl --output out.jsonl`.

Each input line is `{"id": ..., "prompt": "..."}`, `{"id": ..., "prompt_ids": [...]}` or
`{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}` (a chat, rendered by the
checkpoint's chat template or `--chat-template FILE`, with the line's optional
`chat_template_kwargs` as extra template variables), with optional `max_tokens`,
`temperature`, `top_p`, `top_k`, `seed` and `stop` (a string or a list of strings, added
to `--stop`); these override the command-line options, which override the checkpoint's
generation_config.json (its eos ids also end every request; `--generation-config none`
ignores the file). Any other key makes the line an error record (`--lenient`: the line
runs and its record gets a `warning` naming the keys). A `max_tokens` beyond what fits
`--max-model-len` after the prompt is capped to what fits, and the record says so
(`max_tokens_capped`). A text prompt ending on a token the tokenizer would merge with what
follows is token-healed (mtp_jax.healing; the record's `healed` holds the dropped token's
text; `--no-token-healing` turns it off). Each line gets exactly one output record,
appended whole and flushed as soon as it is known: results in the order requests finish, error records
(`{"id": ..., "error": ...}`) as soon as a line is found unrunnable. A line without a
usable id is called `line N` (1-based). A line whose id an earlier line has does not run:
it gets an error record naming that line (`duplicate_of_line`). `--resume` skips every id
already in the output file, error records included; it first cuts off a torn last line (a
record an interrupted run did not finish writing), so the file stays one whole JSON object
per line. A UTF-8 byte-order mark before the first line is ignored.
Progress and the summary go to stderr. The exit status is 1 when nothing can run: no
model, an unreadable input, an unwritable output, an invalid engine setup, or an input of
which no line ran (every line in error, or none at all; lines `--resume` skipped count as
run).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

from . import compile_cache
from .checkpoint import CheckpointError, load
from .chat import ChatError, load_chat_template
from .cli import (GENERATION_FIELDS, INT32_MAX, Fatal, LineError, add_draft_options,
                  add_deterministic_option, add_healing_option, add_prefill_batch_option,
                  add_prefix_cache_option, add_quantize_option, add_verbose_option,
                  apply_draft_options, build_request, check_keys, default_model_dir,
                  load_error, read_lines, sampling_defaults)
from .compile_cache import add_compile_cache_option
from .config import (AUTO, METHODS, ConfigError, EngineConfig, SamplingParams, SpecConfig,
                     parse_num_speculative_tokens)
from .engine import Engine, Request
from .healing import Healer, heal_line
from .progress import Heartbeat
from .quant import mode_of
from .sharding import make_mesh, param_sharding


def _key(rid) -> str:
    """Type-exact identity of an id (so 1, 1.0, true and "1" stay distinct)."""
    return json.dumps(rid, sort_keys=True)


# An input line whose id an earlier line already has does not run: it gets an error
# record carrying this key (the earlier line's number) and its own line number, which
# does not mark the id as done, so `--resume` still runs the earlier line if it had not
# finished, and does not report the same duplicate twice.
DUPLICATE_OF = "duplicate_of_line"


def done_ids(path: str) -> tuple[set, Optional[int], set]:
    """Ids recorded in an existing output file, the length to cut it to when it ends in a
    torn line (None when it does not), and the duplicate-id lines already reported."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return set(), None, set()
    whole = data.rfind(b"\n") + 1  # bytes up to the end of the last whole line
    ids, duplicates = set(), set()
    for raw in data[:whole].split(b"\n"):
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError
            continue  # a foreign line: as if absent
        if isinstance(rec, dict) and DUPLICATE_OF in rec:
            duplicates.add(rec.get("line"))
        elif isinstance(rec, dict) and "id" in rec:
            ids.add(_key(rec["id"]))
    return ids, (whole if whole < len(data) else None), duplicates


def record(rid, res, has_tokenizer: bool) -> dict:
    if res.error and not res.token_ids:  # it never ran
        return {"id": rid, "error": res.error}
    rec = {"id": rid, **({"text": res.text} if has_tokenizer else {}),
           "token_ids": res.token_ids, "finish_reason": res.finish_reason,
           "num_prompt_tokens": res.num_prompt_tokens,
           "num_cached_prompt_tokens": res.num_cached_prompt_tokens,
           "num_generated_tokens": res.num_generated_tokens,
           "mean_accepted_length": round(res.mean_accepted_length, 4),
           "acceptance_per_depth": [round(a, 4) for a in res.acceptance_per_depth]}
    if res.healed is not None:  # token healing re-chose the prompt's last token's text
        rec["healed"] = res.healed
    return {**rec, "error": res.error} if res.error else rec


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m mtp_jax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF-layout or mtp_jax orbax folder, or a Hugging Face Hub "
                                   "id org/name[@revision] (default: the shipped model)")
    p.add_argument("--input", required=True, help="JSONL prompts, or - for stdin")
    p.add_argument("--output", required=True, help="JSONL results, or - for stdout")
    p.add_argument("--method", choices=METHODS, help="draft strategy (default chain; none "
                                                     "for a model without MTP modules)")
    p.add_argument("--num-speculative-tokens", type=_k_arg, default=AUTO, metavar="auto|K",
                   help="drafts per step: auto (default) picks 0..K for every dispatch, K "
                        "being the MTP module count (3 for eagle), from measured acceptance "
                        "and step costs; an integer fixes it")
    p.add_argument("--draft-tree", metavar="SHAPE",
                   help="draft a tree, several candidates per depth verified in one target "
                        "pass (methods chain and eagle): per-depth branching such as 2,2,1 "
                        "(K is its depth), or budget:N[,depth:D][,topk:W] (the N likeliest "
                        "of the topk best children of the topk best nodes a depth, D = K)")
    p.add_argument("--temperature", type=float,
                   help="default: the checkpoint's generation_config.json, else 0 (greedy)")
    p.add_argument("--top-p", type=float, help="default: generation_config.json's, else 1")
    p.add_argument("--top-k", type=int, help="default: generation_config.json's, else 0 (off)")
    p.add_argument("--generation-config", choices=("auto", "none"), default="auto",
                   help="none: ignore the checkpoint's generation_config.json (its eos ids "
                        "and sampling defaults)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="jinja chat template for lines given as messages, instead of the "
                        "checkpoint's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stop", nargs="+", action="extend", default=[], metavar="STR",
                   help="stop strings for every line (added to a line's own)")
    p.add_argument("--max-batch", type=int, default=8)
    add_prefill_batch_option(p)
    add_prefix_cache_option(p)
    add_deterministic_option(p)
    p.add_argument("--max-model-len", type=int,
                   help="default: min(2048, the model's max_position_embeddings)")
    p.add_argument("--resume", action="store_true", help="skip ids already in --output")
    p.add_argument("--lenient", action="store_true",
                   help="run lines with unknown keys (their record gets a warning field) "
                        "instead of giving them an error record")
    p.add_argument("--mesh", metavar="tp=N,dp=M,ep=E",
                   help="shard over devices: tensor parallel N, data parallel M, experts "
                        "over E (MoE models; default: one device)")
    add_healing_option(p)
    add_quantize_option(p)
    add_draft_options(p)
    add_compile_cache_option(p)
    add_verbose_option(p)
    args = p.parse_args(argv)
    if args.resume and args.output == "-":
        p.error("--resume needs an output file, not stdout")
    args.cli_sampling = {k: getattr(args, k) for k in GENERATION_FIELDS
                         if getattr(args, k) is not None}
    try:  # the options given, checked before anything loads
        SamplingParams(seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
                       **args.cli_sampling)
    except ConfigError as e:
        p.error(str(e))
    if (args.top_k or 0) > INT32_MAX:
        p.error(f"--top-k must be <= {INT32_MAX}")
    return args


class _CtrlC:
    """SIGINT during a job: KeyboardInterrupt at once, and a flag that `check()` (called
    after every record) turns into one, so an interrupt Python swallows (one raised inside
    a finalizer or a gc callback is only printed) still ends the job at the next record
    instead of letting it run to the end."""

    def __init__(self):
        self.hit = False
        self._old = None

    def _handler(self, signum, frame):
        self.hit = True
        raise KeyboardInterrupt

    def install(self) -> None:
        self._old = None
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            return  # started with SIGINT ignored (nohup, a background job): keep it so
        try:
            self._old = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread: leave Python's handler in place
            self._old = None

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None

    def check(self) -> None:
        if self.hit:
            raise KeyboardInterrupt


def _k_arg(text: str):
    try:
        return parse_num_speculative_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def load_model(model_dir, mesh=None, quantize=None, verbose: bool = False):
    """The model in `model_dir` (streamed onto `mesh` if given, quantized if asked), or
    Fatal saying why not (raised before anything compiles; a long list of tensors
    shortened unless `verbose`, `load_error`)."""
    try:
        return load(str(model_dir), shardings=param_sharding(mesh), quantize=quantize)
    except (CheckpointError, ConfigError, OSError) as e:
        raise Fatal(f"cannot load model {model_dir}: {load_error(e, verbose)}") from None
    except Exception as e:  # a corrupt file can surface as any type; never a traceback
        raise Fatal(f"cannot load model {model_dir}: {type(e).__name__}: {e}") from None


def with_run_files(model, model_dir, args):
    """`model` with --chat-template and --generation-config applied."""
    if args.chat_template:
        try:
            # the folder it was loaded from (a hub id resolves to its snapshot folder)
            chat = load_chat_template(str(model.path or model_dir), override=args.chat_template)
        except ChatError as e:
            raise Fatal(str(e)) from None
        model = dataclasses.replace(model, chat_template=chat)
    if args.generation_config == "none":
        model = dataclasses.replace(model, generation=None)
    return model


def run_defaults(args, model) -> tuple:
    """(SamplingParams, summary line): the command line's options over the checkpoint's
    generation defaults over the built-in ones."""
    origin = Path(model.generation.origin).name if model.generation else ""
    return sampling_defaults(args.cli_sampling, model.generation_defaults, origin,
                             seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop))


def make_engine(args):
    """(model folder, model, Engine) from the command line, or Fatal saying why not."""
    if args.model:
        model_dir = args.model  # a folder or a hub id (load resolves it: checkpoint/hub.py)
    else:
        searched, model_dir = default_model_dir()
        if model_dir is None:
            raise Fatal(f"no --model given and no shipped model in {searched} (it needs a "
                        "config.json, or a single subfolder with one). Pass --model PATH: "
                        "an HF-layout folder or an orbax folder written by mtp_jax.")
    try:
        mesh = make_mesh(args.mesh)
    except ValueError as e:
        raise Fatal(str(e)) from None
    model = apply_draft_options(load_model(model_dir, mesh, args.quantize, args.verbose), args)
    model = with_run_files(model, model_dir, args)
    cfg = model.config
    if args.stop and model.tokenizer is None:
        raise Fatal("--stop needs a tokenizer and the model has no tokenizer.json")
    method = args.method or ("chain" if cfg.num_mtp_modules else "none")
    k = args.num_speculative_tokens
    max_len = args.max_model_len
    max_len = min(2048, cfg.max_position_embeddings) if max_len is None else max_len
    if max_len > cfg.max_position_embeddings:
        raise Fatal(f"--max-model-len {max_len} exceeds the model's "
                    f"max_position_embeddings ({cfg.max_position_embeddings})")
    # Prefill chunks longer than max_model_len would only add compiled programs.
    chunk = min(256, max(16, 1 << (max_len - 1).bit_length()))
    try:
        spec = SpecConfig(method, num_speculative_tokens=k, draft_tree=args.draft_tree)
        return model_dir, model, Engine(model, spec,
                                        EngineConfig(max_batch=args.max_batch,
                                                     max_model_len=max_len,
                                                     prefill_chunk=chunk,
                                                     kv_dtype=args.kv_dtype,
                                                     prefill_batch=args.prefill_batch,
                                                     prefix_cache=args.prefix_cache,
                                                     deterministic=args.deterministic),
                                        mesh=mesh)
    except (ConfigError, ValueError) as e:
        raise Fatal(str(e)) from None


def read_requests(data: bytes, skip: set, engine: Engine, defaults, emit,
                  reported: frozenset = frozenset(), lenient: bool = False,
                  healer: Optional[Healer] = None):
    """(requests, their ids, the fields each one's record adds, lines in error, lines
    skipped): an error record is emitted for every line that cannot run (a repeated id
    included, unless its line is in `reported`; an unknown key unless `lenient`, which
    makes it a `warning` field); lines whose id is in `skip` are left out. A max_tokens
    beyond what fits max_model_len is capped, and the record says so (`max_tokens_capped`).
    `healer`: heals text prompts (None: off)."""
    requests, ids, notes, bad, skipped = [], [], [], 0, 0
    first = {}  # id -> the line that has it first
    for obj, rid, n in read_lines(data, numbered=True):
        key = _key(rid)
        if key in first:
            if n not in reported:
                emit({"id": rid, "error": f"duplicate id: line {first[key]} has the same id, "
                      "so this line did not run (ids must be unique for --resume to tell "
                      "records apart)", DUPLICATE_OF: first[key], "line": n})
            bad += 1
            continue
        first[key] = n
        if key in skip:
            skipped += 1
            continue
        note = {}
        try:
            if isinstance(obj, LineError):
                raise obj
            warning = check_keys(obj, lenient)
            if warning:
                note["warning"] = warning
            prompt, sp = build_request(obj, engine.model.tokenizer, defaults,
                                       engine.model.chat_template)
            prompt, healing = heal_line(healer, obj, prompt)
            req = Request(len(ids), prompt, sp, healing)
            msg = engine.check(req)
            if msg:
                raise LineError(msg)
        except LineError as e:
            emit({"id": rid, "error": str(e), **note})
            bad += 1
            continue
        budget = engine.sched.budget(req)
        if budget < req.sampling.max_tokens:
            note["max_tokens_capped"] = budget
        requests.append(req)
        ids.append(rid)
        notes.append(note)
    return requests, ids, notes, bad, skipped


def run(engine: Engine, requests: list, ids: list, emit, has_tokenizer: bool,
        notes: Optional[list] = None) -> tuple[str, int]:
    """Stream the requests, emitting each record (with its `notes` fields) as it finishes;
    (the summary lines, how many finished without error)."""
    with Heartbeat() as beat:  # stderr not a terminal: a line every ~10 s instead of a bar
        beat.set("compiling the engine's programs")
        compile_s = engine.warmup(requests) if requests else 0.0
        return _stream(engine, requests, ids, emit, has_tokenizer, notes, compile_s, beat)


def _stream(engine, requests, ids, emit, has_tokenizer, notes, compile_s,
            beat) -> tuple[str, int]:
    """run() after the compile: a progress bar on a terminal, else `beat` says how far."""
    from tqdm import tqdm

    bar = tqdm(total=len(requests), file=sys.stderr, unit="req", disable=None)
    ok, gen, fwd, acc, tried = 0, 0, 0, [0] * engine.spec.k, [0] * engine.spec.k
    done = 0  # bar.n stays 0 while the bar is off
    beat.set(lambda: f"{done}/{len(requests)} requests done, {gen} tokens generated")
    t0 = time.perf_counter()
    for res in engine.stream(requests) if requests else ():  # stream() would compile
        rec = {**record(ids[res.id], res, has_tokenizer), **(notes[res.id] if notes else {})}
        emit(rec)
        ok += rec.get("finish_reason") in ("stop", "length")
        if "token_ids" in rec:  # it ran (maybe until NaN logits stopped it)
            gen, fwd = gen + len(res.token_ids), fwd + res.num_steps + 1
            acc = [a + b for a, b in zip(acc, res.accepted_per_depth)]
            tried = [a + b for a, b in zip(tried, res.verified_per_depth)]
        bar.set_postfix_str(f"{gen / (time.perf_counter() - t0):.1f} tok/s, "
                            f"{gen / max(fwd, 1):.2f} tokens/forward", refresh=False)
        bar.update(1)
        done += 1
    run_s = time.perf_counter() - t0
    bar.close()
    depth = " ".join(f"{a / max(t, 1):.3f}" for a, t in zip(acc, tried)) or "- (no drafts)"
    lines = [f"compile {compile_s:.1f} s | run {run_s:.2f} s | {ok} ok, "
             f"{len(requests) - ok} errors while running",
             f"generated {gen} tokens | {gen / max(run_s, 1e-9):.1f} tokens/s | "
             f"mean accepted length {gen / max(fwd, 1):.3f} tokens per target forward",
             f"acceptance per depth: {depth}"]
    if engine.control is not None:
        lines.append(f"drafts verified per dispatch (adaptive): {schedule_line(engine.control)}")
    if engine.stats["preemptions"]:
        lines.append(f"{engine.stats['preemptions']} preemptions: the KV page pool ran out and "
                     "requests were paused and continued (outputs unchanged)")
    lines.append(prefix_cache_line(engine))
    return "\n".join(lines), ok


def prefix_cache_line(engine) -> str:
    """The prefix cache's hit rate, the prefill it saved and the pool's peak use (shared
    pages counted once, against what the running requests would hold without sharing)."""
    if engine.sched.cache is None:
        why = engine.prefix_cache_off
        return "prefix cache: off" + (f" ({why})" if why else "")
    st = engine.stats
    total, hit = st["prompt_tokens"], st["cached_tokens"]
    return (f"prefix cache: {hit} of {total} prompt tokens cached "
            f"({100 * hit / max(total, 1):.1f} % hit rate), {hit} prefill tokens saved | "
            f"peak KV pages in use {st['peak_pages']} (shared pages once; "
            f"{st['peak_pages_per_request']} counted per request), "
            f"{engine.sched.cache.stats['evicted_blocks']} blocks evicted")


def schedule_line(control) -> str:
    """Dispatches per step kind, and a verdict when speculation never paid."""
    counts = control.counts()
    line = ", ".join(f"K={k}: {n}" for k, n in counts.items()) + " dispatches"
    best = control.best() if None not in (control.cost[0], control.cost[-1]) else None
    if best == 0:
        line += " (speculation off: it did not pay on this machine)"
    return line


def main(argv=None) -> int:
    args = parse_args(argv)
    compile_cache.enable(args.compile_cache)
    cache = compile_cache.CacheStats()
    try:
        try:
            data = sys.stdin.buffer.read() if args.input == "-" else \
                Path(args.input).read_bytes()
        except OSError as e:
            raise Fatal(f"cannot read input {args.input}: {e.strerror or e}") from None
        model_dir, model, engine = make_engine(args)
        defaults, defaults_line = run_defaults(args, model)
        skip, cut, reported = done_ids(args.output) if args.resume else (set(), None, set())
        try:
            if cut is not None:  # drop the torn record: its id runs again
                os.truncate(args.output, cut)
            out = sys.stdout.buffer if args.output == "-" else open(
                args.output, "ab" if args.resume else "wb")
        except OSError as e:
            raise Fatal(f"cannot write output {args.output}: {e.strerror or e}") from None
    except Fatal as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    ctrl_c = _CtrlC()

    def emit(rec: dict) -> None:
        out.write(json.dumps(rec).encode() + b"\n")
        out.flush()
        ctrl_c.check()

    try:
        ctrl_c.install()
        healer = (Healer(model.tokenizer) if args.token_healing and model.tokenizer is not None
                  else None)
        requests, ids, notes, bad, skipped = read_requests(
            data, skip, engine, defaults, emit, frozenset(reported), args.lenient, healer)
        k = f"auto (0..{engine.spec.k})" if engine.spec.adaptive else engine.spec.k
        held = mode_of(model.params)
        weights = ", ".join(([f"{held} weights"] if held else [])
                            + ([f"{args.kv_dtype} KV"] if args.kv_dtype else [])
                            + ([f"with a draft vocabulary of {model.config.draft_vocab_size} "
                                "tokens"] if model.config.draft_vocab_size else [])
                            + ([f"{model.config.draft_head} draft head"]
                               if model.config.draft_head else []))
        weights = f" ({weights})" if weights else ""
        print(f"{engine.spec.method} K={k} on {model_dir}{weights}: {len(requests)} "
              f"requests, {bad} lines in error, {skipped} skipped (already in the output)",
              file=sys.stderr)
        print(defaults_line, file=sys.stderr)
        summary, ok = run(engine, requests, ids, emit, model.tokenizer is not None, notes)
        ctrl_c.check()
    except KeyboardInterrupt:
        print("interrupted: every record written so far is whole; rerun with --resume",
              file=sys.stderr)
        return 130
    finally:
        ctrl_c.restore()
    if out is not sys.stdout.buffer:
        os.fsync(out.fileno())
        out.close()
    print(summary + f"\n{cache}", file=sys.stderr)
    if not ok and not skipped:  # every line in error (or none at all): nothing ran
        print("error: no line of the input ran" if requests or bad else
              "error: the input has no lines", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
