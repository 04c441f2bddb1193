#!/usr/bin/env python3
"""Multi-host launcher: `jax.distributed` on every process, one global mesh, then the
generate or evaluate CLI on every process (SPMD: every process runs the same program).

    python launch/multihost.py [--coordinator HOST:PORT --num-processes N --process-id I]
        [--mesh tp=N,dp=M] -- generate|evaluate|check [CLI ARGS...]
    python launch/multihost.py --local N [--local-devices D] [--mesh ...] -- ...

Run the same command on every host (on a TPU pod: `gcloud compute tpus tpu-vm ssh NAME
--worker=all --command ...`). Without the three coordinator flags
`jax.distributed.initialize()` detects the cluster itself (TPU pods, SLURM, Open MPI);
elsewhere give all three, the same coordinator (process 0's host and a free port) on
every host. `--mesh` is built over the global devices (`mtp_jax.sharding.make_mesh`:
process-major device order, so `tp` stays inside a host and `dp` spans hosts) and passed
on to the CLI as its `--mesh` flag.

Files: the input (`--input`, `--dataset`) is read on process 0 and broadcast, so the other
hosts need no copy of it; the model folder must exist on every host. Only process 0
writes `--output`, `--plot` and stdout; the others write theirs into a private temporary
folder removed at exit (a `--resume` output file is broadcast from process 0 first, so
every process skips the same ids and they all run the same requests).

`check` runs no model: it verifies the distributed set-up (process count, global devices,
a jitted reduction over a mesh that spans every process, an all-gather) and prints one
`CHECK {json}` line per process.

`--local N` spawns N CPU processes on this machine, each with `--local-devices` fake
devices (`--xla_force_host_platform_device_count`) and the coordinator on a free
127.0.0.1 port, with gloo cross-process collectives: the multi-host code path, tested
without a cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ("generate", "evaluate", "check")
INPUT_FLAGS = {"generate": ("--input",), "evaluate": ("--dataset",)}
OUTPUT_FLAGS = {"generate": ("--output",), "evaluate": ("--output", "--plot")}


def parse_args(argv):
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python launch/multihost.py",
                                description=__doc__.split("\n\n")[0],
                                epilog="-- generate|evaluate|check [ARGS...]: the CLI to run "
                                       "on every process and its arguments")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="process 0's address (omit on a TPU pod / SLURM: auto-detected)")
    p.add_argument("--num-processes", type=int, metavar="N")
    p.add_argument("--process-id", type=int, metavar="I")
    p.add_argument("--mesh", metavar="tp=N,dp=M", help="global mesh, passed to the CLI")
    p.add_argument("--local", type=int, metavar="N",
                   help="spawn N CPU processes on this machine (testing)")
    p.add_argument("--local-devices", type=int, default=2, metavar="D",
                   help="fake CPU devices per --local process (default 2)")
    if cut == len(argv) and any(a in COMMANDS for a in argv):
        p.error("put `--` before the CLI and its arguments: ... -- generate ARGS")
    args = p.parse_args(argv[:cut])
    rest = argv[cut + 1:]
    if not rest or rest[0] not in COMMANDS:
        p.error(f"end with `-- CLI [ARGS...]`, CLI one of {', '.join(COMMANDS)}")
    args.command, args.cli_args = rest[0], rest[1:]
    given = [x is not None for x in (args.coordinator, args.num_processes, args.process_id)]
    if args.local is not None:
        if any(given):
            p.error("--local starts its own coordinator: drop --coordinator / "
                    "--num-processes / --process-id")
        if args.local < 1 or args.local_devices < 1:
            p.error("--local and --local-devices must be >= 1")
    elif any(given) and not all(given):
        p.error("give all of --coordinator, --num-processes and --process-id, or none of "
                "them (auto-detection on TPU pods, SLURM, Open MPI)")
    elif all(given) and not 0 <= args.process_id < args.num_processes:
        p.error(f"--process-id must be in [0, {args.num_processes})")
    if args.coordinator is not None and not re.fullmatch(r"\S+:\d+", args.coordinator):
        p.error(f"--coordinator {args.coordinator!r}: expected HOST:PORT")
    if args.mesh:
        if not re.fullmatch(r"\s*(tp|dp)\s*=\s*\d+\s*(,\s*(tp|dp)\s*=\s*\d+\s*)?", args.mesh):
            p.error(f"--mesh {args.mesh!r}: expected 'tp=N,dp=M'")
    return args


# ------------------------------------------------------------------------- --local N
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_env(devices: int) -> dict:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"  # cross-process collectives on CPU
    return env


def child_commands(args, port: int) -> list:
    mesh = ["--mesh", args.mesh] if args.mesh else []
    return [[sys.executable, os.path.abspath(__file__), "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", str(args.local), "--process-id", str(i), *mesh, "--",
             args.command, *args.cli_args] for i in range(args.local)]


def _relay(stream, out, lock) -> None:
    """Copy a child's output to ours whole line by whole line, so the processes' lines
    never interleave mid-line."""
    for line in iter(stream.readline, b""):
        with lock:
            out.write(line)
            out.flush()
    stream.close()


def run_local(args) -> int:
    """Start the processes, wait for all; when one fails, stop the others (they would
    wait for it in a collective until the distributed timeouts)."""
    env = local_env(args.local_devices)
    procs, relays = [], []
    lock = threading.Lock()
    for cmd in child_commands(args, free_port()):
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(p)
        for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
            relays.append(threading.Thread(target=_relay, args=(stream, out, lock),
                                           daemon=True))
            relays[-1].start()
    rc = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:
                rc = failed[0]
                with lock:
                    print(f"multihost: a process exited with status {rc}; stopping the "
                          "others", file=sys.stderr, flush=True)
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for t in relays:
            t.join(timeout=5)
    return rc or next((p.returncode for p in procs if p.returncode), 0)


# ------------------------------------------------------------------- every process
def initialize(args) -> None:
    import jax

    try:
        if args.coordinator is None:
            jax.distributed.initialize()
        else:
            jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"multihost: jax.distributed.initialize failed: {e}\n(outside a TPU "
                         "pod / SLURM / Open MPI job give --coordinator HOST:PORT "
                         "--num-processes N --process-id I, or use --local N to test on "
                         "one machine)") from None


def flag_value(argv: list, flag: str):
    """(index of the value, value) of `flag V` / `flag=V` in argv, or (None, None)."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return i + 1, argv[i + 1]
        if a.startswith(flag + "="):
            return i, a[len(flag) + 1:]
    return None, None


def set_flag(argv: list, flag: str, index: int, value: str) -> None:
    argv[index] = value if argv[index - 1] == flag else f"{flag}={value}"


def broadcast_file(path: str):
    """Process 0's bytes of `path` on every process (None where process 0 has no such
    file)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    data = b""
    if jax.process_index() == 0:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            data = None
    n = int(multihost_utils.broadcast_one_to_all(np.int64(-1 if data is None else len(data))))
    if n < 0:
        return None
    buf = np.frombuffer(data, np.uint8) if data is not None and len(data) == n else \
        np.zeros((n,), np.uint8)
    return multihost_utils.broadcast_one_to_all(buf).tobytes() if n else b""


def localize_files(command: str, argv: list, private: str) -> list:
    """Argv for this process: inputs (and a --resume output) broadcast from process 0 into
    `private`; on processes other than 0, every output path redirected into `private`."""
    import jax

    argv = list(argv)
    rank = jax.process_index()
    for flag in INPUT_FLAGS.get(command, ()):
        i, path = flag_value(argv, flag)
        if path is None or path == "humaneval":
            continue
        if path == "-":
            if jax.process_count() > 1:
                raise SystemExit(f"multihost: {flag} - (stdin) cannot be shared between "
                                 "processes: give a file")
            continue
        data = broadcast_file(path)
        if data is None:  # every process stops, none waits for the others in a collective
            raise SystemExit(f"multihost: process 0 cannot read {flag} {path}")
        if rank:
            local = os.path.join(private, "input-" + os.path.basename(path))
            with open(local, "wb") as f:
                f.write(data)
            set_flag(argv, flag, i, local)
    resume = "--resume" in argv
    for flag in OUTPUT_FLAGS.get(command, ()):
        i, path = flag_value(argv, flag)
        if path == "-" and jax.process_count() > 1:
            raise SystemExit(f"multihost: {flag} - (stdout) would mix with the collectives' "
                             "own messages there: give a file")
        if path is None or path == "-":
            continue
        data = broadcast_file(path) if resume and flag == "--output" else None
        if rank:
            local = os.path.join(private, "output-" + os.path.basename(path))
            if data is not None:
                with open(local, "wb") as f:
                    f.write(data)
            set_flag(argv, flag, i, local)
    return argv


def accepts_flag(module, flag: str) -> bool:
    """Whether a CLI's argument parser knows `flag` (read from its --help)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            module.parse_args(["--help"])
        except SystemExit:
            pass
    return re.search(rf"(^|\s|\[){re.escape(flag)}[\s=\]]", out.getvalue()) is not None


def check(mesh) -> dict:
    """A reduction and an all-gather across every process; what each process saw."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = mesh.devices.size
    # Row r of a [n, 4] array lives on mesh device r (dp-major), holding r + 1.
    spec = P(("dp", "tp"))
    x = jax.make_array_from_callback(
        (n, 4), NamedSharding(mesh, spec),
        lambda idx: np.arange(n, dtype=np.float32)[idx[0]][:, None].repeat(4, 1) + 1)
    total = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=NamedSharding(mesh, P()))(x)
    got = np.asarray(total.addressable_data(0))
    ranks = multihost_utils.process_allgather(np.int32(jax.process_index()))
    return {"process_index": jax.process_index(), "process_count": jax.process_count(),
            "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
            "mesh": dict(mesh.shape), "mesh_processes": sorted({d.process_index
                                                                for d in mesh.devices.flat}),
            "sum": got.tolist(), "sum_expected": [n * (n + 1) / 2] * 4,
            "sum_ok": bool(np.allclose(got, n * (n + 1) / 2)),
            "allgather": np.asarray(ranks).reshape(-1).tolist(), "backend": jax.default_backend()}


def leave() -> None:
    """Leave the distributed runtime together, once every process is done: without it
    each process tears its client down as its interpreter exits, and process 0, which
    hosts the coordination service, can take the service down while another process's
    client still polls it (that process's log then ends in a gRPC error)."""
    import jax
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("multihost: done")
    jax.distributed.shutdown()


def run_process(args) -> int:
    initialize(args)
    import jax

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from mtp_jax.sharding import make_mesh

    rank, count = jax.process_index(), jax.process_count()
    spec = args.mesh or (f"dp={jax.device_count()}" if args.command == "check" else None)
    try:
        mesh = make_mesh(spec)
    except ValueError as e:
        raise SystemExit(f"multihost: {e} (global devices: {jax.device_count()} over {count} "
                         "processes)") from None
    print(f"multihost: process {rank}/{count}, {jax.local_device_count()} local of "
          f"{jax.device_count()} global devices ({jax.default_backend()}), mesh "
          f"{dict(mesh.shape) if mesh is not None else 'none'}", file=sys.stderr, flush=True)
    if args.command == "check":
        print("CHECK " + json.dumps(check(mesh)), flush=True)
        leave()
        return 0
    import importlib

    module = importlib.import_module(f"mtp_jax.{args.command}")
    cli_args = list(args.cli_args)
    if args.mesh and flag_value(cli_args, "--mesh")[1] is None:
        if not accepts_flag(module, "--mesh"):
            raise SystemExit(f"multihost: `{args.command}` takes no --mesh; run it without "
                             "--mesh (every process then runs it whole on its first local "
                             "device)")
        cli_args += ["--mesh", args.mesh]
    private = tempfile.mkdtemp(prefix=f"multihost-p{rank}-")
    stdout = sys.stdout
    try:
        cli_args = localize_files(args.command, cli_args, private)
        with contextlib.ExitStack() as stack:
            if rank:  # process 0 alone speaks on stdout
                sys.stdout = stack.enter_context(open(os.devnull, "w"))
            rc = module.main(cli_args)
        leave()
    finally:
        sys.stdout = stdout
        shutil.rmtree(private, ignore_errors=True)
    return rc or 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_local(args) if args.local is not None else run_process(args)


if __name__ == "__main__":
    sys.exit(main())
