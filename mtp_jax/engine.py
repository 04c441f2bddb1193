"""The request loop: `Engine` runs requests with continuous batching and yields results.

Between dispatches the host admits queued requests into free slots (scheduler.py: which
requests, on which pages, whom to preempt when the pool runs out) and prefills up to
`prefill_batch` admitted together, a row each of every forward (programs.py: the compiled
programs and the decode state). Then one dispatch runs up to `steps_per_dispatch`
speculative steps on device (with adaptive speculation, of the step kind
`mtp_jax.adaptive` picks for it; every process of a multi-host run takes process 0's
choice); after it the host collects finished requests (stop ids, budget, max_model_len and
NaN checks all happen on device; stop *strings* are matched here on the decoded text) and
releases their pages. After `warmup()` nothing recompiles.
"""

from __future__ import annotations

import functools
import time
from typing import Iterable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .adaptive import KController
from .config import EngineConfig, SamplingParams, SpecConfig
from .programs import Runner, engine_config
from .requests import Request, Result, error_result, finished, unrun_result
from .scheduler import Limits, Scheduler
from .step import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, greedy_steps

_REASONS = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ERROR: "error"}


def _part(part: str, name: str, settable: bool = False) -> property:
    """The attribute `name` of the engine's runner or scheduler, as the engine's own."""
    return property(lambda self: getattr(getattr(self, part), name),
                    (lambda self, v: setattr(getattr(self, part), name, v)) if settable
                    else None)


class Engine:
    """Engine(model, spec=SpecConfig(...), max_batch=..., max_model_len=..., mesh=None, ...).

    `mesh`: None (one device) or a `jax.sharding.Mesh` with axes ('dp', 'tp') or
    ('dp', 'ep', 'tp') (see `mtp_jax.sharding.make_mesh`): params and KV sharded over tp,
    routed experts over ep, slots over dp.
    """

    def __init__(self, model, spec: SpecConfig = SpecConfig(), config: Optional[EngineConfig] = None,
                 *, mesh=None, **overrides):
        spec = spec.resolve(model.config)  # "auto" -> adaptive up to the module count
        self.runner = Runner(model, spec, engine_config(model, config, overrides), mesh)
        eng, static = self.config, self.runner.static
        self.sched = Scheduler(self.layout, Limits(
            eng.max_batch, eng.max_model_len, spec.k, model.config.vocab_size,
            eng.max_stop_ids, model.stop_token_ids, pin_sampled=not static.coupled,
            prefix_cache=eng.prefix_cache, write_ahead=spec.write_ahead))
        self.compile_seconds = 0.0
        self.control = KController(spec.k) if spec.adaptive else None
        self.step_prior = None  # seconds per step of each kind at warmup (adaptive only)

    # the runner's and the scheduler's parts, as the engine's own
    state, progs = (_part("runner", n, settable=True) for n in ("state", "progs"))
    spec, config, mesh, layout, static = (_part("runner", n) for n in (
        "spec", "config", "mesh", "layout", "static"))
    buckets, row_buckets, prefill_programs, chunks = (_part("runner", n) for n in (
        "buckets", "row_buckets", "prefill_programs", "chunks"))  # the prefill plan
    slots, alloc = (_part("sched", n, settable=True) for n in ("slots", "alloc"))
    queue, stats = _part("sched", "queue"), _part("sched", "stats")
    # why prefix caching is off though configured (None: on, or not asked for)
    prefix_cache_off = _part("sched", "cache_off")

    @property
    def model(self):
        return self.runner.model

    @model.setter
    def model(self, model) -> None:
        """Other weights of the same configuration (the compiled programs still apply);
        the cached prompt blocks were computed with the old ones and are forgotten."""
        self.runner.model = model
        self.clear_prefix_cache()

    def check(self, req: Request) -> Optional[str]:
        """A clear message if the request can never run, else None."""
        return self.sched.check(req)

    def cache_sizes(self) -> dict:
        """Compiled-program cache sizes (for checking that nothing recompiles)."""
        return self.runner.cache_sizes()

    @property
    def greedy_steps(self) -> bool:
        """Whether dispatches whose running rows are all greedy take the step programs
        without the sampled paths (`step.greedy_steps`)."""
        return greedy_steps(self.config)

    # ----------------------------------------------------------------- compile
    def warmup(self, requests: Iterable[Request] = ()) -> float:
        """Compile every program (all prefill buckets and row counts) on idle slots;
        returns seconds. Again after `jax.clear_caches()` dropped the executables, and when
        the queued requests need a step-program variant not yet compiled (greedy or
        sampled, `greedy_steps`). `requests`: a job about to be streamed, whose variants
        are compiled now as well as the queued requests' (a caller that times its compile
        apart passes them, so that the job's run compiles nothing)."""
        variants = self._step_variants(requests)
        if self.runner.is_warm(variants):
            return 0.0
        t0 = time.perf_counter()
        prior = self.runner.warmup(
            variants, self.prefill_programs(), self._admission(0, _DUMMY, self._no_pages, 0),
            self._padding, timed=self.control is not None)
        if self.control is not None:  # the adaptive controller's cost prior
            self.step_prior = self.control.prior_cost = prior
        self.compile_seconds += time.perf_counter() - t0
        return self.compile_seconds

    def _step_variants(self, requests: Iterable[Request] = ()) -> tuple:
        """The step-program variants the queued requests and `requests` need."""
        return self.runner.step_variants([*self.queue, *requests])

    def reset_control(self) -> None:
        """Forget what adaptive speculation learned on earlier jobs (acceptance, costs,
        schedule). No-op for a fixed K."""
        if self.control is not None:
            self.control = KController(self.spec.k, prior_cost=self.step_prior)

    # --------------------------------------------------------------- admission
    @property
    def _no_pages(self) -> list:
        return [[] for _ in self.layout.groups]

    @functools.cached_property
    def _padding(self) -> tuple:
        """The admit row of a padding row: slot max_batch (dropped), nothing written."""
        return self._admission(self.config.max_batch, _DUMMY, self._no_pages, 0)

    def _admission(self, slot: int, req: Request, pages: list, limit: Optional[int] = None,
                   shared: int = 0) -> tuple:
        """The host arrays that admit `req` into `slot` on its reserved pages (the first
        `shared` of them cached blocks): one row of its prefill batch's admit call.
        `limit`: KV positions it may write (default: its reservation)."""
        sched = self.sched
        tokens = sched.admit_tokens(req) if limit is None else limit
        return self.runner.admission(slot, req, pages, tokens, sched.budget(req),
                                     sched.stop_ids(req), shared)

    def _fill_slots(self, out: list) -> None:
        """Admit queued requests into free slots, in order, prefilling up to
        `prefill_batch` of them together. A request whose prompt starts with blocks that
        an admission of the batch will prefill waits for that prefill (the batch runs
        first), so a shared prefix is computed once."""
        batch = []  # scheduler.Admitted
        for slot in range(self.config.max_batch):
            if self.slots[slot] is not None:
                continue
            if batch and self.sched.head_waits():
                self._prefill_batch(batch, out)
                batch = []
            refused = []
            item = self.sched.take(slot, refused)
            out += [error_result(req, why) for req, why in refused]
            if item is None:
                break  # the queue is empty, or its head waits for pages (keep the order)
            try:
                item = item._replace(row=self._admission(
                    slot, item.req, item.pages, shared=item.cached // self.layout.page_size))
            except Exception as e:  # never lose the batch or leak the reservation
                self._refuse([item], e, out)
                continue
            batch.append(item)
            if len(batch) == self.static.prefill_rows:
                self._prefill_batch(batch, out)
                batch = []
        if batch:
            self._prefill_batch(batch, out)

    def _prefill_batch(self, batch: list, out: list) -> None:
        """Prefill the admitted `batch` in one row-padded batch; the slots start running."""
        r = 1 << (len(batch) - 1).bit_length()
        slots = np.full((r,), self.config.max_batch, np.int32)
        prompt_len, cached = np.zeros((r,), np.int32), np.zeros((r,), np.int32)
        allowed = [None] * r  # the first token's ids of a healed prompt (healing.py)
        for i, a in enumerate(batch):
            slots[i], prompt_len[i], cached[i] = a.slot, len(a.req.prompt_ids), a.cached
            heal = a.req.healing
            if heal is not None and a.origin is None:  # a continued one's first is out
                allowed[i] = heal.allowed
        try:
            self.runner.admit([a.row for a in batch], self._padding)
            self._prefill(slots, prompt_len, self.runner.sampled_variant(a.req for a in batch),
                          allowed, cached)
        except Exception as e:
            self._refuse(batch, e, out)
            return
        self.sched.start(batch)

    def _prefill(self, slots: np.ndarray, prompt_len: np.ndarray, sampled: bool = True,
                 allowed: Optional[list] = None, cached: Optional[np.ndarray] = None):
        self.runner.prefill(slots, prompt_len, sampled, allowed, cached)

    def _refuse(self, batch: list, e: Exception, out: list) -> None:
        """Free what failed admissions hold; each request gets an error result."""
        for a in batch:
            self.sched.drop(a)
            out.append(error_result(a.origin.req if a.origin else a.req,
                                   f"could not admit: {type(e).__name__}: {e}"))
        self.runner.release(self.runner.mask([a.slot for a in batch]))

    def abort(self) -> None:
        """Drop queued requests and free every slot (after an interrupted stream)."""
        live = self.sched.abort()
        if any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.state)):
            # Interrupted between a donating dispatch and the assignment of its result:
            # the state's buffers are gone, so start from a fresh one (every slot is free)
            # whose pages hold nothing a cached block could be read from.
            self.state = self.runner.init_state()
            self.sched.clear_cache()
        elif live:
            self.runner.release(self.runner.mask(live))

    def clear_prefix_cache(self) -> None:
        """Forget the prompt blocks cached by earlier jobs (between the runs of a
        benchmark, whose later runs would otherwise read every prompt from the cache)."""
        if self.sched.running():
            raise RuntimeError("clear_prefix_cache() while requests run")
        self.sched.clear_cache()

    # -------------------------------------------------------------- collection
    def _collect(self) -> list:
        st, fetch = self.state, self.runner.fetch
        finish, ngen, steps, acc, tried = fetch(
            (st.finish, st.num_generated, st.steps, st.accepted, st.drafted))
        self._ready = time.perf_counter()  # the dispatch's steps are done
        self._delta = self.sched.observe(steps, acc, tried, ngen)
        results = []
        finish, unrun = self._poisoned(np.array(finish), results)
        # finished slots, and running ones whose stop strings the host must look for
        look = [i for i, x in enumerate(self.slots)
                if x is not None and (int(finish[i]) in _REASONS or x.stop_strings)]
        out_tokens = np.asarray(fetch(st.out_tokens)) if look else None
        done = np.zeros((self.config.max_batch,), bool)
        for i in look:
            n = 0 if i in unrun else ngen[i]
            res = finished(self.slots[i], self.spec.k, out_tokens[i, :n].tolist(),
                           _REASONS.get(int(finish[i])), steps[i] if n else 0,
                           acc[i] * bool(n), tried[i] * bool(n), self.model.tokenizer)
            if res is not None:
                results.append(res)
                done[i] = True
                self.sched.finish(i)
        if done.any():
            self.runner.release(done)
        return results

    def _poisoned(self, finish: np.ndarray, results: list) -> tuple:
        """(`finish`, slots to end unrun): the requests that read a cached block whose
        prompt met non-finite values end as errors with no tokens from that admission, as
        they would without the cache (computing the same prefix themselves); those waiting
        to continue after a preemption get their error result in `results`."""
        errors = [i for i, x in enumerate(self.slots)
                  if x is not None and finish[i] == FINISH_ERROR]
        unrun = set()
        if not errors or self.sched.cache is None:
            return finish, unrun
        bad_from = self.runner.fetch(self.state.bad_from)
        for i in errors:
            slots, waiting = self.sched.poison(i, int(bad_from[i]))
            for j in slots:
                finish[j] = FINISH_ERROR
                unrun.add(j)
            results += [unrun_result(before, self.spec.k) for before in waiting]
        return finish, unrun

    # --------------------------------------------------------------------- API
    def stream(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Run requests with continuous batching; yield each Result as it finishes.

        If the consumer stops early or the run is interrupted, the remaining requests are
        dropped and their slots freed, so the engine is ready for the next call."""
        for r in requests:
            self.queue.append(r)
        if not self.queue:
            return
        self.sched.group_queue()
        try:
            self.warmup()
            while self.queue or self.sched.running():
                out = []
                admitted = self.sched.admissions
                self._fill_slots(out)
                admitted = self.sched.admissions != admitted
                yield from out
                if not self.sched.running():
                    continue
                n = self.config.steps_per_dispatch
                kind = self.static.k
                if self.control:
                    kind = self.control.choose(None if self.queue else self.sched.last_wave())
                    n = self.control.steps(n, len(self.sched.running()))
                    kind, n = self.runner.agree(kind, n)  # process 0's choice
                self._hold_pages(n)
                running = len(self.sched.running())
                self.stats["max_running"] = max(self.stats["max_running"], running)
                # after an admission the dispatch would also wait for its prefills: a
                # measurement waits for them first and times the steps alone, others go
                # untimed
                timed = not admitted or (self.control is not None and self.control.probe)
                sampled = self.runner.sampled_variant(self.slots[i].req
                                                      for i in self.sched.running())
                # a program's first execution costs several later ones (on a CPU): that
                # dispatch goes untimed
                first = (kind, sampled) not in self.runner.executed
                self.runner.executed.add((kind, sampled))
                timed = timed and not first
                if admitted and timed:
                    jax.block_until_ready(self.state)
                t0 = time.perf_counter()
                self.state = self.progs.steps(kind, sampled)(self.model.params, self.state,
                                                             jnp.int32(n))
                done = self._collect()
                seconds = time.perf_counter() - t0
                if self.control:
                    k, d = self.static.k, self._delta.sum(0)
                    self.control.update(kind, self._ready - t0 if timed else 0.0,
                                        int(self._delta[:, 0].max()),
                                        d[1: k + 1], d[k + 1:])
                yield from done
                self.stats["dispatch_seconds"] += seconds
                self.stats["dispatches"] += 1
        finally:
            self.abort()

    # ------------------------------------------------------------------ paging
    def _hold_pages(self, steps: int) -> None:
        """Give every running request the pages the next dispatch of `steps` steps can
        write; preempt the most recently admitted unpinned ones while the pool cannot."""
        while True:
            need = self.sched.needs(steps)
            if not need:
                return
            grown = self.sched.grow(need)
            if grown is not None:
                self.runner.grow(*grown)
                return
            self._preempt(self.sched.victim())

    def _preempt(self, slot: int) -> None:
        """Free `slot` and queue its request again, first, to continue from its tokens."""
        st = self.state
        ngen, steps, acc, tried, toks = self.runner.fetch(
            (st.num_generated, st.steps, st.accepted, st.drafted, st.out_tokens))
        self.sched.preempt(slot, np.asarray(toks)[slot, : int(ngen[slot])], steps[slot],
                           acc[slot], tried[slot])
        self.runner.release(self.runner.mask([slot]))

    def generate(self, prompts, sampling: Optional[SamplingParams] = None) -> list[Result]:
        """Generate for prompts (token-id lists, strings, or Requests); results in order.

        A prompt that cannot run (wrong type, untokenizable text, out-of-vocabulary ids, too
        long) gets an error Result in its place; the rest of the batch runs."""
        reqs, errors, ids_given = [], {}, []
        for i, p in enumerate(prompts):
            req = p if isinstance(p, Request) else Request(i, p, sampling or SamplingParams())
            ids_given.append(req.id)
            ids = req.prompt_ids
            if isinstance(p, str):  # text prompts; a Request's prompt_ids must be ids
                if self.model.tokenizer is None:
                    errors[i] = "text prompts need a tokenizer (tokenizer.json)"
                else:
                    try:
                        ids = self.model.tokenizer.encode(ids).ids
                    except Exception as e:  # the tokenizer refuses e.g. lone surrogates
                        errors[i] = f"cannot tokenize the prompt: {e}"
            # run under the batch index, so equal ids never swap results
            reqs.append(Request(i, ids, req.sampling, req.healing))
        results = {i: error_result(reqs[i], msg) for i, msg in errors.items()}
        for res in self.stream([r for r in reqs if r.id not in errors]):
            results[res.id] = res
        for i, res in results.items():
            res.id = ids_given[i]
        return [results[i] for i in range(len(reqs))]


_DUMMY = Request(None, [0])  # the warmup's slot and the padding rows: one token, greedy

__all__ = ["Engine", "Request", "Result"]
