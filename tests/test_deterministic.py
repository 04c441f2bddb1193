"""Deterministic mode: a token's logits are bitwise the same whatever rows its call holds.

The target runs over paged KV as the engine's programs run it (the jnp paged attention the
mode uses), in bf16: the logits of one token (slot 0, position 19) computed in a decode
call of 1 row, a verify of 4 rows, batches of 17 and 64 slots and as row 3 of a 16-token
prefill chunk, for dense, MoE + MLA and sliding-window + sink layers. Without the mode the
same calls differ (the test of the test). Then engines: greedy speculative output equals
plain decoding in bf16 and does not depend on the batch.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.checkpoint import from_params, load, to_flat
from mtp_jax.config import EngineConfig, MLAConfig, MoEConfig, SamplingParams, SpecConfig
from mtp_jax.engine import Engine, Request
from mtp_jax.kv_cache import PagedKV, init_caches, make_layout
from mtp_jax.mtp import init_model
from pallas_kernels.invariant import compiler_options, einsum, row_invariant

from spec_models import small_config

SLOTS, PAGE, MAX_LEN = 64, 8, 64
LAYERS = {
    "dense": dict(layout="mimo"),
    "moe_mla": dict(layout="deepseek_v3", moe=MoEConfig(num_experts=8, top_k=2,
                                                         intermediate_size=48),
                    mla=MLAConfig(kv_lora_rank=32, qk_nope_dim=16, qk_rope_dim=8,
                                  v_head_dim=16, q_lora_rank=None), head_dim=24),
    "dsa": None,  # bf16_model
    "window_sinks": dict(layout="mimo", sliding_windows=(6, None),
                         layer_sinks=(True, True, False, False, False)),
}


def bf16_model(name: str):
    if name == "dsa":  # the DeepSeek-V3.2 fixture (MLA + MoE + indexer), top-4 selection
        model = load(os.path.join(os.path.dirname(__file__), "golden", "deepseek_v32_exp"))
        cfg = dataclasses.replace(model.config, dtype="bfloat16", dsa=dataclasses.replace(
            model.config.dsa, index_topk=4))
        return from_params(cfg, to_flat(model.params), jnp.bfloat16)
    kw = dict(LAYERS[name])
    cfg = small_config(kw.pop("layout"), hidden=128, dtype="bfloat16", **kw)
    flat = to_flat(nnx.split(init_model(cfg, seed=3))[1])
    return from_params(cfg, flat, jnp.bfloat16)


def forward(model, layout, caches, slots, tokens, start, invariant: bool):
    """Logits [r, t, V] of `tokens` [r, t] at positions start[r] + i of `slots` [r] over
    the pages, and the caches after it."""
    tables = tuple(  # slot s: the pages s * n + 1 .. (n per slot; a sliding group's ring tiled)
        jnp.asarray(slots[:, None] * n + 1 + np.arange(layout.width) % n, jnp.int32)
        for n in (g.ring_pages or layout.width for g in layout.groups))
    pos = jnp.asarray(start[:, None] + np.arange(tokens.shape[1]), jnp.int32)

    def run(caches, tokens, pos, tables):
        with row_invariant(invariant):
            m = model.module()
            kv = PagedKV(layout, caches, tables, jnp.full((len(slots),), MAX_LEN, jnp.int32),
                         backend="reference")
            normed, _ = m.target(tokens, pos, kv.attend(pos, pos[:, -1] + 1))
            return m.target.head(normed), tuple(kv.caches)

    options = compiler_options() if invariant else {}
    return jax.jit(run, compiler_options=options or None)(
        caches, jnp.asarray(tokens, jnp.int32), pos, tables)


@pytest.fixture(scope="module", params=sorted(LAYERS))
def setting(request):
    model = bf16_model(request.param)
    eng = EngineConfig(max_batch=SLOTS, max_model_len=MAX_LEN, page_size=PAGE,
                       num_pages=SLOTS * 8)
    layout = make_layout(model.config, eng, 0, jnp.bfloat16)
    rng = np.random.default_rng(1)
    caches = jax.tree_util.tree_map(  # every slot's pages hold some earlier request's KV
        lambda c: jnp.asarray(rng.normal(size=c.shape) * 0.5, c.dtype), init_caches(layout))
    seq = rng.integers(0, model.config.vocab_size, 40)
    return request.param, model, layout, caches, seq, rng


def one_token_logits(setting, invariant: bool) -> dict:
    """Slot 0's position-19 logits per kind of call, its positions 0..18 prefilled first."""
    _, model, layout, caches, seq, rng = setting
    v = model.config.vocab_size
    _, caches = forward(model, layout, caches, np.array([0]), seq[None, :19], np.array([0]),
                        invariant)
    out = {}
    for name, rows in (("decode", 1), ("verify", 4)):
        logits, _ = forward(model, layout, caches, np.array([0]), seq[None, 19: 19 + rows],
                            np.array([19]), invariant)
        out[name] = logits[0, 0]
    for n, at in ((17, 5), (64, 40)):  # slot 0 as row `at` of the batch
        slots = np.roll(np.arange(n), at)
        tokens = rng.integers(0, v, (n, 1))
        tokens[at] = seq[19]
        start = rng.integers(0, 40, n)
        start[at] = 19
        logits, _ = forward(model, layout, caches, slots, tokens, start, invariant)
        out[f"batch{n}"] = logits[at, 0]
    logits, _ = forward(model, layout, caches, np.array([0]), seq[None, 16:32], np.array([16]),
                        invariant)
    out["prefill"] = logits[0, 3]
    return {k: np.asarray(x.astype(jnp.float32)) for k, x in out.items()}


def test_a_tokens_logits_do_not_depend_on_its_call(setting):
    got = one_token_logits(setting, invariant=True)
    for name, x in got.items():
        assert np.array_equal(x, got["decode"]), (setting[0], name,
                                                  float(np.abs(x - got["decode"]).max()))
    if setting[0] == "dense":  # the default mode's blocking follows the rows (CPU)
        plain = one_token_logits(setting, invariant=False)
        assert np.allclose(plain["batch64"], got["decode"], atol=0.1)  # the same computation
        assert any(not np.array_equal(x, plain["decode"]) for x in plain.values())


def test_invariant_einsum_equals_einsum_and_one_row_alone():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 37, 96)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(96, 200)), jnp.float32)
    with row_invariant():
        full = jax.jit(lambda a, b: einsum("btd,dn->btn", a, b))(x, w)
        one = jax.jit(lambda a, b: einsum("btd,dn->btn", a, b))(x[1:2, 5:6], w)
    np.testing.assert_allclose(full, jnp.einsum("btd,dn->btn", x, w), rtol=1e-5, atol=1e-4)
    assert np.array_equal(np.asarray(full[1, 5]), np.asarray(one[0, 0]))
    with row_invariant():  # rows named: the other x-only letters stay in each tile
        y = einsum("bqhd,bkd->bqhk", x[:, :, None, :8].repeat(2, 2), x[:, :20, :8], rows="q")
    assert y.shape == (3, 37, 2, 20)


@pytest.fixture(scope="module")
def det_engines():
    model = bf16_model("dense")
    cfg = EngineConfig(max_batch=8, max_model_len=MAX_LEN, page_size=PAGE, prefill_chunk=16,
                       steps_per_dispatch=4, deterministic=True)
    alone = EngineConfig(**{**cfg.__dict__, "max_batch": 1})
    return model, {name: Engine(model, SpecConfig(method, num_speculative_tokens=k), c)
                   for name, method, k, c in (("none", "none", 0, cfg),
                                              ("chain", "chain", 3, cfg),
                                              ("alone", "none", 0, alone))}


def test_bf16_speculative_equals_plain_and_batch_does_not_matter(det_engines):
    model, engines = det_engines
    assert engines["chain"].config.attention_backend == "reference"
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (3, 9, 17, 30,
                                                                              5, 12)]
    greedy = [Request(i, p, SamplingParams(max_tokens=20)) for i, p in enumerate(prompts)]
    seeded = Request("s", prompts[2], SamplingParams(temperature=0.9, seed=5, max_tokens=20))
    plain = engines["none"].generate(greedy + [seeded])
    spec = engines["chain"].generate(greedy)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain[:-1]]
    alone = [engines["alone"].generate([r])[0] for r in greedy[:3] + [seeded]]
    assert [r.token_ids for r in alone] == [r.token_ids for r in plain[:3] + plain[-1:]]
