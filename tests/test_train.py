"""Training smoke test (a few steps on a tiny corpus) and the shipped checkpoint's contract."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import mtp_jax
from mtp_jax import train

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
    c = train.build_corpus(str(tmp_path), train.overlap_lines(problems))
    assert sorted(r for r, _, _ in c["removed"]) == ["leak.py", "leak2.py"]
    rels = [r for r, _ in c["files"]]
    assert rels == sorted(rels) and len(rels) == 3 and not any("site-packages" in r for r in rels)


def test_tiny_training_run_lowers_loss_and_exports(tmp_path):
    corpus, out = tmp_path / "lib", tmp_path / "model"
    _corpus(corpus)
    m = train.train(train.main_parser().parse_args([
        "train", "--out", str(out), "--size", "smoke", "--stdlib", str(corpus),
        "--no-overlap-check", "--vocab-size", "300", "--steps", "16", "--batch", "4",
        "--seq-len", "32", "--warmup", "2", "--lr", "1e-2", "--log-every", "4",
        "--eval-every", "1000", "--eval-rows", "2", "--heldout-percent", "10"]))
    losses = [v for _, v in m["history"]["train"]]
    assert len(losses) == 4 and len(losses[0]) == 4  # target + 3 MTP heads
    assert losses[-1][0] < losses[0][0] - 0.5 and np.mean(losses[-1][1:]) < np.mean(losses[0][1:])
    assert len(m["final_heldout"]["agreement"]) == 3
    assert m["tokens_seen"] == 16 * 4 * 32
    model = mtp_jax.load(str(out))
    cfg = model.config
    assert (cfg.layout, cfg.num_mtp_modules, cfg.mtp_hidden_source) == ("mimo", 3, "previous")
    assert cfg.num_params == m["num_params"]
    assert model.eos_token_ids == (model.tokenizer.token_to_id(train.EOT),)
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
    size = sum(os.path.getsize(os.path.join(SHIPPED, x)) for x in os.listdir(SHIPPED))
    assert size <= 40 * 2**20
    model = mtp_jax.load(SHIPPED)
    cfg = model.config
    assert (cfg.layout, cfg.num_mtp_modules, cfg.mtp_hidden_source) == ("mimo", 3, "previous")
    assert (cfg.mtp_concat_order, cfg.mtp_zero_embed_at_pos0, cfg.mtp_hidden_from,
            cfg.mtp_output_hidden) == ("hidden_first", True, "post_norm", "post_norm")
    assert 10e6 <= cfg.num_params <= 20e6
    tok = model.tokenizer
    assert tok is not None and tok.get_vocab_size() == cfg.vocab_size
    assert model.eos_token_ids == (tok.token_to_id(train.EOT),)
    assert os.path.exists(os.path.join(SHIPPED, "README.md"))
