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
