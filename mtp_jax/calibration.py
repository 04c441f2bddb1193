"""Calibration of fp8 KV-cache scales: run the model over text, keep each head's maximum.

`calibrate_kv_scales` runs the target and MTP modules (`mtp.forward_train`) with an
attention backend that records the largest |key| / |value| per kv head; `fp8_kv_attend`
is the matching backend for a training-style forward that rounds keys and values through
fp8 exactly as the cache stores them. Both sit above the model; the cache's dtype and the
latent row's scale layout are quant.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.kv_write import quantize_rows

from .layers import causal_attend
from .mtp import forward_train
from .quant import FP8_MAX, latent_row_scale

KV_MARGIN = 2.0  # headroom over the calibration maximum before values saturate at 448
# What `calibrate_kv_scales` runs when the caller gives nothing: code and prose, so the
# keys and values see the kinds of tokens a job is likely to hold.
CALIBRATION_TEXT = """\
import numpy as np


def moving_average(values, window=3):
    \"\"\"Mean of each run of `window` consecutive values.\"\"\"
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out = []
    for i in range(len(values) - window + 1):
        out.append(sum(values[i:i + window]) / window)
    return np.asarray(out, dtype=np.float32)


class Counter(dict):
    def add(self, key, n=1):
        self[key] = self.get(key, 0) + n
        return self[key]


The engine reads every key and value of the cache at each step, so the cache's bytes set
the speed of decoding at long contexts. Storing them in eight bits halves those bytes;
each head keeps one scale for its keys and one for its values, chosen once from text
like this and then fixed, so every request sees the same numbers.
"""


def calibrate_kv_scales(model, token_rows=None, margin: float = KV_MARGIN) -> tuple:
    """Per cache layer (target layers, then MTP modules): (k scales [H], v scales [H]) for
    an fp8 KV cache (a latent MLA layer: ((latent scale, rope scale), ()), the row's two
    parts), from the largest |key| / |value| each kv head (part) produces over
    `token_rows` ([b, T] token ids; default CALIBRATION_TEXT through the tokenizer, or
    random ids without one) times `margin`, over fp8's largest value 448. A token whose
    keys exceed that later is saturated (clipped), not turned into Inf."""
    cfg = model.config
    if token_rows is None:
        if model.tokenizer is not None:
            ids = model.tokenizer.encode(CALIBRATION_TEXT).ids
        else:
            ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 512).tolist()
        token_rows = [ids[: min(len(ids), cfg.max_position_embeddings)]]
    tokens = jnp.asarray(token_rows, jnp.int32)

    @jax.jit
    def amax(params, tokens):
        seen = {}

        def recording(positions):
            inner = causal_attend(positions)

            def attend(layer, q, k, v, window, *, sm_scale=None, v_dim=None, sinks=None,
                       index=None):
                def amax(x, axis):
                    return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis)
                if v is None:  # a latent row: its latent and rope parts, one scale each
                    got = (jnp.stack([amax(k[..., :v_dim], None), amax(k[..., v_dim:], None)]),)
                else:  # per kv head, keys and values
                    got = (amax(k, (0, 1, 3)), amax(v, (0, 1, 3)))
                old = seen.get(layer)
                seen[layer] = got if old is None else tuple(map(jnp.maximum, old, got))
                return inner(layer, q, k, v, window, sm_scale=sm_scale, v_dim=v_dim,
                             sinks=sinks, **({} if index is None else {"index": index}))
            return attend

        forward_train(nnx.merge(model.graphdef, params), tokens, attend_for=recording)
        return seen

    seen = jax.device_get(amax(model.params, tokens))

    def scales(a):
        a = np.asarray(a, np.float64) * margin / FP8_MAX
        return tuple(float(x) if x > 0 and np.isfinite(x) else 1.0 for x in a)

    return tuple((scales(seen[i][0]), scales(seen[i][1]) if len(seen[i]) == 2 else ())
                 for i in sorted(seen))


def fp8_kv_attend(scales):
    """attend_for(positions) for `mtp.forward_train`: causal attention over keys and
    values rounded through fp8 with per-layer, per-kv-head `scales`, exactly as an fp8
    cache stores them (write_rows) and the kernels read them back (page * scale)."""
    def rounded(x, s):  # x [b, t, heads, d]
        s = jnp.asarray(s, jnp.float32)
        rows = x.reshape(-1, x.shape[2], x.shape[3]).swapaxes(0, 1)  # [heads, b*t, d]
        back = quantize_rows(rows, s, jnp.float8_e4m3fn).astype(jnp.float32) * s[:, None, None]
        return back.swapaxes(0, 1).reshape(x.shape).astype(x.dtype)

    def attend_for(positions):
        inner = causal_attend(positions)

        def attend(layer, q, k, v, window, *, sm_scale=None, v_dim=None, sinks=None,
                   index=None):  # a DSA layer's index keys stay unrounded here
            ks, vs = scales[layer]
            if v is None:  # a latent row: its two parts over their own scales
                per_dim = latent_row_scale(ks, k.shape[-1], v_dim)
                back = quantize_rows(k.astype(jnp.float32) / per_dim, None, jnp.float8_e4m3fn)
                k = (back.astype(jnp.float32) * per_dim).astype(k.dtype)
            else:
                k, v = rounded(k, ks), rounded(v, vs)
            return inner(layer, q, k, v, window, sm_scale=sm_scale, v_dim=v_dim, sinks=sinks,
                         **({} if index is None else {"index": index}))
        return attend

    return attend_for


__all__ = ["calibrate_kv_scales", "fp8_kv_attend", "CALIBRATION_TEXT", "KV_MARGIN"]
