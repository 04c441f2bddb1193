"""GLM-4.5 MoE, DeepSeek-V3, MiMo-V2-Flash and Step-3.5-Flash against HF transformers' own
classes (golden files).

tests/golden/make_glm4_moe.py and make_deepseek_v3.py built tiny random models with
transformers 5.17's `Glm4MoeForCausalLM` / `DeepseekV3ForCausalLM` (MLA with and without
q_lora_rank, YaRN with mscale, expert groups, shared experts, dense first layers, and an
FP8 block-scaled twin whose golden comes from its dequantized weights), saved them in
the hub layout with an MTP layer appended, and recorded transformers' float32 logits,
final hidden states, greedy tokens and the MTP layer's teacher-forced logits
(tests/golden/README.md). make_mimo_v2_step3p5.py did the same with `MiMoV2FlashForCausalLM`
and the `step3p5` text model (sliding / full layers with their own kv heads, sinks, a value
head dim apart from the key's, the head-wise gate, clamped SwiGLU, zero-centred norms,
per-layer RoPE), each with its 3 MTP layers wired as the published engines run them.
Here, without torch: our forward against those numbers,
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
from mtp_jax.layers import causal_attend
from mtp_jax.mtp import forward_train

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def _mtp_layers(case: str) -> int:
    """How many MTP layers a fixture recorded: `mtp_logits` for one, `mtp_logits_{k}` each."""
    with np.load(os.path.join(GOLDEN, case, "golden.npz")) as gold:
        names = set(gold.files)
    return 1 if "mtp_logits" in names else sum(n.startswith("mtp_logits_") for n in names)


# Every fixture folder is a case: a family's fixture is checked once it is committed.
CASES = tuple(sorted(d for d in os.listdir(GOLDEN)
                     if os.path.isfile(os.path.join(GOLDEN, d, "golden.npz"))))
ONE_MTP = tuple(c for c in CASES if _mtp_layers(c) == 1)
THREE_MTP = tuple(c for c in CASES if _mtp_layers(c) == 3)
GLM45 = ("glm4_moe_air", "glm4_moe_groups", "glm4_moe_shared_head")


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
        return logits[0], [o[0] for o in outs], normed[0]

    logits, outs, hidden = run(params, tokens)
    return np.asarray(logits), [np.asarray(o) for o in outs], np.asarray(hidden)


def _gold_prompt(case):
    return case_data(case)[1]["prompt"]


def mtp_golden(case, gold):
    """The recorded teacher-forced logits of each MTP layer."""
    if case in ONE_MTP:
        return [gold["mtp_logits"]]
    return [gold[f"mtp_logits_{k}"] for k in range(3)]


@pytest.mark.parametrize("case", ONE_MTP)
def test_config_and_layout(case):
    model, _ = case_data(case)
    cfg = model.config
    assert (cfg.moe is None) == (case == "qwen3_5_dense") and cfg.num_mtp_modules == 1
    if case.startswith("qwen3"):  # hybrid: linear-attention layers and the gated attention
        assert cfg.layout == ("qwen3_next" if "next" in case else "qwen3_5")
        assert cfg.attention_gate == "element"
        assert any(cfg.linear_layers) and not cfg.is_linear(cfg.num_layers)
        assert cfg.norm_offset == 1.0 and cfg.mtp_shared_input
        return
    if case.startswith(("deepseek_v32_", "glm_moe_dsa_")):  # DeepSeek Sparse Attention
        assert cfg.layout == case.rsplit("_", 1)[0] and cfg.mla is not None
        assert cfg.dsa is not None and cfg.dsa.index_topk < len(_gold_prompt(case))
        assert cfg.dsa.rope_interleave == (cfg.layout == "glm_moe_dsa")
        specs = [cfg.layer_spec(i).attention for i in range(cfg.num_layers_total)]
        shared = [s.index_shared for s in specs]
        assert shared == ([False, True, False, True, False] if case == "glm_moe_dsa_shared"
                          else [False] * cfg.num_layers_total)
        return
    if case.startswith("deepseek_v3_"):
        assert cfg.layout == "deepseek_v3" and cfg.mla is not None
        assert cfg.mtp_own_head and cfg.mtp_own_embed
        assert (cfg.mla.q_lora_rank is None) == (case == "deepseek_v3_lite")
        assert (cfg.quantization is not None) == (case == "deepseek_v3_fp8")
        return
    if case not in GLM45:
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
    want = mtp_golden(case, gold)
    assert len(mtp_logits) == len(want)
    for got, ref in zip(mtp_logits, want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ("mimo_v2_flash_hub", "mimo_v2_flash_hf", "step3p5_flash"))
def test_mimo_v2_and_step3p5_configs_read_every_published_fact(case):
    model, _ = case_data(case)
    cfg = model.config
    assert cfg.num_mtp_modules == 3 and cfg.moe is not None
    specs = [cfg.layer_spec(i) for i in range(cfg.num_layers_total)]
    att = [s.attention for s in specs]
    if case.startswith("mimo_v2_flash"):
        # hub: the MTP count comes from the tensors (the published config has none)
        assert cfg.layout == "mimo_v2_flash" and cfg.mtp_hidden_source == "target"
        assert [a.window for a in att] == [None, 4, 4, None, 4, 4, 4]
        assert [a.num_kv_heads for a in att] == [1, 2, 2, 1, 2, 2, 2]
        assert [a.sinks for a in att] == [False, True, True, False, True, True, True]
        assert {(a.head_dim, a.v_dim, a.value_scale) for a in att} == {(24, 16, 0.707)}
        assert all(a.rope.rotary_dim == 8 for a in att)  # int(24 * 0.334)
        thetas = (5e6, 1e4) if case.endswith("hub") else (2e6, 2e4)
        assert [a.rope.theta for a in att] == [thetas[a.window is not None] for a in att]
        assert [s.is_moe for s in specs] == [False, True, True, True, False, False, False]
        assert not cfg.mtp_own_head and not cfg.mtp_zero_embed_at_pos0
        return
    assert cfg.layout == "step3p5" and cfg.mtp_hidden_source == "previous"
    assert cfg.norm_offset == 1.0 and cfg.mtp_own_head and not cfg.mtp_zero_embed_at_pos0
    assert [a.num_heads for a in att] == [4, 6, 6, 6, 6, 6, 6]
    assert [a.window for a in att] == [None] + [4] * 6
    assert all(a.gate == "head" and a.qk_norm for a in att)
    assert [a.rope.rotary_dim for a in att] == [8] + [16] * 6
    assert [a.rope.scaling is not None for a in att] == [True] + [False] * 6  # yarn_only_types
    assert [s.is_moe for s in specs] == [False, True, True, True, False, False, False]
    assert specs[2].ffn.swiglu_limit == 0.2 and specs[3].ffn.shared_swiglu_limit == 0.15
    assert specs[0].ffn.swiglu_limit == 0.3  # a dense MLP takes the shared bound
    assert specs[1].ffn.shared_size == 48 and specs[1].ffn.routed_scaling_factor == 3.0


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
            "deepseek_v3_fp8": {"none": 0},
            # 3 MTP layers, K = 3 (evaluate below runs every strategy on two of them)
            "mimo_v2_flash_hub": {"none": 0, "per_step": 3},
            "mimo_v2_flash_hf": {"none": 0, "chain": 3},
            "step3p5_flash": {"none": 0, "window": 3}}.get(
                case, {"none": 0, "chain": 1, "eagle": 2})
    outs = {}
    for method, k in runs.items():
        eng = _engine(model, method, max(k, 1))
        res = eng.generate([Request("a", prompt, SamplingParams(max_tokens=len(gold["greedy"]))),
                            Request("b", other, SamplingParams(max_tokens=12))])
        outs[method] = [r.token_ids for r in res]
    assert outs["none"][0] == want
    for method in runs:
        assert outs[method] == outs["none"], method


@pytest.mark.parametrize("case", ["glm4_moe_air", "deepseek_v3_fp8", "mimo_v2_flash_hub"])
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


# Each strategy runs on one model with one MTP layer and on one with three (two strategies
# per case, so each evaluate call compiles three engines rather than five).
EVALUATE_RUNS = {"glm4_moe_shared_head": "chain,eagle", "deepseek_v3_lite": "window,per_step",
                 "step3p5_flash": "chain,per_step", "mimo_v2_flash_hub": "window,eagle"}


@pytest.mark.parametrize("case", sorted(EVALUATE_RUNS))
def test_evaluate_runs_every_method_lossless(tmp_path, case):
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
                   EVALUATE_RUNS[case], "--num-speculative-tokens",
                   "1" if case in ONE_MTP else "3",
                   "--max-tokens", "10", "--max-batch", "4", "--output", str(report)])
    assert rc == 0
    res = json.loads(report.read_text())
    methods = res["methods"] if "methods" in res else res
    for m in EVALUATE_RUNS[case].split(","):
        assert methods[m]["lossless"] is True, (m, methods[m])


def test_evaluate_runs_cover_every_strategy_on_one_and_three_mtp_layers():
    for cases in (ONE_MTP, THREE_MTP):
        covered = [m for c, ms in EVALUATE_RUNS.items() if c in cases for m in ms.split(",")]
        assert sorted(covered) == ["chain", "eagle", "per_step", "window"]
