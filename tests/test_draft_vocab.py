"""Reduced draft vocabulary: the draft's logits, lossless output, the ids file and CLI."""

from __future__ import annotations

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import build_draft_vocab
from mtp_jax import draft_vocab as dv
from flax import nnx

from mtp_jax.checkpoint import (CheckpointError, from_params, load, quantize_model, save_hf,
                                to_flat)
from mtp_jax.config import ConfigError, EngineConfig, SamplingParams, SpecConfig
from mtp_jax.engine import Engine, Request
from mtp_jax.mtp import init_model
from mtp_jax.reference import generate_reference

from cli_fixtures import make_checkpoint
from spec_models import markov_model, random_model, small_config

MAX_LEN = 64
ENGINE = EngineConfig(max_batch=3, max_model_len=MAX_LEN, page_size=8, prefill_chunk=16)


@pytest.fixture(scope="module")
def model():
    return markov_model("deepseek_v3", target_noise=0.5, mtp_noise=0.2, seed=1)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 61, size=n).tolist() for n in (3, 9, 17)]


def run(model, prompts, spec, sps):
    eng = Engine(model, spec, ENGINE)
    return eng.generate([Request(i, p, s) for i, (p, s) in enumerate(zip(prompts, sps))])


@pytest.mark.parametrize("layout,kw", [("deepseek_v3", {}), ("mimo", {"mtp_own_head": True}),
                                       ("mimo", {"tie_word_embeddings": True}), ("int8", {})])
def test_draft_logits_are_the_full_heads_on_the_set_and_minus_inf_elsewhere(layout, kw):
    if kw.get("tie_word_embeddings"):
        cfg = small_config(layout, **kw)
        base = from_params(cfg, to_flat(nnx.split(init_model(cfg, seed=3))[1]), jnp.float32)
    else:
        base = random_model("mimo" if layout == "int8" else layout, seed=3, **kw)
    if layout == "int8":
        base = quantize_model(base, "int8")
    ids = np.array([5, 0, 17, 60, 33, 2])
    small = dv.with_draft_vocab(base, ids)
    assert small.config.draft_vocab_size == 6 and base.config.draft_vocab_size == 0
    normed = jax.random.normal(jax.random.key(0), (2, base.config.hidden_size))
    for k in range(base.config.num_mtp_modules):
        full = np.asarray(base.module().draft_logits(k, normed))
        got = np.asarray(small.module().draft_logits(k, normed))
        np.testing.assert_allclose(got[:, ids], full[:, ids], rtol=2e-2 if layout == "int8"
                                   else 1e-5, atol=1e-4)
        rest = np.setdiff1d(np.arange(base.config.vocab_size), ids)
        assert np.isneginf(got[:, rest]).all()
    # the target's own head is untouched
    x = jnp.ones((1, base.config.hidden_size))
    np.testing.assert_array_equal(np.asarray(small.module().target.head(x)),
                                  np.asarray(base.module().target.head(x)))


@pytest.mark.parametrize("method", ["chain", "eagle"])
def test_greedy_output_unchanged_and_every_id_drafts_as_the_full_vocabulary(model, prompts,
                                                                             method):
    sps = [SamplingParams(max_tokens=30)] * len(prompts)
    want = [generate_reference(model, p, s, max_len=MAX_LEN)[0] for p, s in zip(prompts, sps)]
    half = run(dv.with_draft_vocab(model, np.arange(0, model.config.vocab_size, 2)), prompts,
               SpecConfig(method, 3), sps)
    assert [r.token_ids for r in half] == want
    if method == "eagle":
        return
    full = run(model, prompts, SpecConfig(method, 3), sps)
    every = run(dv.with_draft_vocab(model, np.arange(model.config.vocab_size)[::-1]), prompts,
                SpecConfig(method, 3), sps)
    for res in (full, every):
        assert [r.token_ids for r in res] == want
    # with every id in the set the drafts are the full vocabulary's, and so is acceptance
    assert [r.accepted_per_depth for r in every] == [r.accepted_per_depth for r in full]
    acc = lambda res: np.sum([r.accepted_per_depth for r in res], 0)  # noqa: E731
    assert acc(full)[0] > 0 and acc(half).sum() <= acc(full).sum()


def test_seeded_sampling_equals_plain_decoding_under_adaptive_k(model, prompts):
    sps = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=24)
           for t, p, s in ((1.0, 1.0, 7), (0.8, 0.9, 8), (0.0, 1.0, 9))]
    plain = [generate_reference(model, p, s, max_len=MAX_LEN)[0] for p, s in zip(prompts, sps)]
    small = dv.with_draft_vocab(model, np.arange(0, model.config.vocab_size, 3))
    got = run(small, prompts, SpecConfig("chain"), sps)  # auto: coupled sampling
    assert [r.token_ids for r in got] == plain


def test_most_frequent_ties_and_always_included_ids():
    counts = np.array([5, 9, 9, 0, 1, 7])
    assert dv.most_frequent(counts, 3).tolist() == [1, 2, 5]
    assert dv.most_frequent(counts, 3, always=[3]).tolist() == [3, 1, 2]
    assert dv.most_frequent(counts, 6).tolist() == [1, 2, 5, 0, 4, 3]
    for bad in (0, 7):
        with pytest.raises(ConfigError, match="size"):
            dv.most_frequent(counts, bad)


def test_bad_ids_and_models_are_refused(model, tmp_path):
    v = model.config.vocab_size
    for ids, msg in (([], "non-empty"), ([1, 1], "distinct"), ([0, v], r"\[0, 61\)"),
                     ([-1], r"\[0, 61\)"), ([0.5], "integers")):
        with pytest.raises(ConfigError, match=msg):
            dv.with_draft_vocab(model, ids)
    small = dv.with_draft_vocab(model, [0, 1, 2])
    with pytest.raises(ConfigError, match="already"):
        dv.with_draft_vocab(small, [3])
    with pytest.raises(ConfigError, match="MTP modules"):
        dv.with_draft_vocab(random_model("mimo", mtp=0), [0])
    with pytest.raises(CheckpointError, match="--draft-vocab"):
        save_hf(small, str(tmp_path / "x"))
    f = tmp_path / "ids.json"
    dv.save_ids(str(f), [4, 2, 9], source="test", counts=np.arange(10))
    assert dv.load_ids(str(f)).tolist() == [4, 2, 9]
    assert dv.load_ids(str(f), 2).tolist() == [4, 2]
    assert json.loads(f.read_text())["coverage"] == pytest.approx(15 / 45)
    with pytest.raises(ConfigError, match="holds 3"):
        dv.load_ids(str(f), 4)
    (tmp_path / "bad.json").write_text('{"ids": [1]}')
    with pytest.raises(ConfigError, match="not a"):
        dv.load_ids(str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="unreadable"):
        dv.load_ids(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="needs --draft-vocab"):
        dv.apply(model, None, 3)


def test_cli_counts_text_and_generate_uses_the_file(tmp_path, capsys):
    from mtp_jax.generate import main as generate

    make_checkpoint(str(tmp_path / "m"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("hello world hello " * 20)
    (corpus / "skip.bin").write_text("zzzz")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert build_draft_vocab.main(["--model", str(tmp_path / "m"), "--text", str(corpus),
                                       "--size", "20", "--output", str(tmp_path / "ids.json")]) == 0
    doc = json.loads((tmp_path / "ids.json").read_text())
    tok = load(str(tmp_path / "m")).tokenizer
    counts = dv.count_text(tok, ["hello world hello " * 20], 100)
    assert doc["size"] == 20 and doc["ids"][: int((counts > 0).sum())] == \
        dv.most_frequent(counts, int((counts > 0).sum())).tolist()
    assert doc["coverage"] == pytest.approx(1.0) and "20 of 100 tokens" in out.getvalue()
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "hello", "max_tokens": 10}) + "\n")
    o = tmp_path / "small.jsonl"
    assert generate(["--model", str(tmp_path / "m"), "--input", str(inp), "--output", str(o),
                     "--num-speculative-tokens", "2", "--max-batch", "1", "--max-model-len",
                     "64", "--draft-vocab", str(tmp_path / "ids.json"),
                     "--draft-vocab-size", "10", "--draft-head", "int8"]) == 0
    # with the reduced heads' quantized copy, which one slot's draft reads
    err = capsys.readouterr().err
    assert "with a draft vocabulary of 10 tokens, int8 draft head" in err
    model = load(str(tmp_path / "m"))
    want = generate_reference(model, list(model.tokenizer.encode("hello").ids),
                              SamplingParams(max_tokens=10), max_len=64)[0]
    assert json.loads(o.read_text())["token_ids"] == want
    capsys.readouterr()
    assert generate(["--model", str(tmp_path / "m"), "--input", str(inp), "--output",
                     str(tmp_path / "x.jsonl"), "--draft-vocab", str(tmp_path / "nope")]) != 0
    assert "--draft-vocab" in capsys.readouterr().err
    assert generate(["--model", str(tmp_path / "m"), "--input", str(inp), "--output",
                     str(tmp_path / "y.jsonl"), "--draft-head", "int8", "--quantize",
                     "int8"]) != 0
    assert "--draft-head: the draft's head is already quantized" in capsys.readouterr().err
