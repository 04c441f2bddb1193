"""Adaptive speculation: the controller's choices, and output that never depends on them.

Engine tests drive the schedule themselves (a controller whose choices follow a fixed
cycle of step kinds, transitions between every pair of kinds included), so they check
that any schedule the real controller could pick keeps greedy output equal to the
reference and seeded sampled output equal to plain decoding with the same seed.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from mtp_jax import step as step_mod
from mtp_jax.adaptive import KController
from mtp_jax.config import ConfigError, EngineConfig, SamplingParams, SpecConfig
from mtp_jax.engine import Engine, Request
from mtp_jax.generate import parse_args
from mtp_jax.reference import generate_reference

from spec_models import markov_model

MAX_LEN = 64
ENGINE = EngineConfig(max_batch=3, max_model_len=MAX_LEN, page_size=8, prefill_chunk=16,
                      steps_per_dispatch=3)
# every ordered pair of kinds 0..3 follows each other somewhere in the cycle
CYCLE = [3, 0, 1, 2, 3, 1, 0, 2, 0, 3, 2, 1, 3, 3]


class Scripted(KController):
    """The real controller's bookkeeping, with the kinds taken from a fixed cycle."""

    def __init__(self, k_max, kinds):
        super().__init__(k_max)
        self._kinds = itertools.cycle(kinds)

    def choose(self, drain=None) -> int:
        return next(self._kinds)


# --------------------------------------------------------------------- controller
def feed(ctl: KController, cost, rate, dispatches: int, steps: int = 10, rows: int = 4):
    """Dispatches with per-step cost[k] seconds and acceptance rate[d] per depth."""
    for _ in range(dispatches):
        k = ctl.choose()
        tried = np.array([steps * rows if d < k else 0 for d in range(ctl.k_max)])
        ctl.update(k, cost[k] * steps, steps, np.round(tried * np.asarray(rate)), tried)


def first_choices(cost, rate, n):
    ctl, order = KController(3), []
    for _ in range(n):
        order.append(ctl.choose())
        tried = np.array([40.0 if d < order[-1] else 0.0 for d in range(3)])
        ctl.update(order[-1], cost[order[-1]] * 10, 10, tried * np.asarray(rate), tried)
    return order, ctl


def test_controller_measures_k_then_0_then_only_a_middle_kind_that_may_win():
    # deep drafts rarely accepted: the interpolated estimate makes K=1 best, so it is timed
    order, ctl = first_choices([1.0, 1.05, 1.1, 1.15], [0.9, 0.05, 0.01], 4)
    assert order == [3, 0, 1, 1] and ctl.cost[2] is None
    # drafting does not pay at any depth: no middle kind is ever timed while measuring
    order, ctl = first_choices([1.0, 1.9, 2.8, 3.7], [0.6, 0.4, 0.3], 4)
    assert order == [3, 0, 0, 0] and ctl.cost[1] is None and ctl.cost[2] is None
    assert ctl.estimated_cost(2) == pytest.approx(1.0 + 2.7 * 2 / 3)


def test_controller_with_a_warmup_prior_times_zero_only_when_it_may_win():
    # the warmup's dummy-slot timings give the kinds' cost ratios; the job's timing of K
    # scales them, so K=0 is not spent measuring while K clearly pays
    prior = [0.5, 0.55, 0.6, 0.65]
    ctl, order = KController(3, prior_cost=prior), []
    for _ in range(5):
        order.append(ctl.choose())
        tried = np.array([40.0 if d < order[-1] else 0.0 for d in range(3)])
        ctl.update(order[-1], 1.3 * 10, 10, tried * 0.9, tried)
    assert order == [3, 3, 3, 3, 3] and ctl.cost[0] is None
    assert ctl.estimated_cost(0) == pytest.approx(0.5 * 1.3 / 0.65)
    # drafting does not pay: the prior makes K=0 the best, so it is measured next
    ctl, order = KController(3, prior_cost=[1.0, 1.9, 2.8, 3.7]), []
    for _ in range(4):
        order.append(ctl.choose())
        tried = np.array([40.0 if d < order[-1] else 0.0 for d in range(3)])
        ctl.update(order[-1], [1.0, 1.9, 2.8, 3.7][order[-1]] * 10, 10,
                   tried * np.array([0.6, 0.4, 0.3]), tried)
    assert order == [3, 0, 0, 0]
    # the nearest measured kind scales an estimate; without any timing, K comes first
    assert ctl.estimated_cost(1) == pytest.approx(1.9 * 1.0 / 1.0)
    assert KController(3, prior_cost=prior).best() == 3
    with pytest.raises(ValueError, match="positive"):
        KController(3, prior_cost=[1.0, 0.0, 1.0, 1.0])


def test_controller_raises_an_early_timing_to_what_later_ones_imply():
    # K's first measurement ran on the prompts alone (51 ms a step); K=1, timed later at
    # longer contexts, costs 42 ms, and warmup says K=3 costs 1.76x K=1: K=3 now costs
    # about 74 ms, not 51, and K=1 (fewer tokens a step, but cheaper) is the better kind
    prior = [0.018, 0.029, 0.040, 0.051]
    ctl = KController(3, prior_cost=prior)
    assert ctl.choose() == 3
    ctl.update(3, 2 * 0.051, 2, [58, 40, 30], [64, 64, 64])
    ctl.update(1, 32 * 0.042, 32, [480, 0, 0], [512, 0, 0])
    assert ctl.estimated_cost(3) == pytest.approx(0.042 * 0.051 / 0.029)
    assert ctl.estimated_cost(1) == pytest.approx(0.042)
    assert ctl.estimated_cost(2) == pytest.approx(0.042 * 0.040 / 0.029)  # from K's, raised
    assert ctl.best() == 1  # 45 tokens/s a row, against 43 (K=2) and 40 (K=3)
    # only ever raised: an early timing above what the later one implies stands
    ctl = KController(3, prior_cost=prior)
    ctl.update(3, 2 * 0.09, 2, [58, 52, 48], [64, 64, 64])
    ctl.update(1, 32 * 0.042, 32, [480, 0, 0], [512, 0, 0])
    assert ctl.estimated_cost(3) == pytest.approx(0.09)
    # and the kind timed last is taken as measured
    ctl.update(3, 4 * 0.06, 4, [58, 52, 48], [64, 64, 64])
    assert ctl.estimated_cost(3) == pytest.approx(0.06)
    assert ctl.estimated_cost(1) == pytest.approx(max(0.042, 0.06 * 0.029 / 0.051))


def test_controller_first_measures_k_over_enough_drafts():
    # the first K dispatch runs until `samples` drafts per depth (a quarter of n at most),
    # later measurements and checks a sixteenth of n
    for running, want in ((1, 8), (6, 6), (64, 2)):
        ctl = KController(3, samples=32)
        assert ctl.choose() == 3 and ctl.steps(32, running) == want
    ctl.update(3, 1.0, 2, [60, 50, 40], [64, 64, 64])
    assert ctl.choose() == 0 and ctl.probe and ctl.steps(32, 64) == 2
    ctl.update(0, 0.5, 2, [0, 0, 0], [0, 0, 0])
    assert ctl.choose() == 3 and not ctl.probe and ctl.steps(32, 64) == 32


def test_controller_cost_ignores_a_slow_outlier():
    # a shared machine only adds time: one dispatch slowed 5x does not flip the choice
    ctl = KController(1)
    feed(ctl, cost=[1.0, 1.2], rate=[0.8], dispatches=6)
    assert ctl.best() == 1
    ctl.update(1, 6.0 * 10, 10, [32], [40])
    assert ctl.cost[1] == pytest.approx(1.2) and ctl.best() == 1


def test_controller_in_the_last_wave_minds_the_slowest_request():
    # drafting pays on average (0.8 accepted at 1.5x the cost), but in the last wave the
    # request whose drafts are never accepted sets the end of the job
    ctl = KController(1)
    feed(ctl, cost=[1.0, 1.5], rate=[0.8], dispatches=3)
    assert ctl.best() == 1
    both = ([50, 50], [[40], [0]], [[50], [50]])
    ctl.choose(drain=both)
    assert ctl.best() == 0
    assert ctl.finish_time(1) == pytest.approx(1.5 * 50 / (1 + (0 + 4 * ctl.rates()[0]) / 54))
    ctl.choose(drain=([50, 5], [[40], [0]], [[50], [50]]))  # the poor one is nearly done
    assert ctl.best() == 1
    ctl.choose(drain=([], [], []))  # nothing running: throughput again
    assert ctl.drain is None and ctl.best() == 1


def test_controller_picks_speculation_when_it_pays():
    # verify + drafts cost 1.3x a plain step, drafts mostly accepted: 3.4 tokens per 1.3
    ctl = KController(3)
    feed(ctl, cost=[1.0, 1.1, 1.2, 1.3], rate=[0.9, 0.8, 0.7], dispatches=200)
    assert ctl.best() == 3
    assert ctl.counts()[3] > 0.9 * 200
    assert ctl.interval >= 16 * ctl.min_interval  # every check confirmed the choice


def test_controller_turns_speculation_off_when_it_does_not_pay():
    # a tiny model on a CPU: each draft costs almost a plain step
    ctl = KController(3)
    feed(ctl, cost=[1.0, 1.9, 2.8, 3.7], rate=[0.6, 0.4, 0.3], dispatches=300)
    assert ctl.best() == 0
    assert ctl.counts()[0] > 0.95 * 300
    assert "k=0" in ctl.summary()


def test_controller_follows_a_change_of_regime():
    ctl = KController(2)
    feed(ctl, cost=[1.0, 1.1, 1.2], rate=[0.9, 0.9], dispatches=60)
    assert ctl.best() == 2
    feed(ctl, cost=[1.0, 3.0, 5.0], rate=[0.9, 0.9], dispatches=600)  # e.g. a full batch
    assert ctl.best() == 0
    assert ctl.schedule[-1][0] == 0


def test_controller_middle_k_when_deep_drafts_fail():
    ctl = KController(3)
    feed(ctl, cost=[1.0, 1.05, 1.1, 1.15], rate=[0.9, 0.05, 0.01], dispatches=200)
    assert ctl.best() == 1


# ---------------------------------------------------------------------- config / CLI
def test_auto_is_the_default_and_resolves_to_the_module_count():
    assert SpecConfig().num_speculative_tokens == "auto"
    cfg = markov_model("mimo", seed=1).config
    spec = SpecConfig().resolve(cfg)
    assert (spec.k, spec.adaptive) == (cfg.num_mtp_modules, True)
    assert SpecConfig("eagle").resolve(cfg).k == 3
    assert SpecConfig("chain", 2).resolve(cfg) == SpecConfig("chain", 2)  # fixed: not adaptive
    none = SpecConfig("none").resolve(cfg)
    assert (none.k, none.adaptive) == (0, False)
    with pytest.raises(ConfigError, match="auto"):
        SpecConfig("chain", "sometimes")
    with pytest.raises(ConfigError, match="resolve"):
        SpecConfig("chain").k
    with pytest.raises(ConfigError, match="MTP modules"):
        SpecConfig("chain").resolve(markov_model("mimo", seed=1, mtp=0).config)


def test_cli_takes_auto_or_an_integer():
    base = ["--input", "x.jsonl", "--output", "y.jsonl"]
    assert parse_args(base).num_speculative_tokens == "auto"
    assert parse_args(base + ["--num-speculative-tokens", "AUTO"]).num_speculative_tokens == "auto"
    assert parse_args(base + ["--num-speculative-tokens", "2"]).num_speculative_tokens == 2
    for bad in ("0", "x"):
        with pytest.raises(SystemExit):
            parse_args(base + ["--num-speculative-tokens", bad])


# --------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def model():
    return markov_model("deepseek_v3", target_noise=0.5, mtp_noise=0.2, seed=1)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 61, size=n).tolist() for n in (3, 9, 17, 30)]


_engines: dict = {}


def engine(model, method, kinds=None) -> Engine:
    if method not in _engines:
        _engines[method] = Engine(model, SpecConfig(method), ENGINE)
    eng = _engines[method]
    eng.control = Scripted(eng.spec.k, kinds or CYCLE)
    return eng


@pytest.mark.parametrize("method", ["chain", "eagle", "per_step"])
def test_any_schedule_is_lossless_greedy(model, prompts, method):
    eng = engine(model, method)
    assert eng.spec.adaptive and eng.spec.k == 3
    budgets = (30, 21, 40, 25)
    results = eng.generate([Request(i, p, SamplingParams(max_tokens=b))
                            for i, (p, b) in enumerate(zip(prompts, budgets))])
    for p, b, res in zip(prompts, budgets, results):
        want, reason = generate_reference(model, p, SamplingParams(max_tokens=b),
                                          max_len=MAX_LEN)
        assert (res.token_ids, res.finish_reason) == (want, reason)
    # every kind ran, drafts were verified at every depth and some accepted
    assert set(eng.control.counts()) == {0, 1, 2, 3}
    tried = np.sum([r.drafted_per_depth for r in results], 0)
    acc = np.sum([r.accepted_per_depth for r in results], 0)
    assert (tried > 0).all() and acc.sum() > 0 and (acc <= tried).all()
    # fewer steps verify deep drafts than steps run: the shallow kinds left them out
    assert tried[2] < sum(r.num_steps for r in results)


@pytest.mark.parametrize("method", ["chain", "eagle"])
def test_seeded_sampling_equals_plain_decoding_whatever_the_schedule(model, prompts, method):
    sp = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=24)
          for t, k, p, s in ((1.0, 0, 1.0, 7), (0.8, 5, 0.9, 8), (0.0, 0, 1.0, 9),
                             (1.3, 0, 0.95, 10))]
    reqs = [Request(i, p, s) for i, (p, s) in enumerate(zip(prompts, sp))]
    plain = [generate_reference(model, p, s, max_len=MAX_LEN)[0] for p, s in zip(prompts, sp)]
    eng = engine(model, method)
    for kinds in (CYCLE, [3], [1, 3, 0]):
        eng.control = Scripted(3, kinds)
        got = eng.generate(reqs)
        assert [r.token_ids for r in got] == plain, kinds
    assert sum(sum(r.accepted_per_depth) for r in got) > 0  # drafts did get accepted


def test_real_controller_on_the_job_stays_lossless(model, prompts):
    eng = engine(model, "chain")
    eng.reset_control()
    assert type(eng.control) is KController and eng.control.dispatches == 0
    before = eng.stats["dispatches"]
    res = eng.generate([Request(i, p, SamplingParams(max_tokens=30))
                        for i, p in enumerate(prompts)])
    for p, r in zip(prompts, res):
        assert r.token_ids == generate_reference(model, p, SamplingParams(max_tokens=30),
                                                 max_len=MAX_LEN)[0]
    assert sum(n for _, n in eng.control.schedule) == eng.stats["dispatches"] - before
    assert eng.control.cost[3] is not None  # K is timed first
    assert eng.control.tried.sum() > 0
    # the warmup timed one step of every kind for the controller's cost prior
    prior = eng.control.prior_cost
    assert prior == eng.step_prior and len(prior) == 4 and min(prior) > 0


def test_a_kind_drafts_over_the_positions_it_can_commit(model, monkeypatch):
    """A step of kind k runs the MTP modules over the k + 1 positions it can commit, not
    the K + 1 of the carry (on a CPU the draft's cost grows with that window)."""
    eng = engine(model, "chain")
    widths, real = [], step_mod.draft

    def spy(model, method, k, kv, win_tokens, *args, **kw):
        widths.append((k, win_tokens.shape[1]))
        return real(model, method, k, kv, win_tokens, *args, **kw)

    monkeypatch.setattr(step_mod, "draft", spy)
    for kind in (1, 2, 3):
        jax.eval_shape(lambda p, st, kind=kind: step_mod.decode_step(
            eng.progs._merge(p), eng.static, st, kind), eng.model.params, eng.state)
    assert widths == [(1, 2), (2, 3), (3, 4)]


def test_a_kind_held_throughout_drafts_as_the_engine_of_that_k(model, prompts):
    """An adaptive engine (K = 3) held at kind 1 commits the same tokens, in the same
    steps, with the same acceptance as an engine of K = 1."""
    reqs = [Request(i, p, SamplingParams(max_tokens=24)) for i, p in enumerate(prompts)]
    got = engine(model, "chain", [1]).generate(reqs)
    want = Engine(model, SpecConfig("chain", 1), ENGINE).generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.num_steps for r in got] == [r.num_steps for r in want]
    assert [r.accepted_per_depth[:1] for r in got] == [r.accepted_per_depth for r in want]
    assert sum(r.accepted_per_depth[0] for r in want) > 0


def test_fixed_k_engine_has_no_controller(model):
    eng = Engine(model, SpecConfig("chain", 2), ENGINE)
    assert eng.control is None
    eng.reset_control()
    assert eng.control is None
