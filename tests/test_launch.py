"""launch/: the Colab notebook run end to end on CPU, the TPU-VM script's dry run, argument
checks and exact gcloud calls (through a fake gcloud), and the multi-host launcher with
two CPU processes on this machine (jax.distributed with gloo collectives).

Nothing here touches a TPU or the network: see README.md, "Scale-out and launch".
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cli_fixtures import make_checkpoint
from cpu_compile import cpu_flags

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"
CHEAP = cpu_flags()
URL = "https://git.example.com/someone/mtp_jax.git"


def cpu_env(**extra) -> dict:
    env = dict(os.environ, XLA_FLAGS=CHEAP, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


# --------------------------------------------------------------------------- notebook
def test_colab_notebook_runs_end_to_end(tmp_path, monkeypatch):
    for mod in ("nbclient", "nbformat", "ipykernel"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed (pip install -e '.[test]' installs it)")
    if importlib.util.find_spec("mtp_jax.evaluate") is None:
        pytest.skip("mtp_jax.evaluate does not exist yet")
    import nbformat
    from nbclient import NotebookClient

    # The kernel inherits this environment: cheap CPU compiles, outputs into tmp_path, the
    # hub demo kept off the network (it skips itself, saying why).
    for k, v in cpu_env(MTP_DEMO_OUT=str(tmp_path), HF_HUB_OFFLINE="1").items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(LAUNCH / "colab_demo.ipynb", as_version=4)
    assert 'REPO_URL = "' in nb.cells[1].source and "git" in nb.cells[1].source
    NotebookClient(nb, timeout=420, kernel_name="python3",
                   resources={"metadata": {"path": str(LAUNCH)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.outputs if o.output_type == "stream")
    assert f"repository {REPO}" in text
    assert "hub demo skipped: " in text, text[-3000:]
    assert text.count("mean accepted length") >= 3, text[-3000:]
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.outputs), "the plot was not displayed"
    report = json.loads((tmp_path / "eval.json").read_text())
    assert list(report["methods"]) == ["none", "chain", "eagle"]
    assert report["config"]["num_prompts"] == 4
    for name in ("chain", "eagle"):
        m = report["methods"][name]
        assert m["lossless"] is True and m["mean_accepted_length"] > 1.0, m
    assert (tmp_path / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------- tpu_vm.sh
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def tpu_vm(*args, path=None, cwd=None):
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = path
    return subprocess.run([shutil.which("bash") or "bash", str(LAUNCH / "tpu_vm.sh"), *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=60)


def dry_run(*args) -> list:
    proc = tpu_vm("--dry-run", "--repo", URL, *args)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines()]


def remote(cmd: list) -> str:
    """The --command of a `gcloud compute tpus tpu-vm ssh` line."""
    assert cmd[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"], cmd
    assert "--worker=all" in cmd
    return next(a for a in cmd if a.startswith("--command="))[len("--command="):]


@needs_bash
def test_tpu_vm_dry_run_prints_every_command():
    cmds = dry_run()
    assert len(cmds) == 6, cmds
    create, install, gen, ev, mkdir, scp = cmds
    assert create == ["gcloud", "compute", "tpus", "tpu-vm", "create", "mtp-jax-demo",
                      "--zone=us-west4-a", "--accelerator-type=v5litepod-8",
                      "--version=tpu-ubuntu2204-base"]
    inst = remote(install)
    assert f"git clone {URL} mtp_jax" in inst and "python3.11 -m venv" in inst
    assert 'pip install -q -e ".[tpu,eval]"' in inst
    g = shlex.split(remote(gen).split("&& ", 2)[-1])
    assert g[1:4] == ["-m", "mtp_jax.generate", "--input"], g
    assert "results/generate.jsonl" in g and "--model" not in g
    e = shlex.split(remote(ev).split("&& ", 2)[-1])
    assert e[1:] == ["-m", "mtp_jax.evaluate", "--dataset", "humaneval", "--output",
                     "results/evaluate.json", "--plot", "results/evaluate.png"], e
    assert mkdir == ["mkdir", "-p", "tpu_results"]
    assert scp == ["gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse",
                   "mtp-jax-demo:mtp_jax/results", "tpu_results/mtp-jax-demo",
                   "--zone=us-west4-a", "--worker=0"]


@needs_bash
def test_tpu_vm_options_and_multi_host_slice():
    cmds = dry_run("--name", "pod1", "--zone=europe-west4-b", "--project", "proj",
                   "--accelerator-type", "v5litepod-16", "--version", "v2-alpha-tpuv5-lite",
                   "--model", "my models/m", "--mesh", "tp=2,dp=8", "--limit", "20",
                   "--results", "out/r", "--delete")
    assert [c[4] for c in cmds if c[0] == "gcloud"] == ["create", "ssh", "ssh", "ssh", "scp",
                                                        "delete"]
    assert cmds[0][5:] == ["pod1", "--zone=europe-west4-b", "--project=proj",
                           "--accelerator-type=v5litepod-16",
                           "--version=v2-alpha-tpuv5-lite"]
    g = shlex.split(remote(cmds[2]).split("&& ", 2)[-1])
    assert g[1:6] == ["launch/multihost.py", "--mesh", "tp=2,dp=8", "--", "generate"], g
    assert g[g.index("--model") + 1] == "my models/m"  # quoted for the remote shell
    e = shlex.split(remote(cmds[3]).split("&& ", 2)[-1])
    assert e[1:4] == ["launch/multihost.py", "--", "evaluate"] and "--mesh" not in e
    assert e[e.index("--limit") + 1] == "20"
    assert cmds[4] == ["mkdir", "-p", "out"] and cmds[5][7] == "out/r"
    assert cmds[-1] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "pod1",
                        "--zone=europe-west4-b", "--project=proj", "--quiet"]


@needs_bash
def test_tpu_vm_dry_run_hub_model_step():
    """--hub-model adds one ssh step before the copy: plain then chain on the chat prompts,
    int8, and the speed-up from the two summaries."""
    cmds = dry_run("--hub-model", "XiaomiMiMo/MiMo-7B-RL@main")
    assert len(cmds) == 7 and [c[4] for c in cmds if c[0] == "gcloud"][-2:] == ["ssh", "scp"]
    hub = remote(cmds[4])
    assert "for m in none chain; do ~/mtp_venv/bin/python -m mtp_jax.generate --model " \
           "XiaomiMiMo/MiMo-7B-RL@main --quantize int8 --method $m --input " \
           "launch/data/chat_prompts.jsonl --output results/hub_$m.jsonl" in hub, hub
    assert "speed-up" in hub and (LAUNCH / "data" / "chat_prompts.jsonl").is_file()


@needs_bash
@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--zone"], "--zone needs a value"),
    (["--zone", "--dry-run"], "--zone needs a value"),
    (["--name", "Bad_Name"], "--name 'Bad_Name'"),
    (["--accelerator-type", "v5e"], "--accelerator-type 'v5e'"),
    (["--limit", "0"], "--limit '0'"),
    (["--mesh", "tp2"], "--mesh 'tp2'"),
    (["--hub-model", "just-a-name"], "--hub-model 'just-a-name'"),
])
def test_tpu_vm_rejects_bad_arguments(args, message):
    proc = tpu_vm("--dry-run", "--repo", URL, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stdout == ""


@needs_bash
def test_tpu_vm_help():
    proc = tpu_vm("--help")
    assert proc.returncode == 0 and "--accelerator-type" in proc.stdout


@needs_bash
def test_tpu_vm_without_gcloud_fails_clearly(tmp_path):
    proc = tpu_vm("--repo", URL, path=str(tmp_path), cwd=tmp_path)  # an empty PATH
    assert proc.returncode == 1
    assert "gcloud (the Google Cloud CLI) is not on PATH" in proc.stderr
    assert "--dry-run" in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "tpu_results").exists()  # nothing ran
    # --dry-run works without gcloud
    dry = tpu_vm("--dry-run", "--repo", URL, path=str(tmp_path))
    assert dry.returncode == 0 and dry.stdout.startswith("gcloud compute tpus tpu-vm create")


@needs_bash
def test_tpu_vm_runs_exactly_the_printed_commands(tmp_path):
    """With a fake gcloud that records its arguments, the real run makes the dry run's
    calls, in order."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    fake = bin_dir / "gcloud"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    args = ("--repo", URL, "--name", "t1", "--delete")
    proc = tpu_vm(*args, path=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    calls = [["gcloud"] + json.loads(x) for x in log.read_text().splitlines()]
    printed = [c for c in dry_run(*args[2:]) if c[0] == "gcloud"]
    assert calls == printed
    assert (tmp_path / "tpu_results").is_dir()  # the mkdir ran here


# ---------------------------------------------------------------------- multihost.py
def load_launcher():
    spec = importlib.util.spec_from_file_location("multihost", LAUNCH / "multihost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_multihost_argument_parsing(capsys):
    mh = load_launcher()
    a = mh.parse_args(["--coordinator", "10.0.0.1:1234", "--num-processes", "4",
                       "--process-id", "3", "--mesh", "tp=2,dp=4", "--", "generate",
                       "--input", "x.jsonl", "--", "y"])
    assert (a.coordinator, a.num_processes, a.process_id, a.mesh) == ("10.0.0.1:1234", 4, 3,
                                                                        "tp=2,dp=4")
    assert a.command == "generate" and a.cli_args == ["--input", "x.jsonl", "--", "y"]
    a = mh.parse_args(["--", "evaluate"])  # auto-detection: no coordinator flags
    assert a.coordinator is None and a.local is None and a.cli_args == []
    a = mh.parse_args(["--local", "2", "--local-devices", "4", "--", "check"])
    assert (a.local, a.local_devices, a.command) == (2, 4, "check")
    bad = [["generate"],  # no --
           ["--", "train"],
           ["--coordinator", "h:1", "--", "check"],  # partial coordinator flags
           ["--coordinator", "h", "--num-processes", "2", "--process-id", "0", "--", "check"],
           ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2", "--",
            "check"],
           ["--local", "2", "--process-id", "0", "--", "check"],
           ["--local", "0", "--", "check"],
           ["--mesh", "tp=2,xx=3", "--", "check"]]
    for argv in bad:
        with pytest.raises(SystemExit):
            mh.parse_args(argv)
    capsys.readouterr()


def test_multihost_helpers():
    mh = load_launcher()
    argv = ["--input", "a.jsonl", "--output=b.jsonl", "--plot", "p.png"]
    assert mh.flag_value(argv, "--input") == (1, "a.jsonl")
    assert mh.flag_value(argv, "--output") == (2, "b.jsonl")
    assert mh.flag_value(argv, "--model") == (None, None)
    mh.set_flag(argv, "--output", 2, "/t/b")
    mh.set_flag(argv, "--plot", 4, "/t/p")
    assert argv == ["--input", "a.jsonl", "--output=/t/b", "--plot", "/t/p"]
    from mtp_jax import generate

    assert mh.accepts_flag(generate, "--max-batch")
    assert not mh.accepts_flag(generate, "--no-such-flag")
    children = mh.child_commands(mh.parse_args(["--local", "2", "--mesh", "dp=4", "--",
                                                "check"]), 4321)
    assert [c[c.index("--process-id") + 1] for c in children] == ["0", "1"]
    assert all(c[c.index("--coordinator") + 1] == "127.0.0.1:4321" for c in children)
    env = mh.local_env(3)
    assert "--xla_force_host_platform_device_count=3" in env["XLA_FLAGS"]
    assert env["JAX_PLATFORMS"] == "cpu" and env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"


def launch_local(*args, timeout=300):
    proc = subprocess.run([sys.executable, str(LAUNCH / "multihost.py"), "--local", "2", *args],
                          capture_output=True, text=True, env=cpu_env(), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_multihost_two_cpu_processes_check():
    """Two processes x two devices: jax.distributed, a 4-device mesh spanning both, a jitted
    reduction across it (cross-process all-reduce over gloo) and an all-gather."""
    proc = launch_local("--local-devices", "2", "--mesh", "tp=2,dp=2", "--", "check",
                        timeout=180)
    # raw_decode: gloo may print its own line onto the end of ours (shared stdout)
    rows = sorted((json.JSONDecoder().raw_decode(x[len("CHECK "):])[0]
                   for x in proc.stdout.splitlines() if x.startswith("CHECK ")),
                  key=lambda r: r["process_index"])
    assert [r["process_index"] for r in rows] == [0, 1], proc.stdout
    for r in rows:
        assert (r["process_count"], r["device_count"], r["local_device_count"]) == (2, 4, 2)
        assert r["mesh"] == {"dp": 2, "tp": 2} and r["mesh_processes"] == [0, 1]
        assert r["sum_ok"] and r["sum"] == [10.0] * 4  # rows 1 + 2 + 3 + 4
        assert r["allgather"] == [0, 1] and r["backend"] == "cpu"


def test_multihost_generate_on_two_processes(tmp_path):
    """The generate CLI on two processes (over a mesh spanning both when the CLI takes
    --mesh): one output file written by process 0 alone, a --resume file broadcast so
    both processes skip the same ids, greedy tokens equal the plain reference decoder's.
    Adaptive K: process 0's choice of step kind is broadcast, so both run the same one."""
    from mtp_jax import generate
    from mtp_jax.config import SamplingParams
    from mtp_jax.reference import generate_reference

    model = make_checkpoint(str(tmp_path / "model"))
    prompts = {"a": "hello world", "b": "the quick brown fox", "c": "one two three"}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": k, "prompt": p}) + "\n" for k, p in prompts.items()))
    out.write_text(json.dumps({"id": "a", "error": "from an earlier run"}) + "\n")
    mesh = ["--mesh", "tp=2,dp=2"] if load_launcher().accepts_flag(generate, "--mesh") else []
    launch_local("--local-devices", "2", *mesh, "--", "generate", "--model",
                 str(tmp_path / "model"), "--input", str(inp), f"--output={out}", "--resume",
                 "--method", "chain", "--num-speculative-tokens", "auto", "--max-tokens", "6",
                 "--max-batch", "2", "--max-model-len", "32")
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert recs[0] == {"id": "a", "error": "from an earlier run"}
    assert sorted(r["id"] for r in recs[1:]) == ["b", "c"], recs  # once each: process 0 only
    for r in recs[1:]:
        ids = model.tokenizer.encode(prompts[r["id"]]).ids
        want = generate_reference(model, ids, SamplingParams(max_tokens=6), max_len=32)[0]
        assert r["token_ids"] == want, (r["id"], mesh)


def test_multihost_unreadable_input_stops_every_process(tmp_path):
    """Process 0 cannot read the input: every process stops with the same message (none
    is left waiting for the others in a collective)."""
    proc = subprocess.run(
        [sys.executable, str(LAUNCH / "multihost.py"), "--local", "2", "--", "generate",
         "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o.jsonl")],
        capture_output=True, text=True, env=cpu_env(), timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.count("multihost: process 0 cannot read --input") >= 1, proc.stderr
    assert not (tmp_path / "o.jsonl").exists()


# -------------------------------------------------------------- multi_gpu_check.sh
FAKE_PYTHON = """#!{python}
import json, os, sys
args = sys.argv[1:]
if args[:1] in (["-"], ["-c"]):  # the script's own helpers run for real
    os.execv({python!r}, [{python!r}] + args)
keep = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
        "CUDA_VISIBLE_DEVICES")
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": args, "env": {{k: os.environ.get(k) for k in keep}}}}) + "\\n")
if "--output" in args:  # a generate run's one record, the same whatever the mesh
    with open(args[args.index("--output") + 1], "a") as f:
        f.write(json.dumps({{"id": "a", "token_ids": [1, 2]}}) + "\\n")
if args[0].endswith("bench_decode.py"):
    open(os.path.join(os.environ["OUT"], "bench_decode.md"), "w").write("| table |\\n")
"""


@needs_bash
def test_multi_gpu_check_command_lines_parse(tmp_path):
    """launch/multi_gpu_check.sh through an interpreter that records its command lines:
    every one is accepted by its CLI's argument parser, with the meshes, processes and
    NVLink-multicast switches the script is for."""
    sys.path.insert(0, str(LAUNCH))
    import bench_decode
    from mtp_jax import generate

    log = tmp_path / "calls.jsonl"
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable, log=str(log)))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    proc = subprocess.run(["bash", str(LAUNCH / "multi_gpu_check.sh")], capture_output=True,
                          text=True, env=cpu_env(PYTHON=str(fake), OUT=str(tmp_path / "out")),
                          timeout=300)
    assert proc.returncode == 0 and "all parts passed" in proc.stdout, proc.stdout + proc.stderr
    assert {p.name for p in (tmp_path / "out").iterdir()} == {
        "summary_generate_multihost_bench.txt", "logs_generate_multihost_bench.tar.gz"}
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert all(c["env"]["NCCL_NVLS_ENABLE"] == "0" and c["env"]["NVSHMEM_DISABLE_NVLS"] == "1"
               and c["env"]["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" for c in calls)
    gen = [generate.parse_args(c["argv"][2:]) for c in calls if c["argv"][:2] == [
        "-m", "mtp_jax.generate"]]
    assert [a.mesh for a in gen] == [None, None, "tp=2", "tp=2", "dp=2", "dp=2"]
    mh = [c for c in calls if c["argv"][0] == "launch/multihost.py"]
    launcher = load_launcher()
    parsed = sorted(((launcher.parse_args(c["argv"][1:]), c["env"]["CUDA_VISIBLE_DEVICES"])
                     for c in mh), key=lambda x: x[0].process_id)
    assert [(a.process_id, a.num_processes, a.mesh, a.command, gpu) for a, gpu in parsed] == [
        (0, 2, "dp=2", "generate", "0"), (1, 2, "dp=2", "generate", "1")]
    assert parsed[0][0].coordinator == parsed[1][0].coordinator
    for a, _ in parsed:
        generate.parse_args(a.cli_args)
    bench = [bench_decode.parse_args(c["argv"][1:]) for c in calls
             if c["argv"][0] == "launch/bench_decode.py"]
    assert [(b.mesh, b.batches, b.ctxs, b.steps_only, b.shape) for b in bench] == [
        (None, "1,8", "4096", True, "mimo-7b"), ("tp=2", "1,8", "4096", True, "mimo-7b")]
    assert len(calls) == len(gen) + len(mh) + len(bench)


def test_profile_breakdown_kinds_and_cpu_trace(tmp_path):
    """Kernel names as an H100 trace of the engine's prefill shows them fall in their
    kinds; a CPU trace has no device plane, so no breakdown (and says so)."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(LAUNCH))
    import profile_trace

    names = {"nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NNN": "matmul",
             "gemm_fusion_dot_3": "matmul", "paged_attention_gpu": "attention",
             "input_scatter_fusion_79": "kv write / scatter",
             "kv_write_gpu": "kv write / scatter",
             "loop_transpose_fusion_75": "copy", "Memset 0": "copy",
             "loop_multiply_fusion_37": "other fusion", "MysteryKernel": "other"}
    assert {n: profile_trace.kind_of(n) for n in names} == names
    with profile_trace.traced(str(tmp_path)):
        jax.block_until_ready(jax.jit(lambda x: x @ x)(jnp.ones((8, 8))))
    assert profile_trace.breakdown(str(tmp_path)) is None
    assert "no accelerator kernels" in profile_trace.render(None)


def test_profile_gaps_split_between_and_inside_programs():
    """Idle time between kernels of two programs (a new dispatch) and inside one, with
    overlapping kernels (two streams) not counted as idle."""
    sys.path.insert(0, str(LAUNCH))
    import profile_trace

    spans = [(30, 40, "b", "k3"), (0, 10, "a", "k1"), (12, 20, "a", "k2"),
             (35, 38, "b", "k4"), (41, 50, "b", "k5")]
    g = profile_trace.gaps(spans)
    assert g["between_programs_ns"] == [10.0, 1]  # k2 ends at 20, k3 starts at 30
    assert g["inside_programs_ns"] == [3.0, 2]  # 10 -> 12, and k3's end 40 -> 41
    assert g["longest"][0] == (10, "a:k2", "b:k3")
