"""Build the GLM-4.7-Flash (``glm4_moe_lite``) golden fixtures with HF transformers.

GLM-4.7-Flash is GLM's MoE (sigmoid router with score-correction bias, group top-k, shared
expert, dense first layers) over DeepSeek-V3's multi-head latent attention, with one MTP
layer. Tiny random models of it are run by transformers' own ``Glm4MoeLiteForCausalLM``
(eager attention and experts, float32, CPU), so CI can check the JAX model against an
implementation we did not write. For every case ``<case>`` in ``CASES`` it writes
``tests/golden/glm4_moe_lite_<case>/``:

* ``config.json``: ``flash`` in the published GLM-4.7-Flash style (DeepSeek-V3 keys:
  ``first_k_dense_replace``, top-level ``rope_theta`` / ``partial_rotary_factor``,
  ``"rope_scaling": null``, ``topk_method``, ``num_nextn_predict_layers``); ``saved`` exactly
  as transformers 5.17 ``save_pretrained`` writes it (``mlp_layer_types``,
  ``rope_parameters``, ``rope_interleave``, ``dtype``).
* ``model.safetensors``: every tensor under the hub names (MLA ``self_attn.*``, per-expert
  ``mlp.experts.{e}.*``, router ``mlp.gate.{weight, e_score_correction_bias}``,
  ``mlp.shared_experts.*``) plus the MTP layer at ``model.layers.{num_hidden_layers}.``. In
  ``flash`` the MTP layer has no ``embed_tokens`` / ``shared_head.head`` of its own (it uses
  the target's, as GLM-4.6 and later publish it); in ``saved`` it carries both.
* ``golden.npz``: prompt, full-forward logits, greedy generation, final hidden state and
  teacher-forced MTP logits (the arrays of the other fixtures; tests/golden/README.md).

The script asserts that the hand-split expert tensors equal what ``save_pretrained``
writes, reloads each folder with ``Glm4MoeLiteForCausalLM.from_pretrained`` (logits must be
bit-identical). transformers 5.17's ``MtpModel`` does not take this model type, so the MTP
layer's outputs come from transformers' own decoder layer and norms with the concat /
projection wired by hand (``_golden_common.run_mtp``). Draws whose routing or argmax decisions are near a tie are redrawn.

Re-run from the repository root with a Python that has torch + transformers::

    python tests/golden/make_glm4_moe_lite.py            # writes into tests/golden/
    python tests/golden/make_glm4_moe_lite.py --out DIR  # writes elsewhere
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

import transformers
from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (
    Glm4MoeLiteDecoderLayer,
    Glm4MoeLiteRMSNorm,
    Glm4MoeLiteTopkRouter,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _golden_common import (  # noqa: E402  (shared with the other fixtures)
    GoldenCheckFailed,
    MtpWeights,
    checked_hub_tensors,
    draw_case,
    draw_prompt,
    load_safetensors,
    new_model,
    parse_args_and_setup,
    randomize_,
    record_golden,
    reload_target,
    write_cases,
    write_fixture_folder,
)

BOS_ID, EOS_ID = 0, 1  # prompts and greedy tokens avoid both

COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    tie_word_embeddings=False,
    use_cache=True,
    max_position_embeddings=256,
)

CASES = {
    "flash": dict(
        style="hub",
        vocab_size=128,
        num_hidden_layers=3,
        dense_layers=1,  # GLM-4.7-Flash: first_k_dense_replace 1
        q_lora_rank=48,
        qk_nope_head_dim=16,
        v_head_dim=16,
        intermediate_size=48,
        moe_intermediate_size=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=1.8,
        norm_topk_prob=True,
        rope_theta=1e6,
        own_embed_and_head=False,
        seed=8000,
    ),
    "saved": dict(
        style="transformers",
        vocab_size=144,
        num_hidden_layers=4,
        dense_layers=2,
        q_lora_rank=None,
        qk_nope_head_dim=12,
        v_head_dim=8,
        intermediate_size=24,
        moe_intermediate_size=4,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_theta=5e4,
        own_embed_and_head=True,
        seed=9000,
    ),
}


def mlp_layer_types(case: dict) -> list[str]:
    n, dense = case["num_hidden_layers"], case["dense_layers"]
    return ["dense"] * dense + ["sparse"] * (n - dense)


def make_config(case: dict) -> Glm4MoeLiteConfig:
    config = Glm4MoeLiteConfig(
        **COMMON,
        vocab_size=case["vocab_size"],
        num_hidden_layers=case["num_hidden_layers"],
        mlp_layer_types=mlp_layer_types(case),
        q_lora_rank=case["q_lora_rank"],
        qk_nope_head_dim=case["qk_nope_head_dim"],
        v_head_dim=case["v_head_dim"],
        intermediate_size=case["intermediate_size"],
        moe_intermediate_size=case["moe_intermediate_size"],
        n_routed_experts=case["n_routed_experts"],
        num_experts_per_tok=case["num_experts_per_tok"],
        n_group=case["n_group"],
        topk_group=case["topk_group"],
        n_shared_experts=case["n_shared_experts"],
        routed_scaling_factor=case["routed_scaling_factor"],
        norm_topk_prob=case["norm_topk_prob"],
        rope_parameters={"rope_type": "default", "rope_theta": case["rope_theta"]},
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        dtype="float32",
    )
    # record_golden counts the router calls from the dense prefix, as DeepSeek-V3 names it
    config.first_k_dense_replace = case["dense_layers"]
    return config


def hub_config_json(case: dict) -> dict:
    """config.json with the keys of the published GLM-4.7-Flash config.json."""
    return {
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "attention_bias": COMMON["attention_bias"],
        "attention_dropout": COMMON["attention_dropout"],
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "first_k_dense_replace": case["dense_layers"],
        "hidden_act": COMMON["hidden_act"],
        "hidden_size": COMMON["hidden_size"],
        "initializer_range": COMMON["initializer_range"],
        "intermediate_size": case["intermediate_size"],
        "kv_lora_rank": COMMON["kv_lora_rank"],
        "max_position_embeddings": COMMON["max_position_embeddings"],
        "model_type": "glm4_moe_lite",
        "moe_intermediate_size": case["moe_intermediate_size"],
        "n_group": case["n_group"],
        "n_routed_experts": case["n_routed_experts"],
        "n_shared_experts": case["n_shared_experts"],
        "norm_topk_prob": case["norm_topk_prob"],
        "num_attention_heads": COMMON["num_attention_heads"],
        "num_experts_per_tok": case["num_experts_per_tok"],
        "num_hidden_layers": case["num_hidden_layers"],
        "num_key_value_heads": COMMON["num_key_value_heads"],
        "num_nextn_predict_layers": 1,
        "pad_token_id": None,
        "partial_rotary_factor": 1.0,
        "q_lora_rank": case["q_lora_rank"],
        "qk_nope_head_dim": case["qk_nope_head_dim"],
        "qk_rope_head_dim": COMMON["qk_rope_head_dim"],
        "rms_norm_eps": COMMON["rms_norm_eps"],
        "rope_scaling": None,
        "rope_theta": case["rope_theta"],
        "routed_scaling_factor": case["routed_scaling_factor"],
        "tie_word_embeddings": COMMON["tie_word_embeddings"],
        "topk_group": case["topk_group"],
        "topk_method": "noaux_tc",
        "torch_dtype": "float32",
        "transformers_version": transformers.__version__,
        "use_cache": COMMON["use_cache"],
        "v_head_dim": case["v_head_dim"],
        "vocab_size": case["vocab_size"],
    }


@torch.no_grad()
def build_case(name: str, case: dict, seed: int, workdir: str):
    """One draw of a case: (model, mtp, config dict, tensors, arrays, stats, save_pretrained dir)."""
    config = make_config(case)
    model, gen = new_model(Glm4MoeLiteForCausalLM, config, seed)
    assert model.config.rope_interleave is True
    # the MTP layer's block is an MoE layer, one past the target's layer types
    mtp_config = copy.deepcopy(model.config)
    mtp_config.mlp_layer_types = mlp_layer_types(case) + ["sparse"]
    mtp = MtpWeights(mtp_config, Glm4MoeLiteRMSNorm, Glm4MoeLiteDecoderLayer,
                     own_embed_and_head=case["own_embed_and_head"])
    randomize_(mtp, gen)
    mtp.eval()
    embed = mtp.embed_tokens if case["own_embed_and_head"] else model.model.embed_tokens
    head = mtp.shared_head_head if case["own_embed_and_head"] else model.lm_head
    prompt = draw_prompt(seed, EOS_ID + 1, case["vocab_size"])
    arrays, stats = record_golden(model, mtp, embed, head, prompt, EOS_ID, Glm4MoeLiteTopkRouter,
                                  seed)
    if any(int(t) in (BOS_ID, EOS_ID) for t in arrays["greedy"]):
        raise GoldenCheckFailed("greedy output contains the bos / eos id")
    tensors, sp_dir = checked_hub_tensors(model, mtp, workdir, name)
    return model, mtp, tensors, arrays, stats, sp_dir


def config_json(case: dict, sp_dir: str) -> dict:
    if case["style"] == "hub":
        return hub_config_json(case)
    with open(os.path.join(sp_dir, "config.json")) as fh:
        saved = json.load(fh)
    saved.pop("first_k_dense_replace", None)  # set above for record_golden, not transformers'
    saved["num_nextn_predict_layers"] = 1  # the appended MTP layer (transformers drops it)
    assert saved["mlp_layer_types"] == mlp_layer_types(case), saved["mlp_layer_types"]
    assert "rope_parameters" in saved and "rope_theta" not in saved, saved
    return saved


@torch.no_grad()
def verify_folder(folder: str, model, case: dict, arrays: dict) -> None:
    """Reload the folder with transformers' own loader and compare. (transformers 5.17's
    MtpModel does not take glm4_moe_lite, so the MTP layer is checked as record_golden ran
    it: transformers' own decoder layer and norms, the concat / projection wired by hand.)"""
    m2 = reload_target(Glm4MoeLiteForCausalLM, folder, model, arrays)
    assert m2.config.mlp_layer_types == mlp_layer_types(case), m2.config.mlp_layer_types
    assert m2.config.rope_parameters["rope_theta"] == case["rope_theta"]
    assert m2.config.rope_interleave is True and m2.config.q_lora_rank == case["q_lora_rank"]
    tensors = load_safetensors(os.path.join(folder, "model.safetensors"))
    p = f"model.layers.{case['num_hidden_layers']}."
    own = [p + "embed_tokens.weight", p + "shared_head.head.weight"]
    assert all((k in tensors) == case["own_embed_and_head"] for k in own), own


def write_case(out_dir: str, name: str, case: dict, workdir: str) -> dict:
    (model, mtp, tensors, arrays, stats, sp_dir), seed, tries = draw_case(
        build_case, name, case, workdir)
    folder = os.path.join(out_dir, f"glm4_moe_lite_{name}")
    write_fixture_folder(folder, config_json(case, sp_dir), tensors, arrays)
    verify_folder(folder, model, case, arrays)
    stats.update(seed=seed, tries=tries)
    return stats


def main() -> None:
    args = parse_args_and_setup(__doc__.split("\n")[0], CASES)
    write_cases(args, CASES, write_case, "glm4_moe_lite_")


if __name__ == "__main__":
    main()
