"""The plain reference generator: dense (non-paged) KV cache, one token per forward.

The oracle the speculative engine is checked against: greedy speculative output must
equal this token for token; sampled output uses the same (seed, position) keys as the
engine's plain path, so `method=none` matches it exactly too. Written for clarity, not
speed: one request at a time, prompt prefilled in one forward padded to a power of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import SamplingParams
from .model import DenseCache
from .sampling import SALT_TARGET, row_keys, sample, split_seed


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, params, caches, tokens, positions, lengths):
    model = nnx.merge(graphdef, params)
    backend = DenseCache(caches, positions, lengths)
    normed, _ = model.target(tokens, positions, backend)
    return model.target.head(normed), backend.caches


@jax.jit
def _pick(logits, temperature, top_k, top_p, seed, position):
    keys = row_keys(seed[None], position[None, None], SALT_TARGET)[:, 0]
    tok, _ = sample(logits[None], temperature[None], top_k[None], top_p[None], keys)
    return tok[0]


def generate_reference(model, prompt_ids, sampling: SamplingParams, *, max_len: int,
                       stop_token_ids=()):
    """Generate for one prompt. Returns (generated ids, finish_reason 'stop' | 'length')."""
    cfg = model.config
    prompt = np.asarray(prompt_ids, np.int32)
    p = len(prompt)
    if not 0 < p < max_len:
        raise ValueError(f"prompt length {p} must be in [1, {max_len})")
    pad = 1 << max(4, (p - 1).bit_length())
    caches = DenseCache.init(cfg, 1, max_len, model.dtype)
    toks = np.zeros((1, pad), np.int32)
    toks[0, :p] = prompt
    pos = np.arange(pad, dtype=np.int32)[None]
    logits, caches = _forward(model.graphdef, model.params, caches, jnp.asarray(toks),
                              jnp.asarray(pos), jnp.asarray([p], jnp.int32))
    row = logits[0, p - 1]
    t = jnp.float32(sampling.temperature)
    k, tp = jnp.int32(sampling.top_k), jnp.float32(sampling.top_p)
    seed = jnp.asarray(split_seed(sampling.seed), jnp.uint32)
    stops = set(stop_token_ids) | set(sampling.stop_token_ids)
    out = []
    position = p
    while True:
        tok = int(_pick(row, t, k, tp, seed, jnp.int32(position)))
        out.append(tok)
        if tok in stops:
            return out, "stop"
        if len(out) >= sampling.max_tokens or position + 1 >= max_len:
            return out, "length"
        logits, caches = _forward(model.graphdef, model.params, caches,
                                  jnp.asarray([[tok]], jnp.int32),
                                  jnp.asarray([[position]], jnp.int32),
                                  jnp.asarray([position + 1], jnp.int32))
        row = logits[0, 0]
        position += 1
