"""The host side: requests, slots, admission, prefill, multi-step dispatches, results.

Continuous batching over `max_batch` fixed slots. Requests queue in order; the head of
the queue is admitted when a slot is free and the pages of its prompt (+ K positions) fit
the pools. KV pages are held as sequences grow: before each dispatch every running
request is given the pages that dispatch can write (its length + steps * (K + 1) + K,
capped at prompt + max_tokens + K), so the decode loop never allocates. When the pool cannot cover
that, the most recently admitted running request is preempted: its pages are freed and it
goes back to the head of the queue with its generated tokens appended to its prompt, to be
prefilled again and continued (same ids, seeds and positions, so the same output); its
result joins both parts. Sampled requests verified by rejection sampling (a fixed K) hold
their whole reservation from admission instead and are never preempted: their tokens
depend on the drafts, which a continuation would draw anew. Admission runs the chunked
prefill (target and MTP history chunk by chunk, then the first drafts) of up to
`prefill_batch` requests admitted together in one batch, a row each of every forward.
Then one dispatch runs up to `steps_per_dispatch` speculative steps on device (with
adaptive speculation, of the step kind `mtp_jax.adaptive` picks for it); between
dispatches the host collects finished requests (stop ids, budget, max_model_len and NaN
checks all happen on device; stop *strings* are matched here on the decoded text) and
releases their pages. Compiled programs depend only on the engine configuration: after
`warmup()` nothing recompiles.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Iterable, Iterator, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import compile_cache
from .adaptive import KController
from .config import ConfigError, EngineConfig, SamplingParams, SpecConfig
from .kv_cache import PageAllocator, check_kernels, make_layout
from .quant import calibrate_kv_scales, mode_of
from .sampling import split_seed
from .sharding import check_mesh, shard_params, state_shardings
from .step import (FINISH_ERROR, FINISH_LENGTH, FINISH_NONE, FINISH_STOP, Static,
                   greedy_dispatches, greedy_steps, init_state, prepare, programs)

_REASONS = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ERROR: "error"}
# Prompt tokens below which a prefill forward costs about the same whatever it carries:
# its matmuls are bound by the weight reads (an H100 reaches its bf16 peak from ~300
# FLOPs per weight byte, i.e. ~300 rows). Sets the shortest chunk of a multi-row prefill.
PREFILL_MIN_TOKENS = 256


@dataclasses.dataclass
class Request:
    id: Any
    prompt_ids: list
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)


@dataclasses.dataclass
class Result:
    id: Any
    token_ids: list
    finish_reason: str  # stop | length | error
    num_prompt_tokens: int
    text: Optional[str] = None
    error: Optional[str] = None
    num_steps: int = 0  # target forwards after prefill
    accepted_per_depth: list = dataclasses.field(default_factory=list)  # counts
    drafted_per_depth: list = dataclasses.field(default_factory=list)  # steps verifying one

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_accepted_length(self) -> float:
        """Generated tokens per target forward (the prefill forward counts as one)."""
        return len(self.token_ids) / (self.num_steps + 1) if self.token_ids else 0.0

    @property
    def verified_per_depth(self) -> list:
        """Steps that verified a draft at each depth (every step, at a fixed K)."""
        return self.drafted_per_depth or [self.num_steps] * len(self.accepted_per_depth)

    @property
    def acceptance_per_depth(self) -> list:
        """Per depth: accepted drafts over the steps that verified a draft there."""
        return [a / t if t else 0.0 for a, t in zip(self.accepted_per_depth,
                                                     self.verified_per_depth)]


@dataclasses.dataclass
class _Live:
    req: Request  # as admitted (a preempted request: prompt + its earlier tokens)
    pages: list
    stop_strings: tuple
    order: int = 0  # admission count: the highest is preempted first
    tokens: int = 0  # KV positions its pages cover
    pinned: bool = False  # holds its whole reservation and is never preempted
    origin: Optional["_Resumed"] = None  # set for a request preempted before

    def before(self, k: int) -> "_Resumed":
        """What the request had done before this admission (nothing, if never preempted)."""
        return self.origin or _Resumed(self.req, [], 0, [0] * k, [0] * k)


class _Admitted(NamedTuple):
    """A request admitted into a slot whose prefill has not run yet."""

    slot: int
    req: Request
    pages: list
    tokens: int  # KV positions its pages cover
    origin: Optional["_Resumed"]  # set for a request preempted before
    row: tuple = ()  # its row of the batch's admit call (`Engine._admission`)


@dataclasses.dataclass
class _Resumed:
    """What a preempted request had done before: its original request, the tokens it
    generated, and its statistics."""

    req: Request
    tokens: list
    steps: int
    accepted: list
    drafted: list


class Engine:
    """Engine(model, spec=SpecConfig(...), max_batch=..., max_model_len=..., mesh=None, ...).

    `mesh`: None (one device) or a `jax.sharding.Mesh` with axes ('dp', 'tp') or
    ('dp', 'ep', 'tp') (see `mtp_jax.sharding.make_mesh`): params and KV sharded over tp,
    routed experts over ep, slots over dp.
    """

    def __init__(self, model, spec: SpecConfig = SpecConfig(), config: Optional[EngineConfig] = None,
                 *, mesh=None, **overrides):
        spec = spec.resolve(model.config)  # "auto" -> adaptive up to the module count
        compile_cache.enable()  # warm starts; $MTP_JAX_COMPILE_CACHE=off disables
        eng = dataclasses.replace(config or EngineConfig(), **overrides)
        # None: rows where matmuls need them to reach peak; never more rows than slots
        # (rounded up to the power of two that runs them)
        rows = eng.prefill_batch or (1 if jax.default_backend() == "cpu" else 8)
        eng = dataclasses.replace(eng, prefill_batch=min(
            rows, 1 << (eng.max_batch - 1).bit_length()))
        scales = None
        if eng.kv_dtype == "fp8":
            if model.kv_scales is None:  # calibrated once per model, kept with it
                model.kv_scales = calibrate_kv_scales(model)
            scales = model.kv_scales
        if mesh is not None:
            check_mesh(model.config, mesh)
            if eng.max_batch % mesh.shape["dp"]:
                raise ConfigError(f"max_batch={eng.max_batch} must be a multiple of dp="
                                  f"{mesh.shape['dp']}")
            model = dataclasses.replace(model, params=shard_params(
                jax.tree_util.tree_map(lambda x: x, model.params), mesh))
        self.model = model
        self.spec = spec
        self.mesh = mesh
        self.config = eng
        k = spec.k
        self.layout = make_layout(model.config, eng, k, model.dtype,
                                  mtp_layers=spec.strategy.modules(k),
                                  scales=scales)
        check_kernels(self.layout, eng, model.config)
        self.static = Static(model.config, spec, eng, self.layout, mesh,
                             weights_quantized=mode_of(model.params) is not None)
        if mesh is None:
            self.progs = programs(self.static, model.graphdef)
        else:
            shape = jax.eval_shape(lambda: init_state(self.static, model.dtype))
            st_sh = state_shardings(shape, mesh, eng.max_batch)
            p_sh = jax.tree_util.tree_map(lambda x: x.sharding, model.params)
            self.progs = programs(self.static, model.graphdef, st_sh, p_sh)
        self._init_state = self.progs.init(model.dtype)
        self.state = self._init_state()
        self.alloc = PageAllocator(self.layout)
        self.slots: list[Optional[_Live]] = [None] * eng.max_batch
        self.queue: collections.deque = collections.deque()
        self.compile_seconds = 0.0
        self._warm = False
        self._warm_variants: set = set()  # step-program variants warmed (sampled or not)
        self.stats = collections.Counter()
        self.control = KController(k) if spec.adaptive else None
        self.step_prior = None  # seconds per step of each kind at warmup (adaptive only)
        self._resumed: dict = {}  # id(queued Request) -> _Resumed, for preempted requests
        self._admissions = 0
        # per-slot counters as of the last collection, for each dispatch's deltas
        self._seen = np.zeros((eng.max_batch, 2 * k + 1), np.int64)
        self._generated = np.zeros((eng.max_batch,), np.int64)

    # ----------------------------------------------------------------- compile
    def buckets(self) -> list[int]:
        """Prefill chunk lengths: powers of two from 16 up to the largest one needed."""
        top = min(self.config.prefill_chunk,
                  max(16, 1 << (self.config.max_model_len - 1).bit_length()))
        return sorted({self._bucket(1 << i) for i in range(top.bit_length())} | {top})

    def row_buckets(self) -> list[int]:
        """Prefill batch sizes (rows of one prefill forward): powers of two up to
        `prefill_batch`."""
        return [1 << i for i in range(self.static.prefill_rows.bit_length())]

    def prefill_programs(self) -> list[tuple]:
        """(rows, chunk length) of every prefill program. A forward of r > 1 rows runs
        chunks of at least PREFILL_MIN_TOKENS / r: below that it is bound by its weight
        reads, so shorter chunks would cost as much and only add compiles. One row keeps
        every chunk length (on CPU, where prefill_batch is 1, short chunks do cost less)."""
        return [(r, c) for r in self.row_buckets() for c in self.buckets()
                if c >= self._chunk(r, 1)]

    def _chunk(self, rows: int, n: int) -> int:
        """The chunk length that runs n prompt tokens per row in a forward of `rows` rows."""
        top = self.buckets()[-1]
        return min(top, max(self._bucket(n), PREFILL_MIN_TOKENS // rows if rows > 1 else 0))

    def warmup(self, requests: Iterable[Request] = ()) -> float:
        """Compile every program (all prefill buckets and row counts) on idle slots;
        returns seconds. Again after `jax.clear_caches()` dropped the executables, and when
        the queued requests need a step-program variant not yet compiled (greedy or
        sampled, `greedy_steps`). `requests`: a job about to be streamed, whose variants
        are compiled now as well as the queued requests' (a caller that times its compile
        apart passes them, so that the job's run compiles nothing)."""
        variants = self._step_variants(requests)
        if (self._warm and set(variants) <= self._warm_variants
                and all(self.cache_sizes().values())):
            return 0.0
        variants = tuple(sorted(self._warm_variants | set(variants)))
        t0 = time.perf_counter()
        p, st = self.model.params, self.state
        # The prefill programs are loaded or compiled without running where the executable
        # store holds them (most buckets go unused by a job); otherwise they run once on
        # padding rows, which write nothing.
        for r, c in self.prefill_programs():
            slots = np.full((r,), self.config.max_batch, np.int32)
            zero = np.zeros((r,), np.int32)
            logits = jnp.zeros((r, self.model.config.vocab_size), jnp.float32)
            out = prepare(self.progs.prefill_target(c), p, st, slots, zero, zero, logits, zero)
            if out is not None:
                st, logits = out
            if self.static.history_apart:
                out = prepare(self.progs.prefill_mtp(c), p, st, slots, zero, zero)
                st = st if out is None else out
            if c == self.buckets()[-1]:
                for sampled in variants:  # the first tokens: the steps' variants
                    out = prepare(self.progs.prefill_finish(sampled), p, st, slots, logits,
                                  zero)
                    st = st if out is None else out
        self.state = st
        # admit a dummy request onto null pages with every KV write dropped (limit 0), run
        # one step of each kind and free the slot again, with the argument types the real
        # calls use. The step bodies must execute here, not only compile: a program's
        # first execution costs several later ones on CPU, which would also mislead the
        # adaptive controller's first timings.
        self._admit([self._admission(0, Request(None, [0]), [[] for _ in self.layout.groups],
                                     limit=0)])
        for kind in self.static.kinds:
            for sampled in variants:
                self.state = self.progs.steps(kind, sampled)(p, self.state, jnp.int32(1))
        if self.control is not None:  # the adaptive controller's cost prior
            self.step_prior = self._time_kinds(sampled=variants[-1])
            self.control.prior_cost = self.step_prior
        b, w = self.config.max_batch, self.layout.width  # the page-growth program, a no-op
        self.state = self.progs.grow(self.state, np.zeros((b,), bool),
                                     np.zeros((b, w), np.int32), np.zeros((b,), np.int32),
                                     np.zeros((w,), np.int32))
        self.state = jax.block_until_ready(self.progs.release(self.state, self._mask([0])))
        self._warm = True
        self._warm_variants = set(variants)
        self.compile_seconds += time.perf_counter() - t0
        return self.compile_seconds

    @property
    def greedy_steps(self) -> bool:
        """Whether dispatches whose running rows are all greedy take the step programs
        without the sampled paths (`step.greedy_steps`)."""
        return greedy_steps(self.config)

    def _sampled(self, reqs) -> bool:
        """Whether steps over these requests need the sampled step programs."""
        return not self.greedy_steps or any(r.sampling.temperature > 0 for r in reqs)

    def _sampled_variant(self, reqs) -> bool:
        """The variant (sampled: True / False) a step dispatch or a prefill batch over these
        requests takes: the greedy programs only where they are warm."""
        return self._sampled(reqs) or False not in self._warm_variants

    def _step_variants(self, requests: Iterable[Request] = ()) -> tuple:
        """The step-program variants (sampled: True / False) the queued requests and
        `requests` need; with none, the greedy one where it exists (temperature 0 is the
        default). Greedy and sampled requests together need both on a GPU, the full
        program alone elsewhere (`step.greedy_dispatches`)."""
        if not self.greedy_steps:
            return (True,)
        need = {self._sampled([r]) for r in [*self.queue, *requests]} or {False}
        if True in need and not greedy_dispatches():
            need = {True}
        return tuple(sorted(need))

    def _time_kinds(self, reps: int = 2, sampled: bool = True) -> Optional[list]:
        """Seconds of one step of each kind on the warmup's dummy slot (least of `reps`);
        None if the dummy ran out of budget (a tiny max_model_len) and a step did nothing."""
        best = [float("inf")] * len(self.static.kinds)
        for _ in range(reps):
            for i, kind in enumerate(self.static.kinds):
                before = int(self.state.num_generated[0])  # also waits for the state
                t0 = time.perf_counter()
                self.state = jax.block_until_ready(self.progs.steps(kind, sampled)(
                    self.model.params, self.state, jnp.int32(1)))
                best[i] = min(best[i], time.perf_counter() - t0)
                if int(self.state.num_generated[0]) == before:
                    return None
        return best

    def reset_control(self) -> None:
        """Forget what adaptive speculation learned on earlier jobs (acceptance, costs,
        schedule). No-op for a fixed K."""
        if self.control is not None:
            self.control = KController(self.spec.k, prior_cost=self.step_prior)

    def cache_sizes(self) -> dict:
        """Compiled-program cache sizes (for checking that nothing recompiles)."""
        variants = self._warm_variants or (True,)
        out = {n: getattr(self.progs, n)._cache_size() for n in ("admit", "release", "grow")}
        out["prefill_finish"] = sum(self.progs.prefill_finish(v)._cache_size()
                                    for v in variants)  # per row count
        out["run_steps"] = sum(self.progs.steps(k, v)._cache_size() for k in self.static.kinds
                               for v in variants)
        apart = self.static.history_apart
        for n in ("prefill_target", "prefill_mtp") if apart else ("prefill_target",):
            fns = [getattr(self.progs, n)(c) for c in self.buckets()]
            out[n] = sum(f._cache_size() for f in fns)  # per chunk length and row count
        return out

    # ------------------------------------------------------------------ checks
    def check(self, req: Request) -> Optional[str]:
        """A clear message if the request can never run, else None."""
        cfg, eng = self.model.config, self.config
        ids = req.prompt_ids
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)) or len(ids) == 0:
            return "empty prompt" if isinstance(ids, (list, tuple)) else \
                "prompt_ids must be a list of integers"
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            return "prompt_ids must be a list of integers"
        bad = [int(t) for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})"
        if len(ids) >= eng.max_model_len:
            return (f"prompt has {len(ids)} tokens; max_model_len is {eng.max_model_len} "
                    "(prompt + at least one generated token must fit)")
        stops = self._stop_ids(req)
        if len(stops) > eng.max_stop_ids:
            return f"{len(stops)} stop token ids; at most {eng.max_stop_ids} are supported"
        need = self._reserve_tokens(req)
        if not self.alloc.ever_fits(need):
            return (f"request needs {need} KV positions, more than the page pool can ever "
                    f"hold ({self.layout.groups[0].num_pages - 1} pages of "
                    f"{self.layout.page_size})")
        return None

    def _stop_ids(self, req: Request) -> list:
        return sorted(set(req.sampling.stop_token_ids) | set(self.model.eos_token_ids))

    def _budget(self, req: Request) -> int:
        return min(req.sampling.max_tokens, self.config.max_model_len - len(req.prompt_ids))

    def _reserve_tokens(self, req: Request) -> int:
        """KV positions the request can ever write: prompt + budget + K."""
        return min(len(req.prompt_ids) + self._budget(req) + self.spec.k,
                   self.config.max_model_len + self.spec.k)

    def _admit_tokens(self, req: Request) -> int:
        """KV positions held at admission: the prompt, the first token and the first
        draft window's writes (the dispatches grow it); a pinned request's whole need."""
        if self._pinned(req):
            return self._reserve_tokens(req)
        return min(len(req.prompt_ids) + 1 + self.spec.k, self._reserve_tokens(req))

    def _pinned(self, req: Request) -> bool:
        """A sampled request verified by rejection sampling (a fixed K) is never
        preempted: continuing it from recomputed KV would draw other drafts, and its
        tokens depend on the drafts (a greedy one's do not, nor do those of coupled
        sampling under adaptive K), so it would not reproduce its seed's output."""
        return self.spec.k > 0 and not self.static.coupled and req.sampling.temperature > 0

    # --------------------------------------------------------------- admission
    def _admission(self, slot: int, req: Request, pages: list, limit: Optional[int] = None
                   ) -> tuple:
        """The host arrays that admit `req` into `slot` on its reserved pages: one row of
        its prefill batch's admit call. `limit`: KV positions it may write (default: its
        reservation)."""
        s, eng = self.static, self.config
        prompt = np.asarray(req.prompt_ids, np.int32)
        buf = np.zeros((s.scratch_len,), np.int32)
        buf[s.offset: s.offset + len(prompt)] = prompt
        stops = np.full((eng.max_stop_ids,), -1, np.int32)
        ids = self._stop_ids(req)
        stops[: len(ids)] = ids
        full = np.zeros((self.layout.width,), np.int32)
        full[: len(pages[0])] = pages[0]
        sp = req.sampling
        tokens = self._admit_tokens(req) if limit is None else limit
        # typed here, so that a request whose fields do not convert fails alone
        i32, f32 = np.int32, np.float32
        return (i32(slot), buf, i32(tokens), i32(self._budget(req)), stops,
                f32(sp.temperature), i32(sp.top_k), f32(sp.top_p),
                np.asarray(split_seed(sp.seed), np.uint32), np.bool_(sp.relaxed),
                np.bool_(self._thinking(prompt)), self.alloc.table_rows(pages), full)

    @functools.cached_property
    def _padding_admission(self) -> tuple:
        """The admit row of a padding row: slot max_batch (dropped), nothing written."""
        return self._admission(self.config.max_batch, Request(None, [0]),
                               [[] for _ in self.layout.groups], limit=0)

    def _admit(self, rows: list) -> None:
        """One admit call for a prefill batch's rows (`_admission`), padded to the
        scratch's rows with slot max_batch: numpy arrays only, so the call is one dispatch."""
        rows = list(rows) + [self._padding_admission] * (self.static.prefill_rows - len(rows))
        cols = [np.stack(col) for col in zip(*rows)]
        cols[-1] = cols[-1].reshape(-1)  # every row's pages, for zeroing
        self.state = self.progs.admit(self.state, *cols)

    def _prefill(self, slots: np.ndarray, prompt_len: np.ndarray, sampled: bool = True
                 ) -> None:
        """Prefill a batch of admitted requests together, a row each (slots [r], padding
        rows max_batch with prompt length 0): the target's chunks, each with the MTP
        history over its positions (`window`: the history's chunks after them), then each
        row's first token and drafts (`sampled` False: every row is greedy). Chunk lengths
        follow the longest remainder."""
        s, p = self.static, self.model.params
        st = self.state
        logits = jnp.zeros((len(slots), self.model.config.vocab_size), jnp.float32)
        history_end = (prompt_len - 1 - s.k).astype(np.int32)  # final windows start here
        for c, start, valid in self.chunks(prompt_len):
            st, logits = self.progs.prefill_target(c)(p, st, slots, start, valid, logits,
                                                      history_end)
        if s.history_apart:
            for c, start, _ in self.chunks(history_end):
                st = self.progs.prefill_mtp(c)(p, st, slots, start, history_end)
        self.state = self.progs.prefill_finish(sampled)(p, st, slots, logits, prompt_len)

    def chunks(self, end: np.ndarray):
        """(chunk length, starts, valid lengths) of each prefill forward over rows whose
        prompts end at `end` [r], until every row is done: chunk lengths follow the
        longest remainder."""
        start = np.zeros_like(end)
        while (start < end).any():
            c = self._chunk(len(end), int((end - start).max()))
            valid = np.clip(end - start, 0, c).astype(np.int32)
            yield c, start, valid
            start = start + valid

    def _thinking(self, prompt) -> bool:
        """Whether the prompt leaves the request inside a thinking phase."""
        spec = self.spec
        if not spec.relaxed_acceptance:
            return False
        marks = [t for t in prompt.tolist() if t in (spec.think_begin_id, spec.think_end_id)]
        return bool(marks) and marks[-1] == spec.think_begin_id

    def _bucket(self, n: int) -> int:
        return min(self.config.prefill_chunk, max(16, 1 << (n - 1).bit_length()))

    def _fill_slots(self, out: list) -> None:
        """Admit queued requests into free slots, in order, prefilling up to
        `prefill_batch` of them together."""
        batch = []  # _Admitted
        for slot in range(self.config.max_batch):
            if self.slots[slot] is not None:
                continue
            item = self._take(slot, out)
            if item is None:
                break  # the queue is empty, or its head waits for pages (keep the order)
            batch.append(item)
            if len(batch) == self.static.prefill_rows:
                self._prefill_batch(batch, out)
                batch = []
        if batch:
            self._prefill_batch(batch, out)

    def _take(self, slot: int, out: list) -> Optional[_Admitted]:
        """The head of the queue, its pages reserved and its admission into `slot`
        prepared (the batch's admit call runs before its prefill), or None if nothing can
        be admitted now.
        Requests that can never run get their error results in `out`."""
        while self.queue:
            req = self.queue[0]
            err = self.check(req)
            if err:
                self.queue.popleft()
                out.append(self._error(req, err))
                continue
            tokens = self._admit_tokens(req)
            pages = self.alloc.reserve(tokens)
            if pages is None:
                return None
            self.queue.popleft()
            item = _Admitted(slot, req, pages, tokens, self._resumed.pop(id(req), None))
            try:
                item = item._replace(row=self._admission(slot, req, pages))
            except Exception as e:  # never lose the batch or leak the reservation
                self._refuse([item], e, out)
                continue
            self._seen[slot] = 0
            self._generated[slot] = 0
            return item
        return None

    def _prefill_batch(self, batch: list, out: list) -> None:
        """Prefill the admitted `batch` in one row-padded batch; the slots start running."""
        r = 1 << (len(batch) - 1).bit_length()
        slots = np.full((r,), self.config.max_batch, np.int32)
        prompt_len = np.zeros((r,), np.int32)
        for i, a in enumerate(batch):
            slots[i], prompt_len[i] = a.slot, len(a.req.prompt_ids)
        try:
            self._admit([a.row for a in batch])
            self._prefill(slots, prompt_len, self._sampled_variant(a.req for a in batch))
        except Exception as e:
            self._refuse(batch, e, out)
            return
        for a in batch:
            self._admissions += 1
            self.slots[a.slot] = _Live(a.req, a.pages, tuple(a.req.sampling.stop),
                                       order=self._admissions, tokens=a.tokens,
                                       origin=a.origin, pinned=self._pinned(a.req))
            self._generated[a.slot] = 1  # the first token, sampled at admission

    def _refuse(self, batch: list, e: Exception, out: list) -> None:
        """Free what failed admissions hold; each request gets an error result."""
        for a in batch:
            self.alloc.release(a.pages)
            out.append(self._error(a.origin.req if a.origin else a.req,
                                   f"could not admit: {type(e).__name__}: {e}"))
        self.state = self.progs.release(self.state, self._mask([a.slot for a in batch]))

    def _mask(self, slots) -> np.ndarray:
        m = np.zeros((self.config.max_batch,), bool)
        m[list(slots)] = True
        return m

    def abort(self) -> None:
        """Drop queued requests and free every slot (after an interrupted stream)."""
        self.queue.clear()
        self._resumed.clear()
        live = [i for i, x in enumerate(self.slots) if x is not None]
        for i in live:
            self.alloc.release(self.slots[i].pages)
            self.slots[i] = None
        if any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.state)):
            # Interrupted between a donating dispatch and the assignment of its result:
            # the state's buffers are gone, so start from a fresh one (every slot is free).
            self.state = self._init_state()
        elif live:
            self.state = self.progs.release(self.state, self._mask(live))

    def _error(self, req: Request, msg: str) -> Result:
        return Result(req.id, [], "error", len(req.prompt_ids) if isinstance(
            req.prompt_ids, (list, tuple, np.ndarray)) else 0, error=msg)

    # -------------------------------------------------------------- collection
    @staticmethod
    def _fetch(tree):
        """Host copies of (possibly process-spanning) arrays; identical on every process."""
        leaves = jax.tree_util.tree_leaves(tree)
        if jax.process_count() == 1 or all(x.is_fully_addressable for x in leaves):
            return jax.device_get(tree)
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(tree, tiled=True)

    def _collect(self) -> list:
        st = self.state
        finish, ngen, steps, acc, tried = self._fetch(
            (st.finish, st.num_generated, st.steps, st.accepted, st.drafted))
        self._ready = time.perf_counter()  # the dispatch's steps are done
        self._generated = np.array(ngen)
        now = np.concatenate([np.asarray(steps)[:, None], acc, tried], axis=1)
        live = np.asarray([x is not None for x in self.slots])
        self._delta = np.where(live[:, None], now - self._seen, 0)
        self._seen = now
        # finished slots, and running ones whose stop strings the host must look for
        look = [i for i, x in enumerate(self.slots)
                if x is not None and (finish[i] != FINISH_NONE or x.stop_strings)]
        out_tokens = np.asarray(self._fetch(st.out_tokens)) if look else None
        done = np.zeros((self.config.max_batch,), bool)
        results = []
        for i in look:
            item = self.slots[i]
            before = item.before(self.spec.k)
            toks = before.tokens + out_tokens[i, : ngen[i]].tolist()
            reason, text, err = _REASONS.get(int(finish[i])), None, None
            found = self._match_stop_string(toks, item.stop_strings) if item.stop_strings \
                else None
            if found is not None:
                toks, text, reason = found[0], found[1], "stop"
            elif reason is None:
                continue  # still running, no stop string yet
            if reason == "error":
                err = "non-finite (NaN or Inf) logits: the request was stopped"
            res = Result(before.req.id, toks, reason, len(before.req.prompt_ids), text=text,
                         error=err, num_steps=before.steps + int(steps[i]),
                         accepted_per_depth=[a + int(x) for a, x in zip(before.accepted, acc[i])],
                         drafted_per_depth=[a + int(x) for a, x in zip(before.drafted, tried[i])])
            if res.text is None and self.model.tokenizer is not None:
                res.text = self.model.tokenizer.decode(toks)
            results.append(res)
            done[i] = True
            self.alloc.release(item.pages)
            self.slots[i] = None
        if done.any():
            self.state = self.progs.release(self.state, done)
        return results

    def _match_stop_string(self, toks, stops):
        """(tokens up to and including the one completing the stop string, text before it)."""
        tok = self.model.tokenizer
        if tok is None:
            return None
        text = tok.decode(toks)
        hits = [text.find(s) for s in stops if s in text]
        if not hits:
            return None
        pos = min(hits)
        for j in range(1, len(toks) + 1):  # shortest prefix whose text holds a stop string
            prefix = tok.decode(toks[:j])
            if any(s in prefix for s in stops):
                return toks[:j], text[:pos]
        return toks, text[:pos]

    # --------------------------------------------------------------------- API
    def stream(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Run requests with continuous batching; yield each Result as it finishes.

        If the consumer stops early or the run is interrupted, the remaining requests are
        dropped and their slots freed, so the engine is ready for the next call."""
        for r in requests:
            self.queue.append(r)
        if not self.queue:
            return
        try:
            self.warmup()
            while self.queue or any(x is not None for x in self.slots):
                out = []
                admitted = self._admissions
                self._fill_slots(out)
                admitted = self._admissions != admitted
                yield from out
                if not any(x is not None for x in self.slots):
                    continue
                n = self.config.steps_per_dispatch
                kind = self.static.k
                if self.control:
                    kind = self.control.choose(None if self.queue else self._last_wave())
                    n = self.control.steps(n, sum(x is not None for x in self.slots))
                    if jax.process_count() > 1:  # every process runs the same program
                        kind, n = self._agree(kind, n)
                self._hold_pages(n)
                running = sum(x is not None for x in self.slots)
                self.stats["max_running"] = max(self.stats["max_running"], running)
                # after an admission the dispatch would also wait for its prefills: a
                # measurement waits for them first and times the steps alone, others go
                # untimed
                timed = not admitted or (self.control is not None and self.control.probe)
                if admitted and timed:
                    jax.block_until_ready(self.state)
                t0 = time.perf_counter()
                sampled = self._sampled_variant(x.req for x in self.slots if x is not None)
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
        k = self.static.k
        while True:
            need = {}
            for i, x in enumerate(self.slots):
                if x is None:
                    continue
                length = len(x.req.prompt_ids) + int(self._generated[i])
                want = min(length + steps * (k + 1) + k, self._reserve_tokens(x.req))
                if want > x.tokens:
                    need[i] = want
            if not need:
                return
            if self._grow(need):
                return
            # Only unpinned requests grow, so one of them (maybe the asker) can yield. A
            # request alone always fits (Engine.check refuses one that never can).
            victims = [i for i, x in enumerate(self.slots) if x is not None and not x.pinned]
            if not victims or sum(x is not None for x in self.slots) == 1:
                raise RuntimeError("the KV page pool cannot hold one request's next dispatch")
            self._preempt(max(victims, key=lambda i: self.slots[i].order))

    def _grow(self, need: dict) -> bool:
        """Extend the slots' pages to `need` {slot: tokens}, all or none."""
        grown, fresh = {}, []
        for i, tokens in need.items():
            new = self.alloc.grow(self.slots[i].pages, tokens)
            if new is None:  # undo: give back what this round handed out
                for j, pages in grown.items():
                    self.alloc.release(pages)
                    for held, extra in zip(self.slots[j].pages, pages):
                        del held[len(held) - len(extra):]
                return False
            grown[i] = new
            fresh += new[0]
        rows = np.zeros((self.config.max_batch, self.layout.width), np.int32)
        limit = np.zeros((self.config.max_batch,), np.int32)
        for i, tokens in need.items():
            rows[i] = self.alloc.table_rows(self.slots[i].pages)[0]
            limit[i] = tokens
            self.slots[i].tokens = tokens
        zero = np.zeros((self.layout.width,), np.int32)
        zero[: len(fresh)] = fresh[: self.layout.width]
        self.state = self.progs.grow(self.state, self._mask(need), rows, limit, zero)
        self.stats["pages_grown"] += len(fresh)
        return True

    def _preempt(self, slot: int) -> None:
        """Free `slot` and queue its request again, first, to continue from its tokens."""
        item = self.slots[slot]
        st = self.state
        ngen, steps, acc, tried, toks = self._fetch(
            (st.num_generated, st.steps, st.accepted, st.drafted, st.out_tokens))
        before = item.before(self.spec.k)
        new = [int(t) for t in np.asarray(toks)[slot, : int(ngen[slot])]]
        done = _Resumed(before.req, before.tokens + new, before.steps + int(steps[slot]),
                        [a + int(x) for a, x in zip(before.accepted, acc[slot])],
                        [a + int(x) for a, x in zip(before.drafted, tried[slot])])
        sp = item.req.sampling
        again = Request(item.req.id, list(item.req.prompt_ids) + new, dataclasses.replace(
            sp, max_tokens=sp.max_tokens - len(new)))
        self.alloc.release(item.pages)
        self.slots[slot] = None
        self.state = self.progs.release(self.state, self._mask([slot]))
        self._resumed[id(again)] = done
        self.queue.appendleft(again)
        self.stats["preemptions"] += 1

    def _last_wave(self) -> tuple:
        """(remaining tokens, accepted [n, K], verified [n, K]) of the running requests, as
        of the last collection (the adaptive controller's view of the job's last wave)."""
        live = [i for i, x in enumerate(self.slots) if x is not None]
        k = self.static.k
        seen = self._seen[live]
        remaining = [self._budget(self.slots[i].req) - self._generated[i] for i in live]
        return np.asarray(remaining), seen[:, 1: k + 1], seen[:, k + 1:]

    @staticmethod
    def _agree(kind: int, n: int) -> tuple:
        """Process 0's (kind, steps) on every process: their timings differ."""
        from jax.experimental import multihost_utils
        out = multihost_utils.broadcast_one_to_all(np.asarray([kind, n], np.int32))
        return int(out[0]), int(out[1])

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
            reqs.append(Request(i, ids, req.sampling))
        results = {i: self._error(reqs[i], msg) for i, msg in errors.items()}
        for res in self.stream([r for r in reqs if r.id not in errors]):
            results[res.id] = res
        for i, res in results.items():
            res.id = ids_given[i]
        return [results[i] for i in range(len(reqs))]


__all__ = ["Engine", "Request", "Result"]
