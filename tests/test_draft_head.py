"""The draft's quantized head copy (checkpoint.with_draft_head): which products read it,
lossless output whatever the copy holds, and the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax import draft_vocab as dv
from mtp_jax import quant
from mtp_jax.qarray import is_quantized, value
from mtp_jax.checkpoint import (CheckpointError, from_params, quantize_model, save_hf,
                                save_orbax, to_flat, with_draft_head)
from mtp_jax.config import ConfigError, EngineConfig, SamplingParams, SpecConfig
from mtp_jax.engine import Engine, Request
from mtp_jax.mtp import init_model
from mtp_jax.reference import generate_reference

from spec_models import markov_model, random_model, small_config

MAX_LEN = 64
ROWS = quant.DRAFT_HEAD_MAX_ROWS  # 64: the most rows that read the copy


@pytest.mark.parametrize("layout,kw,vocab,mode", [
    ("mimo", {}, None, "int8"),
    ("deepseek_v3", {}, None, "fp8"),
    ("mimo", {"tie_word_embeddings": True}, None, "int8"),
    ("mimo", {}, [5, 0, 17, 60, 33, 2], "fp8-block")])
def test_small_products_read_the_quantized_copy_larger_ones_the_head(layout, kw, vocab, mode):
    if kw.get("tie_word_embeddings"):
        cfg = small_config(layout, **kw)
        base = from_params(cfg, to_flat(nnx.split(init_model(cfg, seed=3))[1]), jnp.float32)
    else:
        base = random_model(layout, seed=3, **kw)
    if vocab is not None:
        base = dv.with_draft_vocab(base, np.array(vocab))
    q = with_draft_head(base, mode)
    assert q.config.draft_head == mode and base.config.draft_head is None
    heads = base.module().draft_head_weights()
    copies = q.module().draft_heads
    assert len(copies) == len(heads) == (base.config.num_mtp_modules
                                         if base.config.mtp_own_head else 1)
    assert all(is_quantized(value(c.head)) and value(c.head).shape ==
               value(h).shape for c, h in zip(copies, heads))
    assert quant.mode_of(q.params) is None  # the weights stay as they were
    d = base.config.hidden_size
    for rows in (1, ROWS, ROWS + 1):
        normed = jax.random.normal(jax.random.key(rows), (rows, d))
        for k in range(base.config.num_mtp_modules):
            want = np.asarray(base.module().draft_logits(k, normed))
            got = np.asarray(q.module().draft_logits(k, normed))
            if rows > ROWS:  # the head itself: the same logits, bit for bit
                np.testing.assert_array_equal(got, want)
                continue
            head = value(copies[min(k, len(copies) - 1)].head)
            small = np.asarray(normed @ head.dequantize())
            cols = np.array(vocab) if vocab is not None else np.arange(want.shape[-1])
            np.testing.assert_allclose(got[:, cols], small, rtol=1e-5, atol=1e-5)
            coarse = 0.02 if mode == "int8" else 0.1  # e4m3 keeps 3 mantissa bits
            np.testing.assert_allclose(got[:, cols], want[:, cols], rtol=0,
                                       atol=coarse * np.abs(want[:, cols]).max())
            assert not np.array_equal(got[:, cols], want[:, cols])


@pytest.fixture(scope="module")
def model():
    return markov_model("mimo", target_noise=0.3, mtp_noise=0.05, seed=1)


def generate(model, prompts, max_batch):
    eng = Engine(model, SpecConfig("chain", 3),
                 EngineConfig(max_batch=max_batch, max_model_len=MAX_LEN, page_size=8,
                              prefill_chunk=16))
    return eng.generate([Request(i, p, SamplingParams(max_tokens=30))
                         for i, p in enumerate(prompts)])


def test_output_is_the_targets_whatever_the_copy_holds(model, monkeypatch):
    """A copy that drafts the worst token (the negated head) takes every acceptance at a
    small batch; at a larger one only the first drafts, which the admission's prefill
    makes over its one row. The output stays the plain greedy output. (The copy's row
    limit is lowered to 3 so that the larger batch stays small.)"""
    monkeypatch.setattr(quant, "DRAFT_HEAD_MAX_ROWS", 3)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 61, size=n).tolist() for n in (3, 9, 17)]
    want = [generate_reference(model, p, SamplingParams(max_tokens=30), max_len=MAX_LEN)[0]
            for p in prompts]
    q = with_draft_head(model, "int8")
    flat = to_flat(q.params)
    flat[("draft_heads", 0, "head")] = quant.quantize_array(
        -value(model.module().target.lm_head), (0,), "int8")
    worst = from_params(q.config, flat, jnp.float32)
    small = generate(worst, prompts, max_batch=3)  # 3 rows: the copy
    large = generate(worst, prompts, max_batch=4)  # the head
    for res in (small, large):
        assert [r.token_ids for r in res] == want
    assert all(r.accepted_per_depth == [0, 0, 0] for r in small)
    # with this head every request accepts 7-8 drafts a depth in 8-9 steps (7 when its
    # first drafts, from the prefill, are the worst tokens)
    assert all(min(r.accepted_per_depth) >= 7 and r.num_steps <= 10 for r in large)


def test_errors_and_what_does_not_combine(tmp_path):
    base = random_model("mimo", seed=2)
    with pytest.raises(ConfigError, match="needs MTP modules"):
        with_draft_head(random_model("mimo", seed=2, mtp=0), "int8")
    with pytest.raises(quant.QuantizationError, match="unknown quantization mode"):
        with_draft_head(base, "int4")
    assert with_draft_head(base, None) is base
    q = with_draft_head(base, "int8")
    with pytest.raises(ConfigError, match="already reads a quantized"):
        with_draft_head(q, "int8")
    with pytest.raises(quant.QuantizationError, match="already quantized"):
        with_draft_head(quantize_model(base, "int8"), "int8")
    with pytest.raises(ConfigError, match="draft vocabulary first"):
        dv.with_draft_vocab(q, np.arange(8))
    for save in (save_orbax, save_hf):
        with pytest.raises(CheckpointError, match="--draft-head int8"):
            save(q, str(tmp_path / save.__name__))
    # the model's weights quantized after the copy was made: its head is quantized too
    both = quantize_model(q, "int8")
    assert quant.mode_of(both.params) == "int8"


def test_the_copy_goes_to_the_kernel_up_to_its_own_rows(monkeypatch):
    """The copy's products take the kernel up to DRAFT_HEAD_MAX_ROWS rows whatever the
    per-channel limit (8); a quantized model's own heads keep that limit."""
    monkeypatch.setenv(quant.BACKEND_ENV_VAR, "gpu")
    assert quant._use_kernel((ROWS, 128, 256), 1, True, jnp.int8, ROWS)
    assert not quant._use_kernel((ROWS + 1, 128, 256), 1, True, jnp.int8, ROWS)
    assert not quant._use_kernel((9, 128, 256), 1, True, jnp.int8)
    limits = []
    monkeypatch.setattr(quant, "_use_kernel",
                        lambda mkn, s, per_channel, values_dtype=None, limit=None:
                        limits.append((mkn[0], limit)) or False)
    base = random_model("mimo", seed=4)
    normed = jnp.ones((32, base.config.hidden_size))
    with_draft_head(base, "int8").module().draft_logits(0, normed)
    quantize_model(base, "int8").module().draft_logits(0, normed)
    assert limits == [(32, ROWS), (32, None)]


def test_only_one_device_reads_the_copy(monkeypatch):
    """Under a multi-device mesh XLA runs every quantized product (no kernel), so the
    draft reads the head itself there."""
    from types import SimpleNamespace

    from mtp_jax import sharding

    assert quant.reads_head_copy(ROWS) and not quant.reads_head_copy(ROWS + 1)
    monkeypatch.setattr(sharding, "active_mesh",
                        lambda: SimpleNamespace(devices=np.empty((1, 2))))
    assert not quant.reads_head_copy(1)
    monkeypatch.setattr(sharding, "active_mesh",
                        lambda: SimpleNamespace(devices=np.empty((1, 1))))
    assert quant.reads_head_copy(1)
