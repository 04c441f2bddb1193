"""Saved executables (compile_cache.ExecutableStore): a warm engine loads its programs
whole and decodes exactly as a cold one; keys change with whatever shaped the program;
damaged or unsaveable entries are compiled again.

The suite runs with the compile cache off; these tests give each engine a store of their
own in tmp_path (test_generate_cli checks the CLI's warm start end to end).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import compile_cache
from mtp_jax.compile_cache import CacheStats, ExecutableStore
from mtp_jax.config import EngineConfig, SamplingParams, SpecConfig
from mtp_jax.engine import Engine, Request
from mtp_jax.reference import generate_reference
from mtp_jax.step import Program, preload

from spec_models import markov_model


def _double(x):
    return x * 2 + 1


def test_program_saves_one_executable_per_signature_and_a_new_store_loads_them(tmp_path):
    store = ExecutableStore(str(tmp_path))
    stats = CacheStats()
    cold = Program(jax.jit(_double), "double", store, "ctx")
    a, b = np.arange(3, dtype=np.float32), np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(cold(a), a * 2 + 1)
    np.testing.assert_array_equal(cold(b), b * 2 + 1)
    np.testing.assert_array_equal(cold(a), a * 2 + 1)  # kept: not fetched again
    assert (stats.loaded, stats.saved) == (0, 2) and cold._cache_size() == 2
    assert len(os.listdir(tmp_path)) == 2
    warm = Program(jax.jit(_double), "double", ExecutableStore(str(tmp_path)), "ctx")
    np.testing.assert_array_equal(warm(b), b * 2 + 1)
    np.testing.assert_array_equal(warm(a), a * 2 + 1)
    assert (stats.loaded, stats.saved) == (2, 2)
    assert warm.jitted._cache_size() == 0  # nothing traced


def test_preload_loads_what_the_store_holds_and_compiles_the_rest_together(tmp_path):
    """step.preload loads the saved executables on threads; the missing ones it traces on
    the caller's thread and compiles side by side into the store, so the calls after it
    neither trace nor compile."""
    a, b, c, d = (np.arange(n, dtype=np.float32) for n in (3, 4, 5, 6))
    cold = Program(jax.jit(_double), "double", ExecutableStore(str(tmp_path)), "ctx")
    cold(a), cold(b)
    stats = CacheStats()
    warm = Program(jax.jit(_double), "double", ExecutableStore(str(tmp_path)), "ctx")
    preload([(warm, (a,)), (warm, (b,)), (warm, (c,)), (warm, (d,)), (warm, (a,)),
             (_double, (a,))])
    assert (stats.loaded, stats.saved) == (2, 2) and len(warm._by_args) == 4
    for x in (a, b, c, d):
        np.testing.assert_array_equal(warm(x), x * 2 + 1)
    assert (stats.loaded, stats.saved) == (2, 2)  # nothing fetched again
    assert len(os.listdir(tmp_path)) == 4
    again = Program(jax.jit(_double), "double", ExecutableStore(str(tmp_path)), "ctx")
    np.testing.assert_array_equal(again(d), d * 2 + 1)  # what preload saved loads
    assert stats.loaded == 3 and again.jitted._cache_size() == 0


def test_keys_follow_name_context_arguments_and_switches(tmp_path, monkeypatch):
    store = ExecutableStore(str(tmp_path))
    x = (jnp.zeros((2, 3), jnp.float32), 4)
    base = store.key("p", "ctx", x)
    assert base == ExecutableStore(str(tmp_path)).key("p", "ctx", x)
    others = [store.key("q", "ctx", x), store.key("p", "ctx2", x),
              store.key("p", "ctx", (jnp.zeros((2, 4), jnp.float32), 4)),
              store.key("p", "ctx", (jnp.zeros((2, 3), jnp.bfloat16), 4)),
              store.key("p", "ctx", (jnp.zeros((2, 3), jnp.float32), 4.0)),
              store.key("p", "ctx", (jnp.zeros((2, 3), jnp.float32), jnp.int32(4)))]
    monkeypatch.setenv("MTP_JAX_ATTENTION_BACKEND", "reference")  # read while tracing
    others.append(ExecutableStore(str(tmp_path)).key("p", "ctx", x))
    # what XLA compiles against: TPU flags, the client's memory budget
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_latency_hiding_scheduler=true")
    others.append(ExecutableStore(str(tmp_path)).key("p", "ctx", x))
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5")
    others.append(ExecutableStore(str(tmp_path)).key("p", "ctx", x))
    assert len({base, *others}) == len(others) + 1


def test_damaged_entry_is_compiled_again_and_rewritten(tmp_path):
    store = ExecutableStore(str(tmp_path))
    x = np.arange(5, dtype=np.float32)
    Program(jax.jit(_double), "double", store, "ctx")(x)
    (path,) = [tmp_path / f for f in os.listdir(tmp_path)]
    path.write_bytes(path.read_bytes()[:100])
    stats = CacheStats()
    np.testing.assert_array_equal(Program(jax.jit(_double), "double", store, "ctx")(x),
                                  x * 2 + 1)
    assert (stats.loaded, stats.saved, stats.replaced) == (0, 1, 1)
    Program(jax.jit(_double), "double", store, "ctx")(x)
    assert (stats.loaded, stats.replaced) == (1, 1)


def test_entry_of_the_earlier_format_is_compiled_again(tmp_path):
    """A file without the executable's devices (the store's first format) is not loaded for
    whatever devices this process has: it is compiled afresh and replaced."""
    import pickle

    store = ExecutableStore(str(tmp_path))
    x = np.arange(5, dtype=np.float32)
    Program(jax.jit(_double), "double", store, "ctx")(x)
    (path,) = [tmp_path / f for f in os.listdir(tmp_path)]
    blob, in_tree, out_tree, ids = pickle.loads(path.read_bytes())
    assert ids == [jax.devices()[0].id]
    path.write_bytes(pickle.dumps((blob, in_tree, out_tree)))
    stats = CacheStats()
    Program(jax.jit(_double), "double", ExecutableStore(str(tmp_path)), "ctx")(x)
    assert (stats.loaded, stats.saved, stats.replaced) == (0, 1, 1)
    assert len(pickle.loads(path.read_bytes())) == 4


class _Store:
    """A store whose saved executable is `loaded` and whose fresh compile is `fresh`."""

    def __init__(self, loaded, fresh):
        self.loaded, self.fresh, self.replaced = loaded, fresh, 0

    def get(self, jitted, name, context, args):
        return self.loaded, True

    def replace(self, jitted, name, context, args):
        self.replaced += 1
        return self.fresh


def _refuse(*args):
    raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: refused")


def test_refused_first_call_of_a_loaded_executable_runs_a_fresh_compile():
    x = np.arange(3, dtype=np.float32)
    store = _Store(_refuse, jax.jit(_double))
    prog = Program(jax.jit(_double), "double", store, "ctx")
    np.testing.assert_array_equal(prog(x), x * 2 + 1)
    np.testing.assert_array_equal(prog(x), x * 2 + 1)  # the fresh executable is kept
    assert store.replaced == 1


def test_errors_of_the_program_itself_surface():
    """A fresh compile that fails the same way is the program's error; so is any failure
    of a call that consumed its donated arguments (there is nothing left to run again),
    and any failure of an executable that already ran."""
    x = np.arange(3, dtype=np.float32)
    store = _Store(_refuse, _refuse)
    with pytest.raises(jax.errors.JaxRuntimeError, match="refused"):
        Program(jax.jit(_double), "double", store, "ctx")(x)
    assert store.replaced == 1

    def consume(a):
        a.delete()
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")

    store = _Store(consume, jax.jit(_double))
    with pytest.raises(jax.errors.JaxRuntimeError, match="out of memory"):
        Program(jax.jit(_double), "double", store, "ctx")(jnp.asarray(x))
    assert store.replaced == 0

    calls = []

    def once(a):
        calls.append(a)
        if len(calls) > 1:
            raise jax.errors.JaxRuntimeError("INTERNAL: failed later")
        return a

    store = _Store(once, jax.jit(_double))
    prog = Program(jax.jit(_double), "double", store, "ctx")
    prog(x)
    with pytest.raises(jax.errors.JaxRuntimeError, match="failed later"):
        prog(x)
    assert store.replaced == 0


def _broadcast_sum(x, n):
    z = jnp.zeros((n.shape[0], 8), jnp.float32) + x[:, None]
    return jnp.broadcast_to(z.sum(1), (3, x.shape[0])) * 2


def test_program_in_jax_cache_but_not_in_the_store_saves_a_runnable_executable(tmp_path):
    """After an upgrade the store misses while JAX's own cache still holds the program.
    An executable loaded from JAX's cache and serialized again cannot run on CPU (its
    first call fails with NOT_FOUND), so the store compiles what it saves itself."""
    before = {o: getattr(jax.config, o) for o in (
        "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes")}
    from jax.experimental.compilation_cache import compilation_cache

    x, n = np.arange(5, dtype=np.float32), np.zeros(5, np.int32)
    want = np.broadcast_to((x * 8)[None], (3, 5)) * 2
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        compilation_cache.reset_cache()
        jax.jit(_broadcast_sum)(x, n)  # JAX's cache now holds the program
        assert os.listdir(tmp_path / "jax")
        jax.clear_caches()
        stats = CacheStats()
        cold = Program(jax.jit(_broadcast_sum), "bsum", ExecutableStore(str(tmp_path / "ex")),
                       "ctx")
        np.testing.assert_array_equal(cold(x, n), want)
        jax.clear_caches()
        warm = Program(jax.jit(_broadcast_sum), "bsum", ExecutableStore(str(tmp_path / "ex")),
                       "ctx")
        np.testing.assert_array_equal(warm(x, n), want)
        assert (stats.saved, stats.loaded) == (1, 1)
    finally:
        for o, v in before.items():
            jax.config.update(o, v)
        compilation_cache.reset_cache()


def test_unwritable_folder_runs_without_saving(tmp_path):
    (tmp_path / "file").write_text("")  # a folder under a file cannot be made
    store = ExecutableStore(str(tmp_path / "file" / "executables"))
    stats = CacheStats()
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(Program(jax.jit(_double), "double", store, "ctx")(x),
                                  x * 2 + 1)
    assert (stats.loaded, stats.saved) == (0, 0)
    assert os.listdir(tmp_path) == ["file"]


def test_program_with_a_host_callback_runs_unsaved(tmp_path):
    def f(x):
        return jax.pure_callback(lambda v: np.asarray(v) + 1, jax.ShapeDtypeStruct(x.shape,
                                 x.dtype), x)

    stats = CacheStats()
    x = np.arange(3, dtype=np.float32)
    for _ in range(2):
        store = ExecutableStore(str(tmp_path))
        np.testing.assert_array_equal(Program(jax.jit(f), "cb", store, "ctx")(x), x + 1)
    assert stats.saved == stats.loaded  # whatever this jaxlib can save, it loads back


def test_warm_engine_loads_every_program_and_decodes_the_same(tmp_path, monkeypatch):
    """Two engines over one store: the first compiles and saves its programs, the second
    (a new process would be the same: nothing is shared but the folder) loads them all,
    traces nothing, and both give the reference's greedy tokens, speculation included.
    Warmup runs the step programs but only loads (or compiles) the prefill ones: a job
    runs few of the prefill buckets, and a first execution costs several later ones."""
    monkeypatch.setattr(compile_cache, "executable_store",
                        lambda: ExecutableStore(str(tmp_path)))
    ran = []
    call = Program.__call__
    monkeypatch.setattr(Program, "__call__", lambda self, *a: ran.append(self.name) or
                        call(self, *a))
    model = markov_model("mimo", target_noise=0.5, mtp_noise=0.2, vocab=64, seed=4)
    cfg = EngineConfig(max_batch=2, max_model_len=64, page_size=8, prefill_chunk=16,
                       steps_per_dispatch=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (5, 21, 9)]
    want = [generate_reference(model, p, SamplingParams(max_tokens=12), max_len=64)[0]
            for p in prompts]
    got, stats = [], []
    for _ in range(2):
        s = CacheStats()
        eng = Engine(model, SpecConfig(method="chain", num_speculative_tokens=2), cfg)
        ran.clear()
        eng.warmup()
        assert not [n for n in ran if n.startswith("prefill")], ran
        assert {n for n in ran if n.startswith("steps")} == {f"steps{k}_greedy"
                                                            for k in eng.static.kinds}
        assert all(eng.progs.prefill_target(c)._by_args for c in eng.buckets())
        res = eng.generate([Request(i, p, SamplingParams(max_tokens=12))
                            for i, p in enumerate(prompts)])
        got.append([r.token_ids for r in res])
        stats.append((s.loaded, s.saved))
        traced = sum(getattr(eng.progs, n).jitted._cache_size()
                     for n in ("admit", "release", "grow"))
        traced += sum(eng.progs.steps(k, v).jitted._cache_size() for k in eng.static.kinds
                      for v in eng.runner.warm_variants)
        traced += sum(eng.progs.prefill_finish(v).jitted._cache_size()
                      for v in eng.runner.warm_variants)
        traced += sum(eng.progs.prefill_target(c).jitted._cache_size() for c in eng.buckets())
    assert got[0] == want and got[1] == want
    (loaded0, saved0), (loaded1, saved1) = stats
    assert loaded0 == 0 and saved0 >= 5, stats
    assert loaded1 == saved0 and saved1 == 0, stats
    assert traced == 0  # the warm engine's programs ran from loaded executables only
    assert all(eng.cache_sizes().values())


def test_store_is_off_with_the_cache_off():
    assert jax.config.jax_compilation_cache_dir in (None, "")  # the suite's setting
    assert compile_cache.executable_store() is None
    model = markov_model("mimo", target_noise=0.5, mtp_noise=0.2, vocab=64, seed=4)
    eng = Engine(model, SpecConfig(method="none", num_speculative_tokens=0),
                 EngineConfig(max_batch=2, max_model_len=64, page_size=8, prefill_chunk=16))
    assert not isinstance(eng.progs.admit, Program)
