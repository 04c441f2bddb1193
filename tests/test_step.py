"""The speculative step end to end: lossless greedy, oracle drafts, sampling, seeds.

Engines are compiled once per (layout, method, K) and reused across models with the same
config (programs depend on the config, not the weights).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SamplingParams, SpecConfig
from mtp_jax.engine import Engine, Request
from mtp_jax.layers import causal_attend
from mtp_jax.reference import generate_reference
from mtp_jax.sampling import accept

from spec_models import markov_model

MAX_LEN = 96
ENGINE = EngineConfig(max_batch=3, max_model_len=MAX_LEN, page_size=8, prefill_chunk=16,
                      steps_per_dispatch=6)
# Prompt lengths around page boundaries (page 8) and a long one; mixed budgets; the last
# request runs into max_model_len.
LENGTHS = (3, 8, 9, 17, 30, 80)
BUDGETS = (12, 33, 7, 25, 20, 40)
METHODS = [(m, k) for m in ("chain", "window", "eagle", "per_step") for k in (1, 2, 3)]

_engines: dict = {}


def engine_for(model, layout, method, k, **kw) -> Engine:
    kw = {n: v for n, v in kw.items() if v is not None}  # None: the default
    key = (layout, method, k, tuple(sorted(kw.items())))
    if key not in _engines:
        cfg = ENGINE if not kw else EngineConfig(**{**ENGINE.__dict__, **kw})
        _engines[key] = Engine(model, SpecConfig(method=method, num_speculative_tokens=k), cfg)
    eng = _engines[key]
    eng.model = model  # same config, other weights: the compiled programs still apply
    return eng


@pytest.fixture(scope="module")
def models():
    return {layout: markov_model(layout, target_noise=0.5, mtp_noise=0.2, seed=1)
            for layout in ("mimo", "deepseek_v3")}


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 61, size=n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def references(models, prompts):
    out = {}
    for layout, model in models.items():
        out[layout] = [generate_reference(model, p, SamplingParams(max_tokens=b), max_len=MAX_LEN)
                       for p, b in zip(prompts, BUDGETS)]
    return out


def near_tie_report(model, prompt, got, want):
    """Where greedy outputs first differ, the reference's top-2 logit gap there."""
    j = next(i for i, (a, b) in enumerate(zip(got + [-1], want + [-2])) if a != b)
    seq = jnp.asarray([prompt + want[:j]], jnp.int32)
    m = model.module()
    pos = jnp.arange(seq.shape[1])[None]
    normed, _ = m.target(seq, pos, causal_attend(pos))
    logits = np.asarray(m.target.head(normed))[0, -1]
    top = np.sort(logits)[::-1]
    return (f"first difference at generated index {j}: got {got[j:j + 3]}, want "
            f"{want[j:j + 3]}; reference top-2 logits {top[0]:.5f} / {top[1]:.5f} "
            f"(gap {top[0] - top[1]:.2e}: a near-tie if tiny, otherwise a bug)")


@pytest.mark.parametrize("layout", ["mimo", "deepseek_v3"])
@pytest.mark.parametrize("method,k", METHODS)
def test_greedy_lossless(models, prompts, references, layout, method, k):
    model = models[layout]
    eng = engine_for(model, layout, method, k)
    reqs = [Request(i, p, SamplingParams(max_tokens=b)) for i, (p, b) in
            enumerate(zip(prompts, BUDGETS))]
    results = eng.generate(reqs)
    accepted = 0
    for req, res, (want, reason) in zip(reqs, results, references[layout]):
        assert res.token_ids == want, near_tie_report(model, req.prompt_ids, res.token_ids, want)
        assert res.finish_reason == reason
        accepted += sum(res.accepted_per_depth)
    assert results[-1].finish_reason == "length"
    assert len(prompts[-1]) + len(results[-1].token_ids) == MAX_LEN
    assert accepted > 0  # the partial-acceptance model exercises real rollbacks


@pytest.mark.parametrize("method,k", [("chain", 3), ("per_step", 3)])
def test_batched_prefill_lossless(models, prompts, references, method, k):
    """Requests admitted together are prefilled as rows of one forward (rows padded to a
    power of two, prompts of 3..80 tokens, so rows run out of chunks at different times):
    the same tokens, steps and acceptance as one request per prefill, no recompile."""
    model = models["deepseek_v3"]
    one = engine_for(model, "deepseek_v3", method, k)
    eng = engine_for(model, "deepseek_v3", method, k, max_batch=6, prefill_batch=4)
    eng.warmup()
    assert eng.row_buckets() == [1, 2, 4]
    before = eng.cache_sizes()
    reqs = [Request(i, p, SamplingParams(max_tokens=b)) for i, (p, b) in
            enumerate(zip(prompts, BUDGETS))]
    assert "prefill_mtp" not in before  # the history runs in the target chunk's program
    got, want = eng.generate(reqs), one.generate(reqs)
    for req, g, w, (ref, reason) in zip(reqs, got, want, references["deepseek_v3"]):
        assert g.token_ids == ref, near_tie_report(model, req.prompt_ids, g.token_ids, ref)
        assert (g.finish_reason, g.num_steps, g.accepted_per_depth) == (
            reason, w.num_steps, w.accepted_per_depth)
    assert eng.cache_sizes() == before


def test_hidden_ring_matches_the_whole_prompt_scratch(prompts, monkeypatch):
    """The hidden scratch keeps only the latest chunk + K + 1 positions of a row (a ring a
    later request reuses): the same tokens, steps and acceptance per depth as an engine
    that keeps every position, for prompts of 1..80 tokens (several chunks; shorter than
    the K+1-position draft window, after long ones that filled the ring) in one row."""
    from mtp_jax.step import Static

    # MTP modules that lean on the hidden as much as on the token: a wrong hidden changes
    # the drafts, and so the steps and acceptance
    model = markov_model("deepseek_v3", target_noise=0.5, mtp_noise=1.0, seed=1)
    eng = engine_for(model, "deepseek_v3", "chain", 3)
    assert eng.static.hidden_ring == ENGINE.prefill_chunk + 4
    assert eng.state.prefill_hidden.shape[1] == eng.static.hidden_ring
    reqs = [Request(i, p, SamplingParams(max_tokens=12)) for i, p in enumerate(
        [prompts[5], [7, 3], prompts[4], [9], prompts[3], [4, 4, 1]])]
    got = eng.generate(reqs)
    monkeypatch.setattr(Static, "hidden_ring", property(lambda self: None))
    whole = Engine(model, SpecConfig("chain", num_speculative_tokens=3), ENGINE)
    assert whole.state.prefill_hidden.shape[1] == whole.static.scratch_len
    want = whole.generate(reqs)
    assert [(r.token_ids, r.num_steps, r.accepted_per_depth) for r in got] == [
        (r.token_ids, r.num_steps, r.accepted_per_depth) for r in want]


def test_prefill_programs_skip_chunks_bound_by_weight_reads(models):
    """A forward of r rows runs chunks of at least 256 / r tokens (shorter ones would cost
    as much): 14 prefill programs for 8 rows and chunks 16..256, not 20. Nothing compiles
    here."""
    eng = Engine(models["mimo"], SpecConfig("chain", num_speculative_tokens=1), EngineConfig(
        max_batch=8, max_model_len=512, prefill_chunk=256, prefill_batch=8))
    assert eng.row_buckets() == [1, 2, 4, 8]
    assert eng.prefill_programs() == (
        [(1, c) for c in (16, 32, 64, 128, 256)] + [(2, 128), (2, 256)]
        + [(4, c) for c in (64, 128, 256)] + [(8, c) for c in (32, 64, 128, 256)])
    chunk = eng.runner.chunk
    assert (chunk(1, 5), chunk(8, 5), chunk(2, 300), chunk(4, 100)) == (16, 32, 256, 128)
    # window reads K hiddens past each position: its history runs a chunk program of its own
    assert [Engine(models["mimo"], SpecConfig(m, num_speculative_tokens=2), EngineConfig(
        max_batch=2, max_model_len=64)).static.history_in_target
        for m in ("chain", "window", "eagle", "per_step")] == [True, False, True, True]
    small = Engine(models["mimo"], SpecConfig("chain", num_speculative_tokens=1),
                   EngineConfig(max_batch=3, max_model_len=64, prefill_chunk=256))
    assert small.config.prefill_batch in (1, 4)  # 1 on CPU; never more rows than slots
    assert small.buckets() == [16, 32, 64]


@pytest.mark.parametrize("method", ["chain", "window", "eagle", "per_step"])
def test_target_hidden_source_lossless(prompts, method):
    model = markov_model("mimo", target_noise=0.5, mtp_noise=0.2, seed=2,
                         mtp_hidden_source="target")
    eng = engine_for(model, "mimo-target", method, 2)
    results = eng.generate([Request(i, p, SamplingParams(max_tokens=b))
                            for i, (p, b) in enumerate(zip(prompts[:4], BUDGETS))])
    for p, b, res in zip(prompts, BUDGETS, results):
        want, _ = generate_reference(model, p, SamplingParams(max_tokens=b), max_len=MAX_LEN)
        assert res.token_ids == want, near_tie_report(model, p, res.token_ids, want)


@pytest.mark.parametrize("method", ["chain", "window", "eagle", "per_step"])
def test_oracle_draft_always_agrees(prompts, method):
    k, budget = 3, 33
    model = markov_model("deepseek_v3", agree=True, seed=1)
    eng = engine_for(model, "deepseek_v3", method, k)
    res = eng.generate([Request(0, prompts[2], SamplingParams(max_tokens=budget))])[0]
    assert res.acceptance_per_depth == [1.0] * k
    # the prefill yields one token, every step K + 1
    assert res.num_steps == math.ceil((budget - 1) / (k + 1))
    assert len(res.token_ids) == budget


@pytest.mark.parametrize("method", ["chain", "window", "eagle", "per_step"])
def test_oracle_draft_never_agrees(prompts, method):
    model = markov_model("deepseek_v3", agree=False, seed=1)
    eng = engine_for(model, "deepseek_v3", method, 3)
    res = eng.generate([Request(0, prompts[2], SamplingParams(max_tokens=20))])[0]
    assert res.acceptance_per_depth == [0.0] * 3
    assert res.num_steps == 19 and res.mean_accepted_length == 1.0


def test_no_recompile_after_warmup(models, prompts):
    eng = engine_for(models["mimo"], "mimo", "chain", 3)
    job = [Request(i, p, SamplingParams(max_tokens=5, temperature=0.7, top_k=3, seed=i))
           for i, p in enumerate(prompts)]
    eng.warmup(job)
    before = eng.cache_sizes()
    eng.generate(job)
    assert eng.cache_sizes() == before


@pytest.mark.parametrize("per_dispatch", [True, False], ids=["gpu_rule", "cpu_rule"])
def test_greedy_step_programs_keep_tokens_steps_and_acceptance(models, prompts, references,
                                                              per_dispatch, monkeypatch):
    """EngineConfig.greedy_steps (on by default): dispatches whose rows are all greedy run
    step programs without the sampled rows' paths, and prefill batches whose rows are all
    greedy the first-token program without them. A greedy job, then one that mixes in a
    seeded sampled request: the same tokens, steps and acceptance as an engine that always
    runs the full programs (greedy_steps=False), each variant compiled at the warmup of
    the first job that needs it. A mixed job compiles both variants and picks one per
    dispatch under a GPU's rule (`step.greedy_dispatches`), the full one alone elsewhere."""
    import mtp_jax.programs as programs_module

    monkeypatch.setattr(programs_module, "greedy_dispatches", lambda: per_dispatch)
    model = models["deepseek_v3"]
    full = engine_for(model, "deepseek_v3", "chain", 3, greedy_steps=False)
    eng = engine_for(model, "deepseek_v3", "chain", 3, max_batch=4 if per_dispatch else None)
    assert not full.greedy_steps and eng.greedy_steps  # on by default
    greedy = [Request(i, p, SamplingParams(max_tokens=b)) for i, (p, b) in
              enumerate(zip(prompts, BUDGETS))]
    hot = Request("hot", prompts[2], SamplingParams(temperature=0.8, top_k=5, seed=7,
                                                    max_tokens=20))
    # what a warmup compiles: the variants of the queued requests and of the job it is
    # handed (generate and evaluate time their compile apart), the greedy one for none
    assert eng._step_variants() == eng._step_variants(greedy) == (False,)
    assert eng._step_variants([hot]) == (True,) and full._step_variants() == (True,)
    assert eng._step_variants(greedy + [hot]) == ((False, True) if per_dispatch else (True,))
    mixed = greedy[:2] + [hot] + greedy[4:]
    for job in (greedy, mixed, greedy[3:]):
        warm = set(eng.runner.warm_variants)
        got, want = eng.generate(job), full.generate(job)
        assert eng.runner.warm_variants == warm | set(eng._step_variants(job))
        for g, w in zip(got, want):
            assert (g.token_ids, g.finish_reason, g.num_steps, g.accepted_per_depth) == (
                w.token_ids, w.finish_reason, w.num_steps, w.accepted_per_depth)
        for req, g in zip(job, got):
            if req is not hot:
                assert g.token_ids == references["deepseek_v3"][req.id][0]
    before = eng.cache_sizes()
    eng.generate([hot] + greedy[:3])
    assert eng.cache_sizes() == before


def test_generate_run_compiles_the_jobs_variants_before_it_runs(models, prompts, monkeypatch):
    """`generate.run` (and evaluate) time the compile apart: the warmup they call before
    the job gets the job's requests, so a job that mixes greedy and sampled requests
    compiles the variant(s) it needs there (with nothing queued it would compile the
    greedy one) and nothing while it runs (the stream's own warmup finds every program)."""
    from mtp_jax.generate import run

    eng = engine_for(models["mimo"], "mimo", "chain", 2, max_batch=2)
    job = [Request(0, prompts[0], SamplingParams(max_tokens=6)),
           Request(1, prompts[1], SamplingParams(max_tokens=6, temperature=0.8, seed=3))]
    compiled = []
    warmup = eng.warmup
    monkeypatch.setattr(eng, "warmup", lambda *a: compiled.append(warmup(*a)) or compiled[-1])
    records = []
    run(eng, job, ["g", "s"], records.append, has_tokenizer=False)
    assert [r["id"] for r in sorted(records, key=lambda r: r["id"])] == ["g", "s"]
    assert eng.runner.warm_variants == set(eng._step_variants(job))
    assert compiled[0] > 0 and compiled[1:] == [0.0], compiled


def test_stop_token_and_budget(models, prompts, references):
    model = models["mimo"]
    want, _ = references["mimo"][1]
    stop = want[5]
    first = want.index(stop)
    eng = engine_for(model, "mimo", "chain", 3)
    res = eng.generate([Request(0, prompts[1], SamplingParams(max_tokens=33,
                                                              stop_token_ids=(stop,)))])[0]
    assert res.finish_reason == "stop" and res.token_ids == want[: first + 1]


# ------------------------------------------------------------------------- sampling
SAMPLE_V = 13


def _exact_marginals(model, prompt, sp: SamplingParams, depth: int):
    """Exact distributions of the first `depth` generated tokens (numpy filtering)."""
    m = model.module()

    def dist(seqs):
        seqs = jnp.asarray(seqs, jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)
        normed, _ = m.target(seqs, pos, causal_attend(pos))
        logits = np.asarray(m.target.head(normed)[:, -1], np.float64) / sp.temperature
        out = []
        for row in logits:
            order = np.argsort(-row)
            keep = np.zeros_like(row, bool)
            k = sp.top_k or len(row)
            p = np.exp(row[order[:k]] - row[order[0]])
            p /= p.sum()
            before = np.cumsum(p) - p
            keep[order[:k][before < sp.top_p]] = True
            q = np.where(keep, np.exp(row - row.max()), 0.0)
            out.append(q / q.sum())
        return np.asarray(out)

    paths = [((), 1.0)]
    marg = []
    for _ in range(depth):
        seqs = [list(prompt) + list(t) for t, _ in paths]
        probs = dist(seqs)
        mk = np.zeros(SAMPLE_V)
        nxt = []
        for (t, w), p in zip(paths, probs):
            mk += w * p
            nxt += [(t + (j,), w * p[j]) for j in range(SAMPLE_V) if w * p[j] > 1e-12]
        marg.append(mk)
        paths = nxt
    return marg


def _chi2_ok(counts, expected_p, n):
    exp = expected_p * n
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    keep = e > 0
    stat = float(((obs[keep] - e[keep]) ** 2 / e[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.09  # alpha = 0.001 (Wilson-Hilferty approximation of the chi-square quantile)
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0, max_tokens=3),
                                SamplingParams(temperature=0.8, top_k=6, top_p=0.9,
                                               max_tokens=3)],
                         ids=["t1", "t08-k6-p09"])
def test_speculative_sampling_preserves_distribution(sp):
    model = markov_model("deepseek_v3", vocab=SAMPLE_V, target_noise=0.5, mtp_noise=0.4,
                         scale=3.0, seed=4)
    eng = engine_for(model, "sample", "chain", 2, max_batch=16)
    prompt = [1, 5, 2, 7]
    n = 1200
    reqs = [Request(s, prompt, SamplingParams(**{**sp.__dict__, "seed": s})) for s in range(n)]
    results = eng.generate(reqs)
    assert all(len(r.token_ids) == 3 for r in results)
    marg = _exact_marginals(model, prompt, sp, 3)
    for d in range(3):
        counts = np.bincount([r.token_ids[d] for r in results], minlength=SAMPLE_V)
        ok, stat, crit = _chi2_ok(counts, marg[d], n)
        assert ok, f"depth {d}: chi2 {stat:.1f} >= {crit:.1f}; counts {counts}, " \
                   f"expected {np.round(marg[d] * n, 1)}"
    # the drafts were sometimes rejected, so the residual path ran
    assert 0 < sum(sum(r.accepted_per_depth) for r in results) < sum(
        r.num_steps * 2 for r in results)


@pytest.mark.parametrize("prefill_batch", [None, 8])
def test_seed_independent_of_batch_and_slot(prefill_batch):
    """Also whether the request shares its prefill forward with others (prefill_batch 8)."""
    model = markov_model("deepseek_v3", vocab=SAMPLE_V, target_noise=0.5, mtp_noise=0.4,
                         scale=3.0, seed=4)
    eng = engine_for(model, "sample", "chain", 2, max_batch=16, prefill_batch=prefill_batch)
    prompt = [1, 5, 2, 7, 3, 3, 9]
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=24)
    alone = eng.generate([Request("x", prompt, sp)])[0]
    crowd = [Request(i, prompt[: 2 + i], SamplingParams(temperature=0.9, seed=i, max_tokens=9))
             for i in range(5)]
    mixed = eng.generate(crowd[:3] + [Request("x", prompt, sp)] + crowd[3:])
    assert mixed[3].token_ids == alone.token_ids
    other = eng.generate([Request("x", prompt, SamplingParams(temperature=1.0, seed=99,
                                                              max_tokens=24))])[0]
    assert other.token_ids != alone.token_ids


def test_temperature_zero_ignores_seed(models, prompts, references):
    model = models["deepseek_v3"]
    eng = engine_for(model, "deepseek_v3", "eagle", 2)
    a, b = eng.generate([Request(0, prompts[1], SamplingParams(seed=1, max_tokens=33)),
                         Request(1, prompts[1], SamplingParams(seed=2, max_tokens=33))])
    assert a.token_ids == b.token_ids == references["deepseek_v3"][1][0]


# -------------------------------------------------------------------------- relaxed
def test_relaxed_acceptance_in_thinking_phase():
    v, begin, end = 8, 6, 7
    logits = np.full((2, 3, v), -4.0, np.float32)
    logits[:, :, 0] = 2.0  # top-1 everywhere
    logits[:, :, 1] = 1.9  # a close second
    drafts = jnp.asarray([[1, 1], [1, 1]], jnp.int32)
    zeros = jnp.zeros((2,), jnp.float32)
    args = (jnp.asarray(logits), drafts, jnp.zeros((2, 2, v)), jnp.zeros((2, 3), jnp.int32),
            jnp.zeros((2, 2), jnp.uint32), zeros, jnp.zeros((2,), jnp.int32), zeros + 1)
    n, toks, _ = accept(*args)
    assert n.tolist() == [0, 0] and toks[:, 0].tolist() == [0, 0]
    relaxed = (jnp.asarray([True, True]), jnp.asarray([True, False]), 3, 0.3, begin, end)
    n, toks, think = accept(*args, relaxed=relaxed)
    assert n.tolist() == [2, 0]  # only the request inside the thinking phase relaxes
    assert toks[0].tolist() == [1, 1, 0] and think.tolist() == [True, False]
    # an end-of-thinking draft switches relaxation off for the drafts after it
    logits[0, 0, end] = 1.95
    drafts = jnp.asarray([[end, 1], [1, 1]], jnp.int32)
    n, toks, think = accept(jnp.asarray(logits), drafts, *args[2:], relaxed=relaxed)
    assert n.tolist()[0] == 1 and think.tolist()[0] is False
    # outside the top-k or beyond delta: rejected even while thinking
    n, _, _ = accept(*args, relaxed=(relaxed[0], relaxed[1], 1, 0.3, begin, end))
    assert n.tolist() == [0, 0]
    n, _, _ = accept(*args, relaxed=(relaxed[0], relaxed[1], 3, 0.01, begin, end))
    assert n.tolist() == [0, 0]


def test_relaxed_engine_without_think_tokens_is_lossless(models, prompts, references):
    """Relaxed acceptance on, but no think token ever appears: output stays strict greedy."""
    model = models["mimo"]
    want, _ = references["mimo"][2]
    unused = [t for t in range(61) if t not in want and t not in prompts[2]]
    spec = SpecConfig(method="chain", num_speculative_tokens=2, relaxed_acceptance=True,
                      think_begin_id=unused[0], think_end_id=unused[1])
    res = Engine(model, spec, ENGINE).generate([Request(0, prompts[2],
                                                        SamplingParams(max_tokens=BUDGETS[2]))])[0]
    assert res.token_ids == want


def test_bisection_filter_equals_the_sorted_filter():
    """The CPU's top-k / top-p filter (bisection over the logits' bit patterns) keeps
    exactly the tokens the sort-based one keeps: ties, -inf logits, top-k past the
    vocabulary, top-p of 1, a tiny top-p and 0 (1e-300 in float32) included; rows that need nothing unchanged."""
    from mtp_jax import sampling as S
    rng = np.random.default_rng(1)
    r, v = 6, 1000
    bisect = jax.jit(S._filter_bisect)
    for trial in range(40):
        x = rng.normal(size=(r, v)) * rng.choice([0.5, 2, 8])
        if trial % 5 == 0:
            x[:, :50] = 3.0
        if trial % 7 == 0:
            x[:, 100:200] = -np.inf
        x = jnp.asarray(x, jnp.float32)
        k = jnp.asarray(rng.choice([0, 1, 5, 100, 256, 999, 1000, 2000], size=r), jnp.int32)
        p = jnp.asarray(rng.choice([1.0, 0.95, 0.5, 1e-9, 0.0], size=r), jnp.float32)
        need = ((k > 0) & (k < v)) | (p < 1.0)
        got = np.asarray(bisect(x, k, p, need))
        want = np.asarray(jnp.where(need[:, None], S._filter_sorted(x, k, p), x))
        np.testing.assert_array_equal(got, want)
