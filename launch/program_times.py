"""Where a generate job's run time goes: every engine program call timed to completion.

Runs a `python -m mtp_jax.generate` job (same arguments, `--output` optional) in this
process: compiles (or loads) the programs, then streams the job `--repeat` times on the warm
engine, and prints, per program, its call count, its first call's time and the median of the
later calls, and per repeat the run's wall time against the time spent inside programs
(the rest is the host: scheduling, transfers, collection). A cost paid once per executable
in a process (its first execution) shows as a first call far above the median; a cost paid
on every call shows in the median; a host cost in the remainder.

    python launch/program_times.py --input launch/data/example_prompts.jsonl --mesh tp=2
    python launch/program_times.py --collectives 4 --mesh tp=2   # a collective alone
    python launch/program_times.py --mesh tp=2 --profile /tmp/trace  # + the last repeat's kernels

`--collectives N` first times N distinct jitted programs of one all-reduce each over the
mesh's `tp` axis (first call and second call): whether a fresh executable's first collective
is slow on its own, without the engine. Every call here waits for its outputs, which
serialises what the engine overlaps: the per-program figures add up to more than an
unobserved run takes.
"""

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import jax
import jax.numpy as jnp

from mtp_jax import compile_cache
from mtp_jax import generate as gen
from mtp_jax import step as step_mod

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_trace  # noqa: E402


def _ready(out):
    jax.block_until_ready(out)
    return out


def collective_probe(mesh, n: int) -> list[str]:
    """First and second call (ms) of `n` distinct all-reduce programs over `tp`."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    if mesh is None or "tp" not in mesh.axis_names or mesh.shape["tp"] == 1:
        return ["collectives: no tp axis of size > 1 in the mesh, skipped"]
    x = jax.device_put(jnp.ones((8, 4096), jnp.bfloat16), NamedSharding(mesh, P(None, "tp")))
    lines = []
    for i in range(n):
        f = jax.jit(lambda a, i=i: (a * (i + 1)).sum(axis=1),  # a reduction over tp
                    out_shardings=NamedSharding(mesh, P()))
        f = f.lower(x).compile()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            _ready(f(x))
            times.append((time.perf_counter() - t0) * 1e3)
        lines.append(f"collective program {i}: first call {times[0]:.2f} ms, "
                     f"second {times[1]:.3f} ms")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=2, help="runs of the job on the warm engine")
    p.add_argument("--collectives", type=int, default=0,
                   help="time N fresh all-reduce programs first (0: skip)")
    p.add_argument("--profile", metavar="DIR",
                   help="trace the last repeat into DIR and print its kernels by kind and "
                        "the top kernels of the first accelerator (launch/profile_trace.py)")
    ours, rest = p.parse_known_args(argv)
    if "--output" not in rest:
        rest += ["--output", "-"]
    if "--input" not in rest:
        rest += ["--input", "launch/data/example_prompts.jsonl"]
    args = gen.parse_args(rest)
    compile_cache.enable(args.compile_cache)

    times: dict = defaultdict(list)
    original = step_mod.Program.__call__

    def timed(self, *a):
        t0 = time.perf_counter()
        out = _ready(original(self, *a))
        times[self.name].append(time.perf_counter() - t0)
        return out

    step_mod.Program.__call__ = timed
    if args.compile_cache == "off":
        print("note: --compile-cache off times plain jitted programs, whose first call "
              "compiles", file=sys.stderr)

    t0 = time.perf_counter()
    _, model, engine = gen.make_engine(args)
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} | mesh "
          f"{args.mesh or 'none'} | load {time.perf_counter() - t0:.1f} s", flush=True)
    for line in collective_probe(engine.mesh, ours.collectives):
        print(line, flush=True)
    defaults, _ = gen.run_defaults(args, model)
    data = open(args.input, "rb").read()
    requests, *_ = gen.read_requests(data, set(), engine, defaults, lambda rec: None)
    t0 = time.perf_counter()
    engine.warmup(requests)
    print(f"warmup (compile or load) {time.perf_counter() - t0:.1f} s", flush=True)
    times.clear()
    for r in range(ours.repeat):
        before = sum(map(sum, times.values()))
        t0 = time.perf_counter()
        if ours.profile and r == ours.repeat - 1:
            with profile_trace.traced(ours.profile):
                n = sum(1 for _ in engine.stream(list(requests)))
        else:
            n = sum(1 for _ in engine.stream(list(requests)))
        wall = time.perf_counter() - t0
        inside = sum(map(sum, times.values())) - before
        print(f"run {r}: {n} requests, wall {wall:.3f} s, inside programs {inside:.3f} s, "
              f"host {wall - inside:.3f} s", flush=True)
    print(f"{'program':<28} {'calls':>6} {'first ms':>10} {'median later ms':>16} "
          f"{'total ms':>10}")
    for name, ts in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        later = statistics.median(ts[1:]) * 1e3 if len(ts) > 1 else float("nan")
        print(f"{name:<28} {len(ts):>6} {ts[0] * 1e3:>10.2f} {later:>16.3f} "
              f"{sum(ts) * 1e3:>10.1f}")
    if ours.profile:
        print(profile_trace.render(profile_trace.breakdown(ours.profile), unit="run"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
