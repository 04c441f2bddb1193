"""Hub ids (`--model org/name[@revision]`, `mtp_jax.load`), without the network: a hub cache
is built in the layout huggingface_hub writes (`models--org--name/` with `blobs/` named
by content hash, `snapshots/<commit>/` of links to them and `refs/main`) under a temporary
`HF_HUB_CACHE`, and the CLI runs under `HF_HUB_OFFLINE=1`."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from cli_fixtures import make_checkpoint
from test_generate_cli import ENGINE_ARGS, records, run_cli

REV_MAIN, REV_OLD = "a" * 40, "b" * 40
PROMPTS = [{"id": "a", "prompt": "hello world", "max_tokens": 6},
           {"id": "b", "prompt_ids": [3, 4, 5], "max_tokens": 6}]


def add_snapshot(cache: Path, repo: str, commit: str, src: Path, ref: str | None = "main"):
    """Put the files of folder `src` into `cache` as the snapshot `commit` of `repo`."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    if ref:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(cache folder, local folder of the main revision, of the old one)."""
    root = tmp_path_factory.mktemp("hub")
    main, old = root / "main", root / "old"
    make_checkpoint(str(main), seed=0)
    make_checkpoint(str(old), seed=1)  # other weights: other tokens
    cache = root / "cache"
    add_snapshot(cache, "org/name", REV_MAIN, main)
    add_snapshot(cache, "org/name", REV_OLD, old, ref=None)
    inp = root / "in.jsonl"
    inp.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return cache, main, old, inp


def generate(model, inp, cache, *extra):
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "MTP_JAX_COMPILE_CACHE": "off"}
    r = run_cli(["--model", model, "--input", inp, "--output", "-", "--method", "none",
                 *ENGINE_ARGS, *extra], env=env)
    return r, {rec["id"]: rec["token_ids"] for rec in records(r.stdout)}


def test_parse_hub_id(tmp_path, monkeypatch):
    from mtp_jax.checkpoint.hub import parse_hub_id

    assert parse_hub_id("org/name") == ("org/name", None)
    assert parse_hub_id("XiaomiMiMo/MiMo-7B-RL@main") == ("XiaomiMiMo/MiMo-7B-RL", "main")
    assert parse_hub_id(f"org/name.v2@{REV_OLD}") == ("org/name.v2", REV_OLD)
    for path in ("checkpoints", "./org/name", "/abs/org", "a/b/c", "../org/name", "org/"):
        assert parse_hub_id(path) is None, path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_hub_id("org/name") is None  # an existing folder is always a path


def test_hub_id_offline_matches_local_path(hub):
    """The main revision by hub id gives the local folder's tokens; `@commit` picks the
    other snapshot (other weights, other tokens), also through mtp_jax.load."""
    cache, main, old, inp = hub
    r_local, local = generate(str(main), inp, cache)
    assert r_local.returncode == 0, r_local.stderr.decode()
    r_hub, by_id = generate("org/name", inp, cache)
    assert r_hub.returncode == 0, r_hub.stderr.decode()
    assert by_id == local and len(local) == 2 and all(local.values())
    assert "on org/name" in r_hub.stderr.decode()
    r_old, old_tokens = generate(f"org/name@{REV_OLD}", inp, cache)
    assert r_old.returncode == 0, r_old.stderr.decode()
    assert old_tokens.keys() == local.keys() and old_tokens != local


def test_load_by_hub_id(hub, monkeypatch):
    import huggingface_hub.constants as constants

    import mtp_jax

    cache, main, old, _ = hub
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = mtp_jax.load(f"org/name@{REV_OLD}")
    assert Path(model.path).parent.name == "snapshots" and Path(model.path).name == REV_OLD


def test_missing_model_offline(hub, tmp_path):
    cache, _, _, inp = hub
    r, recs = generate("org/absent", inp, cache)
    err = r.stderr.decode()
    assert r.returncode == 1 and not recs
    assert "org/absent is not in the hub cache" in err and str(cache) in err, err
    assert "HF_HUB_OFFLINE=1" in err and "Traceback" not in err
    # a revision the cache does not hold
    r, _ = generate("org/name@v9", inp, cache)
    assert r.returncode == 1 and "org/name@v9 is not in the hub cache" in r.stderr.decode()
