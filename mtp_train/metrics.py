"""Losses and teacher-forced metrics of the target and its MTP modules, of a model in
training or of an export (held-out files, optionally quantized weights and fp8 keys and
values), and the HumanEval acceptance table that runs the engine on an export."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.calibration import calibrate_kv_scales, fp8_kv_attend
from mtp_jax.checkpoint import load
from mtp_jax.config import SamplingParams, SpecConfig
from mtp_jax.engine import Engine, Request
from mtp_jax.metrics import repeated_ngrams
from mtp_jax.mtp import forward_train
from mtp_jax.qarray import is_quantized

from .corpus import token_stream, windows


def head_losses(model, tokens, attend_for=None):
    """Mean cross-entropy per head [1 + K]: target, then module k predicting t_{i+k+2}."""
    logits, outs = forward_train(model, tokens, attend_for=attend_for)
    T = tokens.shape[1]

    def xent(lg, labels):
        ll = jnp.take_along_axis(lg, labels[..., None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(lg, -1) - ll)

    heads = [xent(logits[:, : T - 1], tokens[:, 1:])]
    heads += [xent(lg[:, : T - k - 2], tokens[:, k + 2:]) for k, lg in enumerate(outs)]
    return jnp.stack(heads), (logits, outs)


def bf16_params(params):
    """Float parameters in bf16; quantized ones (values and scales) as they are."""
    return jax.tree.map(lambda x: x if is_quantized(x) else x.astype(jnp.bfloat16), params,
                        is_leaf=is_quantized)


def make_eval(graphdef, kv_scales=None):
    """The jitted teacher-forced evaluation; with `kv_scales`, every key and value is
    rounded through fp8 with those scales first, as an fp8 KV cache stores them."""
    attend_for = None if kv_scales is None else fp8_kv_attend(kv_scales)

    @jax.jit
    def evaluate(params, tokens):
        """Per-head losses and, per module, teacher-forced top-1 agreement with the
        target's argmax at the same predicted position, top-1 accuracy, and the chained
        agreement (modules 1..k all agree: the greedy acceptance of depth k)."""
        heads, (logits, outs) = head_losses(nnx.merge(graphdef, bf16_params(params)), tokens,
                                            attend_for)
        T, K = tokens.shape[1], len(outs)
        tgt = jnp.argmax(logits, -1)  # position j predicts t_{j+1}
        n = T - K - 1  # anchors every module has a label for
        agree = [jnp.argmax(lg[:, :n], -1) == tgt[:, k + 1: k + 1 + n] for k, lg in enumerate(outs)]
        acc = [jnp.mean(jnp.argmax(lg[:, : T - k - 2], -1) == tokens[:, k + 2:])
               for k, lg in enumerate(outs)]
        chained = jnp.cumprod(jnp.stack(agree), axis=0)
        return dict(loss=heads, agreement=jnp.stack([jnp.mean(a) for a in agree]),
                    chained_agreement=jnp.mean(chained, axis=(1, 2)),
                    accuracy=jnp.stack([jnp.mean(tgt[:, : T - 1] == tokens[:, 1:])] + acc))
    return evaluate


def stream_metrics(evaluate, params, stream, num_bytes, seq_len, batch=16) -> dict:
    """`make_eval`'s metrics averaged over every whole window of `stream`; the target's
    loss also per byte of text (the stream's tokens cover `num_bytes` bytes), comparable
    across tokenizers."""
    rows = windows(stream, seq_len)
    rows = rows[: max(len(rows) // batch, 1) * batch]
    outs = [jax.device_get(evaluate(params, jnp.asarray(rows[i: i + batch])))
            for i in range(0, len(rows), batch)]
    res = {k: np.mean([o[k] for o in outs], axis=0).tolist() for k in outs[0]}
    return dict(res, tokens=int(rows.size), bytes=num_bytes,
                nats_per_byte=res["loss"][0] * len(stream) / max(num_bytes, 1))


def heldout_metrics(model_dir, splits, *, seq_len=512, quantize=None, kv_dtype=None) -> dict:
    """Teacher-forced metrics (`stream_metrics`) of an exported model on each held-out
    split ({name: [text]}), tokenized by the model's own tokenizer, its weights quantized
    and its keys / values rounded through fp8 (calibrated scales) if asked."""
    model = load(model_dir, quantize=quantize)
    scales = None
    if kv_dtype == "fp8":
        scales = model.kv_scales or calibrate_kv_scales(model)
    evaluate = make_eval(model.graphdef, scales)
    out = {}
    for name, texts in splits.items():
        stream = token_stream(model.tokenizer, texts, range(len(texts)))
        if len(stream) >= seq_len:
            out[name] = dict(stream_metrics(evaluate, model.params, stream,
                                            sum(len(t.encode()) for t in texts), seq_len),
                             files=len(texts))
    return out


def acceptance(model_dir, problems, *, methods, k=3, max_tokens=128, max_batch=16,
               max_model_len=1024, limit=None, dtype=None, quantize=None,
               kv_dtype=None) -> dict:
    """Greedy decoding of the HumanEval prompts with each method: tokens per target forward
    (prefill counts as one), acceptance per depth, and per earlier method the number of
    prompts with identical output (all, in exact arithmetic; in bf16 a near-tie can
    round differently in a K+1-token verify than in a 1-token decode)."""
    model = load(model_dir, dtype=dtype, quantize=quantize)
    prompts = [model.tokenizer.encode(p["prompt"]).ids for p in problems[:limit]]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out, ids_of = {}, {}
    for method in ["none"] + [m for m in methods if m != "none"]:
        spec = SpecConfig(method=method, num_speculative_tokens=k)
        eng = Engine(model, spec=spec, max_batch=max_batch, max_model_len=max_model_len,
                     kv_dtype=kv_dtype)
        compile_s = eng.warmup()
        t0 = time.perf_counter()
        res = eng.generate([Request(i, ids, sp) for i, ids in enumerate(prompts)])
        secs = time.perf_counter() - t0
        gen = sum(r.num_generated_tokens for r in res)
        steps = sum(r.num_steps for r in res)
        acc = np.sum([r.accepted_per_depth for r in res], axis=0) \
            if k and spec.strategy.speculative else []
        ids = ids_of[method] = [r.token_ids for r in res]
        copied = [repeated_ngrams(p, t) for p, t in zip(prompts, ids)]
        out[method] = dict(
            mean_accepted_length=gen / (steps + len(res)),
            acceptance_per_depth=[float(a) / steps for a in acc],
            generated_tokens=gen, target_forwards=steps + len(res), seconds=secs,
            compile_seconds=compile_s, errors=sum(r.finish_reason == "error" for r in res),
            prompts=len(res), repeated_4gram_share=sum(copied) / max(gen, 1),
            identical_to={  # prompts with the same greedy output
                m: sum(a == b for a, b in zip(ids, other))
                for m, other in ids_of.items() if m != method})
        print(f"{method:9s} accepted length {out[method]['mean_accepted_length']:.3f}  per "
              f"depth {' '.join(f'{a:.3f}' for a in out[method]['acceptance_per_depth'])}  "
              f"identical to {out[method]['identical_to']} of {len(res)}  repeated 4-grams "
              f"{out[method]['repeated_4gram_share']:.2f}  {secs:.0f}s",
              flush=True)
    return out
