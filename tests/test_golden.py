"""GLM-4.5 MoE and DeepSeek-V3 against HF transformers' own classes (golden files).

tests/golden/make_glm4_moe.py and make_deepseek_v3.py built tiny random models with
transformers 5.17's `Glm4MoeForCausalLM` / `DeepseekV3ForCausalLM` (MLA with and without
q_lora_rank, YaRN with mscale, expert groups, shared experts, dense first layers, and an
FP8 block-scaled twin whose golden comes from its dequantized weights), saved them in
the hub layout with an MTP layer appended, and recorded transformers' float32 logits,
final hidden states, greedy tokens and the MTP layer's teacher-forced logits
(tests/golden/README.md). Here, without torch: our forward against those numbers,
`generate --method none` against transformers' greedy tokens, the speculative methods
against `none`, and `evaluate` on the checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.checkpoint import load
from mtp_jax.config import EngineConfig, SamplingParams, SpecConfig
from mtp_jax.engine import Engine, Request
from mtp_jax.model import causal_attend
from mtp_jax.mtp import forward_train

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
CASES = ("glm4_moe_air", "glm4_moe_groups", "glm4_moe_shared_head", "deepseek_v3_lite",
         "deepseek_v3_yarn", "deepseek_v3_fp8")


def folder(case):
    return os.path.join(GOLDEN, case)


@functools.lru_cache(maxsize=None)
def case_data(case):
    model = load(folder(case))
    gold = dict(np.load(os.path.join(folder(case), "golden.npz")))
    return model, gold


@functools.lru_cache(maxsize=None)
def forward(case):
    model, gold = case_data(case)
    graphdef, params = nnx.split(model.module())
    tokens = jnp.asarray(gold["prompt"][None], jnp.int32)

    @jax.jit
    def run(params, tokens):
        m = nnx.merge(graphdef, params)
        logits, outs = forward_train(m, tokens)
        pos = jnp.arange(tokens.shape[1])[None]
        normed, _ = m.target(tokens, pos, causal_attend(pos))
        return logits[0], outs[0][0], normed[0]

    return [np.asarray(x) for x in run(params, tokens)]


@pytest.mark.parametrize("case", CASES)
def test_config_and_layout(case):
    model, _ = case_data(case)
    cfg = model.config
    assert cfg.moe is not None and cfg.num_mtp_modules == 1
    if case.startswith("deepseek_v3"):
        assert cfg.layout == "deepseek_v3" and cfg.mla is not None
        assert cfg.mtp_own_head and cfg.mtp_own_embed
        assert (cfg.mla.q_lora_rank is None) == (case == "deepseek_v3_lite")
        assert (cfg.quantization is not None) == (case == "deepseek_v3_fp8")
        return
    assert cfg.layout == "glm4_moe"
    assert cfg.rotary_dim == cfg.head_dim // 2  # GLM's partial RoPE
    assert cfg.mtp_own_head == cfg.mtp_own_embed == (case != "glm4_moe_shared_head")
    if case == "glm4_moe_groups":  # transformers-5 style config: theta in rope_parameters
        assert cfg.rope_theta == 5e4 and cfg.qk_norm and cfg.moe.n_group == 4


@pytest.mark.parametrize("case", CASES)
def test_target_logits_and_hidden_match_transformers(case):
    _, gold = case_data(case)
    logits, _, hidden = forward(case)
    np.testing.assert_allclose(logits, gold["logits"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(hidden, gold["hidden"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_mtp_layer_logits_match_transformers_modules(case):
    _, gold = case_data(case)
    _, mtp_logits, _ = forward(case)
    np.testing.assert_allclose(mtp_logits, gold["mtp_logits"], rtol=1e-4, atol=1e-4)


def _cut_at_eos(tokens, eos):
    out = []
    for t in tokens:
        out.append(int(t))
        if t in eos:
            break
    return out


def _engine(model, method, k):
    return Engine(model, SpecConfig(method=method, num_speculative_tokens=k),
                  EngineConfig(max_batch=2, max_model_len=64, page_size=8, prefill_chunk=16,
                               steps_per_dispatch=8))


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers_and_speculation_is_lossless(case):
    model, gold = case_data(case)
    want = _cut_at_eos(gold["greedy"], set(model.eos_token_ids))
    prompt = gold["prompt"].tolist()
    other = prompt[::-1][:7]  # a second request in the batch, shorter
    runs = {"glm4_moe_groups": {"none": 0, "window": 1},
            "deepseek_v3_lite": {"none": 0, "eagle": 2},
            "deepseek_v3_yarn": {"none": 0, "chain": 1},
            "deepseek_v3_fp8": {"none": 0}}.get(case, {"none": 0, "chain": 1, "eagle": 2})
    outs = {}
    for method, k in runs.items():
        eng = _engine(model, method, max(k, 1))
        res = eng.generate([Request("a", prompt, SamplingParams(max_tokens=len(gold["greedy"]))),
                            Request("b", other, SamplingParams(max_tokens=12))])
        outs[method] = [r.token_ids for r in res]
    assert outs["none"][0] == want
    for method in runs:
        assert outs[method] == outs["none"], method


@pytest.mark.parametrize("case", ["glm4_moe_air", "deepseek_v3_fp8"])
def test_generate_cli_none_reproduces_transformers_greedy(tmp_path, case):
    from mtp_jax.generate import main

    model, gold = case_data(case)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "g", "prompt_ids": gold["prompt"].tolist(),
                               "max_tokens": len(gold["greedy"])}) + "\n")
    out = tmp_path / "out.jsonl"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["--model", folder(case), "--input", str(inp), "--output", str(out),
                   "--method", "none", "--max-batch", "1", "--max-model-len", "64"])
    assert rc == 0, err.getvalue()[-2000:]
    rec = json.loads(out.read_text().splitlines()[0])
    assert rec["token_ids"] == _cut_at_eos(gold["greedy"], set(model.eos_token_ids))


@pytest.mark.parametrize("case", ["glm4_moe_shared_head", "deepseek_v3_lite"])
def test_evaluate_runs_every_method_one_mtp_layer_allows(tmp_path, case):
    from mtp_jax.evaluate import main

    _, gold = case_data(case)
    data = tmp_path / "prompts.jsonl"
    rng = np.random.default_rng(0)
    lines = [{"id": i, "prompt_ids": rng.integers(0, 120, 6 + i).tolist()} for i in range(3)]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = tmp_path / "eval.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["--model", folder(case), "--dataset", str(data), "--methods",
                   "chain,window,per_step,eagle", "--num-speculative-tokens", "1",
                   "--max-tokens", "10", "--max-batch", "4", "--output", str(report)])
    assert rc == 0
    res = json.loads(report.read_text())
    methods = res["methods"] if "methods" in res else res
    for m in ("chain", "window", "per_step", "eagle"):
        assert methods[m]["lossless"] is True, (m, methods[m])
