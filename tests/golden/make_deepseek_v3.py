"""Build the DeepSeek-V3 golden fixtures with HF transformers.

What it builds
--------------
Tiny, randomly initialised DeepSeek-V3 models (multi-head latent attention, sigmoid router with
score-correction bias and group-limited top-k, shared experts, dense first layers), run by
Hugging Face transformers' own ``DeepseekV3ForCausalLM`` (eager attention, eager experts,
float32, CPU), so CI can check the JAX model against an implementation we did not write.  For
every case ``<case>`` in ``CASES`` it writes ``tests/golden/deepseek_v3_<case>/``:

* ``config.json`` in the key order / style of the published DeepSeek-V3 ``config.json``
  (``rope_scaling`` with ``"type": "yarn"`` or null, top-level ``rope_theta``,
  ``num_nextn_predict_layers``, ``n_routed_experts``, ``torch_dtype``, ...; the ``fp8`` case
  adds DeepSeek's ``quantization_config``).
* ``model.safetensors``: every tensor under the hub names DeepSeek-V3 publishes (MLA
  ``self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}``, ``kv_a_proj_with_mqa``,
  ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; per-expert ``mlp.experts.{e}.*``; router
  ``mlp.gate.weight`` + ``mlp.gate.e_score_correction_bias``; ``mlp.shared_experts.*``), plus one
  appended MTP layer at ``model.layers.{num_hidden_layers}.``.  In the ``fp8`` case every linear
  weight inside a decoder layer is stored as ``float8_e4m3fn`` with a float32
  ``<name>_scale_inv`` per 16x16 block, the way DeepSeek publishes its FP8 checkpoint.
* ``golden.npz``: prompt, full-forward logits, greedy generation, final hidden state and
  teacher-forced MTP logits (same arrays as the GLM-4.5 fixtures; see ``tests/golden/README.md``).

The fp8 case's golden outputs come from a plain float32 ``DeepseekV3ForCausalLM`` holding the
DEQUANTIZED weights (``fp8.float() * scale_inv`` per block), so nothing depends on transformers'
own FP8 integration.

The script asserts that the hand-split expert tensors equal what ``save_pretrained`` writes,
reloads every folder with ``DeepseekV3ForCausalLM.from_pretrained`` (logits must be
bit-identical), reloads the MTP layer through transformers' own ``MtpModel.from_pretrained`` and
checks it reproduces the stored MTP outputs, and recomputes layer 0's attention with a
hand-written MLA that follows the README's description (rope pair layout, softmax scale, kv_b_proj
split, YaRN frequencies and attention factor).  For the fp8 case it reads the file back,
dequantizes it and checks it reproduces the float32 weights the golden outputs were made with,
and runs the same transformers reload checks on a float32 copy.

Weights are drawn so routing and greedy decisions are far from ties (the same margins as the GLM
fixtures); a case whose draw fails a check is redrawn with the next seed.  Outputs are
deterministic (single CPU thread; the .npz zip entries carry a fixed timestamp).

Re-run (from the repository root, with a Python that has torch + transformers)::

    python tests/golden/make_deepseek_v3.py            # writes into tests/golden/
    python tests/golden/make_deepseek_v3.py --out DIR  # writes elsewhere

Generated with transformers 5.17.0, torch 2.13.0 (CPU), safetensors 0.8.0, numpy 2.4.6.  The
consumers of the fixtures need only numpy + safetensors (plus a float8_e4m3fn decoder, e.g.
``ml_dtypes``, for the fp8 case).

What this script shares with make_glm4_moe.py (weight drawing, the MTP layer, the recorded runs
and tie checks, writing and reloading a folder) is in ``_golden_common.py`` next to it.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

import torch
from torch import nn

import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3TopkRouter,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _golden_common import (  # noqa: E402  (shared with the GLM-4.5 fixtures)
    GoldenCheckFailed,
    MtpWeights,
    checked_hub_tensors,
    draw_case,
    draw_prompt,
    hf_mtp_max_abs_diff,
    load_safetensors,
    new_model,
    parse_args_and_setup,
    randomize_,
    record_golden,
    reload_target,
    write_cases,
    write_fixture_folder,
    write_model_files,
)

BOS_ID, EOS_ID = 0, 1  # as in the published DeepSeek-V3 config.json; prompts avoid both

FP8_BLOCK = (16, 16)  # weight_block_size of the fp8 case (DeepSeek publishes [128, 128])
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(FP8_BLOCK),
}
# Hub names of the tensors DeepSeek-V3 publishes as float8_e4m3fn + <name>_scale_inv: every linear
# inside a decoder layer (target layers and the MTP layer's decoder block).  Not quantized:
# embed_tokens, lm_head, every norm, the router mlp.gate.weight, e_score_correction_bias, and the
# MTP layer's eh_proj / shared_head.head / embed_tokens.
FP8_WEIGHT_RE = re.compile(
    r"^model\.layers\.\d+\."
    r"(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight$"
)

COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,  # MLA: transformers expands k/v to every head itself; keep equal (hub: 128 / 128)
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    tie_word_embeddings=False,
    use_cache=True,
    rope_theta=10000,
)

YARN = {  # DeepSeek's rope_scaling spelling (published keys, alphabetical as in its config.json)
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 4,
    "mscale": 0.8,  # != mscale_all_dim: exercises both the cos/sin factor and the softmax-scale term
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 64,
    "type": "yarn",
}

# mtp_embed_head: "own"  = the MTP layer's embed_tokens / shared_head.head are different random tensors
#                          (a loader that takes the target's instead fails);
#                 "copy" = they are copies of the target's embed_tokens / lm_head (as the published
#                          DeepSeek-V3 checkpoint documents: "shares parameters").
CASES = {
    "lite": dict(
        vocab_size=128,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        v_head_dim=16,
        intermediate_size=48,
        moe_intermediate_size=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        rope_scaling=None,
        max_position_embeddings=256,
        fp8=False,
        mtp_embed_head="own",
        seed=5000,
    ),
    "yarn": dict(
        vocab_size=144,
        num_hidden_layers=4,
        first_k_dense_replace=2,
        q_lora_rank=48,
        qk_nope_head_dim=12,
        v_head_dim=8,
        intermediate_size=24,
        moe_intermediate_size=4,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_scaling=YARN,
        max_position_embeddings=YARN["factor"] * YARN["original_max_position_embeddings"],
        fp8=False,
        mtp_embed_head="own",
        seed=6000,
    ),
}
# the FP8 block-scaled twin of the yarn architecture, with its own seed
CASES["fp8"] = dict(CASES["yarn"], fp8=True, mtp_embed_head="copy", seed=7000)


# ----------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------


def rope_parameters(case: dict) -> dict:
    """What transformers 5.17 makes of the hub rope fields (built here independently of the json)."""
    if case["rope_scaling"] is None:
        return {"rope_type": "default", "rope_theta": float(COMMON["rope_theta"])}
    rs = case["rope_scaling"]
    return {
        "rope_type": rs["type"],
        "rope_theta": float(COMMON["rope_theta"]),
        "factor": float(rs["factor"]),
        "original_max_position_embeddings": rs["original_max_position_embeddings"],
        "beta_fast": float(rs["beta_fast"]),
        "beta_slow": float(rs["beta_slow"]),
        "mscale": float(rs["mscale"]),
        "mscale_all_dim": float(rs["mscale_all_dim"]),
    }


def make_config(case: dict) -> DeepseekV3Config:
    common = {k: v for k, v in COMMON.items() if k != "rope_theta"}
    return DeepseekV3Config(
        **common,
        vocab_size=case["vocab_size"],
        num_hidden_layers=case["num_hidden_layers"],
        first_k_dense_replace=case["first_k_dense_replace"],
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
        max_position_embeddings=case["max_position_embeddings"],
        rope_parameters=rope_parameters(case),
        num_nextn_predict_layers=1,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        dtype="float32",
    )


def hub_config_json(case: dict) -> dict:
    """config.json in the key order / style of the published DeepSeek-V3 config.json.

    ``auto_map`` (remote-code classes, not shipped here) is left out; ``torch_dtype`` is float32
    because every non-FP8 tensor is stored in float32.
    """
    out = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": COMMON["attention_bias"],
        "attention_dropout": COMMON["attention_dropout"],
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "ep_size": 1,
        "first_k_dense_replace": case["first_k_dense_replace"],
        "hidden_act": COMMON["hidden_act"],
        "hidden_size": COMMON["hidden_size"],
        "initializer_range": COMMON["initializer_range"],
        "intermediate_size": case["intermediate_size"],
        "kv_lora_rank": COMMON["kv_lora_rank"],
        "max_position_embeddings": case["max_position_embeddings"],
        "model_type": "deepseek_v3",
        "moe_intermediate_size": case["moe_intermediate_size"],
        "moe_layer_freq": 1,
        "n_group": case["n_group"],
        "n_routed_experts": case["n_routed_experts"],
        "n_shared_experts": case["n_shared_experts"],
        "norm_topk_prob": case["norm_topk_prob"],
        "num_attention_heads": COMMON["num_attention_heads"],
        "num_experts_per_tok": case["num_experts_per_tok"],
        "num_hidden_layers": case["num_hidden_layers"],
        "num_key_value_heads": COMMON["num_key_value_heads"],
        "num_nextn_predict_layers": 1,
        "q_lora_rank": case["q_lora_rank"],
        "qk_nope_head_dim": case["qk_nope_head_dim"],
        "qk_rope_head_dim": COMMON["qk_rope_head_dim"],
    }
    if case["fp8"]:
        out["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    out.update({
        "rms_norm_eps": COMMON["rms_norm_eps"],
        "rope_scaling": None if case["rope_scaling"] is None else dict(case["rope_scaling"]),
        "rope_theta": COMMON["rope_theta"],
        "routed_scaling_factor": case["routed_scaling_factor"],
        "scoring_func": "sigmoid",
        "tie_word_embeddings": COMMON["tie_word_embeddings"],
        "topk_group": case["topk_group"],
        "topk_method": "noaux_tc",
        "torch_dtype": "float32",
        "transformers_version": transformers.__version__,
        "use_cache": COMMON["use_cache"],
        "v_head_dim": case["v_head_dim"],
        "vocab_size": case["vocab_size"],
    })
    return out


# ----------------------------------------------------------------------------
# FP8 block quantization (DeepSeek-V3 format)
# ----------------------------------------------------------------------------


def fp8_quantize(w: torch.Tensor, block=FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float32 -> (float8_e4m3fn [out, in], float32 scale_inv [ceil(out/bo), ceil(in/bi)]).

    Per block: scale_inv = amax(|block|) / 448 (edge blocks partial, no padding value enters the
    amax); q = float8_e4m3fn(clamp(block / scale_inv, -448, 448)) (round to nearest even).
    """
    assert w.dtype == torch.float32 and w.dim() == 2
    bo, bi = block
    rows, cols = w.shape
    scale_inv = torch.empty(math.ceil(rows / bo), math.ceil(cols / bi), dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for r in range(scale_inv.shape[0]):
        for c in range(scale_inv.shape[1]):
            blk = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
            amax = blk.abs().max()
            s = amax / FP8_MAX if float(amax) > 0 else torch.tensor(1.0)
            scale_inv[r, c] = s
            q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = torch.clamp(blk / s, -FP8_MAX, FP8_MAX).to(
                torch.float8_e4m3fn)
    return q, scale_inv


def fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block=FP8_BLOCK) -> torch.Tensor:
    """W = q.float() * scale_inv repeated over each block (edge blocks cropped), in float32."""
    bo, bi = block
    rows, cols = q.shape
    assert scale_inv.shape == (math.ceil(rows / bo), math.ceil(cols / bi)), (q.shape, scale_inv.shape)
    s = scale_inv.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:rows, :cols]
    return q.to(torch.float32) * s


@torch.no_grad()
def fp8_roundtrip_(module: nn.Module, prefix: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Replace every FP8-published weight of `module` (hub prefix `prefix`) by its dequantized value.

    Returns {hub name: (fp8 weight, scale_inv)}.  Fused experts are quantized per expert and per
    projection (gate rows [:F] and up rows [F:] of gate_up_proj separately), exactly as the hub
    tensors are.
    """
    state = module.state_dict()
    out = {}

    def roundtrip(name, view):
        q, s = fp8_quantize(view.clone().contiguous())
        view.copy_(fp8_dequantize(q, s))
        out[name] = (q, s)

    for key in sorted(state):
        t = state[key]
        if key.endswith("mlp.experts.gate_up_proj"):
            base, f = prefix + key[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                roundtrip(f"{base}{e}.gate_proj.weight", t[e, :f])
                roundtrip(f"{base}{e}.up_proj.weight", t[e, f:])
        elif key.endswith("mlp.experts.down_proj"):
            base = prefix + key[: -len("down_proj")]
            for e in range(t.shape[0]):
                roundtrip(f"{base}{e}.down_proj.weight", t[e])
        elif FP8_WEIGHT_RE.match(prefix + key):
            roundtrip(prefix + key, t)
    return out


# ----------------------------------------------------------------------------
# hand-written MLA, following tests/golden/README.md
# ----------------------------------------------------------------------------


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def documented_rope(case: dict) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [rope/2], cos/sin attention factor, softmax scale) as the README describes them."""
    d = COMMON["qk_rope_head_dim"]
    theta = float(COMMON["rope_theta"])
    qk_head_dim = case["qk_nope_head_dim"] + d
    freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rs = case["rope_scaling"]
    if rs is None:
        return freq, 1.0, qk_head_dim ** -0.5
    factor, orig = float(rs["factor"]), rs["original_max_position_embeddings"]

    def corr_dim(rot):
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr_dim(rs["beta_fast"])), 0)
    high = min(math.ceil(corr_dim(rs["beta_slow"])), d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    inv_freq = (freq / factor) * ramp + freq * (1 - ramp)
    attn_factor = yarn_get_mscale(factor, rs["mscale"]) / yarn_get_mscale(factor, rs["mscale_all_dim"])
    scale = qk_head_dim ** -0.5 * yarn_get_mscale(factor, rs["mscale_all_dim"]) ** 2
    return inv_freq, attn_factor, scale


@torch.no_grad()
def check_documented_attention(model, case: dict, prompt: torch.Tensor) -> float:
    """Layer 0's attention, hand-written from the README, against transformers' DeepseekV3Attention."""
    config = model.config
    attn = model.model.layers[0].self_attn
    t = prompt.shape[0]
    h_heads, dn, dr, dv = (config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim,
                           config.v_head_dim)
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(prompt))  # [T, D]
    pos = torch.arange(t)

    inv_freq, attn_factor, scale = documented_rope(case)
    rotary = model.model.rotary_emb
    assert torch.allclose(rotary.inv_freq, inv_freq, rtol=1e-6, atol=0), (rotary.inv_freq, inv_freq)
    assert abs(rotary.attention_scaling - attn_factor) < 1e-12, (rotary.attention_scaling, attn_factor)
    assert abs(attn.scaling - scale) < 1e-12, (attn.scaling, scale)

    def rms(v, w, eps):
        return w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps))

    if config.q_lora_rank is None:
        q = x @ attn.q_proj.weight.T
    else:
        q = rms(x @ attn.q_a_proj.weight.T, attn.q_a_layernorm.weight, attn.q_a_layernorm.variance_epsilon)
        q = q @ attn.q_b_proj.weight.T
    q = q.view(t, h_heads, dn + dr)  # per head: [nope | rope]
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    ckv = x @ attn.kv_a_proj_with_mqa.weight.T  # [T, kv_lora_rank + dr]
    c, k_pe = ckv[:, : config.kv_lora_rank], ckv[:, config.kv_lora_rank:]  # latent | shared rope key
    c = rms(c, attn.kv_a_layernorm.weight, attn.kv_a_layernorm.variance_epsilon)
    kv = (c @ attn.kv_b_proj.weight.T).view(t, h_heads, dn + dv)  # per head: [k_nope | v]
    k_nope, v = kv[..., :dn], kv[..., dn:]

    ang = pos[:, None].float() * inv_freq[None]  # [T, dr/2]
    cos, sin = torch.cos(ang) * attn_factor, torch.sin(ang) * attn_factor

    def rope_pairs(u, cos, sin):  # interleaved pairs (u[2i], u[2i+1]) rotated by angle i; layout kept
        a, b = u[..., 0::2], u[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)

    q_rot = rope_pairs(q_pe, cos[:, None], sin[:, None])  # [T, H, dr]
    k_rot = rope_pairs(k_pe, cos, sin)  # [T, dr], shared by all heads
    scores = (torch.einsum("thd,shd->hts", q_nope, k_nope) + torch.einsum("thd,sd->hts", q_rot, k_rot)) * scale
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.einsum("hts,shd->thd", probs, v).reshape(t, h_heads * dv)
    mine = o @ attn.o_proj.weight.T

    pe = rotary(x[None], pos[None])
    mask = create_causal_mask(config=config, inputs_embeds=x[None], attention_mask=None, past_key_values=None,
                              position_ids=pos[None])
    theirs, _ = attn(x[None], position_embeddings=pe, attention_mask=mask)
    diff = float((mine - theirs[0]).abs().max())
    assert diff <= 1e-5, f"documented MLA differs from DeepseekV3Attention by {diff}"
    return diff


# ----------------------------------------------------------------------------
# one case
# ----------------------------------------------------------------------------


@torch.no_grad()
def build_case(name: str, case: dict, seed: int, workdir: str):
    """One draw of a case. Returns (model, mtp, config dict, tensors, fp8 pairs, arrays, stats)."""
    config = make_config(case)
    model, gen = new_model(DeepseekV3ForCausalLM, config, seed)
    assert model.config.rope_interleave is True

    mtp = MtpWeights(model.config, DeepseekV3RMSNorm, DeepseekV3DecoderLayer, own_embed_and_head=True)
    randomize_(mtp, gen)
    mtp.eval()
    n_layers = config.num_hidden_layers
    if case["mtp_embed_head"] == "copy":
        mtp.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        mtp.shared_head_head.weight.copy_(model.lm_head.weight)
    else:
        assert not torch.equal(mtp.embed_tokens.weight, model.model.embed_tokens.weight)
        assert not torch.equal(mtp.shared_head_head.weight, model.lm_head.weight)

    fp8_pairs = {}
    if case["fp8"]:  # from here on the models hold the dequantized weights
        fp8_pairs.update(fp8_roundtrip_(model, ""))
        fp8_pairs.update(fp8_roundtrip_(mtp.layer, f"model.layers.{n_layers}."))

    prompt = draw_prompt(seed, EOS_ID + 1, case["vocab_size"])

    attn_diff = check_documented_attention(model, case, prompt)

    arrays, stats = record_golden(model, mtp, mtp.embed_tokens, mtp.shared_head_head, prompt, EOS_ID,
                                  DeepseekV3TopkRouter, seed)
    if any(int(t) in (BOS_ID, EOS_ID) for t in arrays["greedy"]):
        raise GoldenCheckFailed("greedy output contains the bos / eos id")

    tensors, _ = checked_hub_tensors(model, mtp, workdir, name)  # float32 (dequantized in the fp8 case)
    if case["fp8"]:
        assert sorted(fp8_pairs) == sorted(k for k in tensors if FP8_WEIGHT_RE.match(k)), "fp8 coverage"
        for k, (q, s) in fp8_pairs.items():
            assert torch.equal(fp8_dequantize(q, s), tensors[k]), k

    stats["documented_attention_max_abs_diff"] = attn_diff
    return model, mtp, hub_config_json(case), tensors, fp8_pairs, arrays, stats


def file_tensors(tensors: dict[str, torch.Tensor], fp8_pairs: dict) -> dict[str, torch.Tensor]:
    """What model.safetensors holds: float32 tensors, FP8-published weights replaced by (fp8, scale_inv)."""
    out = {}
    for k, v in tensors.items():
        if k in fp8_pairs:
            q, s = fp8_pairs[k]
            out[k] = q.contiguous()
            out[k + "_scale_inv"] = s.contiguous()
        else:
            out[k] = v
    return out


@torch.no_grad()
def verify_fp8_file(folder: str, tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Read the fp8 file back and check that dequantizing it reproduces the float32 weights used."""
    stored = load_safetensors(os.path.join(folder, "model.safetensors"))
    n_fp8 = 0
    for k in sorted(stored):
        if k.endswith("_scale_inv"):
            assert k[: -len("_scale_inv")] in stored and stored[k].dtype == torch.float32, k
            continue
        v = stored[k]
        if FP8_WEIGHT_RE.match(k):
            assert v.dtype == torch.float8_e4m3fn, (k, v.dtype)
            s = stored[k + "_scale_inv"]
            assert s.shape == (math.ceil(v.shape[0] / FP8_BLOCK[0]), math.ceil(v.shape[1] / FP8_BLOCK[1])), k
            assert torch.equal(fp8_dequantize(v, s), tensors[k]), k
            n_fp8 += 1
        else:
            assert v.dtype == torch.float32 and k + "_scale_inv" not in stored, k
            assert torch.equal(v, tensors[k]), k
    assert sorted(k for k in stored if not k.endswith("_scale_inv")) == sorted(tensors)
    # at least one weight whose dims are not multiples of the block (kv_a_proj_with_mqa: 40 rows)
    ragged = [k for k in stored if FP8_WEIGHT_RE.match(k) and
              (stored[k].shape[0] % FP8_BLOCK[0] or stored[k].shape[1] % FP8_BLOCK[1])]
    assert any("kv_a_proj_with_mqa" in k for k in ragged), ragged
    with open(os.path.join(folder, "config.json")) as fh:
        assert json.load(fh)["quantization_config"] == FP8_QUANTIZATION_CONFIG
    return dict(fp8_weights=n_fp8, fp8_ragged_weights=len(ragged))


@torch.no_grad()
def verify_folder(folder: str, model, mtp: MtpWeights, case: dict, arrays: dict) -> float:
    """Reload a float32 folder with transformers' own loaders and compare."""
    m2 = reload_target(DeepseekV3ForCausalLM, folder, model, arrays)
    rp = m2.config.rope_parameters
    for key, value in rope_parameters(case).items():
        assert rp[key] == value, (key, rp)
    assert m2.config.rope_interleave is True
    assert m2.config.q_lora_rank == case["q_lora_rank"]
    assert model.model.layers[0].self_attn.scaling == m2.model.layers[0].self_attn.scaling
    assert model.model.rotary_emb.attention_scaling == m2.model.rotary_emb.attention_scaling
    # the MTP layer's own embedding / head, copies of the target's or not as the case says
    tensors = load_safetensors(os.path.join(folder, "model.safetensors"))
    p = f"model.layers.{case['num_hidden_layers']}."
    embed_w, head_w = tensors[p + "embed_tokens.weight"], tensors[p + "shared_head.head.weight"]
    same = case["mtp_embed_head"] == "copy"
    assert torch.equal(embed_w, tensors["model.embed_tokens.weight"]) == same
    assert torch.equal(head_w, tensors["lm_head.weight"]) == same
    return hf_mtp_max_abs_diff(m2, mtp, DeepseekV3DecoderLayer, arrays, embed_w, head_w)


def write_case(out_dir: str, name: str, case: dict, workdir: str) -> dict:
    (model, mtp, config_json, tensors, fp8_pairs, arrays, stats), seed, tries = draw_case(
        build_case, name, case, workdir)
    folder = os.path.join(out_dir, f"deepseek_v3_{name}")
    write_fixture_folder(folder, config_json, file_tensors(tensors, fp8_pairs), arrays)
    if case["fp8"]:
        stats.update(verify_fp8_file(folder, tensors))
        # transformers' loaders on a float32 copy (dequantized weights, no quantization_config)
        f32 = os.path.join(workdir, f"{name}_dequantized")
        os.makedirs(f32, exist_ok=True)
        write_model_files(f32, {k: v for k, v in config_json.items() if k != "quantization_config"}, tensors)
        stats["hf_mtp_model_max_abs_diff"] = verify_folder(f32, model, mtp, case, arrays)
    else:
        stats["hf_mtp_model_max_abs_diff"] = verify_folder(folder, model, mtp, case, arrays)
    stats.update(seed=seed, tries=tries)
    return stats


def main() -> None:
    args = parse_args_and_setup(__doc__.split("\n")[0], CASES)
    write_cases(args, CASES, write_case, "deepseek_v3_")


if __name__ == "__main__":
    main()
