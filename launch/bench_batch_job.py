"""A batch job end to end through the Engine: where the time goes (prefill vs decode).

  PYTHONPATH=. python launch/bench_batch_job.py [--requests 96] [--prompt-len 1024]
      [--new-tokens 256] [--spread 0.75] [--max-batch 32] [--methods none,chain] [--k 3]
      [--shape mimo-7b]
      [--prefill-chunk 256] [--prefill-batch 1,8] [--max-tokens 4096] [--kv-pages N]
      [--pages on-demand,reserve] [--job-programs] [--profile] [--reps 2] [--tiny]
      [--draft-head none,int8] [--shared-prefix 768] [--prefix-cache off,on] [--model DIR]

The 7-8B shape of launch/bench_decode.py with its oracle weights (every draft agrees),
`requests` random prompts of `prompt-len` tokens and `new-tokens` new tokens each, one
engine per method and prefill batch (requests prefilled together: 1 is one request per
prefill forward, the baseline that batched prefill is measured against; `auto` the
engine's default), compiled and
warmed up first, compile reported apart; the job run through `Engine.generate`, best of
--reps. Reported per run:
- wall seconds and generated tokens/s;
- admission seconds: time in admission (prompt prefill, MTP history prefill, first token),
  each admission round followed by a wait for its device work so that it is timed on its
  own (the engine itself overlaps it with nothing either: decoding slots wait meanwhile);
  decode seconds: the dispatches' time;
- prefill tokens/s and its FLOP rate, 2 x (target matmul params + MTP matmul params for
  speculative methods) per prompt token plus causal attention (2 x 2 x layers x q-heads x
  head_dim x L^2 / 2 per prompt), against the bf16 dense peak of the card when known;
- slot idle share: 1 - (sum over dispatches of running slots x dispatch seconds) /
  (max_batch x wall): the slot-time spent waiting on admissions, on the job's ragged end,
  and on the host;
- requests in flight at most, and preemptions.
`--spread S` draws each request's output length uniformly from new-tokens x [1 - S, 1 + S]
(one fixed draw), so requests end at different times and slots free up one by one, as in
a job of real prompts; without it every request of a wave ends together.
`--max-tokens M` (> new-tokens) gives every request a budget of M tokens and a stop id
that ends it after about `new-tokens` (the oracle's token `new-tokens` steps after its
prompt, so it stops there unless that token comes up earlier). With `--kv-pages N` (a pool
smaller than every slot's max_model_len), `--pages on-demand,reserve` compares the
engine's pages on demand with the rule of reserving prompt + max_tokens + K at admission.
`--shared-prefix N` makes the first N tokens of every prompt the same (a system prompt or a
few-shot header; the rest stays random), and `--prefix-cache on,off` runs each
configuration with and without prefix caching (every rep starts with an empty cache, so
only what the job itself shares is reused); a run with the cache reports its cached
prompt tokens, its peak pages (shared pages once, and counted per request) and its
admission and wall time over the same configuration's run without it.
With $OUT set, writes bench_batch_job.json there, each run's tokens as a sha256 digest
(`tokens_sha256`) that runs of other processes compare with.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import itertools
import json
import os
import sys
import tempfile
import time
from typing import Optional

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import SHAPES, TINY, oracle_model, oracle_perm  # noqa: E402
import profile_trace  # noqa: E402

from mtp_jax.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig  # noqa: E402
from mtp_jax.checkpoint import load, with_draft_head  # noqa: E402
from mtp_jax.engine import Engine, Request  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core FLOP/s (SXM)


class TimedEngine(Engine):
    """The engine, with admission rounds and decode dispatches timed apart."""

    job_chunks = None  # set: warm up only the prefill chunk lengths in it

    def _fill_slots(self, out):
        before = self.sched.admissions
        t0 = time.perf_counter()
        super()._fill_slots(out)
        if self.sched.admissions != before:
            jax.block_until_ready(self.state)
            self.stats["admit_seconds"] += time.perf_counter() - t0
            self.stats["admitted"] += self.sched.admissions - before

    def prefill_programs(self):
        keep = self.job_chunks
        return [(r, c) for r, c in super().prefill_programs() if keep is None or c in keep]

    def _collect(self):
        running = sum(x is not None for x in self.slots)
        t0 = time.perf_counter()
        done = super()._collect()
        self.stats["slot_seconds"] += running * (self._ready - self._t_dispatch)
        self.stats["collect_seconds"] += time.perf_counter() - t0
        return done

    def stream(self, requests):
        progs, owner = self.progs, self

        class Timed:  # the programs, with the launch time of each dispatch noted
            def __getattr__(self, name):
                return getattr(progs, name)

            def steps(self, kind, sampled=True):
                fn = progs.steps(kind, sampled)

                def call(*a):
                    owner._t_dispatch = time.perf_counter()
                    return fn(*a)
                call._cache_size = fn._cache_size
                return call

        self.progs = Timed()
        try:
            yield from super().stream(requests)
        finally:
            self.progs = progs


def matmul_params(cfg: ModelConfig, mtp: bool) -> int:
    """Parameters a prompt token multiplies through (no embedding gather, no lm_head: the
    prefill computes logits for the last position only)."""
    per_layer = sum(cfg.block_params(i) for i in range(cfg.num_layers))
    if not mtp:
        return per_layer
    d = cfg.hidden_size
    return per_layer + sum(cfg.block_params(cfg.num_layers + k) + 2 * d * d
                           for k in range(cfg.num_mtp_modules))


def prefill_flops(cfg: ModelConfig, prompt_len: int, mtp: bool, cached: int = 0) -> float:
    """FLOPs of a prompt's prefill after its first `cached` positions (prefix cache)."""
    layers = cfg.num_layers + (cfg.num_mtp_modules if mtp else 0)
    attn = 2 * 2 * layers * cfg.num_heads * cfg.head_dim * (prompt_len ** 2 - cached ** 2) / 2
    return 2 * matmul_params(cfg, mtp) * (prompt_len - cached) + attn


class ReservingEngine(TimedEngine):
    """Admission reserves every position a request may write (prompt + max_tokens + K),
    the baseline for pages on demand: nothing grows, nothing is preempted."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sched.admit_tokens = self.sched.reserve_tokens


def new_tokens(args) -> list:
    """Tokens each request generates: new-tokens, or with --spread S uniform in
    new-tokens x [1 - S, 1 + S] (a fixed draw), so that requests end at different times."""
    u = np.random.default_rng(1).uniform(-1, 1, args.requests)
    return [max(1, round(args.new_tokens * (1 + args.spread * x))) for x in u]


def requests(cfg: ModelConfig, args, prompts) -> list:
    """The job's requests; with --max-tokens, each stops on the oracle's token new-tokens
    steps after its prompt's last one."""
    if args.max_tokens is None:
        return [Request(i, p, SamplingParams(max_tokens=n))
                for i, (p, n) in enumerate(zip(prompts, new_tokens(args)))]
    perm = np.asarray(oracle_perm(cfg))
    out = []
    for i, (p, n) in enumerate(zip(prompts, new_tokens(args))):
        t = p[-1]
        for _ in range(n):
            t = int(perm[t])
        out.append(Request(i, p, SamplingParams(max_tokens=args.max_tokens,
                                                stop_token_ids=(t,))))
    return out


def job_chunks(eng: Engine, prompt_len: int, shared: int = 0) -> set:
    """The prefill chunk lengths a job of prompt_len-token prompts runs (target and MTP
    history chunks, any row count, from position 0 and, with a prefix cache, from the end
    of the blocks a `shared`-token prefix gives: those below both the history end and
    shared - K, prefix_cache.py): the engine's own chunk plan."""
    k, ps = eng.spec.k, eng.config.page_size
    starts = {0}
    if eng.sched.cache is not None and shared:
        starts.add(max(0, min(prompt_len - 1 - k, shared - k)) // ps * ps)
    return {c for r in eng.row_buckets() for end in (prompt_len, prompt_len - 1 - k)
            for start in starts for c, _, _ in eng.chunks(np.full((r,), end, np.int32),
                                                         np.full((r,), start, np.int32))}


def run_job(model, method, k, rows, rule, args, prompts, cache: bool = True):
    cfg = model.config
    eng_cfg = EngineConfig(max_batch=args.max_batch,
                           max_model_len=args.prompt_len + (args.max_tokens or max(
                               new_tokens(args))) + 8, num_pages=args.kv_pages,
                           prefill_chunk=args.prefill_chunk, prefill_batch=rows,
                           step_gemms=args.step_gemms, prefix_cache=cache)
    t0 = time.perf_counter()
    kind = ReservingEngine if rule == "reserve" else TimedEngine
    eng = kind(model, SpecConfig(method, num_speculative_tokens=k), eng_cfg)
    if args.job_programs:
        eng.job_chunks = job_chunks(eng, args.prompt_len, args.shared_prefix)
    eng.warmup()
    compile_s = time.perf_counter() - t0
    reqs = requests(cfg, args, prompts)
    best = None
    for _ in range(args.reps):
        eng.reset_control()
        eng.clear_prefix_cache()
        eng.stats.clear()
        t0 = time.perf_counter()
        res = eng.generate(reqs)
        wall = time.perf_counter() - t0
        if best is None or wall < best["wall_s"]:
            st = dict(eng.stats)
            gen = sum(len(r.token_ids) for r in res)
            flops = sum(prefill_flops(cfg, args.prompt_len, method != "none",
                                      r.num_cached_prompt_tokens) for r in res)
            computed = sum(args.prompt_len - r.num_cached_prompt_tokens for r in res)
            best = {
                "method": method, "k": k, "draft_head": cfg.draft_head,
                "prefill_batch": eng.config.prefill_batch,
                "prefill_chunk": eng.config.prefill_chunk,
                "pages": rule, "preemptions": st.get("preemptions", 0),
                "prefix_cache": cache,
                "cached_prompt_tokens": sum(r.num_cached_prompt_tokens for r in res),
                "peak_pages": st.get("peak_pages", 0),
                "peak_pages_per_request": st.get("peak_pages_per_request", 0),
                "finish_reasons": sorted(collections.Counter(
                    r.finish_reason for r in res).items()),
                "compile_s": compile_s, "wall_s": wall,
                "generated_tokens": gen, "tokens_per_s": gen / wall,
                "admit_s": st.get("admit_seconds", 0.0),
                "decode_s": st.get("dispatch_seconds", 0.0),
                "dispatches": st.get("dispatches", 0),
                "prefill_tokens_per_s": computed  # the prompt tokens prefilled, not cached
                / max(st.get("admit_seconds", 0.0), 1e-9),
                "prefill_flop_per_s": flops / max(st.get("admit_seconds", 0.0), 1e-9),
                "slot_idle_share": 1 - st.get("slot_seconds", 0.0) / (args.max_batch * wall),
                "max_running": st.get("max_running", 0),
                "schedule": eng.control.summary() if eng.control is not None else None,
                "tokens": [r.token_ids for r in res]}
    if args.profile:
        best["admission_profile"] = profile_admission(eng, reqs)
    del eng
    return best


def profile_admission(eng: Engine, reqs: list) -> Optional[dict]:
    """Trace the admission of one wave (max_batch requests of the job, 1 token each: the
    prefill, the MTP history and the first token, prefill_batch requests a round, rounds
    back to back as in the job) and print where its device time goes, per round, with the
    idle time between programs (dispatches) and inside them."""
    batch = [Request(r.id, r.prompt_ids, SamplingParams(max_tokens=1))
             for r in reqs[: eng.config.max_batch]]
    eng.generate(batch)  # any first-call cost outside the trace
    folder = tempfile.mkdtemp(prefix="trace_")
    with profile_trace.traced(folder):
        eng.generate(batch)
        jax.block_until_ready(eng.state)
    table = profile_trace.breakdown(folder)
    rounds = -(-len(batch) // eng.config.prefill_batch)
    print(profile_trace.render(table, per=rounds, unit=f"admission round of "
                               f"{eng.config.prefill_batch} x {len(batch[0].prompt_ids)} "
                               f"tokens ({rounds} rounds traced)"), flush=True)
    return table


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--prefill-batch", default="auto",
                    help="comma list of requests prefilled together (ints or auto)")
    ap.add_argument("--methods", default="none,chain")
    ap.add_argument("--spread", type=float, default=0.0, help="new tokens per request "
                    "uniform in new-tokens x [1 - spread, 1 + spread] (requests end apart)")
    ap.add_argument("--max-tokens", type=int, help="budget per request, stopping near "
                    "--new-tokens on a stop id (default: --new-tokens, no stop id)")
    ap.add_argument("--kv-pages", type=int, help="KV pool pages (default: every slot's "
                    "max_model_len)")
    ap.add_argument("--pages", default="on-demand",
                    help="comma list of page rules: on-demand (the engine), reserve")
    ap.add_argument("--job-programs", action="store_true", help="warm up only the prefill "
                    "chunk lengths the job's prompts use (shorter compiles; the engine's "
                    "own warmup compiles every bucket)")
    ap.add_argument("--profile", action="store_true", help="trace one wave's admission "
                    "rounds per run and print their kernel time by kind and their idle "
                    "time (launch/profile_trace.py)")
    ap.add_argument("--k", default="3", help="K of the speculative methods (an int or auto)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mimo-7b")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--step-gemms", choices=("triton", "cublas"),
                    help="the decode steps' dense matmuls on a GPU (EngineConfig.step_gemms; "
                         "default: by rows)")
    ap.add_argument("--draft-head", default="none",
                    help="comma list of the speculative methods' draft-head copies: none, or "
                         "a quantization mode (mtp_jax.with_draft_head)")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="tokens every prompt starts with (the same in all)")
    ap.add_argument("--prefix-cache", default="on",
                    help="comma list: on (the engine's default), off")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--model", help="a checkpoint folder (e.g. checkpoints/) instead of the "
                    "shape's oracle weights: its own drafts, random prompts of its vocabulary")
    args = ap.parse_args(argv)
    if args.model and args.max_tokens is not None:
        ap.error("--max-tokens stops on the oracle's tokens: not with --model")
    bad = set(args.prefix_cache.split(",")) - {"on", "off"}
    if bad or not 0 <= args.shared_prefix <= args.prompt_len:
        ap.error("--prefix-cache takes on and off; --shared-prefix 0..--prompt-len")
    bad = set(args.pages.split(",")) - {"on-demand", "reserve"}
    if bad:
        ap.error(f"--pages: {sorted(bad)}; choose from on-demand, reserve")
    dev = jax.devices()[0]
    peak = next((v for name, v in PEAK_BF16.items() if name in dev.device_kind), None)
    print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
    if args.model:
        model = load(args.model)
        cfg = model.config
    else:
        cfg = ModelConfig(**(TINY if args.tiny else SHAPES[args.shape]))
        model = oracle_model(cfg, jnp.dtype(cfg.dtype))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.requests, args.prompt_len))
    prompts[:, : args.shared_prefix] = prompts[0, : args.shared_prefix]
    prompts = prompts.tolist()
    k = args.k if args.k == "auto" else int(args.k)
    out = os.environ.get("OUT")
    runs, want = [], None
    heads = {}
    for rows, rule, m, head, cache in itertools.product(
            args.prefill_batch.split(","), args.pages.split(","), args.methods.split(","),
            args.draft_head.split(","), sorted(args.prefix_cache.split(","), key="off".__ne__)):
        if m == "none" and head != args.draft_head.split(",")[0]:
            continue  # no draft: one run
        if m != "none" and head not in heads:
            heads[head] = with_draft_head(model, head)
        r = run_job(model if m == "none" else heads[head], m, 1 if m == "none" else k,
                    None if rows == "auto" else int(rows), rule, args, prompts, cache == "on")
        tokens = r.pop("tokens")
        # a digest, so that jobs of separate processes (say, two kernel backends) compare
        r["tokens_sha256"] = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
        if want is None:
            want = tokens
        else:
            r["same_tokens_as_first"] = tokens == want
        runs.append(r)
        same = ("method", "k", "draft_head", "prefill_batch", "pages")
        off = [x for x in runs if not x["prefix_cache"]
               and all(x[n] == r[n] for n in same)]
        report(r, runs[0], peak, off[0] if off and r["prefix_cache"] else None)
        if out:  # after every run: a later one may not finish in the time given
            with open(os.path.join(out, "bench_batch_job.json"), "w") as f:
                json.dump({"device": dev.device_kind, "jax": jax.__version__,
                           "args": vars(args), "peak_bf16_flop_per_s": peak,
                           "runs": runs}, f, indent=1)


def report(r: dict, first: dict, peak, uncached: Optional[dict] = None) -> None:
    """Print a run; `uncached`: the same configuration's run without the prefix cache."""
    r["vs_first"] = first["wall_s"] / r["wall_s"]
    if uncached is not None:
        r["admit_vs_uncached"] = r["admit_s"] / max(uncached["admit_s"], 1e-9)
        r["wall_vs_uncached"] = r["wall_s"] / uncached["wall_s"]
    r["prefill_pct_of_peak"] = (100 * r["prefill_flop_per_s"] / peak) if peak else None
    print(f"{r['method']} K={r['k']}"
          + (f" draft head {r['draft_head']}" if r.get("draft_head") else "")
          + f" prefill batch {r['prefill_batch']} x chunk "
          f"{r['prefill_chunk']}, pages {r['pages']}: wall "
          f"{r['wall_s']:.2f} s ({r['vs_first']:.2f}x the first), {r['tokens_per_s']:.0f} "
          f"generated tok/s; admission {r['admit_s']:.2f} s "
          f"({100 * r['admit_s'] / r['wall_s']:.0f} %), decode {r['decode_s']:.2f} s in "
          f"{r['dispatches']} dispatches; prefill {r['prefill_tokens_per_s']:.0f} tok/s, "
          f"{r['prefill_flop_per_s'] / 1e12:.0f} TFLOP/s"
          + (f" ({r['prefill_pct_of_peak']:.0f} % of peak)" if peak else "")
          + f"; slot idle {100 * r['slot_idle_share']:.0f} %; in flight at most "
          f"{r['max_running']}, {r['preemptions']} preemptions, finished "
          f"{dict(r['finish_reasons'])}"
          + ("" if "same_tokens_as_first" not in r else
             f"; tokens {'==' if r['same_tokens_as_first'] else '!='} the first's")
          + f"; compile {r['compile_s']:.0f} s"
          + (f"; prefix cache: {r['cached_prompt_tokens']} prompt tokens cached, peak pages "
             f"{r['peak_pages']} ({r['peak_pages_per_request']} counted per request)"
             if r["prefix_cache"] else "; no prefix cache")
          + (f", admission {r['admit_vs_uncached']:.2f}x and wall {r['wall_vs_uncached']:.2f}x"
             " the run without it" if "admit_vs_uncached" in r else "")
          + (f"; {r['schedule']}" if r["schedule"] else ""), flush=True)


if __name__ == "__main__":
    main()
