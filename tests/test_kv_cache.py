"""Paged KV layout: groups by attention kind, pool sizing, reservations, sliding-window rings.

The end-to-end test runs a Step-3.5-style model (a sliding-window target layer and
sliding-window MTP modules, so two KV groups with their own block tables) far past the
window, so the ring pages of the sliding group are reused many times, and checks greedy
speculative output against the dense reference generator.
"""

import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SamplingParams, SpecConfig
from mtp_jax.engine import Engine, Request
from mtp_jax.kv_cache import PageAllocator, make_layout
from mtp_jax.reference import generate_reference

from spec_models import markov_model, small_config

STEP = dict(sliding_windows=(None, 8), mtp_sliding_windows=(8, 8, 8), mtp_own_head=True,
            mtp_concat_order="embed_first", mtp_hidden_from="pre_norm",
            mtp_output_hidden="pre_norm")


def test_layout_groups_and_pool_sizing():
    cfg = small_config("step3p5", **STEP)
    eng = EngineConfig(max_batch=4, max_model_len=64, page_size=4, prefill_chunk=16)
    lay = make_layout(cfg, eng, 3, "float32")
    # target layer 0 full, layer 1 sliding, 3 sliding MTP modules
    assert lay.layer_group == (0, 1, 1, 1, 1)
    full, ring = lay.groups
    assert full.window is None and ring.window == 8
    assert ring.ring_pages * 4 > 8 + 16 - 1  # any chunk's writes never overwrite a visible key
    assert full.num_pages == 4 * ((64 + 3 + 3) // 4) + 1  # every slot at max length + null
    budget = make_layout(cfg, EngineConfig(max_batch=4, max_model_len=64, page_size=4,
                                           kv_memory_gb=1e-3), 3, "float32")
    per_page = lay.bytes_per_page()
    assert budget.groups[0].num_pages == int(1e-3 * 2**30 / (per_page * 1)) + 1


def test_allocator_reserves_rings_and_never_the_null_page():
    cfg = small_config("step3p5", **STEP)
    lay = make_layout(cfg, EngineConfig(max_batch=2, max_model_len=64, page_size=4,
                                        prefill_chunk=16, num_pages=40), 3, "float32")
    alloc = PageAllocator(lay)
    a = alloc.reserve(30)
    assert len(a[0]) == 8 and len(a[1]) == lay.groups[1].ring_pages
    assert 0 not in a[0] + a[1]
    rows = alloc.table_rows(a)
    assert list(rows[0, :8]) == a[0] and not rows[0, 8:].any()
    assert list(rows[1, : 2 * len(a[1])]) == a[1] * 2  # the ring, tiled over the table
    assert alloc.reserve(10 ** 6) is None and not alloc.ever_fits(10 ** 6)
    alloc.release(a)
    assert len(alloc.free[0]) == 40


@pytest.mark.parametrize("method", ["chain", "eagle"])
def test_sliding_window_rings_past_the_window_are_lossless(method):
    model = markov_model("step3p5", target_noise=0.5, mtp_noise=0.2, seed=5, **STEP)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 61, size=n).tolist() for n in (5, 23, 41)]
    eng = Engine(model, SpecConfig(method=method, num_speculative_tokens=3),
                 EngineConfig(max_batch=2, max_model_len=96, page_size=4, prefill_chunk=16,
                              steps_per_dispatch=5))
    assert len(eng.layout.groups) == 2
    results = eng.generate([Request(i, p, SamplingParams(max_tokens=40))
                            for i, p in enumerate(prompts)])
    for p, r in zip(prompts, results):
        want, _ = generate_reference(model, p, SamplingParams(max_tokens=40), max_len=96)
        assert r.token_ids == want
    assert sum(sum(r.accepted_per_depth) for r in results) > 0


def test_allocator_grows_a_reservation_and_gives_all_back():
    cfg = small_config("step3p5", **STEP)
    lay = make_layout(cfg, EngineConfig(max_batch=2, max_model_len=64, page_size=4,
                                        prefill_chunk=16, num_pages=12), 3, "float32")
    alloc = PageAllocator(lay)
    pages = alloc.reserve(5)  # 2 full pages and a ring
    ring = list(pages[1])
    new = alloc.grow(pages, 17)  # 5 pages now: 3 more, the ring unchanged
    assert [len(x) for x in new] == [3, 0] and len(pages[0]) == 5 and pages[1] == ring
    assert alloc.grow(pages, 64) is None and len(pages[0]) == 5  # 16 pages do not fit: none
    alloc.release(pages)
    assert alloc.free_pages(0) == 12


# --------------------------------------------------------------- pages on demand
# Requests that together need far more pages than the pool holds: pages are handed out
# as they grow and the most recent request is preempted (and later continued) when the
# pool runs out. Every output must equal the request run alone: greedy rows and, under
# adaptive K, seeded sampled rows (coupled sampling makes them independent of the
# drafts) are continued from recomputed KV; under a fixed K a sampled row's tokens depend
# on the drafts, so it holds its whole reservation and is never preempted.
PAGED = EngineConfig(max_batch=4, max_model_len=96, page_size=8, prefill_chunk=16,
                     steps_per_dispatch=4, num_pages=24)


@pytest.mark.parametrize("method,k", [("chain", "auto"), ("per_step", 3)])
def test_preempted_requests_continue_to_the_same_output(method, k):
    model = markov_model("deepseek_v3", target_noise=0.5, mtp_noise=0.2, seed=5)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 61, n).tolist() for n in (5, 21, 12, 30, 9, 17, 26, 3)]
    sps = [SamplingParams(max_tokens=40 + 3 * i, seed=100 + i, top_k=0 if i % 3 else 20,
                          temperature=0.8 if i % 2 == 0 else 0.0) for i in range(len(prompts))]
    spec = SpecConfig(method=method, num_speculative_tokens=k)
    eng = Engine(model, spec, PAGED)
    # the old rule (prompt + max_tokens + K reserved up front) would run 2 at a time
    assert 24 // -(-(30 + 61 + eng.spec.k) // 8) <= 2
    preempted = []
    real = eng._preempt
    eng._preempt = lambda slot: (preempted.append(eng.slots[slot].req.sampling), real(slot))
    res = eng.generate([Request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))])
    assert preempted and eng.stats["preemptions"] == len(preempted)
    assert eng.stats["pages_grown"] > 0
    if k != "auto":  # rejection sampling: sampled rows are pinned
        assert all(sp.temperature == 0 for sp in preempted)
    else:  # all four slots busy at once: twice the old rule's two
        assert eng.stats["max_running"] == PAGED.max_batch
    alone = Engine(model, spec, EngineConfig(**{**PAGED.__dict__, "num_pages": None,
                                                "max_batch": 1}))
    # the programs the job needs, as generate / evaluate warm an engine (on a CPU the
    # full ones, which the requests below then share, instead of a variant per kind)
    alone.warmup([Request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))])
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        want = alone.generate([Request(i, p, sp)])[0]
        got = res[i]
        assert got.token_ids == want.token_ids, i
        assert got.finish_reason == want.finish_reason and got.num_prompt_tokens == len(p)
        if sp.temperature == 0:
            ref = generate_reference(model, p, sp, max_len=96)[0]
            assert got.token_ids == list(ref), i
    assert eng.alloc.free_pages(0) == 24  # every page back
