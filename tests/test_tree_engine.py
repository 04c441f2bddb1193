"""Draft trees end to end (SpecConfig.draft_tree): greedy output equal to plain decoding's
for static and dynamic trees with chain and eagle, the tree of branching 1 equal to the
chain, sampled output distributed as the target's, seeds independent of the batch, no
recompile after warmup, and the configurations a tree refuses.

Engines are compiled once per (model config, method, tree) and reused.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtp_jax.config import ConfigError, EngineConfig, SamplingParams, SpecConfig
from mtp_jax.engine import Engine, Request
from mtp_jax.reference import generate_reference

from mtp_jax.models import from_hf

from spec_models import markov_model, small_config
from test_mla import ds_config
from test_step import SAMPLE_V, _chi2_ok, _exact_marginals, near_tie_report

MAX_LEN = 64
ENGINE = EngineConfig(max_batch=3, max_model_len=MAX_LEN, page_size=8, prefill_chunk=16,
                      steps_per_dispatch=4)
# prompts across page boundaries (page 8), of which the 1st, 4th and 5th run (the 4th
# is one where the chain accepts nothing, a tree much); the last runs into max_model_len
LENGTHS = (3, 8, 9, 17, 40)
BUDGETS = (20, 0, 0, 25, 30)

_engines: dict = {}


def engine_for(model, key, spec: SpecConfig, **kw) -> Engine:
    full = (key, spec, tuple(sorted(kw.items())))
    if full not in _engines:
        cfg = ENGINE if not kw else EngineConfig(**{**ENGINE.__dict__, **kw})
        _engines[full] = Engine(model, spec, cfg)
    eng = _engines[full]
    eng.model = model  # same config, other weights: the compiled programs still apply
    return eng


@pytest.fixture(scope="module")
def model():
    return markov_model("mimo", target_noise=0.5, mtp_noise=0.2, seed=1)


@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 61, size=n).tolist() for n in LENGTHS]
    return [Request(i, p, SamplingParams(max_tokens=b))
            for i, (p, b) in enumerate(zip(prompts, BUDGETS)) if b]


@pytest.fixture(scope="module")
def references(model, requests):
    return [generate_reference(model, r.prompt_ids, r.sampling, max_len=MAX_LEN)
            for r in requests]


@pytest.mark.parametrize("method,shape", [("chain", "2,2,1"), ("eagle", "3,1"),
                                          ("chain", "budget:6"), ("eagle", "budget:6")])
def test_greedy_tree_lossless(model, requests, references, method, shape):
    eng = engine_for(model, "mimo", SpecConfig(method, draft_tree=shape))
    results = eng.generate(requests)
    for req, res, (want, reason) in zip(requests, results, references):
        assert res.token_ids == want, near_tie_report(model, req.prompt_ids, res.token_ids,
                                                      want)
        assert res.finish_reason == reason
    assert results[-1].finish_reason == "length"
    # partial acceptance: the walk took other branches than the first and rolled back
    accepted = sum(sum(r.accepted_per_depth) for r in results)
    assert 0 < accepted < sum(r.num_steps for r in results) * eng.spec.k


def test_tree_of_branching_one_is_the_chain(model, requests):
    """A chain-method tree 1,1,1 drafts (one module per depth, each over its committed
    slots and the path so far), verifies and accepts exactly what the chain of K = 3
    does: the same steps and acceptance per depth, request by request."""
    tree = engine_for(model, "mimo", SpecConfig("chain", draft_tree="1,1,1")).generate(requests)
    chain = engine_for(model, "mimo", SpecConfig("chain", num_speculative_tokens=3)
                       ).generate(requests)
    assert [(r.token_ids, r.num_steps, r.accepted_per_depth) for r in tree] == [
        (r.token_ids, r.num_steps, r.accepted_per_depth) for r in chain]


def test_wider_tree_accepts_more(model, requests):
    """Candidates beyond the first at a depth are accepted where the first is not: more
    tokens per target pass than the chain of the same depth."""
    def per_pass(spec):
        res = engine_for(model, "mimo", spec).generate(requests)
        return sum(len(r.token_ids) for r in res) / sum(r.num_steps + 1 for r in res)
    assert per_pass(SpecConfig("chain", draft_tree="2,2,1")) > per_pass(
        SpecConfig("chain", num_speculative_tokens=3))


SAMPLED = [("eagle", "2,2"), ("chain", "budget:4,depth:2,topk:2")]


@pytest.fixture(scope="module")
def sample_model():
    return markov_model("deepseek_v3", vocab=SAMPLE_V, target_noise=0.5, mtp_noise=0.4,
                        scale=3.0, seed=4)


@pytest.mark.parametrize("method,shape", SAMPLED, ids=["static", "dynamic"])
def test_tree_sampling_preserves_distribution(sample_model, method, shape):
    """Multi-candidate rejection sampling: a static tree's siblings drawn independently
    from the draft, a dynamic tree's the draft's top-k (point-mass proposals)."""
    sp = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_tokens=3)
    eng = engine_for(sample_model, "sample", SpecConfig(method, draft_tree=shape),
                     max_batch=16)
    prompt = [1, 5, 2, 7]
    n = 600
    results = eng.generate([Request(s, prompt, SamplingParams(**{**sp.__dict__, "seed": s}))
                            for s in range(n)])
    assert all(len(r.token_ids) == 3 for r in results)
    marg = _exact_marginals(sample_model, prompt, sp, 3)
    for d in range(3):
        counts = np.bincount([r.token_ids[d] for r in results], minlength=SAMPLE_V)
        ok, stat, crit = _chi2_ok(counts, marg[d], n)
        assert ok, f"depth {d}: chi2 {stat:.1f} >= {crit:.1f}; counts {counts}, " \
                   f"expected {np.round(marg[d] * n, 1)}"
    # drafts were sometimes rejected: the residual path ran
    assert 0 < sum(sum(r.accepted_per_depth) for r in results) < sum(
        r.num_steps * 2 for r in results)


@pytest.mark.parametrize("method,shape", SAMPLED, ids=["static", "dynamic"])
def test_tree_seed_independent_of_batch_and_no_recompile(sample_model, method, shape):
    eng = engine_for(sample_model, "sample", SpecConfig(method, draft_tree=shape),
                     max_batch=16)
    prompt = [1, 5, 2, 7, 3, 3, 9]
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=24)
    greedy = [Request("g", prompt, SamplingParams(max_tokens=10))]
    eng.warmup(greedy + [Request("x", prompt, sp)])
    before = eng.cache_sizes()
    alone = eng.generate([Request("x", prompt, sp)])[0]
    crowd = [Request(i, prompt[: 2 + i], SamplingParams(temperature=0.9, seed=i, max_tokens=9))
             for i in range(5)]
    mixed = eng.generate(crowd[:3] + [Request("x", prompt, sp)] + crowd[3:] + greedy)
    assert mixed[3].token_ids == alone.token_ids
    other = eng.generate([Request("x", prompt, SamplingParams(temperature=1.0, seed=99,
                                                              max_tokens=24))])[0]
    assert other.token_ids != alone.token_ids
    assert eng.cache_sizes() == before


@pytest.mark.parametrize("spec,why", [
    (dict(method="window", draft_tree="2,2"), "cannot draft a tree"),
    (dict(method="per_step", draft_tree="2,2"), "cannot draft a tree"),
    (dict(method="none", draft_tree="2"), "cannot draft a tree"),
    (dict(method="chain", num_speculative_tokens=2, draft_tree="2,2,1"), "3 deep"),
    (dict(method="eagle", draft_tree="2,0"), "at least 1"),
    (dict(method="eagle", draft_tree="budget:200"), "at most"),
    (dict(method="chain", draft_tree="2,2", relaxed_acceptance=True), "relaxed"),
])
def test_tree_config_refused(spec, why):
    with pytest.raises(ConfigError, match=why):
        SpecConfig(**spec)


def test_tree_config_resolves_k():
    cfg = small_config("mimo")
    static = SpecConfig("chain", draft_tree="2,2,1").resolve(cfg)
    assert (static.k, static.adaptive, static.tree.num_nodes) == (3, False, 11)
    dynamic = SpecConfig("eagle", draft_tree="budget:8").resolve(cfg)
    assert (dynamic.k, dynamic.tree.max_depth, dynamic.tree.num_nodes) == (3, 3, 9)
    # the pages cover the verify's N rows from L - 1 and the nodes the drafting stores
    # from L - 2 (a static tree's levels but its last; a dynamic one's root and topk a
    # depth but the last)
    assert static.write_ahead == 10 and dynamic.write_ahead == 1 + 4 * 2
    with pytest.raises(ConfigError, match="modules"):  # chain: a module per depth
        SpecConfig("chain", draft_tree="2,2,2,1").resolve(cfg)
    with pytest.raises(ConfigError, match="latent"):
        SpecConfig("eagle", draft_tree="2,2").resolve(from_hf(ds_config()))
