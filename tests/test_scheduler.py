"""The scheduler without jax: admission order, pages on demand, preemption, pinning."""

import os
import subprocess
import sys

import numpy as np
import pytest

from mtp_jax.scheduler import Limits, Scheduler

from sched_fakes import Layout, Req, Sampling


def test_importing_the_scheduler_does_not_import_jax():
    code = ("import sys; import mtp_jax.scheduler; "
            "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')); "
            "assert not bad, bad")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)  # this checkout's


def sched(k=2, pin=False, max_batch=2, **layout):
    return Scheduler(Layout(**layout), Limits(max_batch=max_batch, max_model_len=64, k=k,
                                              vocab_size=100, max_stop_ids=4,
                                              eos_token_ids=(1,), pin_sampled=pin))


def admit(s, slot):
    refused = []
    item = s.take(slot, refused)
    if item is not None:
        s.start([item])
    return item, refused


def test_check_names_what_can_never_run():
    s = sched()
    assert s.check(Req(0, [])) == "empty prompt"
    assert s.check(Req(0, "abc")) == "prompt_ids must be a list of integers"
    assert "outside the vocabulary" in s.check(Req(0, [5, 100]))
    assert "max_model_len" in s.check(Req(0, list(range(64))))
    assert "stop token ids" in s.check(Req(0, [3], Sampling(stop_token_ids=(2, 3, 4, 5))))
    assert "page pool" in s.check(Req(0, [3] * 60, Sampling(max_tokens=3)))
    assert s.check(Req(0, [3, 4])) is None
    assert s.stop_ids(Req(0, [3], Sampling(stop_token_ids=(7,)))) == [1, 7]


def test_admission_holds_the_prompt_and_the_first_window_and_keeps_the_order():
    s = sched(k=2)
    s.queue.extend([Req("bad", []), Req("a", [3] * 10), Req("b", [4] * 40)])
    a, refused = admit(s, 0)
    assert [(r.id, why) for r, why in refused] == [("bad", "empty prompt")]
    assert a.tokens == 10 + 1 + 2 and [len(p) for p in a.pages] == [2]
    assert s.slots[0].order == 1 and s.generated[0] == 1
    # b needs 6 pages of the 6 left: admitted; nothing is left for a third
    b, _ = admit(s, 1)
    assert b.req.id == "b" and s.alloc.free_pages() == 0
    s.queue.append(Req("c", [5]))
    assert s.take(0, []) is None and len(s.queue) == 1  # waits, in order


def test_pages_grow_before_a_dispatch_and_the_newest_request_yields():
    s = sched(k=2)
    s.queue.extend([Req("a", [3] * 10, Sampling(max_tokens=40)),
                    Req("b", [4] * 20, Sampling(max_tokens=40))])
    admit(s, 0), admit(s, 1)
    need = s.needs(steps=4)
    assert need == {0: 10 + 1 + 4 * 3 + 2, 1: 20 + 1 + 4 * 3 + 2}
    assert s.grow(need) is None  # 8 pages cannot hold 4 + 5: nothing handed out
    assert s.alloc.free_pages() == 8 - 2 - 3
    victim = s.victim()
    assert victim == 1  # the most recent admission
    s.preempt(victim, tokens=[7], steps=0, accepted=[0, 0], drafted=[0, 0])
    again = s.queue[0]
    assert again.prompt_ids == [4] * 20 + [7] and again.sampling.max_tokens == 39
    assert s.stats["preemptions"] == 1 and s.slots[1] is None
    mask, rows, limit, pages = s.grow(s.needs(steps=4))
    assert mask.tolist() == [True, False] and limit[0] == 25 and rows[0, :4].all()
    assert (pages > 0).sum() == 2 and s.stats["pages_grown"] == 2
    # the continuation gets the earlier part back when it is admitted again
    item = s.take(1, [])
    assert item is None or item.origin.tokens == [7]


def test_sampled_requests_verified_by_rejection_are_pinned_and_reserve_all():
    s = sched(k=2, pin=True)
    hot = Req("hot", [3] * 10, Sampling(max_tokens=20, temperature=0.7))
    assert s.pinned(hot) and s.admit_tokens(hot) == s.reserve_tokens(hot) == 10 + 20 + 2
    assert not s.pinned(Req("cold", [3] * 10))
    assert not sched(k=2, pin=False).pinned(hot)  # coupled sampling (adaptive K)
    assert not sched(k=0, pin=True).pinned(hot)  # plain decoding
    s.queue.append(hot)
    admit(s, 0)
    with pytest.raises(RuntimeError, match="page pool"):
        s.victim()  # a pinned request alone never yields


def test_counters_and_the_last_wave():
    s = sched(k=2)
    s.queue.extend([Req("a", [3] * 4, Sampling(max_tokens=10))])
    admit(s, 0)
    delta = s.observe(steps=np.array([3, 9]), accepted=np.array([[2, 1], [5, 5]]),
                      verified=np.array([[3, 3], [9, 9]]), generated=np.array([6, 0]))
    assert delta.tolist() == [[3, 2, 1, 3, 3], [0, 0, 0, 0, 0]]  # free slots count nothing
    remaining, acc, tried = s.last_wave()
    assert remaining.tolist() == [4] and acc.tolist() == [[2, 1]] and tried.tolist() == [[3, 3]]
    assert s.abort() == [0] and s.alloc.free_pages() == 8 and not s.queue
