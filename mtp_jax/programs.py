"""An engine's device side: its compiled programs, the decode state they carry, warmup.

`Runner` builds, for one model and configuration, the KV layout, the static config the
programs specialise on and the programs themselves (step.Programs, sharded over a mesh
when there is one), and holds the donated `DecodeState`. It runs what the request loop
(engine.py) asks for: the admit call of a prefill batch, its chunked prefill (target and
MTP history chunk by chunk, then the first drafts, up to `prefill_batch` requests a row
each), page growth and slot release, and `warmup`, which compiles or loads every program
so that nothing compiles once a job runs. Compiled programs depend only on the engine
configuration.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import compile_cache
from .calibration import calibrate_kv_scales
from .config import ConfigError, EngineConfig, SpecConfig
from .kv_cache import check_kernels, make_layout
from .pages import table_rows
from .quant import mode_of
from .sampling import split_seed
from .sharding import check_mesh, shard_params, state_shardings
from .step import (Static, greedy_dispatches, greedy_steps, init_state, preload, prepare,
                   programs)

# Prompt tokens below which a prefill forward costs about the same whatever it carries:
# its matmuls are bound by the weight reads (an H100 reaches its bf16 peak from ~300
# FLOPs per weight byte, i.e. ~300 rows). Sets the shortest chunk of a multi-row prefill.
PREFILL_MIN_TOKENS = 256


def engine_config(model, config: Optional[EngineConfig], overrides: dict) -> EngineConfig:
    """The engine configuration with its defaults filled: prefill_batch None becomes the
    rows where matmuls need them to reach peak, never more rows than slots (rounded up to
    the power of two that runs them)."""
    eng = dataclasses.replace(config or EngineConfig(), **overrides)
    rows = eng.prefill_batch or (1 if jax.default_backend() == "cpu" else 8)
    eng = dataclasses.replace(eng, prefill_batch=min(rows, 1 << (eng.max_batch - 1).bit_length()))
    if eng.deterministic and eng.attention_backend is None:
        # the jnp paged attention reads every row's pages in one fixed order; the kernels
        # split the KV by batch and query length
        eng = dataclasses.replace(eng, attention_backend="reference")
    return eng


class Runner:
    def __init__(self, model, spec: SpecConfig, eng: EngineConfig, mesh=None):
        compile_cache.enable()  # warm starts; $MTP_JAX_COMPILE_CACHE=off disables
        scales = None
        if eng.kv_dtype == "fp8":
            if model.kv_scales is None:  # calibrated once per model, kept with it
                model.kv_scales = calibrate_kv_scales(model)
            scales = model.kv_scales
        if eng.deterministic and model.config.linear_layers:
            raise ConfigError(
                "deterministic=True does not cover Gated DeltaNet (linear-attention) layers: "
                "a prompt's tokens run the chunked delta rule and decoded ones the recurrent "
                "rule, whose sums are taken in different orders; run without it")
        if mesh is not None:
            check_mesh(model.config, mesh)
            if eng.max_batch % mesh.shape["dp"]:
                raise ConfigError(f"max_batch={eng.max_batch} must be a multiple of dp="
                                  f"{mesh.shape['dp']}")
            model = dataclasses.replace(model, params=shard_params(
                jax.tree_util.tree_map(lambda x: x, model.params), mesh))
        self.model, self.spec, self.config, self.mesh = model, spec, eng, mesh
        k = spec.k
        # the pages a request holds cover what its steps write past its length
        self.layout = make_layout(model.config, eng, spec.write_ahead, model.dtype,
                                  mtp_layers=spec.strategy.modules(k), scales=scales)
        check_kernels(self.layout, eng, model.config)
        # prefix caching is host-side only: it must not key the compiled programs
        self.static = Static(model.config, spec, dataclasses.replace(eng, prefix_cache=True),
                             self.layout, mesh,
                             weights_quantized=mode_of(model.params) is not None)
        if mesh is None:
            self.progs = programs(self.static, model.graphdef)
        else:
            shape = jax.eval_shape(lambda: init_state(self.static, model.dtype))
            linear = {i for i, x in enumerate(model.config.linear_layers) if x}
            st_sh = state_shardings(shape, mesh, eng.max_batch, linear)
            p_sh = jax.tree_util.tree_map(lambda x: x.sharding, model.params)
            self.progs = programs(self.static, model.graphdef, st_sh, p_sh)
        self.init_state = self.progs.init(model.dtype)
        self.state = self.init_state()
        self.warm = False
        self.warm_variants: set = set()  # step-program variants warmed (sampled or not)
        self.executed: set = set()  # (kind, sampled) step programs that have run once
        self._all_allowed: dict = {}  # rows -> all-true first-token mask (`all_allowed`)

    # ------------------------------------------------------------ prefill plan
    def bucket(self, n: int) -> int:
        return min(self.config.prefill_chunk, max(16, 1 << (n - 1).bit_length()))

    def buckets(self) -> list[int]:
        """Prefill chunk lengths: powers of two from 16 up to the largest one needed."""
        top = min(self.config.prefill_chunk,
                  max(16, 1 << (self.config.max_model_len - 1).bit_length()))
        return sorted({self.bucket(1 << i) for i in range(top.bit_length())} | {top})

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
                if c >= self.chunk(r, 1)]

    def chunk(self, rows: int, n: int) -> int:
        """The chunk length that runs n prompt tokens per row in a forward of `rows` rows."""
        top = self.buckets()[-1]
        return min(top, max(self.bucket(n), PREFILL_MIN_TOKENS // rows if rows > 1 else 0))

    def chunks(self, end: np.ndarray, start: Optional[np.ndarray] = None):
        """(chunk length, starts, valid lengths) of each prefill forward over rows whose
        prompts run from `start` [r] (default 0: a prefix cache hit starts later) to `end`
        [r], until every row is done: chunk lengths follow the longest remainder."""
        start = np.zeros_like(end) if start is None else np.minimum(start, end)
        while (start < end).any():
            c = self.chunk(len(end), int((end - start).max()))
            valid = np.clip(end - start, 0, c).astype(np.int32)
            yield c, start, valid
            start = start + valid

    # ---------------------------------------------------------------- variants
    def sampled(self, reqs) -> bool:
        """Whether steps over these requests need the sampled step programs."""
        return not greedy_steps(self.config) or any(r.sampling.temperature > 0 for r in reqs)

    def sampled_variant(self, reqs) -> bool:
        """The variant (sampled: True / False) a step dispatch or a prefill batch over these
        requests takes: the greedy programs only where they are warm."""
        return self.sampled(reqs) or False not in self.warm_variants

    def step_variants(self, reqs) -> tuple:
        """The step-program variants (sampled: True / False) these requests need; with
        none, the greedy one where it exists (temperature 0 is the default). Greedy and
        sampled requests together need both on a GPU, the full program alone elsewhere
        (`step.greedy_dispatches`)."""
        if not greedy_steps(self.config):
            return (True,)
        need = {self.sampled([r]) for r in reqs} or {False}
        if True in need and not greedy_dispatches():
            need = {True}
        return tuple(sorted(need))

    # ------------------------------------------------------------------ warmup
    def is_warm(self, variants) -> bool:
        return (self.warm and set(variants) <= self.warm_variants
                and all(self.cache_sizes().values()))

    def warmup(self, variants, prefill_programs, dummy_row, padding, timed: bool
               ) -> Optional[list]:
        """Compile (or load) every program: the prefill ones of `prefill_programs` (rows,
        chunk), and the steps of every kind in `variants` and the warmed ones, run on a
        dummy slot admitted by `dummy_row` (rows padded with `padding`). `timed`: return one step's seconds per kind
        (`time_kinds`), the adaptive controller's cost prior."""
        variants = tuple(sorted(self.warm_variants | set(variants)))
        p, st = self.model.params, self.state
        preload(self._warmup_calls(variants, prefill_programs))
        # The prefill programs are loaded or compiled without running where the executable
        # store holds them (most buckets go unused by a job); otherwise they run once on
        # padding rows, which write nothing.
        for r, c in prefill_programs:
            slots, zero, logits = self._padding_rows(r)
            out = prepare(self.progs.prefill_target(c), p, st, slots, zero, zero, logits, zero)
            if out is not None:
                st, logits = out
            if self.static.history_apart:
                out = prepare(self.progs.prefill_mtp(c), p, st, slots, zero, zero)
                st = st if out is None else out
            if c == self.buckets()[-1]:
                for sampled in variants:  # the first tokens: the steps' variants
                    out = prepare(self.progs.prefill_finish(sampled), p, st, slots, logits,
                                  zero, self.all_allowed(r))
                    st = st if out is None else out
        self.state = st
        # admit a dummy request onto null pages with every KV write dropped (limit 0), run
        # one step of each kind and free the slot again, with the argument types the real
        # calls use. The step bodies must execute here, not only compile: a program's
        # first execution costs several later ones on CPU, which would also mislead the
        # adaptive controller's first timings.
        self.admit([dummy_row], padding)
        # Adaptive K: only the end kinds (0 and K) run here, for the cost prior; the kinds
        # between are loaded (or compiled) and run first when the controller picks one
        # (that dispatch goes untimed), so a short job does not pay for kinds it never uses.
        ends = {0, self.static.k}
        for kind in self.static.kinds:
            for sampled in variants:
                if timed and kind not in ends:
                    out = prepare(self.progs.steps(kind, sampled), p, self.state, jnp.int32(1))
                    if out is None:
                        continue
                    self.state = out
                else:
                    self.state = self.progs.steps(kind, sampled)(p, self.state, jnp.int32(1))
                self.executed.add((kind, sampled))
        prior = self.time_kinds(sampled=variants[-1]) if timed else None
        b, w = self.config.max_batch, self.layout.width  # the page-growth program, a no-op
        self.grow(np.zeros((b,), bool), np.zeros((b, w), np.int32), np.zeros((b,), np.int32),
                  np.zeros((w,), np.int32))
        self.release(self.mask([0]))
        self.state = jax.block_until_ready(self.state)
        self.warm = True
        self.warm_variants = set(variants)
        return prior

    def _padding_rows(self, r: int) -> tuple:
        """(slots, zeros, starting logits) of `r` prefill rows that write nothing."""
        return (np.full((r,), self.config.max_batch, np.int32), np.zeros((r,), np.int32),
                self.progs.no_logits(r))

    def _warmup_calls(self, variants, prefill_programs) -> list:
        """[(program, args)] of every program `warmup` prepares, as it calls them (only
        the argument types matter: it is for `step.preload`)."""
        p, st = self.model.params, self.state
        calls = []
        for r, c in prefill_programs:
            slots, zero, logits = self._padding_rows(r)
            calls.append((self.progs.prefill_target(c), (p, st, slots, zero, zero, logits, zero)))
            if self.static.history_apart:
                calls.append((self.progs.prefill_mtp(c), (p, st, slots, zero, zero)))
            if c == self.buckets()[-1]:
                calls += [(self.progs.prefill_finish(v), (p, st, slots, logits, zero,
                                                          self.all_allowed(r)))
                          for v in variants]
        calls += [(self.progs.steps(kind, v), (p, st, jnp.int32(1)))
                  for kind in self.static.kinds for v in variants]
        return calls

    def time_kinds(self, reps: int = 1, sampled: bool = True) -> Optional[list]:
        """Seconds of one step of each kind on the warmup's dummy slot: kinds 0 and K timed
        (least of `reps`), the kinds between interpolated (each verified draft adds about
        the same; docs/DECISIONS.md, "Adaptive speculation"); None if the dummy ran out of
        budget (a tiny max_model_len) and a step did nothing."""
        k = self.static.k
        ends = {}
        for _ in range(reps):
            for kind in (0, k):
                before = int(self.state.num_generated[0])  # also waits for the state
                t0 = time.perf_counter()
                self.state = jax.block_until_ready(self.progs.steps(kind, sampled)(
                    self.model.params, self.state, jnp.int32(1)))
                ends[kind] = min(ends.get(kind, float("inf")), time.perf_counter() - t0)
                if int(self.state.num_generated[0]) == before:
                    return None
        return [ends[0] + (ends[k] - ends[0]) * i / k for i in range(k + 1)]

    def cache_sizes(self) -> dict:
        """Compiled-program cache sizes (for checking that nothing recompiles)."""
        variants = self.warm_variants or (True,)
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

    # ------------------------------------------------------- device-side calls
    def admission(self, slot: int, req, pages: list, tokens: int, budget: int,
                  stop_ids: list, shared: int = 0) -> tuple:
        """The host arrays that admit `req` into `slot` on its reserved pages, writing
        below `tokens` positions: one row of its prefill batch's admit call. `shared`: its
        first pages are cached blocks, read only (not zeroed)."""
        s, eng = self.static, self.config
        prompt = np.asarray(req.prompt_ids, np.int32)
        buf = np.zeros((s.scratch_len,), np.int32)
        buf[s.offset: s.offset + len(prompt)] = prompt
        stops = np.full((eng.max_stop_ids,), -1, np.int32)
        stops[: len(stop_ids)] = stop_ids
        full = np.zeros((self.layout.width,), np.int32)
        full[: len(pages[0]) - shared] = pages[0][shared:]
        sp = req.sampling
        # typed here, so that a request whose fields do not convert fails alone
        i32, f32 = np.int32, np.float32
        return (i32(slot), buf, i32(tokens), i32(budget), stops,
                f32(sp.temperature), i32(sp.top_k), f32(sp.top_p),
                np.asarray(split_seed(sp.seed), np.uint32), np.bool_(sp.relaxed),
                np.bool_(self.thinking(prompt)), table_rows(self.layout, pages), full)

    def thinking(self, prompt) -> bool:
        """Whether the prompt leaves the request inside a thinking phase."""
        spec = self.spec
        if not spec.relaxed_acceptance:
            return False
        marks = [t for t in prompt.tolist() if t in (spec.think_begin_id, spec.think_end_id)]
        return bool(marks) and marks[-1] == spec.think_begin_id

    def admit(self, rows: list, padding: tuple) -> None:
        """One admit call for a prefill batch's rows (`admission`), padded to the
        scratch's rows with `padding` (slot max_batch): numpy arrays only, so the call is
        one dispatch."""
        rows = list(rows) + [padding] * (self.static.prefill_rows - len(rows))
        cols = [np.stack(col) for col in zip(*rows)]
        cols[-1] = cols[-1].reshape(-1)  # every row's pages, for zeroing
        self.state = self.progs.admit(self.state, *cols)

    def all_allowed(self, rows: int):
        """The first-token mask [rows, V] of rows without healing (all true), kept on the
        device: a batch that heals nothing sends no mask."""
        if rows not in self._all_allowed:
            self._all_allowed[rows] = jnp.ones((rows, self.model.config.vocab_size), bool)
        return self._all_allowed[rows]

    def first_allowed(self, allowed: list):
        """The first-token mask [r, V] of a prefill batch: per row None (any token) or the
        ids its first token may take (healing.Healing.allowed; ids past the model's
        vocabulary are dropped)."""
        if all(a is None for a in allowed):
            return self.all_allowed(len(allowed))
        v = self.model.config.vocab_size
        mask = np.ones((len(allowed), v), bool)
        for i, ids in enumerate(allowed):
            if ids is not None:
                mask[i] = False
                mask[i, ids[ids < v]] = True
        return jnp.asarray(mask)

    def prefill(self, slots: np.ndarray, prompt_len: np.ndarray, sampled: bool = True,
                allowed: Optional[list] = None, cached: Optional[np.ndarray] = None) -> None:
        """Prefill a batch of admitted requests together, a row each (slots [r], padding
        rows max_batch with prompt length 0): the target's chunks, each with the MTP
        history over its positions (`window`: the history's chunks after them), then each
        row's first token and drafts (`sampled` False: every row is greedy; `allowed`: per
        row None or the ids its first token may take, `first_allowed`). `cached` [r]: the
        prompt positions whose target and MTP KV the row's cached blocks hold (below the
        history end, prefix_cache.py): its chunks start there."""
        s, p = self.static, self.model.params
        logits = self.progs.no_logits(len(slots))
        history_end = (prompt_len - 1 - s.k).astype(np.int32)  # final windows start here
        # the state after every program, so that a program that fails leaves the engine a
        # live state (each call consumes the one before) to release the batch's slots from
        for c, start, valid in self.chunks(prompt_len, cached):
            self.state, logits = self.progs.prefill_target(c)(p, self.state, slots, start,
                                                              valid, logits, history_end)
        if s.history_apart:
            for c, start, _ in self.chunks(history_end, cached):
                self.state = self.progs.prefill_mtp(c)(p, self.state, slots, start,
                                                       history_end)
        mask = self.first_allowed(allowed or [None] * len(slots))
        self.state = self.progs.prefill_finish(sampled)(p, self.state, slots, logits,
                                                        prompt_len, mask)

    def grow(self, mask, rows, limit, pages) -> None:
        self.state = self.progs.grow(self.state, mask, rows, limit, pages)

    def release(self, mask) -> None:
        self.state = self.progs.release(self.state, mask)

    def mask(self, slots) -> np.ndarray:
        m = np.zeros((self.config.max_batch,), bool)
        m[list(slots)] = True
        return m

    def fetch(self, tree):
        """Host copies of (possibly process-spanning) arrays; identical on every process."""
        leaves = jax.tree_util.tree_leaves(tree)
        if jax.process_count() == 1 or all(x.is_fully_addressable for x in leaves):
            return jax.device_get(tree)
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(tree, tiled=True)

    @staticmethod
    def agree(kind: int, n: int) -> tuple:
        """Process 0's (kind, steps) on every process: their timings differ, and every
        process must run the same program."""
        if jax.process_count() == 1:
            return kind, n
        from jax.experimental import multihost_utils
        out = multihost_utils.broadcast_one_to_all(np.asarray([kind, n], np.int32))
        return int(out[0]), int(out[1])


__all__ = ["Runner", "engine_config", "PREFILL_MIN_TOKENS"]
