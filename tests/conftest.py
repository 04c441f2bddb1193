"""Test set-up shared by the whole suite.

On CPU the tiny test models spend most of their time in XLA compilation, not in running,
so unless the user chose their own `XLA_FLAGS` we ask XLA for cheap compiles before jax
is imported (tests/cpu_compile.py). `JAX_PLATFORMS` is left as the user set it.
"""

from __future__ import annotations

import gc
import importlib.util
import os

from cpu_compile import cpu_flags, fewer_collections

_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12",
                        "jax_plugins.xla_cuda13", "jax_rocm60_plugin", "libtpu")


def _platform_is_cpu() -> bool:
    """Whether jax will run on CPU, decided without importing jax."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    for name in _ACCELERATOR_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return False
        except (ImportError, ValueError):
            continue
    return True


if "XLA_FLAGS" not in os.environ and _platform_is_cpu():
    os.environ["XLA_FLAGS"] = cpu_flags()

# The suite compiles from scratch (a persistent compilation cache would make a test's
# compile depend on earlier runs); test_generate_cli checks warm starts in its own folder.
os.environ.setdefault("MTP_JAX_COMPILE_CACHE", "off")

# Fewer full garbage collections while the workers compile (`cpu_compile.fewer_collections`;
# `pytest_runtest_teardown` below still forces one when the process runs short of maps).
fewer_collections()


# Every compiled XLA CPU program maps its kernels' code into the process (three memory
# maps per kernel, about a thousand per engine), and the suite keeps engines in module
# caches. A worker that compiles a few hundred programs reaches the kernel's per-process
# limit (vm.max_map_count, 65530 by default), after which the next compile crashes the
# process inside LLVM. So between tests, once half the limit is used, drop every compiled
# program (engines still alive recompile on their next call).
def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0  # not Linux: no such limit to watch


_MAP_LIMIT = _map_limit()


def _maps_in_use() -> int:
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


# Reading the maps costs the kernel about half a microsecond a line (15 ms at 30k maps),
# which after every test came to 7 s of a worker's time. A test adds at most a few thousand
# maps (a handful of engines), so below a quarter of the limit every 8th test looks.
_seen = {"maps": 0, "tests": 0}


def pytest_runtest_teardown(item, nextitem):
    if not _MAP_LIMIT:
        return
    _seen["tests"] += 1
    if _seen["maps"] < _MAP_LIMIT // 4 and _seen["tests"] % 8:
        return
    _seen["maps"] = _maps_in_use()
    if _seen["maps"] > _MAP_LIMIT // 2:
        import jax

        jax.clear_caches()
        gc.collect()
        _seen["maps"] = _maps_in_use()


# The files that take longest run first: `-n 2 --dist loadfile` hands each worker whole
# files in collection order (xdist would otherwise order them by test count), so the two
# workers finish together instead of one waiting on the other's last long file.
_LONGEST_FIRST = ("test_sharding.py", "test_step.py", "test_golden.py", "test_launch.py",
                  "test_reliability.py", "test_draft_vocab.py", "test_quant.py",
                  "test_kv_cache.py", "test_generate_cli.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = os.path.basename(str(item.fspath))
        return _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file is kept
