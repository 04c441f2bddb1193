"""Joint training of the target and its MTP modules (DeepSeek-V3 style): model shapes,
AdamW with warmup + cosine decay, the jitted step, the training loop and the export."""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.checkpoint import from_params, save_hf, to_flat
from mtp_jax.config import ModelConfig
from mtp_jax.mtp import init_model

from .corpus import EOT, humaneval_problems, overlap_lines, prepare_data, windows, write_jsonl
from .metrics import bf16_params, head_losses, make_eval, stream_metrics

SIZES = {  # model shapes; `small` is the shipped one, `small6` the one before it
    "small": dict(hidden_size=384, intermediate_size=768, num_layers=12, num_heads=6,
                  num_kv_heads=2, head_dim=64),
    "small6": dict(hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6,
                   num_kv_heads=2, head_dim=64),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=32),
}


def make_config(size: str, vocab_size: int, max_len: int) -> ModelConfig:
    return ModelConfig(layout="mimo", vocab_size=vocab_size, **SIZES[size], rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=max_len,
                       attention_bias=True, tie_word_embeddings=True, num_mtp_modules=3,
                       mtp_hidden_source="previous", dtype="bfloat16")


def make_optimizer(params):
    """AdamW (b1 0.9, b2 0.95, weight decay 0.1 on matrices only) after global-norm clipping
    at 1.0, without its learning rate: `make_step` applies the rate it is given, so the
    schedule's length can be fixed after training has started (`--time-budget`)."""
    import optax

    decay = jax.tree.map(lambda x: x.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95),
                       optax.add_decayed_weights(0.1, mask=decay))


def lr_at(step, *, peak, warmup, total, final=0.1) -> float:
    """Linear warmup from 0 to `peak` over `warmup` steps, then cosine decay to
    `final * peak` at `total` (optax's warmup_cosine_decay_schedule)."""
    if step < warmup:
        return peak * step / warmup
    frac = min((step - warmup) / max(total - warmup, 1), 1.0)
    return peak * (final + (1 - final) * 0.5 * (1 + np.cos(np.pi * frac)))


def make_step(graphdef, opt, mtp_weight):
    import optax

    def loss_fn(params, tokens):
        heads, _ = head_losses(nnx.merge(graphdef, bf16_params(params)), tokens)
        return heads[0] + mtp_weight * jnp.mean(heads[1:]), heads

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, data, rows, lr):
        (_, heads), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, data[rows])
        updates, opt_state = opt.update(grads, opt_state, params)
        updates = jax.tree.map(lambda u: -lr * u, updates)
        return optax.apply_updates(params, updates), opt_state, heads

    return step


def plot_curves(history, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = ["target"] + [f"MTP {k + 1}" for k in range(len(history["train"][0][1]) - 1)]
    steps = [s for s, _ in history["train"]]
    for h, name in enumerate(names):
        line, = a.plot(steps, [v[h] for _, v in history["train"]], label=f"{name} (train)")
        if history["val"]:
            a.plot([s for s, _ in history["val"]], [v["loss"][h] for _, v in history["val"]],
                   "o--", color=line.get_color(), ms=3, label=f"{name} (held-out)")
    a.set(xlabel="step", ylabel="cross-entropy (nats)", yscale="log", title="loss per head")
    a.legend(fontsize=7)
    for k in range(len(names) - 1):
        b.plot([s for s, _ in history["val"]], [v["agreement"][k] for _, v in history["val"]],
               "o-", ms=3, label=f"MTP {k + 1} vs target argmax")
    b.set(xlabel="step", ylabel="top-1 agreement", ylim=(0, 1),
          title="held-out teacher-forced agreement")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train(args) -> dict:
    t_start = time.perf_counter()
    if args.no_overlap_check:
        overlap = set()
    else:
        overlap = overlap_lines(humaneval_problems(args.humaneval))
    d = prepare_data(args, overlap)
    tok, stream = d["tokenizer"], d["stream"]
    val_stream = np.concatenate([d["val_stdlib"], d["val_packages"]])
    if not len(val_stream):  # a corpus too small for a held-out file: its last window
        val_stream = stream[-args.seq_len:]
    T, B = args.seq_len, args.batch
    rows = windows(stream, T)
    val_rows = windows(val_stream, T)  # evenly spaced, so no single file dominates
    val_rows = val_rows[np.unique(np.linspace(0, len(val_rows) - 1, args.eval_rows).astype(int))]
    rng = np.random.default_rng(args.seed + 2)

    cfg = make_config(args.size, tok.get_vocab_size(), args.max_len)
    model = init_model(cfg, seed=args.seed, dtype=jnp.float32)
    # Tied embeddings: the model's unit-variance embedding init would start the shared
    # head at logits of scale sqrt(d); start it GPT-2 style instead.
    model.target.embed.set_value(jax.random.normal(
        jax.random.key(args.seed + 1), model.target.embed.shape, jnp.float32) * 0.02)
    graphdef, params = nnx.split(model)
    opt = make_optimizer(params)
    opt_state = opt.init(params)
    step_fn, eval_fn = make_step(graphdef, opt, args.mtp_weight), make_eval(graphdef)
    warmup = min(args.warmup, args.steps - 1)
    total = args.steps
    probe = min(warmup, 50) if args.time_budget else None  # steps timed to size the run
    order = np.zeros(0, np.int64)
    data, val = jnp.asarray(rows), jnp.asarray(val_rows)
    plan = (f"steps fitted to a {args.time_budget:.0f}s budget" if probe else
            f"{total} steps of {B}x{T} = {total * B * T:,} tokens "
            f"({total * B / len(rows):.2f} epochs)")
    print(f"model {cfg.num_params:,} parameters ({args.size}); {plan}", flush=True)

    history, pending = {"train": [], "val": []}, []
    t0 = t_compile = time.perf_counter()
    done = 0  # steps taken
    while done < total:
        while len(order) < (done + 1) * B:  # one seeded permutation of the windows per epoch
            order = np.concatenate([order, rng.permutation(len(rows))])
        lr = np.float32(lr_at(done, peak=args.lr, warmup=warmup, total=total))
        params, opt_state, heads = step_fn(params, opt_state, data,
                                           jnp.asarray(order[done * B:(done + 1) * B]), lr)
        pending.append(heads)
        done += 1
        if done == 1:
            jax.block_until_ready(heads)
            t_compile = time.perf_counter() - t0
            t0 = time.perf_counter()
        if done == probe:  # still in warmup, where the rate does not depend on `total`
            jax.block_until_ready(heads)
            rate = (done - 1) / (time.perf_counter() - t0)
            left = args.time_budget - (time.perf_counter() - t_start)
            total = max(done + int(left * rate), warmup + 1)
            print(f"{rate:.2f} steps/s: {total} steps of {B}x{T} = {total * B * T:,} tokens "
                  f"({total * B / len(rows):.2f} epochs) fit the budget", flush=True)
        last = done == total
        if done % args.log_every == 0 or last:
            mean = np.mean(np.asarray(jax.device_get(pending)), axis=0).tolist()
            history["train"].append((done, mean))
            pending = []
            el = time.perf_counter() - t0
            print(f"step {done}: " + " ".join(f"{x:.3f}" for x in mean) +
                  f"  {(done - 1) * B * T / max(el, 1e-9):,.0f} tok/s  {el:.0f}s", flush=True)
            over = args.time_limit and el > args.time_limit
            if done % args.eval_every == 0 or last or over:
                ev = jax.device_get(eval_fn(params, val))
                history["val"].append((done, {k: np.asarray(v).tolist() for k, v in ev.items()}))
                print("  held-out loss " + " ".join(f"{x:.3f}" for x in ev["loss"]) +
                      "  agreement " + " ".join(f"{x:.3f}" for x in ev["agreement"]), flush=True)
            if over:
                print(f"time limit {args.time_limit}s reached: stopping at step {done}")
                break
    train_seconds = time.perf_counter() - t0

    os.makedirs(args.out, exist_ok=True)
    trained = from_params(cfg, to_flat(params), jnp.bfloat16, tokenizer=tok,
                          eos_token_ids=(tok.token_to_id(EOT),))
    save_hf(trained, args.out, max_shard_bytes=args.max_shard_bytes)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    plot_curves(history, os.path.join(args.out, "loss_curves.png"))
    if d["prompts"]:
        write_jsonl(os.path.join(args.out, "heldout_prompts.jsonl"), d["prompts"])
    # The exported (bf16) weights, as the engine will see them, on the whole held-out split
    # of each kind (the curves above use `--eval-rows` windows of both).
    exported = jax.tree.map(lambda x: x.astype(jnp.float32), trained.params)
    final = {name: stream_metrics(eval_fn, exported, d[name], d["bytes"][name], T)
             for name in ("val_stdlib", "val_packages") if len(d[name]) >= T}
    metrics = dict(
        argv=sys.argv[1:], device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
        python=sys.version.split()[0], jax=jax.__version__, corpus=d["report"],
        files=d["files"], bytes=d["bytes"], files_removed=d["removed"],
        removed_tokens=d["removed_tokens"], tokenizer_files=d["tokenizer_files"],
        train_tokens=len(stream), heldout_tokens=len(val_stream),
        heldout_eval_tokens=int(val_rows.size), vocab_size=tok.get_vocab_size(),
        num_params=cfg.num_params, steps=done, planned_steps=total, batch=B, seq_len=T,
        tokens_seen=done * B * T, epochs=done * B / len(rows),
        compile_seconds=t_compile, train_seconds=train_seconds,
        total_seconds=time.perf_counter() - t_start, final_train_loss=history["train"][-1][1],
        final_heldout=final, history=history)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    for name, m in final.items():
        print(f"{name} (exported bf16, {m['tokens']:,} tokens): loss " +
              " ".join(f"{x:.3f}" for x in m["loss"]) +
              f" ({m['nats_per_byte']:.4f} nats/byte)  agreement " +
              " ".join(f"{x:.3f}" for x in m["agreement"]) +
              f"  chained {' '.join(f'{x:.3f}' for x in m['chained_agreement'])}", flush=True)
    print(f"train {train_seconds:.0f}s, total {metrics['total_seconds']:.0f}s", flush=True)
    return metrics
