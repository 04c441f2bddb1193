"""Installed, not only cloned: a wheel built from the working tree, installed (not
editable) into a fresh venv, runs the main job with the shipped model from a directory
outside the checkout. The venv sees this interpreter's packages (jax, flax, ...), so
nothing is downloaded; the wheel is built without build isolation for the same reason.
About a minute on a 2-core CPU (wheel 10 s, venv 5 s, the job's cold compile the rest);
`-m "not install"` leaves it out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cpu_compile import cpu_flags

REPO = Path(__file__).resolve().parent.parent
LINES = [{"id": "fib", "prompt": "def fibonacci(n):\n"},
         {"id": "add", "prompt": "def add(a, b):\n"},
         {"id": "ids", "prompt_ids": [10, 20, 30]}]


def working_tree(dst: Path) -> None:
    """Copy the files git tracks or would track (not ignored: no build/ left-overs)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, out.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


@pytest.mark.install
def test_wheel_runs_the_main_job_from_anywhere(tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to know the working tree")
    src, wheels, venv, work = (tmp_path / d for d in ("src", "wheels", "venv", "work"))
    for d in (src, work):
        d.mkdir()
    working_tree(src)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}

    def sh(*cmd, **kw):
        r = subprocess.run(list(map(str, cmd)), capture_output=True, env=env, timeout=120, **kw)
        assert r.returncode == 0, f"{cmd}: {r.stderr.decode()[-3000:]}"
        return r

    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
       "-w", wheels, src)
    (wheel,) = wheels.glob("mtp_jax-*.whl")
    sh(sys.executable, "-m", "venv", "--system-site-packages", venv)
    py = venv / "bin" / "python"
    sh(py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel)
    shutil.rmtree(src)  # nothing of the tree is left to find but the installed package

    (work / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in LINES))
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags(), MTP_JAX_COMPILE_CACHE="off",
               HF_HUB_OFFLINE="1")
    r = sh(py, "-c", "import mtp_jax; print(mtp_jax.__file__)", cwd=work)
    assert Path(r.stdout.decode().strip()).is_relative_to(venv)  # not the checkout's
    r = sh(py, "-m", "mtp_jax.generate", "--input", "in.jsonl", "--output", "out.jsonl",
           "--max-tokens", "8", "--max-model-len", "128", cwd=work)
    recs = [json.loads(x) for x in (work / "out.jsonl").read_text().splitlines()]
    assert sorted(x["id"] for x in recs) == ["add", "fib", "ids"]
    assert all(x["finish_reason"] in ("stop", "length") and x["token_ids"] for x in recs), recs
    assert "shipped_model" in r.stderr.decode()  # the copy inside the installed package
