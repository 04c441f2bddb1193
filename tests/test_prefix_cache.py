"""Prefix caching: the cache and the scheduler without jax, then engines whose outputs must
equal the reference's with shared prompt prefixes, a small pool (blocks evicted and
recomputed, requests preempted), prefill batches that would compute a prefix twice, and
seeded sampling against an engine without the cache."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SamplingParams, SpecConfig
from mtp_jax.engine import Engine, Request
from mtp_jax.pages import PageAllocator
from mtp_jax.prefix_cache import PrefixCache
from mtp_jax.scheduler import Limits, Scheduler

import sched_fakes as fakes
from sched_fakes import Group, Sampling
from spec_models import markov_model


# a pool of 12 pages of 4 positions (+ the null page); requests of 4 new tokens
Layout = functools.partial(fakes.Layout, page_size=4, width=16, groups=(Group(None, 13),))


def Req(rid, prompt_ids, sampling=Sampling(max_tokens=4)):  # noqa: N802 (a fake class)
    return fakes.Req(rid, prompt_ids, sampling)


def sched(k=1, max_batch=3, cache=True, **layout):
    return Scheduler(Layout(**layout), Limits(max_batch=max_batch, max_model_len=64, k=k,
                                              vocab_size=100, max_stop_ids=4,
                                              prefix_cache=cache))


# ------------------------------------------------------------------- the cache
def test_keys_cover_the_blocks_below_the_history_end_and_their_lookahead():
    cache = PrefixCache(Layout(), lookahead=2)
    p = list(range(20, 31))  # P = 11: history end 11 - 1 - 2 = 8, two blocks of 4
    keys = cache.keys(p)
    assert len(keys) == 2
    assert cache.keys(p[:10]) == keys[:1]  # history end 7: one block
    # a token inside the lookahead (position 9 < 8 + 2) changes block 1's key only
    other = cache.keys(p[:9] + [99] + p[10:])
    assert other[0] == keys[0] and other[1] != keys[1]
    assert cache.keys(p[:8] + [99] * 3)[1] != keys[1]  # position 8: the lookahead too
    assert cache.keys([5] + p[1:])[1] != keys[1]  # keys chain over every token before
    assert PrefixCache(Layout(), lookahead=0).keys(p[:9]) == \
        PrefixCache(Layout(), lookahead=0).keys(p[:10])[:2]


def test_refcounts_idle_blocks_and_eviction_order():
    cache = PrefixCache(Layout(), lookahead=0)
    a = [cache.register(bytes([i]), (10 + i,)) for i in range(3)]  # a prompt's 3 blocks
    assert all(b.refs == 1 and not b.ready for b in a)
    assert cache.register(bytes([0]), (99,)) is None  # held already
    for b in a:
        b.ready = True
    cache.acquire(a[:2])  # a second reader of the first two
    cache.release(a)
    assert list(cache.idle) == [bytes([2])] and cache.shared_refs() == 0
    cache.release(a[:2])
    # idle, least recently used first: the prompt's last block before its first
    assert list(cache.idle) == [bytes([2]), bytes([1]), bytes([0])]
    assert cache.hits([bytes([0]), bytes([1]), bytes([7]), bytes([2])]) == a[:2]
    assert cache.evict(2) == [(12,), (11,)]
    assert cache.hits([bytes([0]), bytes([1])]) == a[:1] and cache.held_pages() == 1
    late = cache.register(bytes([5]), (20,))  # its admission failed before its prefill
    assert cache.forget([late]) == [(20,)] and bytes([5]) not in cache.blocks


@pytest.mark.parametrize("layout,why", [
    (Layout(groups=(Group(None, 9), Group(8, 9, 2))), "sliding-window"),
    (Layout(linear=(object(), None)), "linear-attention")])
def test_layouts_it_cannot_share_say_why(layout, why):
    assert why in PrefixCache.supports(layout)
    s = Scheduler(layout, Limits(max_batch=2, max_model_len=64, k=1, vocab_size=100,
                                 max_stop_ids=4, prefix_cache=True))
    assert s.cache is None and why in s.cache_off


def test_allocator_reclaims_idle_blocks_when_short():
    cache = PrefixCache(Layout(), lookahead=0)
    alloc = PageAllocator(Layout(), cache)
    held = alloc.reserve(4 * 4)
    for j, page in enumerate(held[0]):
        cache.register(bytes([j]), (page,)).ready = True
    cache.release(list(cache.blocks.values()))
    assert alloc.free_pages() == 12 and len(alloc.free[0]) == 8  # 4 idle, reclaimable
    got = alloc.reserve(11 * 4)
    assert got is not None and len(set(got[0])) == 11
    assert cache.held_pages() == 1 and cache.stats["evicted_blocks"] == 3
    assert alloc.reserve(2 * 4) is None  # 1 idle page left
    assert alloc.reserve(4, held=[[]]) is not None


# --------------------------------------------------------------- the scheduler
def test_admission_shares_blocks_and_waits_for_a_prefix_being_prefilled():
    s = sched(k=1)
    head = list(range(10, 22))  # 12 tokens: 3 blocks of 4
    # b's first 13 tokens are a's: block 2's key reads position 12 (K = 1 past its end)
    a, b, c = Req("a", head + [40, 41]), Req("b", head + [40, 51, 52]), Req("c", [7] * 9)
    s.queue.extend([a, c, b])
    s.group_queue()  # b shares a's blocks: next to it
    assert [r.id for r in s.queue] == ["a", "b", "c"]
    first = s.take(0, [])
    assert first.cached == 0 and len(first.blocks) == 3  # registered, not ready
    assert s.head_waits()  # b would compute the same blocks again
    s.start([first])
    assert not s.head_waits()
    second = s.take(1, [])
    assert second.cached == 12 and second.pages[0][:3] == first.pages[0][:3]
    assert len(set(second.pages[0][3:]) & set(first.pages[0])) == 0
    s.start([second])
    # shared pages are counted once: a holds 4 pages (14 + 1 + 1 positions), b 5
    assert s.pages_in_use() == 4 + 5 - 3
    assert s.stats["peak_pages_per_request"] == 9 and s.stats["peak_pages"] == 6
    assert s.stats["cached_tokens"] == 12 and s.stats["prompt_tokens"] == 29
    s.finish(0)
    assert s.pages_in_use() == 5  # b still reads the three shared pages
    s.finish(1)
    assert s.pages_in_use() == 0 and s.alloc.free_pages() == 12
    assert s.cache.held_pages() == 3 and len(s.cache.idle) == 3


def test_a_failed_admission_forgets_its_blocks_and_returns_every_page():
    s = sched(k=0)
    head = list(range(10, 19))  # 9 tokens: 2 blocks below the history end 8
    s.queue.append(Req("a", head))
    a = s.take(0, [])
    s.drop(a)
    assert s.cache.held_pages() == 0 and len(s.alloc.free[0]) == 12
    s.queue.append(Req("b", head))
    b = s.take(0, [])
    s.start([b])
    s.finish(0)
    s.queue.append(Req("c", head + [1]))
    c = s.take(0, [])
    assert c.cached == 8
    s.drop(c)  # a hit loses its reader, nothing it read is freed
    assert s.cache.held_pages() == 2 and len(s.cache.idle) == 2


def test_preempted_requests_resume_from_their_cached_blocks():
    s = sched(k=1, max_batch=2)
    s.queue.append(Req("a", list(range(10, 20)), Sampling(max_tokens=8)))
    a = s.take(0, [])
    s.start([a])
    s.preempt(0, [3, 4, 5], steps=2, accepted=[1], drafted=[2])
    again = s.take(0, [])
    assert again.req.prompt_ids[-3:] == [3, 4, 5] and again.cached == 8
    s.start([again])
    assert s.slots[0].before(1).cached == 0  # the first admission's count is reported


def test_off_without_the_option():
    s = sched(cache=False)
    assert s.cache is None and s.cache_off is None
    s.queue.extend([Req("a", list(range(12))), Req("b", list(range(12)))])
    s.start([s.take(0, [])])
    assert s.take(1, []).cached == 0


# ------------------------------------------------------------------- engines
MAX_LEN = 96
ENGINE = EngineConfig(max_batch=3, max_model_len=MAX_LEN, page_size=8, prefill_chunk=16,
                      steps_per_dispatch=6, num_pages=15, prefill_batch=2)
_engines: dict = {}


def engine(method, k, **kw):
    key = (method, k, tuple(sorted(kw.items())))
    if key not in _engines:
        _engines[key] = Engine(_model(), SpecConfig(method, num_speculative_tokens=k),
                               dataclasses.replace(ENGINE, **kw))
    return _engines[key]


_MODEL: list = []


def _model():
    if not _MODEL:
        _MODEL.append(markov_model("deepseek_v3", target_noise=0.5, mtp_noise=0.2, seed=1))
    return _MODEL[0]


def _prompts():
    """Prompts sharing a 26-token header (tails of 1 to 30 tokens), one sharing only its
    first 16, a duplicate, and two unrelated ones."""
    rng = np.random.default_rng(7)
    head = rng.integers(0, 61, size=26).tolist()
    tails = [rng.integers(0, 61, size=n).tolist() for n in (3, 12, 1, 30, 17)]
    out = [head + t for t in tails]
    out.append(head[:16] + rng.integers(0, 61, size=20).tolist())
    out.append(list(out[1]))
    out += [rng.integers(0, 61, size=n).tolist() for n in (9, 40)]
    return out


BUDGETS = (20, 14, 30, 9, 25, 18, 14, 22, 12)


@pytest.fixture(scope="module")
def references():
    from mtp_jax.reference import generate_reference

    return [generate_reference(_model(), p, SamplingParams(max_tokens=b), max_len=MAX_LEN)[0]
            for p, b in zip(_prompts(), BUDGETS)]


def _requests(**sp):
    return [Request(i, p, SamplingParams(max_tokens=b, **sp))
            for i, (p, b) in enumerate(zip(_prompts(), BUDGETS))]


# chain: MTP history in the target's chunk programs; window: in programs of their own, read
# ahead; per_step: draft-only modules (eagle's sampled run below, none's in the engine tests)
STRATEGIES = [("chain", 2), ("window", 3), ("per_step", 3)]
BIG = dict(num_pages=None)  # enough pages for every slot: nothing preempted or evicted


@pytest.mark.parametrize("method,k", STRATEGIES)
def test_same_tokens_steps_and_acceptance_as_without_the_cache(references, method, k):
    """Greedy output is the reference's whatever the drafts, so the drafts are checked
    through acceptance: a hit's MTP KV must be what the request would have computed."""
    eng, plain = engine(method, k, **BIG), engine(method, k, prefix_cache=False, **BIG)
    eng.clear_prefix_cache()
    got, want = eng.generate(_requests()), plain.generate(_requests())
    assert [r.token_ids for r in got] == references
    assert [(r.num_steps, r.accepted_per_depth) for r in got] == \
        [(r.num_steps, r.accepted_per_depth) for r in want]
    assert sum(sum(r.accepted_per_depth) for r in got) > 0
    cached = [r.num_cached_prompt_tokens for r in got]
    assert sum(c > 0 for c in cached) >= 5 and cached[-2:] == [0, 0]
    assert all(r.num_cached_prompt_tokens == 0 for r in want)
    assert eng.stats["peak_pages"] < eng.stats["peak_pages_per_request"]
    before = eng.cache_sizes()
    again = eng.generate(_requests())  # a second job: the first's blocks still cached
    assert [r.token_ids for r in again] == references
    assert sum(r.num_cached_prompt_tokens for r in again) > sum(cached)
    assert eng.cache_sizes() == before  # hits start prefills later: nothing recompiles


@pytest.mark.parametrize("method,k", [("chain", 2), ("per_step", 3)])
def test_greedy_output_equals_the_reference_with_a_small_pool(references, method, k):
    eng = engine(method, k)
    eng.clear_prefix_cache()
    results = eng.generate(_requests())
    assert [r.token_ids for r in results] == references
    stats, cache = eng.stats, eng.sched.cache.stats
    assert stats["cached_tokens"] > 0
    # the pool of 14 pages cannot hold three requests' growth: blocks were evicted and
    # requests preempted (and resumed from their cached blocks where those were kept)
    assert stats["preemptions"] > 0 and cache["evicted_blocks"] > 0


def test_seeded_sampling_equals_an_engine_without_the_cache():
    eng, plain = engine("eagle", 2, **BIG), engine("eagle", 2, prefix_cache=False, **BIG)
    eng.clear_prefix_cache()
    reqs = _requests(temperature=0.8, seed=11)
    got, want = eng.generate(reqs), plain.generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert sum(r.num_cached_prompt_tokens for r in got) > 0
    assert plain.sched.cache is None and plain.prefix_cache_off is None


def test_new_weights_forget_the_cached_blocks():
    eng = engine("chain", 2, **BIG)
    eng.generate(_requests()[:2])
    assert eng.sched.cache.held_pages() > 0
    eng.model = _model()
    assert eng.sched.cache.held_pages() == 0


@pytest.mark.parametrize("method,k", [("window", 3), ("chain", 2)])
def test_a_hit_reads_the_kv_the_request_would_have_written(method, k):
    """Every layer's KV (target and MTP) in the pages a request reads from the cache equals
    what its own prefill writes there. b shares a's first 26 tokens, so the block of
    positions 16..23 is shared only when no MTP module there reads a token past 25: module
    m at position p reads token p + 1 + m, up to 25 for K = 2 and 26 for K = 3."""
    eng = engine(method, k, **BIG)
    rng = np.random.default_rng(5)
    head = rng.integers(0, 61, size=26).tolist()
    a, b = head + [1, 2, 3, 4, 5, 6], head + [7, 8, 9, 10, 11]
    sp = SamplingParams(max_tokens=2)
    cache = eng.sched.cache

    def kv_of(prompt):
        pages = np.asarray([blk.pages[0] for blk in cache.hits(cache.keys(prompt))])
        return pages, [np.asarray(c)[..., pages, :, :] for layer in eng.state.caches
                       for c in layer]

    eng.clear_prefix_cache()
    eng.generate([Request(0, a, sp)])
    res = eng.generate([Request(1, b, sp)])[0]
    assert res.num_cached_prompt_tokens == (24 if k < 3 else 16)
    pages, read = kv_of(b)
    eng.clear_prefix_cache()
    eng.generate([Request(1, b, sp)])
    own_pages, own = kv_of(b)
    assert len(pages) == len(own_pages) == 3
    for x, y in zip(read, own):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
