"""XLA flags for cheap CPU compiles, for the test processes and the subprocesses they start,
and the garbage-collector thresholds they compile under (`fewer_collections`).

On CPU the tiny test models spend most of their time in XLA compilation, not in running.
BASE asks for the lowest backend optimization level. On top of it, EXTRA asks for
XLA:CPU's elemental emitters instead of its fusion emitters and for one LLVM module per
program instead of split modules compiled on a thread pool (on a 2-core machine both
cores are busy with test workers anyway). With EXTRA the whole suite (`-n 2 --dist
loadfile`, jax 0.10.2, 2 cores) took 7 min 00 s - 7 min 22 s against 13 min 47 s with
BASE alone. Newer jaxlib releases may drop such switches, and an unknown flag in XLA_FLAGS
aborts the process, so `cpu_flags()` checks once per test run, in short subprocesses,
which of them this jaxlib accepts, and keeps the answer in the environment for the xdist
workers and the subprocesses the tests start.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

BASE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
EXTRA = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
_ENV = "MTP_JAX_TEST_CPU_XLA_FLAGS"


def _accepted(flags: str) -> bool:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    try:
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"],
                              env=env, capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def cpu_flags() -> str:
    """The cheap-compile XLA flags for a CPU process: BASE and those of EXTRA that this
    jaxlib knows."""
    if _ENV not in os.environ:
        flags = " ".join((BASE,) + EXTRA)
        if not _accepted(flags):
            flags = " ".join([BASE] + [f for f in EXTRA if _accepted(f"{BASE} {f}")])
        os.environ[_ENV] = flags
    return os.environ[_ENV]


def fewer_collections() -> None:
    """Garbage-collector thresholds for a process that traces and compiles many programs.

    Tracing and compiling allocate millions of small objects, and a test worker keeps
    engines and their programs alive across a file, so CPython's default thresholds (700,
    10, 10) walk a heap of several million objects in full collections again and again:
    each worker of the suite spent 16-18 s in 36-41 of them. Collecting the young
    generation every 10k allocations instead: 6-7 s in 7 full collections (an 8-device
    sharding script: 1.57 -> 0.30 s). Cycles are still collected."""
    gc.set_threshold(10_000, 10, 10)
