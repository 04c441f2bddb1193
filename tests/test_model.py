"""Every block of the target and the MTP modules against float64 numpy written in the tests.

RMSNorm (plain and zero-centred), RoPE (default, linear, dynamic, yarn, llama3; partial
rotary), GQA attention with and without a sliding window, SwiGLU, a decoder block, the
whole target, the MTP module for each layout's facts (concat order, position-0 zeroing,
pre / post-norm hand-on hidden, own / shared head and embedding), the training-style MTP
chain, and cached decoding (one token at a time) against one full forward.

Parameters are random (norm weights and biases too) and read from the NNX modules in the
layouts documented in attention.py and layers.py: qkv [d, k, g + 2, h], o [n, h, d],
gate_up [d, 2, f].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hf_fixtures as F
from mtp_jax.config import ModelConfig, RopeScaling
from mtp_jax.models import from_hf
from mtp_jax.layers import (MLP, RMSNorm, apply_rope, causal_attend, dense_attention,
                            rope_inv_freq)
from mtp_jax.model import Block, DenseCache
from mtp_jax.mtp import MTPModel

RTOL = 2e-5  # f32 engine vs f64 numpy, relative to the largest reference value


def assert_close(got, want, rtol=RTOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got))
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6)
    assert err < rtol, f"relative error {err:.2e}"


def small_config(**kw) -> ModelConfig:
    base = dict(layout="mimo", vocab_size=80, hidden_size=32, intermediate_size=48,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_mtp_modules=2,
                rms_norm_eps=1e-5, dtype="float32")
    base.update(kw)
    return ModelConfig(**base)


def rope_kwargs(cfg: ModelConfig) -> dict:
    rs = cfg.rope_scaling
    if rs is None:
        return dict(rot_dim=cfg.rotary_dim, theta=cfg.rope_theta)
    return dict(rot_dim=cfg.rotary_dim, theta=cfg.rope_theta, kind=rs.kind, factor=rs.factor,
                original_max=rs.original_max_position, beta_fast=rs.beta_fast,
                beta_slow=rs.beta_slow, attention_factor=rs.attention_factor,
                low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)


def arch_of_config(cfg: ModelConfig) -> F.Arch:
    """The numpy reference's view of a ModelConfig (the facts under test in test_config)."""
    return F.Arch(layout=cfg.layout, vocab=cfg.vocab_size, hidden=cfg.hidden_size,
                  layers=cfg.num_layers, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, eps=cfg.rms_norm_eps, norm_offset=cfg.norm_offset,
                  qkv_bias=cfg.attention_bias, qk_norm=cfg.qk_norm,
                  tied=cfg.tie_word_embeddings, rope=rope_kwargs(cfg),
                  windows=cfg.sliding_windows, mtp_windows=cfg.mtp_sliding_windows,
                  num_mtp=cfg.num_mtp_modules, concat=cfg.mtp_concat_order,
                  zero_pos0=cfg.mtp_zero_embed_at_pos0, hidden_from=cfg.mtp_hidden_from,
                  out_hidden=cfg.mtp_output_hidden, own_head=cfg.mtp_own_head,
                  own_embed=cfg.mtp_own_embed, shared_input=cfg.mtp_shared_input,
                  source=cfg.mtp_hidden_source)


def random_model(cfg: ModelConfig, seed: int = 0):
    """An MTPModel with every parameter random (norm weights and biases too).

    Filled from numpy on the abstract model: cheaper than init_model's on-device draws,
    which compile one random kernel per parameter shape.
    """
    abstract = nnx.eval_shape(lambda: MTPModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)
    for path, var in state.flat_state():
        shape = var.get_value().shape
        x = rng.standard_normal(shape)
        if path[-1] == "weight":  # every RMSNorm
            x = 1.0 - cfg.norm_offset + 0.2 * x
        elif path[-1] == "qkv_bias":
            x = 0.2 * x
        elif path[-1] == "o":  # [n, h, d]
            x = x / np.sqrt(shape[0] * shape[1])
        elif path[-1] != "embed":  # [in, ...] projections and heads
            x = x / np.sqrt(shape[0])
        var.set_value(jnp.asarray(x, jnp.float32))
    return nnx.merge(graphdef, state)


def _a(x):
    return np.asarray(x[...], np.float64)


def block_weights(block) -> dict:
    """A Block's parameters as HF-oriented arrays under hf_fixtures' short names."""
    qkv = _a(block.attn.qkv)  # [d, k, g + 2, h]; per kv head: its g query heads, k, v
    d, kh, g2, h = qkv.shape
    g = g2 - 2
    w = dict(input_norm=_a(block.input_norm.weight), post_norm=_a(block.post_attn_norm.weight),
             q=qkv[:, :, :g].reshape(d, kh * g * h).T, k=qkv[:, :, g].reshape(d, kh * h).T,
             v=qkv[:, :, g + 1].reshape(d, kh * h).T,
             o=_a(block.attn.o).reshape(kh * g * h, d).T,
             gate=_a(block.mlp.gate_up)[:, 0].T, up=_a(block.mlp.gate_up)[:, 1].T,
             down=_a(block.mlp.down).T)
    if block.attn.qkv_bias is not None:
        b = _a(block.attn.qkv_bias)  # [k, g + 2, h]
        w.update(q_bias=b[:, :g].reshape(-1), k_bias=b[:, g].reshape(-1),
                 v_bias=b[:, g + 1].reshape(-1))
    if block.attn.q_norm is not None:
        w.update(q_norm=_a(block.attn.q_norm.weight), k_norm=_a(block.attn.k_norm.weight))
    return w


def target_head(model):
    t = model.target
    return _a(t.embed) if t.lm_head is None else _a(t.lm_head).T  # [v, d]


def np_target_of(model, tokens):
    t = model.target
    return F.np_decoder(_a(t.embed), [block_weights(b) for b in t.layers],
                        _a(t.final_norm.weight), target_head(model), arch_of_config(model.cfg),
                        tokens)


def mtp_weights(model, k: int) -> dict:
    mod = model.mtp[k]
    inp = mod.input if mod.input is not None else model.mtp_shared
    return dict(enorm=_a(inp.enorm.weight), hnorm=_a(inp.hnorm.weight), proj=_a(inp.proj).T,
                final_norm=_a(inp.final_norm.weight), block=block_weights(mod.block),
                head=target_head(model) if mod.head is None else _a(mod.head).T,
                embed=_a(model.target.embed) if mod.embed is None else _a(mod.embed))


# ------------------------------------------------------------------ RMSNorm, SwiGLU
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(offset):
    rng = np.random.default_rng(0)
    norm = RMSNorm(24, eps=1e-5, offset=offset)
    w = rng.standard_normal(24) * 0.3 + (1.0 - offset)
    norm.weight.set_value(jnp.asarray(w, jnp.float32))
    x = rng.standard_normal((2, 3, 24)) * 3.0
    assert_close(norm(jnp.asarray(x, jnp.float32)), F.np_rms_norm(x, w, 1e-5, offset))


def test_rms_norm_zero_centred_init_is_identity_scale():
    x = np.random.default_rng(1).standard_normal((4, 16))
    norm = RMSNorm(16, eps=1e-6, offset=1.0)
    assert_close(norm(jnp.asarray(x, jnp.float32)), F.np_rms_norm(x, np.ones(16), 1e-6))


def test_swiglu_mlp():
    mlp = variant_model("dynamic_mha").target.layers[1].mlp
    assert isinstance(mlp, MLP)
    x = np.random.default_rng(2).standard_normal((2, 5, 32))
    gu = _a(mlp.gate_up)
    assert_close(mlp(jnp.asarray(x, jnp.float32)),
                 F.np_swiglu(x, gu[:, 0].T, gu[:, 1].T, _a(mlp.down).T))


# ------------------------------------------------------------------ RoPE
ROPES = {
    "default": None,
    "linear": RopeScaling("linear", 4.0),
    "dynamic": RopeScaling("dynamic", 2.0, 128),
    "yarn": RopeScaling("yarn", 4.0, 2048),
    "yarn_attention_factor": RopeScaling("yarn", 8.0, 512, beta_fast=16.0, beta_slow=2.0,
                                         attention_factor=1.3),
    "llama3": RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0),
}


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("name", list(ROPES))
def test_rope_inv_freq(name, partial):
    cfg = small_config(head_dim=32, rope_scaling=ROPES[name], partial_rotary_factor=partial)
    inv, scale = rope_inv_freq(cfg)
    want_inv, want_scale = F.np_inv_freq(**rope_kwargs(cfg))
    assert inv.shape == (cfg.rotary_dim // 2,)
    assert_close(inv, want_inv, 1e-6)
    assert scale == pytest.approx(want_scale, rel=1e-6)


def test_llama3_and_yarn_use_all_three_frequency_bands():
    # The cases above only prove something if the scaled frequencies mix kept, blended
    # and fully interpolated ones.
    for name in ("llama3", "yarn"):
        cfg = small_config(head_dim=32, rope_scaling=ROPES[name])
        base = F.np_inv_freq(rot_dim=32, theta=cfg.rope_theta)[0]
        ratio = F.np_inv_freq(**rope_kwargs(cfg))[0] / base
        factor = cfg.rope_scaling.factor
        assert np.any(np.isclose(ratio, 1.0)) and np.any(np.isclose(ratio, 1 / factor))
        assert np.any((ratio < 0.999) & (ratio > 1 / factor + 1e-3))


@pytest.mark.parametrize("partial", [1.0, 0.25])
@pytest.mark.parametrize("name", ["default", "dynamic", "yarn_attention_factor"])
def test_apply_rope_rotate_half(name, partial):
    cfg = small_config(head_dim=32, rope_scaling=ROPES[name], partial_rotary_factor=partial)
    inv, scale = rope_inv_freq(cfg)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 3, 32))
    pos = rng.integers(0, 300, (2, 5))
    got = apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos, jnp.int32), inv, scale)
    want_inv, want_scale = F.np_inv_freq(**rope_kwargs(cfg))
    want = np.stack([F.np_rope(x[b], pos[b], want_inv, want_scale) for b in range(2)])
    assert_close(got, want, 5e-5)  # f32 angles at positions up to 300
    if partial < 1:  # the dims past the rotary part pass through untouched
        np.testing.assert_array_equal(np.asarray(got)[..., cfg.rotary_dim:],
                                      x[..., cfg.rotary_dim:].astype(np.float32))


# ------------------------------------------------------------------ attention
@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("group", [1, 2])
def test_dense_attention_gqa_and_sliding_window(window, group):
    rng = np.random.default_rng(5)
    b, s, kv, h = 2, 7, 2, 8
    q = rng.standard_normal((b, s, kv * group, h))
    k, v = rng.standard_normal((b, s, kv, h)), rng.standard_normal((b, s, kv, h))
    pos = np.broadcast_to(np.arange(s), (b, s))
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    got = dense_attention(f32(q), f32(k), f32(v), jnp.asarray(pos), jnp.asarray(pos),
                          jnp.ones((b, s), bool), window)
    want = np.stack([F.np_attention(q[i], k[i], v[i], pos[i], pos[i], window)
                     for i in range(b)])
    assert_close(got, want)


@pytest.mark.parametrize("window", [None, 2])
def test_dense_attention_suffix_queries_and_invalid_keys(window):
    # Two queries at positions 4 and 5 over 8 cached keys of which 6 are valid: keys at
    # positions 6 and 7 hold garbage (NaN would poison a wrong mask's sum; use huge values).
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 2, 4, 8))
    k, v = rng.standard_normal((1, 8, 2, 8)), rng.standard_normal((1, 8, 2, 8))
    k[:, 6:], v[:, 6:] = 1e4, 1e4
    q_pos, k_pos = np.array([[4, 5]]), np.arange(8)[None]
    got = dense_attention(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                          jnp.asarray(v, jnp.float32), jnp.asarray(q_pos), jnp.asarray(k_pos),
                          jnp.asarray(k_pos < 6), window)
    want = F.np_attention(q[0], k[0, :6], v[0, :6], q_pos[0], k_pos[0, :6], window)
    assert_close(got[0], want)


# ------------------------------------------------------------------ blocks and target
VARIANTS = {
    "qwen2_bias_linear_window": dict(attention_bias=True, rope_scaling=ROPES["linear"],
                                     sliding_windows=(3, None)),
    "qwen3next_qknorm_offset_partial_yarn": dict(
        layout="qwen3_next", qk_norm=True, norm_offset=1.0, partial_rotary_factor=0.25,
        rope_scaling=ROPES["yarn_attention_factor"], mtp_shared_input=True),
    "llama3_tied_gqa4": dict(num_heads=8, num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
                             rope_scaling=ROPES["llama3"], sliding_windows=(None, 2)),
    "dynamic_mha": dict(num_heads=2, num_kv_heads=2, rope_scaling=ROPES["dynamic"]),
}


@functools.lru_cache(maxsize=None)
def variant_model(name):
    return random_model(small_config(**VARIANTS[name]), seed=len(name))


@pytest.mark.parametrize("name, window", [("qwen2_bias_linear_window", 3),
                                          ("qwen3next_qknorm_offset_partial_yarn", None)])
def test_decoder_block(name, window):
    model = variant_model(name)
    block = model.target.layers[0]
    arch = arch_of_config(model.cfg)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 9, model.cfg.hidden_size))
    pos = np.stack([np.arange(9), np.arange(9) + 40])
    graphdef, params = nnx.split(block)
    assert block.attn.spec.window == window  # the window comes from the layer's spec
    got = jax.jit(lambda p, x, pos: nnx.merge(graphdef, p)(
        x, pos, causal_attend(pos), 0))(params, jnp.asarray(x, jnp.float32),
                                        jnp.asarray(pos, jnp.int32))
    want = np.stack([F.np_block(x[b], pos[b], block_weights(block), arch, window)
                     for b in range(2)])
    assert_close(got, want)
    assert isinstance(block, Block)


@functools.lru_cache(maxsize=None)
def target_run(name):
    """(tokens [2, 12], logits, pre-norm hidden, post-norm hidden) of one full forward."""
    model = variant_model(name)
    tokens = np.random.default_rng(8).integers(0, model.cfg.vocab_size, (2, 12)).astype(np.int32)
    graphdef, params = nnx.split(model)

    @jax.jit
    def fwd(params, tokens):
        m = nnx.merge(graphdef, params)
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        normed, pre = m.target(tokens, pos, causal_attend(pos))
        return m.target.head(normed), pre, normed

    return (tokens,) + tuple(fwd(params, jnp.asarray(tokens)))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_target_forward(name):
    model = variant_model(name)
    tokens, logits, pre, post = target_run(name)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 12, model.cfg.vocab_size)
    for b in range(2):
        want_logits, want_pre, want_post = np_target_of(model, tokens[b])
        assert_close(logits[b], want_logits)
        assert_close(pre[b], want_pre)
        assert_close(post[b], want_post)
    hidden = model.target.mtp_hidden(post, pre)
    assert hidden is (post if model.cfg.mtp_hidden_from == "post_norm" else pre)


# ------------------------------------------------------------------ MTP modules
@functools.lru_cache(maxsize=None)
def layout_model(layout, source=None):
    cfg = from_hf(F.hf_config(layout))  # the shapes test_checkpoint loads
    if source is not None:
        cfg = dataclasses.replace(cfg, mtp_hidden_source=source)
    return random_model(cfg, seed=F.LAYOUTS.index(layout))


def test_layouts_cover_every_mtp_fact():
    cfgs = [layout_model(layout).cfg for layout in F.LAYOUTS]
    assert {c.mtp_concat_order for c in cfgs} == {"hidden_first", "embed_first"}
    assert {c.mtp_zero_embed_at_pos0 for c in cfgs} == {True, False}
    assert {c.mtp_output_hidden for c in cfgs} == {"pre_norm", "post_norm"}
    assert {c.mtp_hidden_from for c in cfgs} == {"pre_norm", "post_norm"}
    assert {c.mtp_own_head for c in cfgs} == {True, False}
    assert {c.mtp_own_embed for c in cfgs} == {True, False}
    assert any(any(w for w in c.mtp_sliding_windows) for c in cfgs)


@pytest.mark.parametrize("layout", F.LAYOUTS)
def test_mtp_module(layout):
    model = layout_model(layout)
    cfg = model.cfg
    arch = arch_of_config(cfg)
    rng = np.random.default_rng(9)
    t = 7
    tokens = rng.integers(0, cfg.vocab_size, (2, t))
    hidden = rng.standard_normal((2, t, cfg.hidden_size))
    pos = np.stack([np.arange(t), np.arange(t) + 5])  # row 0 holds position 0
    graphdef, params = nnx.split(model)

    @jax.jit
    def every_module(params, tokens, hidden, pos):
        m = nnx.merge(graphdef, params)
        outs = []
        for k in range(cfg.num_mtp_modules):
            hand_on, out = m.draft(k, tokens, hidden, pos, causal_attend(pos))
            outs.append((hand_on, m.draft_logits(k, out)))
        return outs

    outs = every_module(params, jnp.asarray(tokens, jnp.int32),
                        jnp.asarray(hidden, jnp.float32), jnp.asarray(pos, jnp.int32))
    for k, (hand_on, logits) in enumerate(outs):
        w = mtp_weights(model, k)
        for b in range(2):
            want_h, want_logits = F.np_mtp(w, arch, k, tokens[b], hidden[b], pos[b])
            assert_close(hand_on[b], want_h)
            assert_close(logits[b], want_logits)


@pytest.mark.parametrize("layout, source", [(layout, "previous") for layout in F.LAYOUTS]
                         + [("deepseek_v3", "target")])
def test_forward_train_chain(layout, source):
    model = layout_model(layout, source)
    cfg = model.cfg
    arch = arch_of_config(cfg)
    T = 9
    tokens = np.random.default_rng(11).integers(0, cfg.vocab_size, (2, T))
    graphdef, params = nnx.split(model)
    logits, outs = F.forward_train_jit(graphdef, params, jnp.asarray(tokens, jnp.int32))
    assert len(outs) == cfg.num_mtp_modules
    weights = [mtp_weights(model, k) for k in range(cfg.num_mtp_modules)]
    for b in range(2):
        want_logits, pre, post = np_target_of(model, tokens[b])
        assert_close(logits[b], want_logits)
        chain = F.np_mtp_chain(weights, arch, tokens[b], pre, post)
        for k, (got, want) in enumerate(zip(outs, chain)):
            assert got.shape[1] == T - k - 1
            assert_close(got[b], want)


def test_forward_train_equals_manual_draft_chain():
    # Module k at anchor i consumes token t_{i+k+1} and module k-1's hidden at anchor i.
    # Run the chain by hand with model.draft over the anchors every module has
    # (0..T-K-1) and compare with forward_train's per-module spans.
    model = layout_model("step3p5")
    K, T = model.cfg.num_mtp_modules, 9
    anchors = T - K
    tokens = jnp.asarray(np.random.default_rng(12).integers(0, model.cfg.vocab_size, (2, T)),
                         jnp.int32)
    graphdef, params = nnx.split(model)
    _, outs = F.forward_train_jit(graphdef, params, tokens)

    @jax.jit
    def manual_chain(params, tokens):
        m = nnx.merge(graphdef, params)
        pos = jnp.broadcast_to(jnp.arange(T), (2, T))
        normed, pre = m.target(tokens, pos, causal_attend(pos))
        h = m.target.mtp_hidden(normed, pre)[:, :anchors]
        p = pos[:, :anchors]
        logits = []
        for k in range(K):
            h, out = m.draft(k, tokens[:, k + 1: k + 1 + anchors], h, p, causal_attend(p))
            logits.append(m.draft_logits(k, out))
        return logits

    for k, manual in enumerate(manual_chain(params, tokens)):
        assert_close(outs[k][:, :anchors], manual, 1e-6)


# ------------------------------------------------------------------ cached decode
@functools.partial(jax.jit, static_argnames=("graphdef",))
def _cached_step(graphdef, params, caches, tokens, positions):
    m = nnx.merge(graphdef, params)
    backend = DenseCache(caches, positions)
    normed, _ = m.target(tokens, positions, backend)
    return m.target.head(normed), backend.caches


@pytest.mark.parametrize("name, padded_prefill", [("qwen2_bias_linear_window", True),
                                                   ("qwen3next_qknorm_offset_partial_yarn",
                                                    False)])
def test_cached_decode_equals_full_forward(name, padded_prefill):
    model = variant_model(name)
    cfg = model.cfg
    tokens, full, _, _ = target_run(name)
    T, prompt, max_len = tokens.shape[1], 5, 16
    graphdef, params = nnx.split(model)
    caches = DenseCache.init(cfg, 2, max_len, jnp.float32)
    # A padded prefill writes junk KV past the prompt; decoding overwrites it position by
    # position and the causal mask never lets a query see it first.
    width = 8 if padded_prefill else prompt
    first = np.zeros((2, width), np.int32)
    first[:, :prompt] = tokens[:, :prompt]
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), (2, width))
    logits, caches = _cached_step(graphdef, params, caches, jnp.asarray(first), jnp.asarray(pos))
    rows = [np.asarray(logits)[:, :prompt]]
    for p in range(prompt, T):
        logits, caches = _cached_step(graphdef, params, caches, jnp.asarray(tokens[:, p:p + 1]),
                                      jnp.full((2, 1), p, jnp.int32))
        rows.append(np.asarray(logits))
    cached = np.concatenate(rows, axis=1)
    np.testing.assert_allclose(cached, np.asarray(full), rtol=1e-5, atol=1e-5)
