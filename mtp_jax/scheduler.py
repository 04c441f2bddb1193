"""Continuous batching on the host: the queue, the slots, KV pages, preemption.

Plain Python and numpy (no jax), testable without a device: the engine (engine.py) asks
it what to admit and which pages to hand out, and turns its answers into device calls.

Requests queue in order; the head of the queue is admitted when a slot is free and the
pages of its prompt (+ K positions) fit the pools. KV pages are held as sequences grow:
before each dispatch every running request is given the pages that dispatch can write
(its length + steps * (K + 1) + K, capped at prompt + max_tokens + K), so the decode loop
never allocates. When the pool cannot cover that, the most recently admitted running
request is preempted: its pages are freed and it goes back to the head of the queue with
its generated tokens appended to its prompt, to be prefilled again and continued (same
ids, seeds and positions, so the same output); its result joins both parts. Sampled
requests verified by rejection sampling (a fixed K) hold their whole reservation from
admission instead and are never preempted: their tokens depend on the drafts, which a
continuation would draw anew.

With prefix caching (prefix_cache.py) a request's first pages may be cached blocks of an
earlier prompt with the same tokens: it holds a reference to them instead of pages of its
own, and its prefill starts after them. The blocks of its prompt it prefills itself are
cached for the requests after it. Waiting requests are ordered so that those sharing a
prefix are admitted together (`group_queue`).

A request is any dataclass with `id`, `prompt_ids` and `sampling` (max_tokens,
temperature, stop_token_ids), as engine.Request.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple, Optional

import numpy as np

from .pages import PageAllocator
from .prefix_cache import PrefixCache


@dataclasses.dataclass
class Resumed:
    """What a preempted request had done before: its original request, the tokens it
    generated, and its statistics."""

    req: Any
    tokens: list
    steps: int
    accepted: list
    drafted: list
    cached: int = 0  # prompt tokens its first admission took from the prefix cache
    read: tuple = ()  # the cached blocks its earlier admissions read


@dataclasses.dataclass
class Live:
    """A running request in its slot."""

    req: Any  # as admitted (a preempted request: prompt + its earlier tokens)
    pages: list
    stop_strings: tuple
    order: int = 0  # admission count: the highest is preempted first
    tokens: int = 0  # KV positions its pages cover
    pinned: bool = False  # holds its whole reservation and is never preempted
    origin: Optional[Resumed] = None  # set for a request preempted before
    blocks: list = dataclasses.field(default_factory=list)  # cached blocks its first pages are
    cached: int = 0  # prompt tokens this admission took from the prefix cache

    def before(self, k: int) -> Resumed:
        """What the request had done before this admission (nothing, if never preempted)."""
        return self.origin or Resumed(self.req, [], 0, [0] * k, [0] * k, self.cached)


class Admitted(NamedTuple):
    """A request admitted into a slot whose prefill has not run yet."""

    slot: int
    req: Any
    pages: list
    tokens: int  # KV positions its pages cover
    origin: Optional[Resumed]  # set for a request preempted before
    row: tuple = ()  # its row of the batch's admit call (host arrays)
    blocks: tuple = ()  # cached blocks its first pages are: read (ready) or its to prefill
    cached: int = 0  # prompt tokens whose KV the cache holds: its prefill starts there


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the scheduler needs to know of the engine: sizes and the pinning rule."""

    max_batch: int
    max_model_len: int
    k: int  # drafts per step (the largest K when adaptive)
    vocab_size: int
    max_stop_ids: int
    eos_token_ids: tuple = ()
    pin_sampled: bool = False  # sampled requests verify by rejection sampling at a fixed K
    prefix_cache: bool = False  # share the KV of full prompt blocks (prefix_cache.py)
    # KV positions past the committed length a step may write besides the committed
    # tokens (SpecConfig.write_ahead: a draft tree's nodes); None: k
    write_ahead: Optional[int] = None

    @property
    def ahead(self) -> int:
        return self.k if self.write_ahead is None else self.write_ahead


class Scheduler:
    """Slots, queue and page pools of one engine (`layout`: its kv_cache.KVLayout)."""

    def __init__(self, layout, limits: Limits):
        self.layout, self.limits = layout, limits
        b, k = limits.max_batch, limits.k
        # why prefix caching is off though asked for (None: on, or not asked for)
        self.cache_off = PrefixCache.supports(layout) if limits.prefix_cache else None
        self.cache = PrefixCache(layout, k) if limits.prefix_cache and not self.cache_off \
            else None
        self.alloc = PageAllocator(layout, self.cache)
        self.keys: dict = {}  # id(queued request) -> its blocks' keys
        self.slots: list[Optional[Live]] = [None] * b
        self.queue: collections.deque = collections.deque()
        self.resumed: dict = {}  # id(queued request) -> Resumed, for preempted requests
        self.admissions = 0
        self.stats = collections.Counter()
        # per-slot counters as of the last collection: (steps, accepted [K], verified [K])
        # and generated tokens
        self.seen = np.zeros((b, 2 * k + 1), np.int64)
        self.generated = np.zeros((b,), np.int64)

    # ------------------------------------------------------------------ rules
    def running(self) -> list:
        """Slots holding a request."""
        return [i for i, x in enumerate(self.slots) if x is not None]

    def stop_ids(self, req) -> list:
        return sorted(set(req.sampling.stop_token_ids) | set(self.limits.eos_token_ids))

    def budget(self, req) -> int:
        return min(req.sampling.max_tokens, self.limits.max_model_len - len(req.prompt_ids))

    def reserve_tokens(self, req) -> int:
        """KV positions the request can ever write: prompt + budget + K (a tree: its
        write-ahead)."""
        lim = self.limits
        return min(len(req.prompt_ids) + self.budget(req) + lim.ahead,
                   lim.max_model_len + lim.ahead)

    def admit_tokens(self, req) -> int:
        """KV positions held at admission: the prompt, the first token and the first
        draft window's writes (the dispatches grow it); a pinned request's whole need."""
        if self.pinned(req):
            return self.reserve_tokens(req)
        return min(len(req.prompt_ids) + 1 + self.limits.ahead, self.reserve_tokens(req))

    def pinned(self, req) -> bool:
        """A sampled request verified by rejection sampling (a fixed K) is never
        preempted: continuing it from recomputed KV would draw other drafts, and its
        tokens depend on the drafts (a greedy one's do not, nor do those of coupled
        sampling under adaptive K), so it would not reproduce its seed's output."""
        return self.limits.k > 0 and self.limits.pin_sampled and req.sampling.temperature > 0

    def check(self, req) -> Optional[str]:
        """A clear message if the request can never run, else None."""
        lim = self.limits
        ids = req.prompt_ids
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)) or len(ids) == 0:
            return "empty prompt" if isinstance(ids, (list, tuple)) else \
                "prompt_ids must be a list of integers"
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            return "prompt_ids must be a list of integers"
        bad = [int(t) for t in ids if not 0 <= t < lim.vocab_size]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary [0, {lim.vocab_size})"
        if len(ids) >= lim.max_model_len:
            return (f"prompt has {len(ids)} tokens; max_model_len is {lim.max_model_len} "
                    "(prompt + at least one generated token must fit)")
        stops = self.stop_ids(req)
        if len(stops) > lim.max_stop_ids:
            return f"{len(stops)} stop token ids; at most {lim.max_stop_ids} are supported"
        need = self.reserve_tokens(req)
        if not self.alloc.ever_fits(need):
            return (f"request needs {need} KV positions, more than the page pool can ever "
                    f"hold ({self.layout.groups[0].num_pages - 1} pages of "
                    f"{self.layout.page_size})")
        return None

    # -------------------------------------------------------------- admission
    def take(self, slot: int, refused: list) -> Optional[Admitted]:
        """The head of the queue with its pages reserved for `slot`, or None if nothing can
        be admitted now (the queue is empty, or its head waits for pages: the order is
        kept). Requests that can never run are dropped, as (request, why) in `refused`."""
        while self.queue:
            req = self.queue[0]
            err = self.check(req)
            if err:
                self.queue.popleft()
                refused.append((req, err))
                continue
            tokens = self.admit_tokens(req)
            hits = [b for b in self._hits(req) if b.ready]
            if self.cache:
                self.cache.acquire(hits)
            pages = self.alloc.reserve(tokens, [[b.pages[g] for b in hits]
                                                for g in range(len(self.layout.groups))])
            if pages is None:
                if self.cache:
                    self.alloc.release_blocks(self.cache.release(hits))
                return None
            self.queue.popleft()
            self.seen[slot] = 0
            self.generated[slot] = 0
            blocks = hits + self._register(req, pages, len(hits))
            cached = len(hits) * self.layout.page_size
            self.stats["prompt_tokens"] += len(req.prompt_ids)
            self.stats["cached_tokens"] += cached
            return Admitted(slot, req, pages, tokens, self.resumed.pop(id(req), None),
                            blocks=tuple(blocks), cached=cached)
        return None

    # ----------------------------------------------------------- prefix cache
    def _keys(self, req) -> list:
        """The keys of the request's prompt blocks (none for a request `check` refuses)."""
        held = self.keys.get(id(req))
        if held is None or held[0] is not req:
            keys = self.cache.keys(req.prompt_ids) if self.check(req) is None else []
            held = self.keys[id(req)] = (req, keys)
        return held[1]

    def _hits(self, req) -> list:
        """The cached blocks the request's prompt starts with (ready or not)."""
        return self.cache.hits(self._keys(req)) if self.cache else []

    def head_waits(self) -> bool:
        """Whether the queue's head starts with a block an admission not yet prefilled
        registered: it waits for that prefill rather than computing the prefix again."""
        return bool(self.queue) and any(not b.ready for b in self._hits(self.queue[0]))

    def _register(self, req, pages: list, start: int) -> list:
        """Cache the request's blocks after its `start` hits on the pages it prefills them
        into (not ready until its prefill ran); the blocks registered."""
        keys = self._keys(req) if self.cache else []
        self.keys.pop(id(req), None)
        out = []
        for j in range(start, len(keys)):
            block = self.cache.register(keys[j], tuple(ids[j] for ids in pages))
            if block is None:  # held already (not reachable from this prompt's hits)
                break
            out.append(block)
        return out

    def drop(self, item: Admitted) -> None:
        """Free an admission whose prefill did not run: its hits lose a reference, the
        blocks it registered are forgotten, its other pages go back to the pool."""
        hits = [b for b in item.blocks if b.ready]
        if self.cache:
            self.alloc.release_blocks(self.cache.release(hits))
            self.cache.forget([b for b in item.blocks if not b.ready])
        self.alloc.release([ids[len(hits):] for ids in item.pages])

    def poison(self, slot: int, position: int) -> tuple:
        """The request in `slot` met a non-finite hidden at prompt `position`: its blocks
        from there on hold unusable KV and leave the cache. The other requests that read
        any of them would have met the same values computing their prompt: (the running
        ones' slots, to end with that error; the preempted ones waiting to continue,
        `Resumed`, taken off the queue)."""
        if not self.cache:
            return [], []
        live = self.slots[slot]
        ps = self.layout.page_size
        self.cache.kill([b for j, b in enumerate(live.blocks) if (j + 1) * ps > position])
        slots = [i for i, x in enumerate(self.slots) if x is not None and i != slot
                 and any(b.dead for b in x.blocks)]
        waiting = [r for r in self.queue if id(r) in self.resumed
                   and any(b.dead for b in self.resumed[id(r)].read)]
        for r in waiting:
            self.queue.remove(r)
        return slots, [self.resumed.pop(id(r)) for r in waiting]

    def group_queue(self) -> None:
        """Order the waiting requests (not those continuing after a preemption, which stay
        first) so that those sharing prompt blocks are next to each other: by the first
        appearance of each of their blocks' keys, as a walk of the prefix tree in arrival
        order. Outputs do not depend on the order."""
        if self.cache is None:
            return
        resumed = [r for r in self.queue if id(r) in self.resumed]
        waiting = [r for r in self.queue if id(r) not in self.resumed]
        first = {}
        for i, r in enumerate(waiting):
            for key in self._keys(r):
                first.setdefault(key, i)
        order = sorted(range(len(waiting)), key=lambda i: [first[key] for key in self._keys(
            waiting[i])] or [i])
        self.queue.clear()
        self.queue.extend(resumed + [waiting[i] for i in order])

    def reset(self) -> None:
        """Idle: no queue, free slots, every page in the pool, nothing cached (the KV pages
        were reset)."""
        self.queue.clear()
        self.resumed.clear()
        self.keys.clear()
        self.slots = [None] * self.limits.max_batch
        if self.cache:
            self.cache = PrefixCache(self.layout, self.limits.k)
        self.alloc = PageAllocator(self.layout, self.cache)

    def clear_cache(self) -> None:
        """Forget every cached block (the KV pages were reset); no request may run."""
        if self.cache:
            self.alloc.release_blocks(self.cache.clear())

    def pages_in_use(self) -> int:
        """Pages of the first group the running requests hold, each shared page counted
        once (idle cached blocks not counted)."""
        return self.layout.groups[0].num_pages - 1 - self.alloc.free_pages(0)

    def start(self, batch: list) -> None:
        """The admitted `batch` was prefilled: its slots run (the first token is out), the
        blocks it registered can be read."""
        for a in batch:
            self.admissions += 1
            for block in a.blocks:
                block.ready = True
            self.slots[a.slot] = Live(a.req, a.pages, tuple(a.req.sampling.stop),
                                      order=self.admissions, tokens=a.tokens,
                                      origin=a.origin, pinned=self.pinned(a.req),
                                      blocks=list(a.blocks), cached=a.cached)
            self.generated[a.slot] = 1
        held = sum(len(x.pages[0]) for x in self.slots if x is not None)
        self.stats["peak_pages"] = max(self.stats["peak_pages"], self.pages_in_use())
        self.stats["peak_pages_per_request"] = max(self.stats["peak_pages_per_request"], held)

    def finish(self, slot: int) -> None:
        """Free a slot and its pages (its cached blocks stay cached, one reader fewer)."""
        live = self.slots[slot]
        if self.cache:
            self.alloc.release_blocks(self.cache.release(live.blocks))
        self.alloc.release([ids[len(live.blocks):] for ids in live.pages])
        self.slots[slot] = None

    def abort(self) -> list:
        """Drop the queue and free every slot; the slots that were running."""
        self.queue.clear()
        self.resumed.clear()
        self.keys.clear()
        live = self.running()
        for i in live:
            self.finish(i)
        return live

    def observe(self, steps, accepted, verified, generated) -> np.ndarray:
        """Record the device's per-slot counters after a dispatch; their growth since the
        last one [B, 2K + 1] (steps, accepted per depth, verified per depth), zero on free
        slots."""
        self.generated = np.array(generated)
        now = np.concatenate([np.asarray(steps)[:, None], accepted, verified], axis=1)
        live = np.asarray([x is not None for x in self.slots])
        delta = np.where(live[:, None], now - self.seen, 0)
        self.seen = now
        return delta

    def last_wave(self) -> tuple:
        """(remaining tokens, accepted [n, K], verified [n, K]) of the running requests, as
        of the last collection (the adaptive controller's view of the job's last wave)."""
        live, k = self.running(), self.limits.k
        seen = self.seen[live]
        remaining = [self.budget(self.slots[i].req) - self.generated[i] for i in live]
        return np.asarray(remaining), seen[:, 1: k + 1], seen[:, k + 1:]

    # ----------------------------------------------------------------- paging
    def needs(self, steps: int) -> dict:
        """{slot: KV positions} of the running requests whose pages do not cover what the
        next dispatch of `steps` steps can write."""
        k, need = self.limits.k, {}
        for i, x in enumerate(self.slots):
            if x is None:
                continue
            length = len(x.req.prompt_ids) + int(self.generated[i])
            want = min(length + steps * (k + 1) + self.limits.ahead, self.reserve_tokens(x.req))
            if want > x.tokens:
                need[i] = want
        return need

    def grow(self, need: dict) -> Optional[tuple]:
        """Extend the slots' pages to `need` {slot: tokens}, all or none: the device's
        update (slot mask [B], table rows [B, width], write limits [B], the new pages
        [width], null-padded), or None when the pool cannot cover them."""
        grown, fresh = {}, []
        for i, tokens in need.items():
            new = self.alloc.grow(self.slots[i].pages, tokens)
            if new is None:  # undo: give back what this round handed out
                for j, pages in grown.items():
                    self.alloc.release(pages)
                    for held, extra in zip(self.slots[j].pages, pages):
                        del held[len(held) - len(extra):]
                return None
            grown[i] = new
            fresh += new[0]
        b, w = self.limits.max_batch, self.layout.width
        rows, limit = np.zeros((b, w), np.int32), np.zeros((b,), np.int32)
        for i, tokens in need.items():
            rows[i] = self.alloc.table_rows(self.slots[i].pages)[0]
            limit[i] = tokens
            self.slots[i].tokens = tokens
        pages = np.zeros((w,), np.int32)
        pages[: len(fresh)] = fresh[:w]
        self.stats["pages_grown"] += len(fresh)
        return self.mask(need), rows, limit, pages

    def victim(self) -> int:
        """The slot to preempt: the most recently admitted unpinned one. Only unpinned
        requests grow, so one of them (maybe the asker) can yield; a request alone always
        fits (`check` refuses one that never can)."""
        victims = [i for i, x in enumerate(self.slots) if x is not None and not x.pinned]
        if not victims or len(self.running()) == 1:
            raise RuntimeError("the KV page pool cannot hold one request's next dispatch")
        return max(victims, key=lambda i: self.slots[i].order)

    def preempt(self, slot: int, tokens, steps: int, accepted, drafted) -> None:
        """Free `slot` and queue its request again, first, to continue from the `tokens`
        it generated in this admission (with its `steps` and per-depth counts)."""
        item = self.slots[slot]
        before = item.before(self.limits.k)
        new = [int(t) for t in tokens]
        done = Resumed(before.req, before.tokens + new, before.steps + int(steps),
                       [a + int(x) for a, x in zip(before.accepted, accepted)],
                       [a + int(x) for a, x in zip(before.drafted, drafted)], before.cached,
                       before.read + tuple(item.blocks))
        sp = item.req.sampling
        again = dataclasses.replace(item.req, prompt_ids=list(item.req.prompt_ids) + new,
                                    sampling=dataclasses.replace(
                                        sp, max_tokens=sp.max_tokens - len(new)))
        self.finish(slot)
        self.resumed[id(again)] = done
        self.queue.appendleft(again)
        self.stats["preemptions"] += 1

    def mask(self, slots) -> np.ndarray:
        m = np.zeros((self.limits.max_batch,), bool)
        m[list(slots)] = True
        return m


__all__ = ["Scheduler", "Limits", "Live", "Admitted", "Resumed"]
