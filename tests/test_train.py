"""Training smoke test (a few steps on a tiny corpus) and the shipped checkpoint's contract."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import mtp_jax
from mtp_train import cli, corpus, metrics, train
from mtp_train.corpus import EOT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "checkpoints")


def _corpus(root, n=24):
    """A tiny synthetic Python corpus: repetitive enough that a few steps lower the loss."""
    for i in range(n):
        sub = os.path.join(root, f"pkg{i % 3}")
        os.makedirs(sub, exist_ok=True)
        body = "".join(f"def f{i}_{j}(x, y):\n    return x * {j} + y - {i}\n\n\n"
                       for j in range(12))
        with open(os.path.join(sub, f"mod{i}.py"), "w") as f:
            f.write(f'"""Module {i}."""\n\nimport os\n\n\n{body}')
    os.makedirs(os.path.join(root, "site-packages"), exist_ok=True)
    with open(os.path.join(root, "site-packages", "skipped.py"), "w") as f:
        f.write("x = 1\n")


def test_overlap_filter_drops_files_sharing_evaluation_lines(tmp_path):
    _corpus(tmp_path, n=3)
    with open(tmp_path / "leak.py", "w") as f:
        f.write("def secret(x):\n    return 1\n")
    with open(tmp_path / "leak2.py", "w") as f:
        f.write("def g():\n    return [v * v for v in range(10) if v % 3 == 1]\n")
    problems = [{"prompt": "def secret(x):\n    \"\"\"Doc.\"\"\"\n", "entry_point": "secret",
                 "canonical_solution": "    return [v * v for v in range(10) if v % 3 == 1]\n"}]
    c = corpus.build_corpus(str(tmp_path), corpus.overlap_lines(problems))
    assert sorted(r for r, _, _ in c["removed"]) == ["leak.py", "leak2.py"]
    rels = [r for r, _ in c["files"]]
    assert rels == sorted(rels) and len(rels) == 3 and not any("site-packages" in r for r in rels)


def test_tiny_training_run_lowers_loss_and_exports(tmp_path):
    corpus, out = tmp_path / "lib", tmp_path / "model"
    _corpus(corpus)
    m = train.train(cli.main_parser().parse_args([
        "train", "--out", str(out), "--size", "smoke", "--stdlib", str(corpus),
        "--no-overlap-check", "--vocab-size", "300", "--steps", "16", "--batch", "4",
        "--seq-len", "32", "--warmup", "2", "--lr", "1e-2", "--log-every", "4",
        "--eval-every", "1000", "--eval-rows", "2", "--heldout-percent", "10"]))
    losses = [v for _, v in m["history"]["train"]]
    assert len(losses) == 4 and len(losses[0]) == 4  # target + 3 MTP heads
    assert losses[-1][0] < losses[0][0] - 0.5 and np.mean(losses[-1][1:]) < np.mean(losses[0][1:])
    held = m["final_heldout"]["val_stdlib"]
    assert len(held["agreement"]) == 3 and held["tokens"] > 0
    assert held["nats_per_byte"] == pytest.approx(
        held["loss"][0] * m["heldout_tokens"] / m["bytes"]["val_stdlib"])
    assert m["tokens_seen"] == 16 * 4 * 32
    model = mtp_jax.load(str(out))
    cfg = model.config
    assert (cfg.layout, cfg.num_mtp_modules, cfg.mtp_hidden_source) == ("mimo", 3, "previous")
    assert cfg.num_params == m["num_params"]
    assert model.eos_token_ids == (model.tokenizer.token_to_id(EOT),)
    text = "def f1_2(x, y):\n    return x\n"
    assert model.tokenizer.decode(model.tokenizer.encode(text).ids) == text
    assert os.path.exists(out / "loss_curves.png")


@pytest.mark.skipif(not os.path.exists(os.path.join(SHIPPED, "config.json")),
                    reason="no shipped checkpoint")
def test_shipped_checkpoint_is_mimo_with_three_chained_modules():
    with open(os.path.join(SHIPPED, "config.json")) as f:
        raw = json.load(f)
    assert raw["model_type"] == "mimo" and raw["num_nextn_predict_layers"] == 3
    assert raw["mtp_hidden_source"] == "previous"
    # 48 MB of weights keeps the repository small enough to travel with the code
    assert os.path.getsize(os.path.join(SHIPPED, "model.safetensors")) <= 48e6
    model = mtp_jax.load(SHIPPED)
    cfg = model.config
    assert (cfg.layout, cfg.num_mtp_modules, cfg.mtp_hidden_source) == ("mimo", 3, "previous")
    assert (cfg.mtp_concat_order, cfg.mtp_zero_embed_at_pos0, cfg.mtp_hidden_from,
            cfg.mtp_output_hidden) == ("hidden_first", True, "post_norm", "post_norm")
    assert cfg.num_layers == 12 and cfg.num_params <= 24e6  # a deep target, small modules
    tok = model.tokenizer
    assert tok is not None and tok.get_vocab_size() == cfg.vocab_size
    assert model.eos_token_ids == (tok.token_to_id(EOT),)
    assert os.path.exists(os.path.join(SHIPPED, "README.md"))


def _dist(site, name, licence_lines, files):
    """An installed distribution: its .dist-info (METADATA, RECORD) and its files."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                                   + "".join(x + "\n" for x in licence_lines)
                                   + "\nLicense text follows: GPL\n")
    record = []
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
        record.append(f"{rel},sha256=x,{len(text)}")
    (info / "RECORD").write_text("\n".join(record + [f"{info.name}/METADATA,,",
                                                     "../../bin/tool.py,,"]) + "\n")


def test_package_corpus_keeps_permissive_dedups_and_holds_out_whole_packages(tmp_path):
    site, std = tmp_path / "site", tmp_path / "lib"
    _corpus(std, n=3)
    fn = 'def area(w, h):\n    """The area of a w by h rectangle, in square units of w."""\n'
    _dist(site, "okpkg", ["License-Expression: MIT"],
          {"okpkg/__init__.py": fn + "    return w * h\n",
           "okpkg/copy.py": open(std / "pkg0" / "mod0.py").read(),  # same as a stdlib file
           "okpkg/big.py": "x = 1\n" * 400, "okpkg/data.bin": "no"})
    _dist(site, "gplpkg", ["License: GPL-3.0", "Classifier: License :: OSI Approved :: "
                           "GNU General Public License v3 (GPLv3)"], {"gplpkg/a.py": "y = 2\n"})
    _dist(site, "Other_Pkg", ["Classifier: License :: OSI Approved :: BSD License"],
          {"other_pkg/m.py": "z = 3\n"})
    dists = corpus.find_distributions([str(site)])
    assert [(d["name"], d["permissive"]) for d in dists] == [
        ("gplpkg", False), ("okpkg", True), ("other-pkg", True)]
    assert dists[1]["files"] == ["okpkg/__init__.py", "okpkg/big.py", "okpkg/copy.py"]
    assert dists[1]["licence"] == "MIT" and "GPL" in dists[0]["licence"]
    assert not corpus.is_permissive("BSD; GNU Lesser General Public License (LGPL)")
    seen = {__import__("hashlib").sha1(open(std / "pkg0" / "mod0.py").read().encode()).digest()}
    pk = corpus.build_package_corpus(dists, set(), seen=seen, max_file_bytes=2000)
    assert [(s, r) for s, r, _ in pk["files"]] == [("okpkg", "okpkg/__init__.py"),
                                                   ("other-pkg", "other_pkg/m.py")]
    assert pk["duplicates"] == 1 and pk["too_large"] == ["okpkg:okpkg/big.py"]
    assert corpus.heldout_prompts(pk["files"], 4, min_chars=10) == [
        {"id": "okpkg:okpkg/__init__.py", "prompt": fn}]
    files = [("b", f"b{i}.py", fn) for i in range(3)] + [("a", "a0.py", fn)]
    assert [p["id"] for p in corpus.heldout_prompts(files, 3, min_chars=10)] == [
        "a:a0.py", "b:b0.py", "b:b1.py"]  # in turns over the packages

    args = cli.main_parser().parse_args([
        "heldout", "--model", "unused", "--stdlib", str(std), "--site-packages", str(site),
        "--heldout-packages-percent", "100", "--heldout-percent", "0"])
    args.max_files = None
    c = corpus.assemble_corpus(args, set())
    assert len(c["train"]) == 3 and not c["heldout_stdlib"]
    assert [r for _, r, _ in c["heldout_packages"]] == [  # big.py is under the default cap
        "okpkg/__init__.py", "okpkg/big.py", "other_pkg/m.py"]
    assert [p["name"] for p in c["report"]["packages"] if p["heldout"]] == [
        "gplpkg", "okpkg", "other-pkg"]


def test_repeated_ngrams_counts_tokens_a_copy_would_predict():
    from mtp_jax.metrics import repeated_ngrams  # the runtime's, which train's metrics use

    assert repeated_ngrams([1, 2, 3, 4], [1, 2, 3, 4]) == 1  # only the last closes a seen 4-gram
    assert repeated_ngrams([1, 2, 3], [4, 1, 2, 3, 4]) == 1  # the output's own 4-grams count
    assert repeated_ngrams([], [5] * 6) == 2
    assert repeated_ngrams([7, 8, 9, 10], [11, 12]) == 0
