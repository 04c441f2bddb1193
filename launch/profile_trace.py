"""Where a traced region's device time goes: kernels by kind, the top kernels, idle time.

    with profile_trace.traced(folder):
        ...  # the work, ending in block_until_ready
    table = profile_trace.breakdown(folder)
    print(profile_trace.render(table, per=n))  # n: units of work in the region

`breakdown` reads the newest `*.xplane.pb` under the folder (`jax.profiler.ProfileData`,
no TensorBoard needed), takes the kernel events of the first accelerator plane, and sums
their durations by kind (matmul, attention, KV write / scatter, copy, reduce, other
fusions, other), by kernel name, and over the span from the first kernel's start to the
last one's end; the span minus the busy time is the device's idle time between kernels.
On a machine without an accelerator plane (CPU) it says so and returns None.
Tracing slows the host side (each dispatch records events), so the idle share of a traced
region overstates the untraced one wherever the host is on the critical path: compare the
kernel time with the same region timed untraced (bench_decode.py --profile does).
"""

from __future__ import annotations

import collections
import contextlib
import glob
import os
from typing import Optional

import jax

# Kind of a kernel, from its name or its HLO op (lower case), first match wins.
KINDS = (
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "dot")),
    ("attention", ("attention", "paged", "flash", "mha", "mla")),
    ("kv write / scatter", ("write_rows", "kv_write", "scatter", "dynamic-update-slice",
                            "dynamic_update_slice")),
    ("copy", ("copy", "memcpy", "memset", "transpose")),
    ("reduce", ("reduce", "argmax", "sort", "topk")),
    ("other fusion", ("fusion",)),
)


@contextlib.contextmanager
def traced(folder: str):
    os.makedirs(folder, exist_ok=True)
    jax.profiler.start_trace(folder)
    try:
        yield
    finally:
        jax.profiler.stop_trace()


def kind_of(name: str, op: str = "") -> str:
    text = f"{name} {op}".lower()
    return next((kind for kind, keys in KINDS if any(k in text for k in keys)), "other")


def _stat(event, key: str) -> str:
    for k, v in event.stats:
        if k == key:
            return str(v)
    return ""


def breakdown(folder: str, top: Optional[int] = 15) -> Optional[dict]:
    """{'span_ns', 'busy_ns', 'kernels', 'kinds': {kind: [ns, count]}, 'top': [(name, op,
    kind, ns, count)]} for the newest trace under `folder`, or None without a device plane.
    `top` kernels by time are kept (None: every kernel)."""
    from jax.profiler import ProfileData

    files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {folder}")
    data = ProfileData.from_file(max(files, key=os.path.getmtime))
    plane = next((p for p in data.planes if p.name.startswith("/device:")), None)
    if plane is None:
        return None
    lines = [(line.name, len(list(line.events))) for line in plane.lines]
    kinds = collections.defaultdict(lambda: [0.0, 0])
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    start, end, busy, n = float("inf"), 0.0, 0.0, 0
    spans = []  # (start, end, program, kernel) of every kernel, for the gaps
    for line in plane.lines:
        # kernel streams ("Stream #14(MemcpyD2D,Compute)"), not the summary lines ("XLA
        # Ops") nor streams of host <-> device copies alone
        name = line.name.lower()
        if "stream" not in name or ("compute" not in name and "memcpy" in name):
            continue
        for e in line.events:
            op = _stat(e, "hlo_op")
            kind = kind_of(e.name, op)
            kinds[kind][0] += e.duration_ns
            kinds[kind][1] += 1
            key = (e.name[:80], op[:80], kind)
            per_kernel[key][0] += e.duration_ns
            per_kernel[key][1] += 1
            start = min(start, e.start_ns)
            end = max(end, e.start_ns + e.duration_ns)
            spans.append((e.start_ns, e.start_ns + e.duration_ns, _stat(e, "hlo_module"),
                          e.name[:60]))
            busy += e.duration_ns
            n += 1
    host = collections.defaultdict(lambda: [0.0, 0])  # jitted calls on the Python thread
    for p in data.planes:
        if p.name.startswith("/host:"):
            for line in p.lines:
                if line.name == "python":
                    for e in line.events:
                        if e.name.startswith("PjitFunction("):
                            host[e.name[12:-1]][0] += e.duration_ns
                            host[e.name[12:-1]][1] += 1
    if not n:
        return None
    ranked = sorted(((*k, v[0], v[1]) for k, v in per_kernel.items()), key=lambda x: -x[3])
    return {"plane": plane.name, "lines": lines, "span_ns": end - start, "busy_ns": busy,
            "kernels": n, "host_calls": sorted(([k, *v] for k, v in host.items()),
                                               key=lambda x: -x[1]),
            "kinds": {k: list(v) for k, v in sorted(kinds.items(), key=lambda x: -x[1][0])},
            "top": ranked[:top], "gaps": gaps(spans)}


def gaps(spans: list, top: int = 10) -> dict:
    """The device's idle time between kernels, split into gaps where the next kernel
    belongs to another program (XLA module: a new dispatch, waiting on the host) and gaps
    inside one program, with the longest gaps and the kernels around them."""
    spans.sort()
    between = [0.0, 0]
    inside = [0.0, 0]
    longest = []
    reach = spans[0][1] if spans else 0.0
    for prev, cur in zip(spans, spans[1:]):
        gap = cur[0] - max(reach, prev[1])
        reach = max(reach, cur[1])
        if gap <= 0:
            continue
        where = between if cur[2] != prev[2] else inside
        where[0] += gap
        where[1] += 1
        longest.append((gap, f"{prev[2]}:{prev[3]}", f"{cur[2]}:{cur[3]}"))
    longest.sort(reverse=True)
    return {"between_programs_ns": between, "inside_programs_ns": inside,
            "longest": longest[:top]}


def render(table: Optional[dict], per: int = 1, unit: str = "forward") -> str:
    """Text of a breakdown, times per `unit` (the region held `per` of them)."""
    if table is None:
        return "no accelerator kernels in the trace (CPU run): no breakdown"
    ms = lambda ns: ns / per / 1e6  # noqa: E731
    busy = table["busy_ns"]
    lines = [f"{table['plane']}: {ms(table['span_ns']):.2f} ms per {unit} from first kernel "
             f"to last, {ms(busy):.2f} ms of kernels ({table['kernels'] / per:.0f} kernels), "
             f"idle {100 * (1 - busy / table['span_ns']):.1f} %"]
    for kind, (ns, count) in table["kinds"].items():
        lines.append(f"  {kind:20s} {ms(ns):8.2f} ms  {100 * ns / busy:5.1f} %  "
                     f"{count / per:6.0f} kernels")
    calls = table.get("host_calls") or []
    if calls:
        lines.append(f"  host, dispatching jitted calls: {ms(sum(c[1] for c in calls)):.2f} ms "
                     "(" + ", ".join(f"{name} x{count / per:.0f} {ms(ns):.2f} ms"
                                     for name, ns, count in calls[:8]) + ")")
    g = table.get("gaps")
    if g:
        (bn, bc), (inn, ic) = g["between_programs_ns"], g["inside_programs_ns"]
        lines.append(f"  idle between programs {ms(bn):.2f} ms ({bc / per:.0f} gaps), inside "
                     f"programs {ms(inn):.2f} ms ({ic / per:.0f} gaps); longest: "
                     + "; ".join(f"{ns / 1e3:.0f} us {a} -> {b}"
                                 for ns, a, b in g["longest"][:5]))
    lines.append("  top kernels:")
    for name, op, kind, ns, count in table["top"][:15]:
        lines.append(f"    {ms(ns):7.2f} ms  x{count / per:<5.0f} {kind:18s} {name}"
                     + (f"  [{op}]" if op else ""))
    return "\n".join(lines)


__all__ = ["traced", "breakdown", "render", "kind_of", "KINDS"]
