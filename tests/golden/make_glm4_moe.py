"""Build the GLM-4.5-MoE (and Qwen3-MoE block) golden fixtures with HF transformers.

What it builds
--------------
Tiny, randomly initialised GLM-4.5-MoE models, run by Hugging Face transformers'
own ``Glm4MoeForCausalLM`` (eager attention, eager experts, float32, CPU), so CI
can check the JAX model against an implementation we did not write.  For every
case ``<case>`` in ``CASES`` it writes ``tests/golden/glm4_moe_<case>/``:

* ``config.json``: either hub style (top-level ``rope_theta`` /
  ``partial_rotary_factor`` / ``rope_scaling: null``, as the published
  GLM-4.5(-Air) configs are written) or exactly what transformers'
  ``save_pretrained`` writes (with ``rope_parameters``).
* ``model.safetensors``: every tensor under the hub names GLM-4.5 publishes
  (per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``, router
  ``mlp.gate.weight`` + ``mlp.gate.e_score_correction_bias``, ...), plus one
  appended MTP layer at ``model.layers.{num_hidden_layers}.``.
* ``golden.npz``: prompt, full-forward logits, greedy generation, final hidden
  state and teacher-forced MTP logits (see ``tests/golden/README.md``).

and ``tests/golden/qwen3_moe_block.npz`` from transformers'
``Qwen3MoeSparseMoeBlock`` (softmax router).

The target weights in model.safetensors are split from transformers' fused
expert tensors by ``fused_to_hub``; the script asserts that this equals what
``save_pretrained`` writes for the target layers, reloads every folder with
``Glm4MoeForCausalLM.from_pretrained`` and checks logits are bit-identical, and
reloads the MTP layer through transformers' own ``MtpModel.from_pretrained``
and checks it reproduces the stored MTP outputs.

Weights are drawn so routing and greedy decisions are far from ties (every
router top-k / group choice is separated by > 1e-4 from the next candidate,
every greedy / MTP argmax by > 1e-3 from the runner-up); a case whose draw
fails a check is redrawn with the next seed.  Outputs are deterministic
(single CPU thread; the .npz zip entries carry a fixed timestamp).

Re-run (from the repository root, with a Python that has torch + transformers)::

    python tests/golden/make_glm4_moe.py            # writes into tests/golden/
    python tests/golden/make_glm4_moe.py --out DIR  # writes elsewhere

Generated with transformers 5.17.0, torch 2.13.0 (CPU), safetensors 0.8.0,
numpy 2.4.6.  The consumers of the fixtures need only numpy + safetensors.

What this script shares with make_deepseek_v3.py (weight drawing, the MTP layer,
the recorded runs and tie checks, writing and reloading a folder) is in
``_golden_common.py`` next to it.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

import transformers
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, Qwen3MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import (
    Glm4MoeDecoderLayer,
    Glm4MoeRMSNorm,
    Glm4MoeTopkRouter,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _golden_common import (  # noqa: E402  (shared with the DeepSeek-V3 fixtures)
    MAX_TRIES,
    ROUTER_MARGIN,
    GoldenCheckFailed,
    MtpWeights,
    checked_hub_tensors,
    draw_case,
    draw_prompt,
    fused_to_hub,
    hf_mtp_max_abs_diff,
    load_safetensors,
    new_model,
    parse_args_and_setup,
    randomize_,
    record_golden,
    reload_target,
    save_npz_deterministic,
    write_cases,
    write_fixture_folder,
)

COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=32,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    hidden_act="silu",
    attention_dropout=0.0,
    initializer_range=0.02,
    tie_word_embeddings=False,
    use_cache=True,
)

# config_style: "hub" = published GLM-4.5 config.json layout, "transformers" = save_pretrained output.
# mtp_style: "glm45" = MTP layer carries its own embed_tokens + shared_head.head;
#            "glm46" = they are omitted (MTP shares the target's embedding / lm_head).
CASES = {
    "air": dict(
        vocab_size=128,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        use_qk_norm=False,
        attention_bias=True,
        partial_rotary_factor=0.5,
        rope_theta=1000000.0,
        config_style="hub",
        mtp_style="glm45",
        seed=1000,
    ),
    "groups": dict(
        vocab_size=144,
        num_hidden_layers=4,
        first_k_dense_replace=2,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        partial_rotary_factor=0.5,
        # deliberately not a common default, so a loader that ignores rope_parameters fails
        rope_theta=50000.0,
        config_style="transformers",
        mtp_style="glm45",
        seed=2000,
    ),
    "shared_head": dict(
        vocab_size=160,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
        use_qk_norm=False,
        attention_bias=True,
        partial_rotary_factor=0.5,
        rope_theta=1000000.0,
        config_style="hub",
        mtp_style="glm46",
        seed=3000,
    ),
}


# ----------------------------------------------------------------------------
# GLM-4.5 MoE
# ----------------------------------------------------------------------------


def special_ids(vocab_size: int) -> tuple[int, list[int]]:
    eos = [vocab_size - 3, vocab_size - 2, vocab_size - 1]
    return eos[0], eos  # pad_token_id, eos_token_id (GLM: pad == first eos id)


def make_config(case: dict) -> Glm4MoeConfig:
    pad, eos = special_ids(case["vocab_size"])
    cfg = Glm4MoeConfig(
        **COMMON,
        vocab_size=case["vocab_size"],
        num_hidden_layers=case["num_hidden_layers"],
        first_k_dense_replace=case["first_k_dense_replace"],
        n_routed_experts=case["n_routed_experts"],
        num_experts_per_tok=case["num_experts_per_tok"],
        n_group=case["n_group"],
        topk_group=case["topk_group"],
        n_shared_experts=case["n_shared_experts"],
        routed_scaling_factor=case["routed_scaling_factor"],
        norm_topk_prob=case["norm_topk_prob"],
        use_qk_norm=case["use_qk_norm"],
        attention_bias=case["attention_bias"],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": case["rope_theta"],
            "partial_rotary_factor": case["partial_rotary_factor"],
        },
        partial_rotary_factor=case["partial_rotary_factor"],
        num_nextn_predict_layers=1,
        pad_token_id=pad,
        eos_token_id=eos,
        dtype="float32",
    )
    return cfg


def hub_config_json(case: dict) -> dict:
    """config.json in the key order / style of the published GLM-4.5(-Air) config.json."""
    pad, eos = special_ids(case["vocab_size"])
    theta = case["rope_theta"]
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": case["attention_bias"],
        "attention_dropout": COMMON["attention_dropout"],
        "pad_token_id": pad,
        "eos_token_id": eos,
        "head_dim": COMMON["head_dim"],
        "hidden_act": COMMON["hidden_act"],
        "hidden_size": COMMON["hidden_size"],
        "partial_rotary_factor": case["partial_rotary_factor"],
        "initializer_range": COMMON["initializer_range"],
        "intermediate_size": COMMON["intermediate_size"],
        "max_position_embeddings": COMMON["max_position_embeddings"],
        "model_type": "glm4_moe",
        "moe_intermediate_size": COMMON["moe_intermediate_size"],
        "norm_topk_prob": case["norm_topk_prob"],
        "num_attention_heads": COMMON["num_attention_heads"],
        "n_group": case["n_group"],
        "topk_group": case["topk_group"],
        "n_routed_experts": case["n_routed_experts"],
        "n_shared_experts": case["n_shared_experts"],
        "routed_scaling_factor": case["routed_scaling_factor"],
        "num_experts_per_tok": case["num_experts_per_tok"],
        "first_k_dense_replace": case["first_k_dense_replace"],
        "num_hidden_layers": case["num_hidden_layers"],
        "num_key_value_heads": COMMON["num_key_value_heads"],
        "rms_norm_eps": COMMON["rms_norm_eps"],
        "rope_scaling": None,
        "rope_theta": int(theta) if float(theta).is_integer() else theta,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": COMMON["tie_word_embeddings"],
        "torch_dtype": "float32",
        "transformers_version": transformers.__version__,
        "use_cache": COMMON["use_cache"],
        "use_qk_norm": case["use_qk_norm"],
        "vocab_size": case["vocab_size"],
    }


@torch.no_grad()
def build_glm_case(name: str, case: dict, seed: int, workdir: str):
    """One draw of a case. Returns (model, mtp, config dict, tensors, arrays, stats) or raises GoldenCheckFailed."""
    config = make_config(case)
    model, gen = new_model(Glm4MoeForCausalLM, config, seed)

    own = case["mtp_style"] == "glm45"
    mtp = MtpWeights(model.config, Glm4MoeRMSNorm, Glm4MoeDecoderLayer, own_embed_and_head=own)
    randomize_(mtp, gen)
    mtp.eval()
    if own:
        assert not torch.equal(mtp.embed_tokens.weight, model.model.embed_tokens.weight)
        assert not torch.equal(mtp.shared_head_head.weight, model.lm_head.weight)
        mtp_embed, mtp_head = mtp.embed_tokens, mtp.shared_head_head
    else:
        mtp_embed, mtp_head = model.model.embed_tokens, model.lm_head

    pad, eos = special_ids(case["vocab_size"])
    prompt = draw_prompt(seed, 0, case["vocab_size"] - len(eos))

    arrays, stats = record_golden(model, mtp, mtp_embed, mtp_head, prompt, pad, Glm4MoeTopkRouter, seed)
    if any(int(t) in eos for t in arrays["greedy"]):
        raise GoldenCheckFailed("greedy output contains an eos id")

    tensors, sp_dir = checked_hub_tensors(model, mtp, workdir, name)
    if case["config_style"] == "hub":
        config_json = hub_config_json(case)
    else:
        with open(os.path.join(sp_dir, "config.json")) as fh:
            config_json = json.load(fh)
    return model, mtp, config_json, tensors, arrays, stats


@torch.no_grad()
def verify_folder(folder: str, model, mtp: MtpWeights, case: dict, arrays: dict) -> float:
    """Reload the written folder with transformers' own loaders and compare."""
    m2 = reload_target(Glm4MoeForCausalLM, folder, model, arrays)
    rp = m2.config.rope_parameters
    assert rp["rope_theta"] == case["rope_theta"] and rp["partial_rotary_factor"] == case["partial_rotary_factor"], rp
    # the MTP layer's embedding / head: its own ones when the file has them, else the target's
    tensors = load_safetensors(os.path.join(folder, "model.safetensors"))
    p = f"model.layers.{case['num_hidden_layers']}."
    if case["mtp_style"] == "glm45":
        embed_w, head_w = tensors[p + "embed_tokens.weight"], tensors[p + "shared_head.head.weight"]
        assert not torch.equal(embed_w, tensors["model.embed_tokens.weight"])
        assert not torch.equal(head_w, tensors["lm_head.weight"])
    else:
        assert p + "embed_tokens.weight" not in tensors and p + "shared_head.head.weight" not in tensors
        embed_w, head_w = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    return hf_mtp_max_abs_diff(m2, mtp, Glm4MoeDecoderLayer, arrays, embed_w, head_w)


def write_glm_case(out_dir: str, name: str, case: dict, workdir: str) -> dict:
    (model, mtp, config_json, tensors, arrays, stats), seed, tries = draw_case(build_glm_case, name, case, workdir)
    folder = os.path.join(out_dir, f"glm4_moe_{name}")
    write_fixture_folder(folder, config_json, tensors, arrays)
    stats["hf_mtp_model_max_abs_diff"] = verify_folder(folder, model, mtp, case, arrays)
    stats.update(seed=seed, tries=tries)
    return stats


# ----------------------------------------------------------------------------
# Qwen3-MoE softmax-router block
# ----------------------------------------------------------------------------


@torch.no_grad()
def write_qwen3_block(out_dir: str, base_seed: int = 4000) -> dict:
    n_tok, d, n_exp, k, f = 10, 64, 8, 2, 32
    for attempt in range(MAX_TRIES):
        seed = base_seed + attempt
        gen = torch.Generator().manual_seed(seed)
        blocks, cfgs = {}, {}
        for norm in (True, False):
            cfg = Qwen3MoeConfig(hidden_size=d, num_experts=n_exp, num_experts_per_tok=k, moe_intermediate_size=f,
                                 norm_topk_prob=norm, hidden_act="silu")
            cfg._experts_implementation = "eager"
            cfgs[norm] = cfg
            blocks[norm] = Qwen3MoeSparseMoeBlock(cfg).eval()
        # one set of weights shared by both variants
        state = blocks[True].state_dict()
        for name in sorted(state):
            std = 0.3 if name == "gate.weight" else 0.1
            state[name].copy_(std * torch.randn(state[name].shape, generator=gen))
        blocks[False].load_state_dict(state)
        x = torch.randn(n_tok, d, generator=gen)
        probs = torch.softmax(x @ state["gate.weight"].t(), dim=-1)
        top = probs.sort(dim=-1, descending=True).values
        margin = float((top[:, k - 1] - top[:, k]).min())
        if margin > ROUTER_MARGIN:
            break
    else:
        raise RuntimeError("qwen3 block: no seed passed the router tie check")

    outs = {}
    for norm, block in blocks.items():
        y = block(x[None])
        assert isinstance(y, torch.Tensor), type(y)  # 5.17 returns only the hidden states (no router logits)
        outs[norm] = y[0]
    assert not torch.allclose(outs[True], outs[False])
    router_logits, _, topk_idx = blocks[True].gate(x)
    arrays = {"x": x.numpy().astype(np.float32)}
    arrays.update({k_: v.numpy().astype(np.float32) for k_, v in fused_to_hub(
        {"mlp.experts.gate_up_proj": state["experts.gate_up_proj"], "mlp.experts.down_proj": state["experts.down_proj"]},
        "").items()})
    # strip the "mlp." prefix used only to trigger the split: Qwen3-MoE names inside a block are experts.{e}.*
    arrays = {(kk[len("mlp."):] if kk.startswith("mlp.") else kk): vv for kk, vv in arrays.items()}
    arrays["gate.weight"] = state["gate.weight"].numpy().astype(np.float32)
    arrays["y_norm_topk_prob_true"] = outs[True].numpy().astype(np.float32)
    arrays["y_norm_topk_prob_false"] = outs[False].numpy().astype(np.float32)
    arrays["router_logits"] = router_logits.numpy().astype(np.float32)
    arrays["topk_indices"] = topk_idx.numpy().astype(np.int64)
    arrays["num_experts_per_tok"] = np.array(k, dtype=np.int64)
    arrays["seed"] = np.array(seed, dtype=np.int64)
    # the split weights must rebuild the fused block exactly
    check = Qwen3MoeSparseMoeBlock(cfgs[True]).eval()
    check.gate.weight.copy_(torch.from_numpy(arrays["gate.weight"]))
    check.experts.gate_up_proj.copy_(torch.stack([
        torch.cat([torch.from_numpy(arrays[f"experts.{e}.gate_proj.weight"]),
                   torch.from_numpy(arrays[f"experts.{e}.up_proj.weight"])], 0) for e in range(n_exp)]))
    check.experts.down_proj.copy_(torch.stack([torch.from_numpy(arrays[f"experts.{e}.down_proj.weight"])
                                               for e in range(n_exp)]))
    assert np.array_equal(check(x[None])[0].numpy(), arrays["y_norm_topk_prob_true"])
    save_npz_deterministic(os.path.join(out_dir, "qwen3_moe_block.npz"), arrays)
    return dict(seed=seed, router_margin=margin)


def main() -> None:
    args = parse_args_and_setup(__doc__.split("\n")[0], CASES)
    write_cases(args, CASES, write_glm_case, "glm4_moe_")
    stats = write_qwen3_block(args.out)
    print(f"qwen3_moe_block: {stats}")


if __name__ == "__main__":
    main()
