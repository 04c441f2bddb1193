"""Small models with controlled draft quality for the speculative-decoding tests.

`markov_model` builds real weights (no mock in the code path) whose target mostly
predicts a fixed permutation of the current token, perturbed by attention and MLP so
the sequence depends on context. Its MTP modules read only the embedding of their input
token (identity projection, block outputs scaled by `mtp_noise`), so with `agree=True`
and no noise every draft equals the target's choice; `agree=False` rolls the modules'
heads (DeepSeek layout) so no draft ever agrees; `mtp_noise` in between gives partial
acceptance, which exercises every rollback length.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.checkpoint import from_params, to_flat
from mtp_jax.config import ModelConfig
from mtp_jax.mtp import init_model


def small_config(layout: str, *, vocab=61, hidden=64, layers=2, mtp=3, **kw) -> ModelConfig:
    base = dict(
        layout=layout, vocab_size=vocab, hidden_size=hidden, intermediate_size=96,
        num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16, num_mtp_modules=mtp,
        dtype="float32")
    if layout == "mimo":
        base.update(attention_bias=True, mtp_concat_order="hidden_first",
                    mtp_output_hidden="post_norm")
    elif layout == "deepseek_v3":
        base.update(mtp_own_head=True, mtp_own_embed=True, mtp_concat_order="embed_first",
                    mtp_output_hidden="pre_norm")
    base.update(kw)
    return ModelConfig(**base)


def markov_model(layout="mimo", *, agree=True, target_noise=0.0, mtp_noise=0.0, scale=20.0,
                 seed=0, **kw):
    cfg = small_config(layout, **kw)
    v, d = cfg.vocab_size, cfg.hidden_size
    flat = to_flat(nnx.split(init_model(cfg, seed=seed))[1])
    rng = np.random.default_rng(seed)
    for key in list(flat):
        if key[-1] in ("o", "down"):
            noise = target_noise if key[0] == "target" else mtp_noise
            flat[key] = np.asarray(flat[key]) * noise
    emb = rng.normal(size=(v, d)).astype(np.float32)
    perm = rng.permutation(v)
    normed = emb / np.sqrt((emb ** 2).mean(-1, keepdims=True))
    head = (np.linalg.pinv(normed) @ (np.eye(v)[perm] * scale)).astype(np.float32)
    flat[("target", "embed")] = emb
    flat[("target", "lm_head")] = head
    eye = np.eye(d, dtype=np.float32)
    inputs = ([("mtp_shared",)] if cfg.mtp_shared_input and cfg.num_mtp_modules else
              [("mtp", k, "input") for k in range(cfg.num_mtp_modules)])
    for path in inputs:
        proj = np.asarray(flat[path + ("proj",)]) * mtp_noise
        if cfg.mtp_concat_order == "hidden_first":
            proj[d:] += eye
        else:
            proj[:d] += eye
        flat[path + ("proj",)] = proj
    for k in range(cfg.num_mtp_modules):
        if cfg.mtp_own_head:
            flat[("mtp", k, "embed")] = emb
            flat[("mtp", k, "head")] = head if agree else np.roll(head, 1, axis=1)
        elif not agree:
            raise ValueError("agree=False needs per-module heads (deepseek_v3 layout)")
    return from_params(cfg, flat, jnp.float32)


def random_model(layout="mimo", *, scale=6.0, seed=0, **kw):
    """Random weights with the target's logits sharpened (peaked) by `scale`."""
    cfg = small_config(layout, **kw)
    flat = to_flat(nnx.split(init_model(cfg, seed=seed))[1])
    flat[("target", "lm_head")] = np.asarray(flat[("target", "lm_head")]) * scale
    return from_params(cfg, flat, jnp.float32)
