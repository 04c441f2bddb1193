"""End-to-end decode benchmark on a 7-8 B dense shape (MiMo-7B or Llama-2-7B dimensions,
3 MTP modules).

  PYTHONPATH=. python launch/bench_decode.py [--shape mimo-7b|llama2-7b]
      [--batches 1,8,32,64] [--ctxs 1024,4096] [--weights bf16,int8,fp8,fp8-block]
      [--acceptance checkpoints/acceptance_bf16.json] [--profile] [--tiny]
      [--draft-vocab 0,32768] [--draft-head none,int8] [--kv-dtype model,fp8]

`--weights` runs the same table for the model as built and for each quantized copy
(`mtp_jax.quantize_model`), side by side in one process, against one copy-bandwidth
measurement; the bytes limit counts the quantized weights' bytes (values and scales).
`--draft-vocab` and `--draft-head` do the same for a reduced draft vocabulary and for the
draft's quantized head copy; the draft's limit counts the head it reads at that batch.
`--kv-dtype model,fp8` runs pages in the model's dtype and fp8 pages side by side.

Random bf16 weights arranged so that greedy decoding is a fixed permutation of the
current token and every MTP module predicts it too (attention / MLP output projections
are zero, so they cost their full bytes but change nothing): the "oracle draft that
always agrees". All timings use the engine's own jitted programs on a state built
directly at the wanted context (every slot active, kv_len = ctx; prefill is not timed).

Per (batch B, context ctx), all in one run with the copy bandwidth measured beside them:
- plain decode step (`method=none`, the engine's step loop for greedy rows, per step) against
  the limit (target weights bytes + KV bytes read) / copy bandwidth;
- verify: target forward over K+1 = 4 tokens per slot (N times in one jitted
  `fori_loop`) divided by the plain step time;
- draft: the `chain` draft of 3 modules + heads over a 4-token window (fori_loop), against
  its own bytes limit (module weights + the head read once per module + MTP KV);
- device idle fraction: the engine pattern (4 dispatches of `run_steps` of N/4 steps,
  each followed by the host collecting the small per-slot arrays) against the same N
  steps in one dispatch: idle = 1 - one-dispatch time / engine-pattern time (the host
  gap between dispatches; the loop's own per-step predicate is inside both);
- tokens/s: plain (B / step), oracle speculative measured (generated tokens / time in
  the engine loop with K = 3 and every draft accepted) and projected at the shipped
  model's acceptance per depth (B * (1 + sum_d a_d) / speculative step time).
Bytes: weights counted once per step as held (embedding only for the gathered rows:
negligible; quantized weights with their scales), KV = B * ctx * layers * 2 * kv_heads *
head_dim * 2 bytes. Under `--mesh` the limits are one device's: its shard of each weight
and its part of the KV (kv heads split over tp, slots over dp, where they divide), against
one device's copy bandwidth.
With $OUT set, writes bench_decode.json and bench_decode.md there.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # B=64 x 4k KV is ~45 GB

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_paged_attention import copy_bandwidth  # noqa: E402
import profile_trace  # noqa: E402

from mtp_jax.checkpoint import (Model, abstract_model, quantize_model,  # noqa: E402
                                with_draft_head)
from mtp_jax.config import EngineConfig, ModelConfig, SpecConfig  # noqa: E402
from mtp_jax.draft_vocab import with_draft_vocab  # noqa: E402
from mtp_jax.drafting import draft  # noqa: E402
from mtp_jax.strategies import CHAIN  # noqa: E402
from mtp_jax.kv_cache import PageAllocator, PagedKV, make_layout  # noqa: E402
from mtp_jax.calibration import calibrate_kv_scales  # noqa: E402
from mtp_jax.quant import mode_of, reads_head_copy  # noqa: E402
from mtp_jax.sharding import (axis_size, batch_axis, kv_heads_axis, make_mesh,  # noqa: E402
                              shard_params, state_shardings, use_mesh)
from mtp_jax.step import (Static, decode_step, greedy_steps, init_state,  # noqa: E402
                          programs, step_compiler_options)

MIMO_7B = dict(layout="mimo", vocab_size=151680, hidden_size=4096, intermediate_size=11008,
               num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, num_mtp_modules=3,
               attention_bias=True, rope_theta=640000.0, max_position_embeddings=32768,
               mtp_hidden_source="previous", dtype="bfloat16")
# Llama-2-7B as gpt-fast runs it: 32 heads / 32 kv heads, no biases, vocabulary 32000
# (the MTP modules are the same MiMo-style modules on top)
LLAMA2_7B = dict(MIMO_7B, vocab_size=32000, num_layers=32, num_kv_heads=32, attention_bias=False,
                 rope_theta=10000.0, max_position_embeddings=4096)
SHAPES = {"mimo-7b": MIMO_7B, "llama2-7b": LLAMA2_7B}
TINY = dict(MIMO_7B, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
K = 3


def log(*a):
    print(*a, flush=True)


def oracle_perm(cfg: ModelConfig, seed=0) -> jax.Array:
    """The permutation of oracle_model(cfg, seed): the token after t is perm[t]."""
    return jax.random.permutation(jax.random.fold_in(jax.random.PRNGKey(seed), 1),
                                  cfg.vocab_size)


def oracle_model(cfg: ModelConfig, dtype, seed=0) -> Model:
    """Random weights whose greedy continuation is perm(current token), drafts agreeing."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    key = jax.random.PRNGKey(seed)
    v, d = cfg.vocab_size, cfg.hidden_size
    perm = oracle_perm(cfg, seed)
    inv = jnp.argsort(perm)

    @jax.jit
    def embed_and_head(k):
        e = jax.random.normal(k, (v, d), jnp.float32)
        n = e * jax.lax.rsqrt(jnp.mean(e * e, -1, keepdims=True))
        return e.astype(dtype), (n[inv].T / np.sqrt(d) * 30.0).astype(dtype)

    emb, head = embed_and_head(jax.random.fold_in(key, 2))
    eye = jnp.eye(d, dtype=dtype)
    for i, (path, var) in enumerate(state.flat_state()):
        path = tuple(path)
        shape = var.get_value().shape
        name = path[-1] if path[-1] != "weight" else path[-2]
        if path == ("target", "embed"):
            val = emb
        elif path == ("target", "lm_head"):
            val = head
        elif path[-1] == "weight":  # norms
            val = jnp.ones(shape, dtype)
        elif name in ("o", "down", "qkv_bias", "out_proj", "experts_down"):
            val = jnp.zeros(shape, var.get_value().dtype)
        elif name == "proj":  # pass the embedding half of the MTP concat
            halves = [jnp.zeros((d, d), dtype), eye]
            val = jnp.concatenate(halves if cfg.mtp_concat_order == "hidden_first"
                                  else halves[::-1], 0)
        else:
            fan_in = shape[0]
            val = (jax.random.normal(jax.random.fold_in(key, 100 + i), shape, jnp.float32)
                   * fan_in ** -0.5).astype(var.get_value().dtype)
        var.set_value(val)
    return Model(cfg, graphdef, state)


def held_bytes(value) -> int:
    """Bytes of a parameter (values and scales) that one device holds: the whole of each
    array on one device, its shard under a mesh."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree_util.tree_leaves(value))


def weight_bytes(model: Model, prefix) -> int:
    """`held_bytes` of the parameters under `prefix`, the target's embedding aside (a step
    reads only its gathered rows)."""
    return sum(held_bytes(var.get_value()) for path, var in model.params.flat_state()
               if tuple(path)[: len(prefix)] == prefix and tuple(path) != ("target", "embed"))


def kv_share(mesh, cfg: ModelConfig, b: int) -> float:
    """The part of a step's KV reads that falls on one device: its kv heads (split over
    `tp` where they divide) of its slots (split over `dp` where they divide)."""
    heads = axis_size(mesh, "tp") if kv_heads_axis(mesh, cfg.num_kv_heads) else 1
    slots = axis_size(mesh, "dp") if batch_axis(mesh, b) else 1
    return 1 / (heads * slots)


def decoding_state(static: Static, model: Model, b: int, ctx: int, dtype):
    """Every slot active at kv_len = ctx, sequential pages (a ring per slot in sliding
    groups), huge budgets."""
    st = init_state(static, dtype)
    layout = static.layout
    per = layout.pages_for(0, static.eng.max_model_len + K)
    # slot i's pages: a run of its own per group (a ring in sliding groups), laid into
    # table rows the way the engine's allocator lays them
    alloc = PageAllocator(layout)
    rows = np.stack([alloc.table_rows(
        [list(1 + i * n + np.arange(n)) for n in
         (per if grp.window is None else grp.ring_pages for grp in layout.groups)])
        for i in range(b)], axis=1)  # [groups, b, width]
    tables = [jnp.asarray(r) for r in rows]
    rng = np.random.default_rng(0)
    return st.replace(
        active=jnp.ones((b,), bool), length=jnp.full((b,), ctx, jnp.int32),
        last_token=jnp.asarray(rng.integers(0, model.config.vocab_size, b), jnp.int32),
        max_tokens=jnp.full((b,), 1 << 30, jnp.int32),
        limit=jnp.full((b,), per * layout.page_size, jnp.int32),
        block_tables=tuple(tables))


def timed(fn, reps=3):
    """Best and median seconds of fn() (which blocks) over `reps` calls, after one untimed
    call: the same work as a timed one, so that nothing a program does once (its first
    execution, buffers, collectives' set-up) is timed."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts)


def bench_programs(model, eng: EngineConfig, dtype, mesh=None, k=K,
                   methods=("none", "chain")) -> dict:
    """{method: program} (speculative ones with k tokens): the engine's compiled programs
    for this model and config (fp8 KV: with the model's calibrated scales)."""
    progs = {}
    for method in methods:
        spec = SpecConfig(method=method, num_speculative_tokens=k)
        layout = make_layout(model.config, eng, spec.k, dtype,
                             mtp_layers=spec.strategy.modules(spec.k), scales=model.kv_scales)
        static = Static(model.config, spec, eng, layout, mesh,
                        weights_quantized=mode_of(model.params) is not None)
        if mesh is None:
            progs[method] = programs(static, model.graphdef)
        else:
            shape = jax.eval_shape(lambda: init_state(static, dtype))
            p_sh = jax.tree_util.tree_map(lambda x: x.sharding, model.params)
            progs[method] = programs(static, model.graphdef,
                                     state_shardings(shape, mesh, eng.max_batch), p_sh)
    return progs


def fresh_state(prog, model, b, ctx, dtype, mesh=None):
    """A `decoding_state` for `prog`'s layout, placed as its programs expect."""
    st = decoding_state(prog.static, model, b, ctx, dtype)
    return st if mesh is None else jax.device_put(st, prog.state_sharding)


def _tokens(tok, b, q, vocab, spread):
    """[b, q] input tokens from the last ones: repeated, or spread over the vocabulary
    (so each position routes to its own experts in an MoE model)."""
    if spread:
        return (tok[:, None] + jnp.arange(q)[None] * 7919) % vocab
    return jnp.broadcast_to(tok[:, None], (b, q))


def verify_loop(model, layout, b, q, mesh=None, spread=False, options=None):
    """Jitted `f(params, caches, st, n)`: n target forwards over q tokens per slot (the
    verify of a K = q - 1 step), caches donated and returned."""
    cfg = model.config

    # the caches update in place
    @functools.partial(jax.jit, donate_argnums=(1,), compiler_options=options or None)
    def f(params, caches, st, n):
        m = nnx.merge(model.graphdef, params)

        def body(i, carry):
            caches, tok = carry
            # linear-attention layers keep their state after each token, as a verify does
            keep = q > 1 and bool(layout.linear)
            kv = PagedKV(layout, caches, st.block_tables, st.limit, mesh=mesh, keep_states=keep)
            pos = st.length[:, None] - 1 + jnp.arange(q)
            toks = _tokens(tok, b, q, cfg.vocab_size, spread)
            normed, _ = m.target(toks, pos, kv.attend(pos, st.length + q - 1))
            logits = m.target.head(normed)
            # every row's argmax, as the step's acceptance reads them (one row alone would
            # let XLA slice the head's product down to that row)
            nxt = jnp.max(jnp.argmax(logits, -1), -1).astype(jnp.int32)
            if keep:  # an accepted count known only from the logits, as in the step
                kv.commit_states(nxt % q)
            return tuple(kv.caches), nxt

        with use_mesh(mesh):
            return jax.lax.fori_loop(0, n, body, (caches, st.last_token))
    return f


def draft_loop(model, layout, b, dtype, mesh=None, spread=False, k=K, options=None,
               sampled=True, strategy=CHAIN):
    """Jitted `f(params, caches, st, n)`: n drafts of k tokens over a k+1 window (`chain`,
    or the strategy given)."""
    cfg = model.config

    @functools.partial(jax.jit, donate_argnums=(1,), compiler_options=options or None)
    def f(params, caches, st, n):
        m = nnx.merge(model.graphdef, params)
        sp = st.sampling

        def body(i, carry):
            caches, tok = carry
            kv = PagedKV(layout, caches, st.block_tables, st.limit, mesh=mesh)
            a = st.length - 2
            pos = a[:, None] - k + jnp.arange(k + 1)
            toks = _tokens(tok, b, k + 1, cfg.vocab_size, spread)
            hid = jnp.zeros((b, k + 1, cfg.hidden_size), dtype) + tok[:, None, None].astype(dtype)
            d, _ = draft(m, strategy, k, kv, toks, hid, pos, sp, sampled=sampled)
            return tuple(kv.caches), d[:, -1]

        with use_mesh(mesh):
            return jax.lax.fori_loop(0, n, body, (caches, st.last_token))
    return f


def fixed_trip_loop(model, static: Static, steps: int):
    """Jitted `f(params, st)`: `steps` decode steps of the program's kind in a loop of a
    static trip count (no predicate read between steps), state donated."""
    kind = static.k

    @functools.partial(jax.jit, donate_argnums=(1,),
                       compiler_options=step_compiler_options(static, kind) or None)
    def f(params, st):
        m = nnx.merge(model.graphdef, params)
        with use_mesh(static.mesh):
            return jax.lax.fori_loop(0, steps, lambda i, st: decode_step(m, static, st, kind),
                                     st)
    return f


def bench_batch(model, b, ctxs, steps, dtype, acceptance, mesh=None, steps_only=False,
                kv_dtype=None, profile=False, step_gemms=None, page_size=16,
                fixed_trip=False, sampled_steps=False):
    cfg = model.config
    # room on one state for the untimed call, the timed ones and a traced one, each
    # `steps` steps of up to K + 1 tokens
    max_len = max(ctxs) + steps * (K + 1) * 5 + 64
    eng = EngineConfig(max_batch=b, max_model_len=max_len, page_size=page_size,
                       prefill_chunk=max(16, page_size),
                       kv_dtype=kv_dtype, step_gemms=step_gemms)
    out = []
    progs = bench_programs(model, eng, dtype, mesh)
    layout = progs["chain"].static.layout
    p = model.params

    def fresh(method, ctx):
        return fresh_state(progs[method], model, b, ctx, dtype, mesh)

    # the loops time parts of the K step: compiled with its options
    options = step_compiler_options(progs["chain"].static, K)
    v4 = verify_loop(model, layout, b, K + 1, mesh, options=options)
    # the engine's programs for greedy rows (without the sampled paths where it has them)
    sampled = not greedy_steps(eng)
    draft_k = draft_loop(model, layout, b, dtype, mesh, options=options, sampled=sampled)
    n = jnp.int32(steps)
    for ctx in ctxs:
        row = dict(batch=b, ctx=ctx, page_size=page_size,
                   mesh=str(dict(mesh.shape)) if mesh else None)
        t0 = time.perf_counter()
        # plain and speculative steps through the engine's while loop, the program the
        # engine runs for greedy rows (on a GPU without the sampled paths); one state alive
        for mth, pr in progs.items():
            prog = pr.steps(pr.static.k, sampled)
            holder = {"st": fresh(mth, ctx)}

            def run(prog=prog):
                holder["st"] = jax.block_until_ready(prog(p, holder["st"], n))
            best, med = timed(run)
            row[f"{mth}_step_ms"] = best / steps * 1e3
            row[f"{mth}_step_ms_median"] = med / steps * 1e3
            if sampled_steps:  # the program with the sampled paths, from a fresh state
                other = pr.steps(pr.static.k, sampled=True)
                holder["st"] = fresh(mth, ctx)
                row[f"{mth}_sampled_step_ms"] = timed(
                    functools.partial(run, prog=other))[0] / steps * 1e3
                log(f"{mth} B={b} ctx={ctx}: step {row[f'{mth}_step_ms']:.3f} ms, with the "
                    f"sampled paths {row[f'{mth}_sampled_step_ms']:.3f} ms")
            if fixed_trip:  # the same steps without the while loop's predicate, from a
                # fresh state (the one above may be near its slots' limit)
                fixed = fixed_trip_loop(model, dataclasses.replace(pr.static, sampled=sampled),
                                        steps)
                holder["st"] = fresh(mth, ctx)

                def run_fixed():
                    holder["st"] = jax.block_until_ready(fixed(p, holder["st"]))
                row[f"{mth}_fixed_step_ms"] = timed(run_fixed)[0] / steps * 1e3
                log(f"{mth} B={b} ctx={ctx}: step {row[f'{mth}_step_ms']:.3f} ms in the "
                    f"while loop, {row[f'{mth}_fixed_step_ms']:.3f} ms at a fixed trip count")
            if profile:  # one more timed call, traced: the step's kernels by kind
                folder = tempfile.mkdtemp(prefix=f"trace_{mth}_")
                with profile_trace.traced(folder):
                    run()
                table = profile_trace.breakdown(folder, top=None)  # JSON keeps every kernel
                log(f"{mth} B={b} ctx={ctx}: " + profile_trace.render(table, per=steps,
                                                                      unit="step"))
                if table:  # tracing slows the host: idle against the untraced step instead
                    busy = table["busy_ns"] / steps / 1e6
                    idle = 1 - busy * steps / 1e3 / best
                    log(f"  kernels {busy:.2f} ms per step against the untraced step "
                        f"{best / steps * 1e3:.2f} ms: idle {100 * idle:.1f} %")
                row[f"{mth}_profile"] = table
            del holder
        if not steps_only:
            for name, fn in (("verify4_ms", v4), ("draft_ms", draft_k)):
                st = fresh("chain", ctx)
                caches, st = st.caches, st.replace(caches=())
                holder = {"c": caches}

                def run():  # the donated caches come back and feed the next call
                    holder["c"] = jax.block_until_ready(fn(p, holder["c"], st, steps))[0]
                best, _ = timed(run)
                row[name] = best / steps * 1e3
                if profile:
                    folder = tempfile.mkdtemp(prefix=f"trace_{name}_")
                    with profile_trace.traced(folder):
                        run()
                    table = profile_trace.breakdown(folder, top=None)
                    log(f"{name[:-3]} B={b} ctx={ctx}: "
                        + profile_trace.render(table, per=steps, unit="call"))
                    row[f"{name[:-3]}_profile"] = table
        row["compile_and_time_s"] = time.perf_counter() - t0
        # idle: engine pattern (dispatches + host collect) vs the same steps in one dispatch
        one_s = row["chain_step_ms"] * steps / 1e3
        st = fresh("chain", ctx)
        chain = progs["chain"].steps(K, sampled)
        dispatches = 4
        per = jnp.int32(steps // dispatches)
        st = jax.block_until_ready(chain(p, st, per))  # untimed, as the timed ones
        gen0 = int(np.sum(jax.device_get(st.num_generated)))
        t0e = time.perf_counter()
        for _ in range(dispatches):
            st = chain(p, st, per)
            small = jax.device_get((st.active, st.finish, st.num_generated, st.steps,
                                    st.accepted))
        eng_s = time.perf_counter() - t0e
        del st
        gen = int(np.sum(small[2])) - gen0
        row["idle_fraction"] = max(0.0, 1 - one_s / eng_s)
        row["oracle_tokens_per_s"] = gen / eng_s
        row["oracle_tokens_per_step"] = gen / b / steps
        row["plain_tokens_per_s"] = b / (row["none_step_ms"] / 1e3)
        e = 1 + sum(acceptance) if acceptance else None
        row["projected_tokens_per_s"] = b * e / (row["chain_step_ms"] / 1e3) if e else None
        out.append(row)
        log(json.dumps(row))
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "bench_decode_rows.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,8,64")
    ap.add_argument("--ctxs", default="1024,4096")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--acceptance", default="checkpoints/acceptance_bf16.json",
                    help="JSON with the shipped model's acceptance per depth (chain, K=3)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mimo-7b")
    ap.add_argument("--kv-dtype", default="model",
                    help="comma list of KV page dtypes to run side by side: model (the "
                         "model's dtype, the default) and fp8 (scales calibrated on the "
                         "oracle model)")
    ap.add_argument("--weights", default="bf16",
                    help="comma list of bf16 (as built) and quantization modes "
                         "(int8, fp8, fp8-block), each timed in this run")
    ap.add_argument("--mesh", help="tp=N,dp=M: shard the model (tensor parallel) and slots")
    ap.add_argument("--draft-vocab", default="0",
                    help="comma list of reduced draft vocabulary sizes to run (0: the full "
                         "vocabulary); the set is ids 0..N-1, so oracle drafts outside it are "
                         "rejected: read the draft time and the projection, not the oracle")
    ap.add_argument("--draft-head", default="none",
                    help="comma list of the draft's head copies to run: none, or a "
                         "quantization mode (mtp_jax.with_draft_head: read at batches up to "
                         "64 slots)")
    ap.add_argument("--sampled-steps", action="store_true",
                    help="also time the step programs with the sampled rows' paths (the "
                         "engine's for batches with a sampled row; on a CPU, always)")
    ap.add_argument("--fixed-trip", action="store_true",
                    help="also time the steps in a loop of a static trip count (no predicate "
                         "read between steps) beside the engine's while loop")
    ap.add_argument("--page-sizes", default="16",
                    help="comma list of KV page sizes (tokens a page) to run")
    ap.add_argument("--steps-only", action="store_true",
                    help="time only the plain and speculative steps (skip verify / draft)")
    ap.add_argument("--profile", action="store_true", help="trace one call of each step "
                    "program and print its kernel time per step by kind, device idle "
                    "included (launch/profile_trace.py)")
    ap.add_argument("--step-gemms", choices=("triton", "cublas"),
                    help="the steps' dense matmuls on a GPU (EngineConfig.step_gemms; "
                         "default: by rows)")
    args = ap.parse_args(argv)
    args.kv_dtypes = [None if x == "model" else x for x in args.kv_dtype.split(",")]
    if set(args.kv_dtypes) - {None, "fp8"}:
        ap.error(f"--kv-dtype {args.kv_dtype!r}: choose from model, fp8")
    return args


def main(argv=None):
    args = parse_args(argv)
    kv_dtypes = args.kv_dtypes
    cfg = ModelConfig(**(TINY if args.tiny else SHAPES[args.shape]))
    dtype = jnp.dtype(cfg.dtype)
    acceptance = None
    if os.path.exists(args.acceptance):
        with open(args.acceptance) as f:
            data = json.load(f)
        acc = data.get("methods", data)
        best = max(acc, key=lambda m: acc[m].get("mean_accepted_length", 0))
        acceptance = acc[best]["acceptance_per_depth"]
        log(f"shipped-model acceptance per depth ({best}): {acceptance}")
    dev = jax.devices()[0]
    log(f"device {dev.device_kind}, jax {jax.__version__}")
    bw = copy_bandwidth() if jax.default_backend() == "gpu" else {"none": float("nan")}
    best_bw = max(bw.values())
    log(f"copy bandwidth {bw}")
    t0 = time.perf_counter()
    mesh = make_mesh(args.mesh)
    base = oracle_model(cfg, dtype)
    log(f"model {cfg.num_params / 1e9:.2f} B params built in {time.perf_counter() - t0:.1f}s")
    if "fp8" in kv_dtypes:  # read only by engines with fp8 pages
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 256)).tolist()
        base.kv_scales = calibrate_kv_scales(base, ids)
    rows = []
    variants = [(w, int(n), h, kv) for w in args.weights.split(",")
                for n in args.draft_vocab.split(",") for h in args.draft_head.split(",")
                for kv in kv_dtypes]
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    for weights, n_draft, draft_head, kv_dtype in variants:
        kv_bytes = 1 if kv_dtype == "fp8" else dtype.itemsize
        kv_tok = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_bytes
        model = base if weights in ("bf16", "f32", "none") else quantize_model(base, weights)
        if n_draft:
            model = with_draft_vocab(model, np.arange(n_draft))
        model = with_draft_head(model, draft_head)
        model = dataclasses.replace(model, params=shard_params(model.params, mesh))
        jax.block_until_ready(model.params)
        tw = weight_bytes(model, ("target",))
        mtp_w = weight_bytes(model, ("mtp",))
        embed = next(v.get_value() for path, v in model.params.flat_state()
                     if tuple(path) == ("target", "embed"))
        head_w = held_bytes(embed) if model.config.tie_word_embeddings else weight_bytes(
            model, ("target", "lm_head"))
        if n_draft:  # the draft reads its reduced heads, not the target lm_head
            head_w = weight_bytes(model, ("draft_vocab",)) / len(
                model.module().draft_vocab.heads)
        # ... and their quantized copy at batches of few enough rows
        copy_w = (weight_bytes(model, ("draft_heads",)) / len(model.module().draft_heads)
                  if model.config.draft_head else None)
        log(f"weights {weights}: target {tw / 1e9:.2f} GB, MTP {mtp_w / 1e9:.2f} GB"
            + (" per device" if mesh is not None else ""))
        for b, page in [(int(x), p) for x in args.batches.split(",") for p in page_sizes]:
            for row in bench_batch(model, b, [int(x) for x in args.ctxs.split(",")],
                                   args.steps, dtype, acceptance, mesh, args.steps_only,
                                   kv_dtype, args.profile, args.step_gemms, page,
                                   args.fixed_trip, args.sampled_steps):
                ctx = row["ctx"]
                row["kv_dtype"] = (kv_dtype or str(dtype)) + (
                    f" p{page}" if page_sizes != [16] else "")
                kv = b * ctx * kv_tok * kv_share(mesh, cfg, b)  # one device's
                plain_bytes = tw + kv
                with use_mesh(mesh):  # the rule the model reads the copy by
                    copied = copy_w is not None and reads_head_copy(b)
                read = copy_w if copied else head_w
                draft_bytes = mtp_w + K * read + K * kv / cfg.num_layers
                row["weights"] = (weights + (f" dv{n_draft}" if n_draft else "")
                                  + (f" dh-{draft_head}" if model.config.draft_head else ""))
                row["plain_limit_ms"] = plain_bytes / best_bw * 1e3
                row["plain_pct_of_limit"] = row["plain_limit_ms"] / row["none_step_ms"] * 100
                row["draft_limit_ms"] = draft_bytes / best_bw * 1e3
                if "verify4_ms" in row:
                    row["verify_ratio"] = row["verify4_ms"] / row["none_step_ms"]
                    row["draft_pct_of_limit"] = row["draft_limit_ms"] / row["draft_ms"] * 100
                row["oracle_speedup"] = row["oracle_tokens_per_s"] / row["plain_tokens_per_s"]
                if row["projected_tokens_per_s"]:
                    row["projected_speedup"] = (row["projected_tokens_per_s"]
                                                / row["plain_tokens_per_s"])
                rows.append(row)
        del model
    head_md = ("| weights | KV | B | ctx | plain ms (limit, %) | verify(4) / plain | "
               "draft ms (limit, %) | idle | plain tok/s | oracle spec tok/s (x) | "
               "projected tok/s (x) |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    def opt(r, fmt, *keys):
        return fmt.format(*[r[k] for k in keys]) if all(k in r for k in keys) else "n/a"

    md = head_md + "".join(
        f"| {r['weights']} | {r['kv_dtype']} | {r['batch']} | {r['ctx']} | "
        f"{r['none_step_ms']:.2f} "
        f"({r['plain_limit_ms']:.2f}, "
        f"{r['plain_pct_of_limit']:.0f} %) | {opt(r, '{:.2f}', 'verify_ratio')} | "
        + opt(r, "{:.2f} ({:.2f}, {:.0f} %)", "draft_ms", "draft_limit_ms", "draft_pct_of_limit")
        + " | "
        f"{r['idle_fraction'] * 100:.1f} % | {r['plain_tokens_per_s']:.0f} | "
        f"{r['oracle_tokens_per_s']:.0f} ({r['oracle_speedup']:.2f}) | "
        + (f"{r['projected_tokens_per_s']:.0f} ({r['projected_speedup']:.2f})"
           if r.get("projected_speedup") else "n/a") + " |\n" for r in rows)
    log("\n" + md)
    out = os.environ.get("OUT")
    if out:
        meta = dict(device=dev.device_kind, jax=jax.__version__, copy_bandwidth=bw,
                    config=dataclasses.asdict(cfg), acceptance=acceptance,
                    argv=sys.argv)
        with open(os.path.join(out, "bench_decode.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1, default=str)
        with open(os.path.join(out, "bench_decode.md"), "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
