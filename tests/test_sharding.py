"""Sharding on 8 fake CPU devices: sharded greedy outputs equal single-device outputs for
every method; orbax restores straight into the sharding. Runs in a subprocess because the
device count is fixed when jax starts."""

import json
import os
import subprocess
import sys

import pytest

from mtp_jax.sharding import make_mesh

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ)
    env["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                        "--xla_backend_optimization_level=0 "
                        "--xla_llvm_disable_expensive_passes=true")
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "scripts",
                                                        "sharded_equivalence.py")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("method", ["none", "chain", "window", "eagle", "per_step"])
def test_sharded_greedy_equals_single_device(result, method):
    r = result["methods"][method]
    assert all(r["equal"]), r
    assert r["qkv_spec"] == [None, "tp", None, None]
    assert r["kv_spec"] == ["tp", None, None, None]
    dp = dict(x.split("=") for x in r["mesh"].split(","))["dp"]
    if dp != "1":
        assert r["slots_spec"] == ["dp"]
    if method != "none":
        assert r["accepted"] > 0


def test_orbax_restores_into_the_sharding(result):
    o = result["orbax"]
    assert o["equal"] and o["sharded"] and o["spread"]
    assert o["vocab_split"] == [None, "tp"]
    assert o["shard_shape"] == [64, 32]  # hidden 64, vocab 64 split over tp=2


def test_mesh_spec_parsing():
    assert make_mesh(None) is None
    with pytest.raises(ValueError):
        make_mesh("tp=2,xx=1")
    with pytest.raises(ValueError):
        make_mesh("tp=64")
