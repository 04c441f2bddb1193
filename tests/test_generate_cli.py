"""End-to-end tests of `python -m mtp_jax.generate`, run as a subprocess on small random
checkpoints (tests/cli_fixtures.py). Each run that generates pays a fresh compile, so the
module makes only two of them: `chain` from stdin to stdout through the default-model
lookup (every error kind rides along), compiling into an empty persistent cache folder of
its own, and `none` on the orbax copy with `--resume` and the cache off. A third run
(`chain` on the same model and engine options) loads its programs from the first one's
folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli_fixtures import make_checkpoint, make_orbax
from cpu_compile import cpu_flags

REPO = Path(__file__).resolve().parent.parent
ENGINE_ARGS = ["--max-batch", "2", "--max-model-len", "64"]

VALID = [
    {"id": "t1", "prompt": "hello world", "max_tokens": 12},
    {"id": "i1", "prompt_ids": [1, 2, 3, 4], "max_tokens": 20},
    {"id": 7, "prompt_ids": [5, 6], "max_tokens": 9, "top_k": 5},  # top_k is moot at T=0
    {"prompt_ids": [9, 8, 7], "max_tokens": 5},  # no id: "line 4"
    {"id": "dup", "prompt_ids": [11], "max_tokens": 3},
]
# (line, the id its record must carry, a piece of the expected error message)
ERRORS = [
    ({"id": "dup", "prompt_ids": [5, 100]}, "dup", "duplicate id: line"),  # a valid "dup" first
    ({"id": "neg", "prompt_ids": [-1, 5]}, "neg", "outside the vocabulary"),
    ({"id": "long", "prompt_ids": [1] * 70}, "long", "max_model_len is 64"),
    ({"id": "empty", "prompt": ""}, "empty", "empty prompt"),
    ({"id": "empty_ids", "prompt_ids": []}, "empty_ids", "empty prompt_ids"),
    ({"id": "missing"}, "missing", "missing prompt"),
    ({"id": "both", "prompt": "hi", "prompt_ids": [1]}, "both", "not both"),
    ({"id": "strids", "prompt_ids": "1 2 3"}, "strids", "list of integers"),
    ({"id": "boolids", "prompt_ids": [1, True]}, "boolids", "list of integers"),
    ({"id": "temp", "prompt_ids": [1], "temperature": -1}, "temp", "temperature"),
    ({"id": "topp", "prompt_ids": [1], "top_p": 0}, "topp", "top_p"),
    ({"id": "topk", "prompt_ids": [1], "top_k": 1.5}, "topk", "top_k"),
    ({"id": "booltopk", "prompt_ids": [1], "top_k": True}, "booltopk", "top_k"),
    ({"id": "maxtok", "prompt_ids": [1], "max_tokens": 0}, "maxtok", "max_tokens"),
    ({"id": "seed", "prompt_ids": [1], "seed": -3}, "seed", "seed"),
    ({"id": "stop", "prompt_ids": [1], "stop": [1]}, "stop", "stop"),
    ({"id": [1], "prompt_ids": [1]}, "line {n}", "id must be"),
    ({"id": "typo", "prompt_ids": [1], "max_token": 3}, "typo", "unknown keys ['max_token']"),
    ([1, 2], "line {n}", "JSON object"),
]
RAW_ERRORS = [  # lines that are not JSON at all
    (b'{"id": "broken", "prompt": ', "line {n}", "malformed JSON"),
    (b'{"id": "nan", "prompt_ids": [1], "temperature": NaN}', "nan", "temperature"),
    (b'{"id": "latin", "prompt": "caf\xe9"}', "latin", "UTF-8"),
]


def run_cli(args, *, stdin=None, env=None, timeout=300):
    full_env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags())
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "mtp_jax.generate", *map(str, args)],
                          input=stdin, capture_output=True, env=full_env, cwd=REPO,
                          timeout=timeout)


def records(data: bytes) -> list:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model = make_checkpoint(str(root / "shipped" / "hf"))
    make_orbax(model, str(root / "orbax"))
    return root


@pytest.fixture(scope="module")
def chain_run(ckpt):
    """chain, stdin -> stdout, model found through the default lookup (single subfolder),
    compiling into the empty cache folder `ckpt / "cache"` (a warm start reads it later)."""
    lines, expect = [json.dumps(x).encode() for x in VALID], {}
    for obj, rid, msg in ERRORS:
        lines.append(json.dumps(obj).encode())
        expect[len(lines)] = (rid.format(n=len(lines)), msg)
    lines.append(b"")  # blank lines are skipped without a record
    for raw, rid, msg in RAW_ERRORS:
        lines.append(raw)
        expect[len(lines)] = (rid.format(n=len(lines)), msg)
    proc = run_cli(["--input", "-", "--output", "-", "--method", "chain", *ENGINE_ARGS,
                    "--compile-cache", ckpt / "cache"],
                   stdin=b"\n".join(lines) + b"\n",
                   env={"MTP_JAX_DEFAULT_MODEL": str(ckpt / "shipped")})
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return proc, records(proc.stdout), expect


def test_chain_records_errors_and_summary(chain_run):
    proc, recs, expect = chain_run
    assert len(recs) == len(VALID) + len(ERRORS) + len(RAW_ERRORS)  # one per non-blank line
    ok = [r for r in recs if "token_ids" in r]
    assert sorted(map(str, (r["id"] for r in ok))) == sorted(["t1", "i1", "7", "line 4", "dup"])
    for r, src in zip(sorted(ok, key=lambda r: str(r["id"])), sorted(
            VALID, key=lambda v: str(v.get("id", "line 4")))):
        assert set(r) == {"id", "text", "token_ids", "finish_reason", "num_prompt_tokens",
                          "num_cached_prompt_tokens", "num_generated_tokens",
                          "mean_accepted_length", "acceptance_per_depth"}
        assert r["finish_reason"] == "length"  # the random model has no EOS
        assert r["num_generated_tokens"] == len(r["token_ids"]) == src["max_tokens"]
        assert all(0 <= t < 100 for t in r["token_ids"])
        assert isinstance(r["text"], str)
        assert 1.0 <= r["mean_accepted_length"] <= 4.0
        assert len(r["acceptance_per_depth"]) == 3
        if "prompt_ids" in src:
            assert r["num_prompt_tokens"] == len(src["prompt_ids"])
    errs = [r for r in recs if "token_ids" not in r]
    assert all(set(r) == {"id", "error"} or set(r) == {"id", "error", "duplicate_of_line",
                                                        "line"} for r in errs)
    got = sorted((json.dumps(r["id"]), r["error"]) for r in errs)
    want = sorted((json.dumps(rid), msg) for rid, msg in expect.values())
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, err), (_, msg) in zip(got, want):
        assert msg in err
    err = proc.stderr.decode()
    assert "compile" in err and "tokens/s" in err and "mean accepted length" in err
    assert "acceptance per depth" in err
    assert f"5 requests, {len(errs)} lines in error" in err and "5 ok, 0 errors" in err


def test_none_orbax_resume(ckpt, chain_run, tmp_path):
    """Greedy `none` on the orbax copy gives chain's tokens; --resume skips recorded ids
    (error records too), cuts off a torn last line (its id runs again) and otherwise never
    rewrites the file. `--compile-cache off` turns the persistent cache off."""
    chain = {r["id"]: r for r in chain_run[1] if "token_ids" in r}
    t1 = chain["t1"]["text"]
    stop = t1[3:6]
    inp = tmp_path / "in.jsonl"
    lines = VALID[:3] + [{"id": "empty", "prompt": ""},
                         {"id": "t1stop", "prompt": "hello world", "max_tokens": 12,
                          "stop": stop}]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    pre = [{"id": 7, "token_ids": [1]}, {"id": "empty", "error": "empty prompt"}]
    torn = '{"id": "t1", "text": "he'
    out.write_text("".join(json.dumps(x) + "\n" for x in pre) + torn)
    proc = run_cli(["--model", ckpt / "orbax", "--input", inp, "--output", out, "--resume",
                    "--method", "none", "--stop", "@@", *ENGINE_ARGS, "--compile-cache", "off"])
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert "compile cache off" in proc.stderr.decode()
    text = out.read_text().split("\n")
    assert text[:2] == [json.dumps(x) for x in pre] and text[-1] == "" and torn not in text
    new = [json.loads(x) for x in text[2:-1]]
    assert sorted(r["id"] for r in new) == ["i1", "t1", "t1stop"]
    for rid in ("t1", "i1"):
        assert new[[r["id"] for r in new].index(rid)]["token_ids"] == chain[rid]["token_ids"]
        assert new[[r["id"] for r in new].index(rid)]["acceptance_per_depth"] == []
    s = new[[r["id"] for r in new].index("t1stop")]
    assert s["finish_reason"] == "stop" and s["text"] == t1[: t1.find(stop)]
    assert chain["t1"]["token_ids"][: len(s["token_ids"])] == s["token_ids"]
    assert "3 requests, 0 lines in error, 2 skipped" in proc.stderr.decode()
    # A second resume has nothing left to do and adds nothing.
    before = out.read_bytes()
    proc = run_cli(["--model", ckpt / "orbax", "--input", inp, "--output", out, "--resume"])
    assert proc.returncode == 0 and out.read_bytes() == before


def test_no_model_says_how_to_pass_one(tmp_path):
    (tmp_path / "a" / "x").mkdir(parents=True)  # no config.json anywhere
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt_ids": [1]}\n')
    proc = run_cli(["--input", inp, "--output", tmp_path / "out.jsonl"],
                   env={"MTP_JAX_DEFAULT_MODEL": str(tmp_path / "a")})
    assert proc.returncode != 0
    assert "--model PATH" in proc.stderr.decode()


def test_unreadable_input_and_bad_setup(ckpt, tmp_path, capsys):
    """Failures before any generation, driven through main() in-process (no compile)."""
    from mtp_jax.generate import main

    hf, inp, out = ckpt / "shipped" / "hf", tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    assert main(["--model", str(hf), "--input", str(tmp_path / "nope"), "--output", str(out)])
    assert "cannot read input" in capsys.readouterr().err
    inp.write_text('{"id": 1, "prompt_ids": [1]}\n')
    assert main(["--model", str(hf), "--input", str(inp), "--output", str(out),
                 "--method", "window", "--num-speculative-tokens", "4"])
    assert "MTP modules" in capsys.readouterr().err
    assert main(["--model", str(hf), "--input", str(inp), "--output", str(out),
                 "--method", "window", "--draft-tree", "2,2"])
    assert "method 'window' cannot draft a tree" in capsys.readouterr().err
    assert main(["--model", str(hf), "--input", str(inp), "--output", str(out),
                 "--draft-tree", "2,x"])
    assert "branching at depth 2 must be an integer" in capsys.readouterr().err
    assert main(["--model", str(tmp_path), "--input", str(inp), "--output", str(out)])
    assert "cannot load model" in capsys.readouterr().err
    assert main(["--model", str(hf), "--input", str(inp), "--output", str(tmp_path)])
    assert "cannot write output" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--model", str(hf), "--input", str(inp), "--output", "-", "--top-p", "2"])
    assert e.value.code == 2 and "top_p" in capsys.readouterr().err


def test_default_model_lookup(tmp_path, monkeypatch):
    from mtp_jax.cli import DEFAULT_MODEL_ENV, default_model_dir

    monkeypatch.setenv(DEFAULT_MODEL_ENV, str(tmp_path))
    assert default_model_dir() == (tmp_path, None)  # empty
    (tmp_path / "m1").mkdir()
    (tmp_path / "m1" / "config.json").write_text("{}")
    assert default_model_dir() == (tmp_path, tmp_path / "m1")  # its single model subfolder
    (tmp_path / "m2").mkdir()
    (tmp_path / "m2" / "config.json").write_text("{}")
    assert default_model_dir() == (tmp_path, None)  # ambiguous
    (tmp_path / "config.json").write_text("{}")
    assert default_model_dir() == (tmp_path, tmp_path)  # the folder itself
    monkeypatch.delenv(DEFAULT_MODEL_ENV)
    assert default_model_dir()[0] == REPO / "checkpoints"


def test_model_without_tokenizer_or_mtp(tmp_path, capsys):
    """Text prompts and stop strings need a tokenizer; no MTP modules means `none`. Every
    line here is in error, so nothing compiles."""
    from mtp_jax.generate import main

    make_checkpoint(str(tmp_path / "m"), num_mtp=0, tokenizer=False)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt": "hello"}\n'
                   '{"id": "b", "prompt_ids": [1], "stop": "x"}\n')
    args = ["--model", str(tmp_path / "m"), "--input", str(inp), "--output", str(out),
            *ENGINE_ARGS]
    assert main(args) == 1  # every line in error: nothing ran
    recs = records(out.read_bytes())
    assert [r["id"] for r in recs] == ["a", "b"]
    assert "tokenizer" in recs[0]["error"] and "tokenizer" in recs[1]["error"]
    assert "none K=0" in capsys.readouterr().err
    assert main(args + ["--stop", "x"]) == 1
    assert "--stop needs a tokenizer" in capsys.readouterr().err
    assert main(args + ["--method", "chain"]) == 1
    assert "MTP modules" in capsys.readouterr().err


def test_record_fields():
    from mtp_jax.engine import Result
    from mtp_jax.generate import record

    res = Result("x", [4, 5, 6], "stop", 2, text="abc", num_steps=1, accepted_per_depth=[1, 0])
    assert record("x", res, True) == {
        "id": "x", "text": "abc", "token_ids": [4, 5, 6], "finish_reason": "stop",
        "num_prompt_tokens": 2, "num_cached_prompt_tokens": 0, "num_generated_tokens": 3,
        "mean_accepted_length": 1.5, "acceptance_per_depth": [1.0, 0.0]}
    assert "text" not in record("x", res, False)
    healed = Result("h", [4], "length", 3, text="x", healed="\n")  # token healing re-chose
    assert record("h", healed, True)["healed"] == "\n"
    nan = Result("y", [4], "error", 2, error="non-finite logits", num_steps=0)
    assert record("y", nan, False)["error"] == "non-finite logits"
    assert record("z", Result("z", [], "error", 2, error="bad"), False) == {
        "id": "z", "error": "bad"}


def test_second_run_loads_its_programs_from_the_compile_cache(ckpt, chain_run, tmp_path):
    """Warm starts: chain_run compiled every program into an empty cache folder of its own
    and saved the engine's executables there; a second run of `chain` with the same model
    and engine options loads every one of them (the option wins over
    $MTP_JAX_COMPILE_CACHE, which the suite sets to off).
    test_none_orbax_resume runs with the cache off."""
    first = chain_run[0].stderr.decode()
    saved = re.search(r"compile cache 0 hits / [1-9]\d* misses, executables 0 loaded / "
                      r"([1-9]\d*) saved", first)
    assert saved, first[-800:]
    cache = ckpt / "cache"
    assert any(cache.iterdir())
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt_ids": [3, 5, 7], "max_tokens": 6}) + "\n")
    proc = run_cli(["--model", ckpt / "shipped" / "hf", "--input", inp, "--output",
                    tmp_path / "o.jsonl", "--method", "chain", *ENGINE_ARGS,
                    "--compile-cache", cache])
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    second = proc.stderr.decode()
    # every engine program loaded whole (nothing traced); the hits are the small eager
    # operations that build the engine's state
    assert re.search(r"compile cache \d+ hits / 0 misses, executables "
                     rf"{saved.group(1)} loaded / 0 saved", second), second[-800:]


def test_duplicate_ids_later_line_gets_an_error_and_resume_loses_nothing(ckpt, tmp_path):
    """A repeated id does not run: its line gets an error record naming the first line.
    That record does not mark the id done, so `--resume` after an interruption that hit
    before the first line finished still runs it, and does not report the duplicate
    twice."""
    from mtp_jax.generate import main

    lines = [{"id": "a", "prompt_ids": [3, 5]}, {"id": "b", "prompt_ids": [7]},
             {"id": "a", "prompt_ids": [9, 9, 9]}, {"id": "c", "prompt_ids": [4]}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ["--model", str(ckpt / "shipped" / "hf"), "--input", str(inp), "--output",
            str(out), "--method", "none", "--max-tokens", "4", *ENGINE_ARGS]
    assert main(args) == 0
    recs = records(out.read_bytes())
    dup = [r for r in recs if "duplicate_of_line" in r]
    assert len(dup) == 1 and dup[0]["id"] == "a" and dup[0]["duplicate_of_line"] == 1
    assert dup[0]["line"] == 3 and "line 1" in dup[0]["error"]
    ran = {r["id"]: r for r in recs if "token_ids" in r}
    assert sorted(ran) == ["a", "b", "c"]
    # As if interrupted after the duplicate's error and b: a and c are still to run.
    out.write_text(json.dumps(dup[0]) + "\n" + json.dumps(ran["b"]) + "\n")
    assert main(args + ["--resume"]) == 0
    again = records(out.read_bytes())
    assert sum("duplicate_of_line" in r for r in again) == 1
    assert sorted(r["id"] for r in again if "token_ids" in r) == ["a", "b", "c"]
    assert [r for r in again if r["id"] == "a" and "token_ids" in r][0] == ran["a"]


def test_strict_keys_exit_status_when_nothing_runs(ckpt, tmp_path, capsys):
    """Unknown keys are an error record for their line; an input of which no line runs
    (or that has no lines) exits 1. Nothing here compiles."""
    from mtp_jax.cli import KNOWN_KEYS
    from mtp_jax.generate import main

    assert {"id", "prompt", "prompt_ids", "max_tokens", "temperature", "top_p", "top_k",
            "seed", "stop", "messages", "chat_template_kwargs"} == KNOWN_KEYS
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    args = ["--model", str(ckpt / "shipped" / "hf"), "--input", str(inp), "--output",
            str(out), "--method", "none", *ENGINE_ARGS]
    inp.write_text('{"id": "a", "prompt_ids": [1], "max_token": 3}\n'
                   '{"id": "b", "promt": "hi"}\n')
    assert main(args) == 1
    recs = records(out.read_bytes())
    assert [r["id"] for r in recs] == ["a", "b"]
    assert "unknown keys ['max_token']" in recs[0]["error"] and "--lenient" in recs[0]["error"]
    assert "unknown keys ['promt']" in recs[1]["error"]
    assert "no line of the input ran" in capsys.readouterr().err
    inp.write_text("\n")
    assert main(args) == 1 and out.read_bytes() == b""
    assert "the input has no lines" in capsys.readouterr().err


def test_lenient_warns_and_max_tokens_capped(ckpt, tmp_path):
    """--lenient runs a line with unknown keys and says so in its record; a max_tokens that
    does not fit max_model_len after the prompt is capped and the record says to what."""
    from mtp_jax.generate import main

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "w", "prompt_ids": [3, 5], "max_tokens": 4,
                               "colour": "red"}) + "\n"
                   + json.dumps({"id": "cap", "prompt_ids": [1] * 60, "max_tokens": 10})
                   + "\n" + json.dumps({"id": "bad", "prompt_ids": [], "x": 1}) + "\n")
    assert main(["--model", str(ckpt / "shipped" / "hf"), "--input", str(inp), "--output",
                 str(out), "--method", "none", "--lenient", *ENGINE_ARGS]) == 0
    recs = {r["id"]: r for r in records(out.read_bytes())}
    assert recs["w"]["num_generated_tokens"] == 4 and "max_tokens_capped" not in recs["w"]
    assert "unknown keys ['colour']" in recs["w"]["warning"]
    assert recs["cap"]["max_tokens_capped"] == 4 == recs["cap"]["num_generated_tokens"]
    assert "warning" not in recs["cap"]
    assert "empty prompt_ids" in recs["bad"]["error"] and "['x']" in recs["bad"]["warning"]


@pytest.mark.parametrize("mesh", ["tp=2", "dp=2"])
def test_mesh_of_two_devices_gives_the_single_device_tokens(ckpt, chain_run, tmp_path, mesh):
    """The CLI over two (fake CPU) devices, heads or slots split, emits the tokens of the
    single-device chain_run (greedy: any K gives them; a fixed K compiles one step
    program)."""
    chain = {r["id"]: r["token_ids"] for r in chain_run[1] if "token_ids" in r}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in VALID[:3]))
    flags = f"--xla_force_host_platform_device_count=2 {cpu_flags()}"
    proc = run_cli(["--model", ckpt / "shipped" / "hf", "--input", inp, "--output", out,
                    "--mesh", mesh, "--method", "chain", "--num-speculative-tokens", "2",
                    *ENGINE_ARGS, "--compile-cache", "off"], env={"XLA_FLAGS": flags})
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert "3 ok, 0 errors" in proc.stderr.decode()
    got = {r["id"]: r["token_ids"] for r in records(out.read_bytes())}
    assert got == {rid: chain[rid] for rid in got} and len(got) == 3
