"""Warm starts on a process that sees several devices (fake CPU devices, in subprocesses):
the README job run twice, unsharded and `--mesh tp=2,dp=2` runs sharing one cache folder,
and the saved executables' device binding (tests/scripts/store_devices.py).

A saved executable used to be loaded for every device the process sees, so on any machine
of several devices the second single-device run failed ("Attempted to execute with 2
argument lists when local device count is 1")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli_fixtures import make_checkpoint
from cpu_compile import cpu_flags

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
SUMMARY = re.compile(r"executables (\d+) loaded / (\d+) saved")


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        [str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")]))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} " + cpu_flags()
    env.pop("MTP_JAX_COMPILE_CACHE", None)
    return env


def _generate(args, devices: int, out: Path, cache: Path) -> tuple[dict, tuple[int, int]]:
    """Run the CLI; its tokens by id and its (loaded, saved) executable counts."""
    proc = subprocess.run([sys.executable, "-m", "mtp_jax.generate", *map(str, args),
                           "--output", str(out), "--compile-cache", str(cache)],
                          cwd=REPO, env=_env(devices), capture_output=True, timeout=900)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    assert "could not run here" not in err, err[-1500:]
    counts = SUMMARY.search(err)
    assert counts, err[-1500:]
    tokens = {}
    for line in out.read_text().splitlines():
        rec = json.loads(line)
        assert "error" not in rec, rec
        tokens[rec["id"]] = rec["token_ids"]
    return tokens, (int(counts.group(1)), int(counts.group(2)))


def test_readme_job_twice_on_two_devices(tmp_path):
    """The README's main command (shipped model, example prompts, default settings) on a
    process that sees two devices: the second run loads every executable the first saved
    and writes the same tokens."""
    job = ["--input", REPO / "launch" / "data" / "example_prompts.jsonl"]
    cold, (loaded0, saved0) = _generate(job, 2, tmp_path / "a.jsonl", tmp_path / "cache")
    warm, (loaded1, saved1) = _generate(job, 2, tmp_path / "b.jsonl", tmp_path / "cache")
    assert loaded0 == 0 and saved0 > 0
    assert (loaded1, saved1) == (saved0, 0)
    assert warm == cold


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm_devices")
    make_checkpoint(str(root / "hf"))
    prompts = root / "in.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in (
        {"id": "a", "prompt_ids": [3, 5, 7, 9], "max_tokens": 14},
        {"id": "b", "prompt": "hello world", "max_tokens": 10},
        {"id": "c", "prompt_ids": [11, 2], "max_tokens": 9, "temperature": 0.8, "seed": 3})))
    return root


def test_unsharded_and_mesh_runs_share_one_cache_on_eight_devices(small_model, tmp_path):
    """An unsharded run, a tp=2,dp=2 run, then both again, from one cache folder on eight
    devices: each warm run loads every executable its cold run saved, nothing is saved
    twice, and all four runs write the same tokens (greedy and seeded sampled)."""
    base = ["--model", small_model / "hf", "--input", small_model / "in.jsonl",
            "--max-batch", "2", "--max-model-len", "64"]
    cache = tmp_path / "cache"
    runs = {}
    for i, mesh in enumerate(([], ["--mesh", "tp=2,dp=2"], [], ["--mesh", "tp=2,dp=2"])):
        runs[i] = _generate(base + mesh, 8, tmp_path / f"{i}.jsonl", cache)
    tokens = [t for t, _ in runs.values()]
    assert all(t == tokens[0] for t in tokens), tokens
    (l0, s0), (l1, s1), (l2, s2), (l3, s3) = (c for _, c in runs.values())
    assert l0 == 0 and s0 > 0 and l1 == 0 and s1 > 0
    assert (l2, s2) == (s0, 0) and (l3, s3) == (s1, 0)


def test_saved_executables_are_bound_to_their_devices(tmp_path):
    proc = subprocess.run([sys.executable, str(HERE / "scripts" / "store_devices.py"),
                           str(tmp_path)], cwd=REPO, env=_env(2), capture_output=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert "store_devices ok" in proc.stdout.decode()
