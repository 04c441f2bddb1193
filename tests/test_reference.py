"""The plain reference generator (`mtp_jax.reference.generate_reference`): the oracle the
speculative engine is checked against, so its own behaviour is pinned down here.

Greedy equals argmax decoding done by hand with full forwards; temperature 0 ignores the
seed; a sampled output is reproducible for a seed and changes with it; stop ids,
`max_tokens` and `max_len` end generation with the right reason.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.checkpoint import Model
from mtp_jax.config import ModelConfig, SamplingParams
from mtp_jax.layers import causal_attend
from mtp_jax.mtp import MTPModel
from mtp_jax.reference import generate_reference

MAX_LEN = 32
PROMPT = [3, 17, 42, 5, 9]


@functools.lru_cache(maxsize=None)
def model() -> Model:
    """A small random target (one sliding-window layer) with sharp logits."""
    cfg = ModelConfig(layout="mimo", vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      attention_bias=True, sliding_windows=(None, 6), num_mtp_modules=1,
                      dtype="float32")
    abstract = nnx.eval_shape(lambda: MTPModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(0)
    for path, var in state.flat_state():
        shape = var.get_value().shape
        x = rng.standard_normal(shape)
        if path[-1] == "weight":
            x = 1.0 + 0.1 * x
        elif path[-1] == "qkv_bias":
            x = 0.1 * x
        elif path[-1] == "lm_head":
            x = 3.0 * x / np.sqrt(shape[0])  # logits of a few units: clear argmaxes
        elif path[-1] == "o":
            x = x / np.sqrt(shape[0] * shape[1])
        elif path[-1] != "embed":
            x = x / np.sqrt(shape[0])
        var.set_value(jnp.asarray(x, jnp.float32))
    return Model(cfg, graphdef, state)


@functools.lru_cache(maxsize=None)
def _full_forward():
    m = model()

    @jax.jit
    def logits(params, tokens):  # tokens [1, MAX_LEN]; causal, so padding never leaks back
        target = nnx.merge(m.graphdef, params).target
        pos = jnp.arange(MAX_LEN)[None]
        normed, _ = target(tokens, pos, causal_attend(pos))
        return target.head(normed)

    return lambda tokens: np.asarray(logits(m.params, jnp.asarray(tokens)))


def manual_greedy(prompt, n):
    """Argmax decoding with one full forward per token (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        row = np.zeros((1, MAX_LEN), np.int32)
        row[0, : len(seq)] = seq
        seq.append(int(np.argmax(_full_forward()(row)[0, len(seq) - 1])))
    return seq[len(prompt):]


def generate(sampling, prompt=PROMPT, max_len=MAX_LEN, stop_token_ids=()):
    return generate_reference(model(), prompt, sampling, max_len=max_len,
                              stop_token_ids=stop_token_ids)


def test_greedy_equals_manual_argmax_decoding():
    out, reason = generate(SamplingParams(max_tokens=12))
    assert reason == "length" and len(out) == 12
    assert out == manual_greedy(PROMPT, 12)
    assert len(set(out)) > 1  # a constant output would prove little
    again, _ = generate(SamplingParams(max_tokens=12))
    assert again == out


def test_greedy_with_a_long_prompt_past_the_sliding_window():
    prompt = list(np.random.default_rng(1).integers(0, 64, 19))  # pads the prefill to 32
    out, _ = generate(SamplingParams(max_tokens=6), prompt=prompt)
    assert out == manual_greedy(prompt, 6)


def test_temperature_zero_ignores_the_seed():
    outs = {tuple(generate(SamplingParams(temperature=0.0, seed=s, top_k=5, top_p=0.9,
                                          max_tokens=10))[0]) for s in (0, 1, 2**40 + 7)}
    assert len(outs) == 1
    assert list(outs.pop()) == manual_greedy(PROMPT, 10)


def test_sampling_is_reproducible_and_varies_with_the_seed():
    def sampled(seed):
        return generate(SamplingParams(temperature=1.5, seed=seed, max_tokens=16))[0]

    first = sampled(11)
    assert sampled(11) == first
    others = [sampled(s) for s in (12, 2**33 + 11)]
    assert all(o != first for o in others)
    assert first != manual_greedy(PROMPT, 16)
    assert all(0 <= t < 64 for t in first)


def test_top_k_one_is_greedy_at_any_temperature():
    out, _ = generate(SamplingParams(temperature=2.0, top_k=1, seed=5, max_tokens=8))
    assert out == manual_greedy(PROMPT, 8)


@pytest.mark.parametrize("where", ["sampling_params", "argument"])
def test_stop_token_ends_generation(where):
    greedy = manual_greedy(PROMPT, 12)
    stop = greedy[4]
    first = greedy.index(stop)
    if where == "sampling_params":
        out, reason = generate(SamplingParams(max_tokens=12, stop_token_ids=(stop,)))
    else:
        out, reason = generate(SamplingParams(max_tokens=12), stop_token_ids=(stop,))
    assert reason == "stop"
    assert out == greedy[: first + 1]  # the stop token is emitted, nothing after it


def test_max_tokens_is_respected():
    for n in (1, 3):
        out, reason = generate(SamplingParams(max_tokens=n, temperature=1.0, seed=3))
        assert len(out) == n and reason == "length"


def test_max_len_bounds_prompt_plus_output():
    out, reason = generate(SamplingParams(max_tokens=100))
    assert reason == "length"
    assert len(PROMPT) + len(out) == MAX_LEN
    assert out == manual_greedy(PROMPT, MAX_LEN - len(PROMPT))
    out, reason = generate(SamplingParams(max_tokens=100), prompt=list(range(MAX_LEN - 1)))
    assert len(out) == 1 and reason == "length"


@pytest.mark.parametrize("prompt", [[], list(range(MAX_LEN))])
def test_bad_prompt_length_is_an_error(prompt):
    with pytest.raises(ValueError, match="prompt length"):
        generate(SamplingParams(), prompt=prompt)
