"""Build the MiMo-V2-Flash and Step-3.5-Flash golden fixtures with HF transformers.

What it builds
--------------
Tiny, randomly initialised models of two hybrid sliding-window / full-attention MoE
architectures with three MTP layers each, run by Hugging Face transformers' own classes (eager
attention, eager experts, float32, CPU), so CI can check the JAX models against an implementation
we did not write.  For every case in ``CASES`` it writes ``tests/golden/<case>/``:

* ``mimo_v2_flash_hub``, ``mimo_v2_flash_hf``: ``MiMoV2FlashForCausalLM``
  (``transformers.models.mimo_v2_flash``).  4 target layers ``[full, sliding, sliding, full]``,
  first layer a dense MLP, the rest sigmoid-routed MoE (8 experts, top-2, score-correction bias,
  no shared experts); sliding layers have twice the KV heads of full layers and per-head
  attention sinks; head_dim 24 (qk) / 16 (v), partial RoPE (rotary dim 8), values scaled by
  ``attention_value_scale``.  Three MTP layers (sliding attention with sinks, dense MLP).
  ``_hub`` writes ``config.json`` in the published MiMo-V2-Flash key style
  (``hybrid_layer_pattern``, ``moe_layer_freq``, ``swa_*``, ``layernorm_epsilon``, no
  ``num_nextn_predict_layers``); ``_hf`` writes it exactly as transformers' ``save_pretrained``
  does (``layer_types``, ``mlp_layer_types``, per-type ``rope_parameters``) plus
  ``"num_nextn_predict_layers": 3``.  Both use the hub tensor names (``self_attn.attention_sink_bias``,
  ``model.mtp.layers.{k}.*``).
* ``step3p5_flash``: ``Step3p7TextModel`` (``transformers.models.step3p7``;
  its text config has ``model_type`` "step3p5") plus a hand-added ``lm_head`` (transformers has no
  text-only CausalLM class for it).  4 target layers ``[full, sliding, sliding, sliding]`` (full
  layers 4 query heads, sliding layers 6, 2 KV heads, head_dim 16), zero-centred RMSNorms
  (``x_hat * (1 + w)``) everywhere incl. q/k norms, head-wise sigmoid output gate ``g_proj``,
  per-layer RoPE theta / partial factor, llama3 RoPE scaling on full layers only, layer 0 dense,
  layers 1-3 MoE (8 experts, top-2, sigmoid router + bias, routed output x 3.0, shared expert),
  clamped SwiGLU (bounds small enough that the clamp changes the outputs).  Three MTP layers at
  ``model.layers.{4,5,6}`` (sliding attention, dense MLP), each with its own
  ``transformer.shared_head.{norm,output}``.  ``config.json`` is in the published Step-3.5-Flash
  key style (7-long per-layer lists that include the MTP layers, ``attention_other_setting``,
  ``moe_layers_enum``, ``swiglu_limits*``, ...).

Each folder holds ``config.json``, ``model.safetensors`` (float32, hub tensor names; see
``tests/golden/README.md``) and ``golden.npz``: prompt, full-forward logits, greedy continuation
(with a KV cache, re-checked without one), final hidden state after and before the final norm,
and the teacher-forced outputs of all three MTP layers (``mtp_logits_{k}``, ``mtp_y_{k}``).

Teacher-forced MTP (layer k = 0, 1, 2; anchors i = 0 .. T-2-k)::

    e   = target embed_tokens(prompt[i+k+1])                # no zeroing at position 0
    g   = MiMo:  hidden[i]                                  # target, AFTER its final norm, every k
          Step:  hidden_prenorm[i] for k = 0, mtp_y_{k-1}[i] for k > 0
    x   = eh_proj(cat([enorm(e), hnorm(g)]))                # embedding first
    y   = decoder block k (RoPE position ids i, sliding-window causal mask over the anchors)   # mtp_y_k
    mtp_logits_k = MiMo: lm_head(final_layernorm(y));  Step: shared_head.output(shared_head.norm(y))

The decoder blocks are transformers' own ``MiMoV2FlashDecoderLayer`` / ``Step3p7DecoderLayer``,
built from a copy of the target config whose per-layer lists are extended so that layer indices
N .. N+2 exist (sliding, dense; for Step the 7-long hub lists themselves, so the MTP layer L uses
entry L of every per-layer list, as vLLM does).  Only the concat / projection / norm / head wiring
is hand-written.

Checks made while writing (all must pass):

* every routing decision has a margin > 1e-4 between the last chosen and the first rejected
  expert, every greedy step and every MTP row a top-1/top-2 logit gap > 1e-3, no greedy token
  is the bos / eos id (0 / 1); otherwise the next seed is drawn;
* the greedy tokens are the same when every step is recomputed without a cache;
* MiMo: the hand-made hub tensors equal what ``save_pretrained`` writes (it writes the sinks as
  ``self_attn.attention_sink_bias``); ``MiMoV2FlashForCausalLM.from_pretrained(folder)`` loads
  every target tensor (the ``model.mtp.*`` tensors are ignored) and reproduces the logits bit for
  bit.  transformers 5.17 does not read the published key style (``hybrid_layer_pattern``,
  ``swa_*``, ``rope_theta``, ...), so the ``_hub`` folder is reloaded with an explicit config
  (and the script asserts that the plain config load gets ``layer_types`` wrong and
  ``rope_parameters`` None); removing the sinks, or widening the window past the sequence,
  must change the logits;
* Step: the file is read back, mapped to transformers' in-memory names (inverse of the
  ``step3p7`` entry of ``conversion_mapping.py``) and loaded with ``load_state_dict(strict=True)``
  into a fresh model built from the written ``config.json`` (bit-identical logits and MTP
  outputs); the same file is also loaded by transformers' own loader through
  ``Step3p7ForConditionalGeneration.from_pretrained`` (a tiny vision tower added), which must
  load every text tensor under the hub names and give the same logits (within 1e-5: the weights
  are bit-identical, the summation order is not); every configured SwiGLU clamp must actually clip
  values on the prompt, and removing the clamps, widening the window or dropping the llama3
  scaling must change the logits; the full-layer frequencies must show llama3's three regimes;
* an independent float64 reference, hand-written from the config keys (for Step following vLLM's
  ``step3p5.py`` / ``step3p5_mtp.py``: every per-layer setting indexed by the absolute layer
  number), reading only ``config.json`` and ``model.safetensors``, must reproduce logits, hidden
  states, greedy logits and all MTP outputs within 1e-4 (it does to about 2e-6).

Where transformers 5.17 and vLLM disagree about Step-3.5 (none of it changes these fixtures
except as noted) is listed in ``tests/golden/README.md``.

Outputs are deterministic (single CPU thread; the .npz zip entries carry a fixed timestamp).

Re-run (from the repository root, with a Python that has torch + transformers)::

    python tests/golden/make_mimo_v2_step3p5.py            # writes into tests/golden/
    python tests/golden/make_mimo_v2_step3p5.py --out DIR  # writes elsewhere

Generated with transformers 5.17.0, torch 2.13.0 (CPU), safetensors 0.8.0, numpy 2.4.6.  The
consumers of the fixtures need only numpy + safetensors.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from transformers import GenerationConfig
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.mimo_v2_flash import MiMoV2FlashConfig, MiMoV2FlashForCausalLM
from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import (
    MiMoV2FlashDecoderLayer,
    MiMoV2FlashRMSNorm,
    MiMoV2FlashTopkRouter,
)
from transformers.models.step3p7 import Step3p7Config, Step3p7ForConditionalGeneration, Step3p7TextConfig
from transformers.models.step3p7.modeling_step3p7 import (
    Step3p7DecoderLayer,
    Step3p7Experts,
    Step3p7MLP,
    Step3p7RMSNorm,
    Step3p7TextModel,
    Step3p7TopKRouter,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _golden_common import (  # noqa: E402  (shared with the GLM-4.5 / DeepSeek-V3 fixtures)
    G_NEW,
    LOGIT_MARGIN,
    ROUTER_MARGIN,
    T_PROMPT,
    GoldenCheckFailed,
    RouterMonitor,
    check_save_pretrained,
    draw_case,
    draw_prompt,
    fused_to_hub,
    init_value,
    load_safetensors,
    new_model,
    parse_args_and_setup,
    randomize_,
    target_arrays,
    top2_gap,
    write_cases,
    write_fixture_folder,
    write_json,
)

BOS_ID, EOS_ID = 0, 1  # prompts are drawn from 2..V-1; a greedy continuation may not contain either
N_MTP = 3
REF_TOL = 1e-4  # float64 reference vs transformers (float32)

# ----------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------

MIMO_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,  # full layers; transformers doubles it on sliding layers
    head_dim=24,  # deliberately not a power of two
    v_head_dim=16,
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    sliding_window=4,
    partial_rotary_factor=0.334,  # rotary dim int(24 * 0.334) = 8
    attention_value_scale=0.707,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
)

STEP_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,  # full layers
    swa_heads=6,  # sliding layers (attention_other_setting)
    num_attention_groups=2,
    head_dim=16,
    sliding_window=4,
    rope_theta=[5000000.0] + [10000.0] * 6,
    partial_rotary_factors=[0.5] + [1.0] * 6,
    # original_max_position_embeddings 512: of the 4 full-layer frequencies (rotary dim 8, theta 5e6)
    # pair 0 is kept (wavelength 6.3 < 512/32), pair 1 is smoothed, pairs 2-3 are divided by `factor`
    rope_scaling={"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 512,
                  "low_freq_factor": 1.0, "high_freq_factor": 32.0},
    max_position_embeddings=1024,
    moe_layers_enum="1,2,3",
    moe_num_experts=8,
    moe_top_k=2,
    intermediate_size=96,
    moe_intermediate_size=32,
    share_expert_dim=48,
    moe_router_scaling_factor=3.0,
    rms_norm_eps=1e-5,
)

CASES = {
    "mimo_v2_flash_hub": dict(family="mimo", config_style="hub", vocab_size=152, rope_theta=5000000.0,
                              swa_rope_theta=10000.0, seed=11000),
    # thetas that are not transformers' MiMo defaults (5e6 / 1e4), so a loader that ignores
    # rope_parameters fails
    "mimo_v2_flash_hf": dict(family="mimo", config_style="transformers", vocab_size=136, rope_theta=2000000.0,
                             swa_rope_theta=20000.0, seed=12000),
    "step3p5_flash": dict(family="step", vocab_size=150, seed=13000,
                          # 7 entries: 4 target layers + 3 MTP layers; 0 = no clamp
                          swiglu_limits=[0.0, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0],  # routed experts, MoE layer 2
                          swiglu_limits_shared=[0.3, 0.0, 0.0, 0.15, 0.0, 0.0, 0.0]),  # dense 0, shared 3
}


# ----------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------


def init_mimo(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("self_attn.sinks"):
        return torch.randn(shape, generator=gen, dtype=torch.float32)  # N(0, 1): the sinks matter
    return init_value(name, shape, gen)


def init_step(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    if "norm" in name:  # zero-centred norms (y = x_hat * (1 + w)): weights around 0
        return 0.1 * torch.randn(shape, generator=gen, dtype=torch.float32)
    return init_value(name, shape, gen)


@torch.no_grad()
def set_eager(config) -> None:
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"


class StepRouterMonitor:
    """Forward hook on Step3p7TopKRouter: margin of every top-k decision, re-derived as
    top-k(sigmoid(x W^T) + bias) and compared with the router's own choice."""

    def __init__(self):
        self.min_margin = float("inf")
        self.calls = 0

    def __call__(self, module, args, output):
        _, _, topk_indices = output
        x = args[0].reshape(-1, module.hidden_dim).float()
        choice = torch.sigmoid(x @ module.weight.float().t()) + module.e_score_correction_bias
        ranked = choice.sort(dim=-1, descending=True)
        k = module.top_k
        mine = ranked.indices[:, :k].sort(-1).values
        theirs = topk_indices.reshape(-1, k).sort(-1).values
        if not torch.equal(mine, theirs):
            raise AssertionError("re-derived routing disagrees with Step3p7TopKRouter")
        self.min_margin = min(self.min_margin, float((ranked.values[:, k - 1] - ranked.values[:, k]).min()))
        self.calls += 1


def hook_routers(modules, router_cls, monitor):
    return [m.register_forward_hook(monitor) for m in modules if isinstance(m, router_cls)]


def tie_checks(router_margin: float, greedy_logits: torch.Tensor, greedy: torch.Tensor,
               mtp_logits: list[torch.Tensor]) -> dict:
    gap_greedy = float(top2_gap(greedy_logits).min())
    gap_mtp = float(min(top2_gap(m).min() for m in mtp_logits))
    if router_margin <= ROUTER_MARGIN:
        raise GoldenCheckFailed(f"router margin {router_margin:.2e}")
    if gap_greedy <= LOGIT_MARGIN:
        raise GoldenCheckFailed(f"greedy top-2 gap {gap_greedy:.2e}")
    if gap_mtp <= LOGIT_MARGIN:
        raise GoldenCheckFailed(f"mtp top-2 gap {gap_mtp:.2e}")
    if any(int(t) in (BOS_ID, EOS_ID) for t in greedy):
        raise GoldenCheckFailed("greedy output contains the bos / eos id")
    return dict(router_margin=router_margin, greedy_gap=gap_greedy, mtp_gap=gap_mtp)


@torch.no_grad()
def teacher_forced_mtp(layers, embed: nn.Module, prompt: torch.Tensor, hidden: torch.Tensor,
                       hidden_prenorm: torch.Tensor, source: str, rotary, mask_config, final_norm, head):
    """The MTP recipe of the module docstring; returns ([y_k], [logits_k]).

    `rotary(x, pos)` gives the sliding layers' (cos, sin); `final_norm(k, layer)` / `head(k, layer)`
    the norm / head modules of layer k.
    """
    t = prompt.shape[0]
    ys, logits = [], []
    for k, layer in enumerate(layers):
        n = t - 1 - k  # anchors 0 .. T-2-k
        e = embed(prompt[k + 1: t])  # token i+k+1 for anchor i
        if source == "target":
            g = hidden[:n]
        else:  # "previous": pre-norm target hidden, then the previous MTP block's output
            g = hidden_prenorm[:n] if k == 0 else ys[-1][:n]
        x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(g)], dim=-1))[None]
        pos = torch.arange(n)[None]
        mask = create_sliding_window_causal_mask(config=mask_config, inputs_embeds=x, attention_mask=None,
                                                 past_key_values=None, position_ids=pos)
        y = layer.block(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))[0]
        ys.append(y)
        logits.append(head(k, layer)(final_norm(k, layer)(y)))
    return ys, logits


@torch.no_grad()
def window_effect(config, run, logits) -> float:
    """Max |logits change| when the sliding window is made longer than the sequence (masks are built
    from config.sliding_window on every forward)."""
    w = config.sliding_window
    config.sliding_window = 10 ** 6
    try:
        return float((run() - logits).abs().max())
    finally:
        config.sliding_window = w


def golden_arrays(prompt, logits, greedy, greedy_logits, hidden, hidden_prenorm, mtp_y, mtp_logits, seed):
    arrays = target_arrays(prompt, logits, greedy, greedy_logits, hidden, hidden_prenorm, seed)
    for k in range(len(mtp_y)):
        arrays[f"mtp_y_{k}"] = mtp_y[k].numpy().astype(np.float32)
        arrays[f"mtp_logits_{k}"] = mtp_logits[k].numpy().astype(np.float32)
    return arrays


# ----------------------------------------------------------------------------
# independent float64 reference, written from the published model descriptions
# ----------------------------------------------------------------------------


def r_rms(x, w, eps, zero_centred):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * ((1.0 + w) if zero_centred else w)


def r_inv_freq(head_dim, partial, theta, llama3=None):
    """Inverse frequencies of the rotated dims (rotary dim = int(head_dim * partial)); llama3: the dict
    {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings} (Llama-3.1 rule)."""
    dim = int(head_dim * partial)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if llama3 is None:
        return inv
    factor, lo, hi, orig = (llama3["factor"], llama3["low_freq_factor"], llama3["high_freq_factor"],
                            llama3["original_max_position_embeddings"])
    out = []
    for f in inv.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < orig / hi:
            out.append(f)
        elif wavelen > orig / lo:
            out.append(f / factor)
        else:
            s = (orig / wavelen - lo) / (hi - lo)
            out.append((1 - s) * f / factor + s * f)
    return torch.tensor(out, dtype=torch.float64)


def r_rope(x, pos, inv_freq):
    """NeoX (rotate-half) RoPE on the first 2 * len(inv_freq) dims of x [T, H, D]; the rest passes."""
    r = 2 * inv_freq.shape[0]
    ang = pos[:, None].double() * inv_freq[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    xr, xp = x[..., :r], x[..., r:]
    rot = torch.cat([-xr[..., r // 2:], xr[..., : r // 2]], -1)
    return torch.cat([xr * cos + rot * sin, xp], -1)


def r_attention(x, w, p, a, pos):
    """One attention block. w: tensors, p: name prefix, a: dict(heads, kv, hd, vd, inv_freq, window,
    sinks, v_scale, qk_norm, gate, eps, zc)."""
    t = x.shape[0]
    h, kv, hd, vd = a["heads"], a["kv"], a["hd"], a["vd"]
    q = (x @ w[p + "q_proj.weight"].T).view(t, h, hd)
    k = (x @ w[p + "k_proj.weight"].T).view(t, kv, hd)
    v = (x @ w[p + "v_proj.weight"].T).view(t, kv, vd) * a["v_scale"]
    if a["qk_norm"]:
        q = r_rms(q, w[p + "q_norm.weight"], a["eps"], a["zc"])
        k = r_rms(k, w[p + "k_norm.weight"], a["eps"], a["zc"])
    q, k = r_rope(q, pos, a["inv_freq"]), r_rope(k, pos, a["inv_freq"])
    k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)  # head j uses kv head j // (h/kv)
    s = torch.einsum("thd,shd->hts", q, k) * hd ** -0.5
    qi, ki = pos[:, None], pos[None, :]
    allowed = ki <= qi
    if a["window"]:
        allowed &= (qi - ki) < a["window"]  # the window counts the current token
    s = s.masked_fill(~allowed, float("-inf"))
    if a["sinks"] is not None:  # one extra logit per head in the softmax denominator, no value
        s = torch.cat([s, a["sinks"][:, None, None].expand(h, t, 1)], dim=-1)
        prob = torch.softmax(s, dim=-1)[..., :-1]
    else:
        prob = torch.softmax(s, dim=-1)
    o = torch.einsum("hts,shd->thd", prob, v)
    if a["gate"]:
        o = o * torch.sigmoid(x @ w[p + "g_proj.weight"].T)[:, :, None]
    return o.reshape(t, h * vd) @ w[p + "o_proj.weight"].T


def r_swiglu(x, wg, wu, wd, limit):
    g, u = F.silu(x @ wg.T), x @ wu.T
    if limit:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (g * u) @ wd.T


def r_moe(x, router_w, bias, gate, up, down, top_k, renorm, scale, limit):
    """Sigmoid router: top-k of (scores + bias); weights = unbiased scores (renormalised) x scale."""
    scores = torch.sigmoid(x @ router_w.T)
    idx = torch.topk(scores + bias, top_k, dim=-1).indices
    wts = scores.gather(1, idx)
    if renorm:
        wts = wts / wts.sum(-1, keepdim=True)
    wts = wts * scale
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(idx[t, j])
            out[t] += wts[t, j] * r_swiglu(x[t:t + 1], gate[e], up[e], down[e], limit)[0]
    return out


def r_read(folder: str):
    with open(os.path.join(folder, "config.json")) as fh:
        cfg = json.load(fh)
    w = {k: v.double() for k, v in load_safetensors(os.path.join(folder, "model.safetensors")).items()}
    return cfg, w


@torch.no_grad()
def reference_check(folder: str, arrays: dict, forward, mtp_forward) -> float:
    """Compare the float64 reference (`forward(ids) -> (logits, prenorm, hidden)`, `mtp_forward(prompt,
    hidden, prenorm) -> (ys, logits)`) against every stored array; returns the max abs difference."""
    prompt = torch.from_numpy(arrays["prompt"])
    logits, prenorm, hidden = forward(prompt)
    ids = torch.cat([prompt, torch.from_numpy(arrays["greedy"])[:-1]])
    g_logits = forward(ids)[0][T_PROMPT - 1:]
    ys, mlog = mtp_forward(prompt, hidden, prenorm)
    pairs = [(logits, "logits"), (prenorm, "hidden_prenorm"), (hidden, "hidden"), (g_logits, "greedy_logits")]
    pairs += [(ys[k], f"mtp_y_{k}") for k in range(N_MTP)] + [(mlog[k], f"mtp_logits_{k}") for k in range(N_MTP)]
    worst = 0.0
    for mine, name in pairs:
        ref = torch.from_numpy(arrays[name]).double()
        assert mine.shape == ref.shape, (name, mine.shape, ref.shape)
        diff = float((mine - ref).abs().max())
        assert diff <= REF_TOL, f"reference differs from transformers on {name} by {diff}"
        worst = max(worst, diff)
    assert torch.equal(g_logits.argmax(-1), torch.from_numpy(arrays["greedy"]))
    return worst


# ----------------------------------------------------------------------------
# MiMo-V2-Flash
# ----------------------------------------------------------------------------


def mimo_rope_parameters(case: dict) -> dict:
    prf = MIMO_COMMON["partial_rotary_factor"]
    return {
        "full_attention": {"rope_type": "default", "rope_theta": case["rope_theta"], "partial_rotary_factor": prf},
        "sliding_attention": {"rope_type": "default", "rope_theta": case["swa_rope_theta"],
                              "partial_rotary_factor": prf},
    }


def mimo_config(case: dict, n_layers_extra: int = 0) -> MiMoV2FlashConfig:
    """The target config; with n_layers_extra = 3, the same config extended by three sliding / dense
    layers (indices N .. N+2), from which the MTP blocks are built."""
    c = MIMO_COMMON
    cfg = MiMoV2FlashConfig(
        vocab_size=case["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"] + n_layers_extra,
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        v_head_dim=c["v_head_dim"],
        layer_types=c["layer_types"] + ["sliding_attention"] * n_layers_extra,
        mlp_layer_types=c["mlp_layer_types"] + ["dense"] * n_layers_extra,
        sliding_window=c["sliding_window"],
        rope_parameters=mimo_rope_parameters(case),
        attention_value_scale=c["attention_value_scale"],
        attention_bias=False,
        moe_intermediate_size=c["moe_intermediate_size"],
        n_routed_experts=c["n_routed_experts"],
        num_experts_per_tok=c["num_experts_per_tok"],
        n_group=c["n_group"],
        topk_group=c["topk_group"],
        norm_topk_prob=c["norm_topk_prob"],
        routed_scaling_factor=None,  # hub: null (= 1.0)
        rms_norm_eps=c["rms_norm_eps"],
        max_position_embeddings=c["max_position_embeddings"],
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        num_nextn_predict_layers=N_MTP,
        dtype="float32",
    )
    set_eager(cfg)
    return cfg


def mimo_hub_config_json(case: dict) -> dict:
    """config.json in the published MiMo-V2-Flash key style (no num_nextn_predict_layers)."""
    c = MIMO_COMMON
    return {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "vocab_size": case["vocab_size"],
        "hidden_size": c["hidden_size"],
        "num_hidden_layers": c["num_hidden_layers"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "v_head_dim": c["v_head_dim"],
        "swa_num_attention_heads": c["num_attention_heads"],
        "swa_num_key_value_heads": 2 * c["num_key_value_heads"],
        "swa_head_dim": c["head_dim"],
        "swa_v_head_dim": c["v_head_dim"],
        "partial_rotary_factor": c["partial_rotary_factor"],
        "rope_theta": case["rope_theta"],
        "swa_rope_theta": case["swa_rope_theta"],
        "rope_scaling": None,
        "sliding_window": c["sliding_window"],
        "sliding_window_size": c["sliding_window"],
        "attention_chunk_size": c["sliding_window"],
        "hybrid_layer_pattern": [int(t == "sliding_attention") for t in c["layer_types"]],
        "moe_layer_freq": [int(t == "sparse") for t in c["mlp_layer_types"]],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "attention_value_scale": c["attention_value_scale"],
        "attention_bias": False,
        "intermediate_size": c["intermediate_size"],
        "moe_intermediate_size": c["moe_intermediate_size"],
        "n_routed_experts": c["n_routed_experts"],
        "num_experts_per_tok": c["num_experts_per_tok"],
        "n_shared_experts": None,
        "routed_scaling_factor": None,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": c["n_group"],
        "topk_group": c["topk_group"],
        "norm_topk_prob": c["norm_topk_prob"],
        "layernorm_epsilon": c["rms_norm_eps"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "max_position_embeddings": c["max_position_embeddings"],
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }


def mimo_config_from_hub_json(j: dict) -> MiMoV2FlashConfig:
    """What the published keys mean, as a transformers config (transformers 5.17 does not read them)."""
    assert j["swa_num_key_value_heads"] == 2 * j["num_key_value_heads"]  # transformers' fixed rule
    assert j["swa_num_attention_heads"] == j["num_attention_heads"] and j["swa_head_dim"] == j["head_dim"]
    assert j["swa_v_head_dim"] == j["v_head_dim"] and j["add_swa_attention_sink_bias"]
    assert not j["add_full_attention_sink_bias"]
    prf = j["partial_rotary_factor"]
    cfg = MiMoV2FlashConfig(
        vocab_size=j["vocab_size"], hidden_size=j["hidden_size"], intermediate_size=j["intermediate_size"],
        num_hidden_layers=j["num_hidden_layers"], num_attention_heads=j["num_attention_heads"],
        num_key_value_heads=j["num_key_value_heads"], head_dim=j["head_dim"], v_head_dim=j["v_head_dim"],
        layer_types=["sliding_attention" if p else "full_attention" for p in j["hybrid_layer_pattern"]],
        mlp_layer_types=["sparse" if f else "dense" for f in j["moe_layer_freq"]],
        sliding_window=j["sliding_window"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": j["rope_theta"], "partial_rotary_factor": prf},
            "sliding_attention": {"rope_type": "default", "rope_theta": j["swa_rope_theta"],
                                  "partial_rotary_factor": prf},
        },
        attention_value_scale=j["attention_value_scale"], attention_bias=j["attention_bias"],
        moe_intermediate_size=j["moe_intermediate_size"], n_routed_experts=j["n_routed_experts"],
        num_experts_per_tok=j["num_experts_per_tok"], n_group=j["n_group"], topk_group=j["topk_group"],
        norm_topk_prob=j["norm_topk_prob"], routed_scaling_factor=j["routed_scaling_factor"],
        rms_norm_eps=j["layernorm_epsilon"], max_position_embeddings=j["max_position_embeddings"],
        tie_word_embeddings=j["tie_word_embeddings"], bos_token_id=j["bos_token_id"],
        eos_token_id=j["eos_token_id"], pad_token_id=None, dtype="float32",
    )
    return cfg


class MimoMtpLayer(nn.Module):
    """One MiMo-V2-Flash MTP layer: enorm, hnorm, eh_proj, a MiMoV2FlashDecoderLayer, final_layernorm."""

    def __init__(self, ext_config: MiMoV2FlashConfig, layer_idx: int):
        super().__init__()
        d, eps = ext_config.hidden_size, ext_config.rms_norm_eps
        self.enorm = MiMoV2FlashRMSNorm(d, eps)
        self.hnorm = MiMoV2FlashRMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = MiMoV2FlashDecoderLayer(ext_config, layer_idx)
        self.final_layernorm = MiMoV2FlashRMSNorm(d, eps)


def mimo_block_to_hub(key: str) -> str:
    return key.replace("self_attn.sinks", "self_attn.attention_sink_bias").replace(
        "post_attention_layernorm.", "pre_mlp_layernorm.")


def mimo_hub_tensors(model, mtp_layers, workdir: str, name: str) -> dict[str, torch.Tensor]:
    """Target tensors (per-expert split, sinks as attention_sink_bias) + model.mtp.layers.{k}.*; the
    target part must equal what save_pretrained writes."""
    target = {k.replace("self_attn.sinks", "self_attn.attention_sink_bias"): v
              for k, v in fused_to_hub(model.state_dict(), "").items()}
    check_save_pretrained(model, target, workdir, name)
    assert any(k.endswith("self_attn.attention_sink_bias") for k in target)  # what save_pretrained calls the sinks
    out = dict(target)
    for k, layer in enumerate(mtp_layers):
        p = f"model.mtp.layers.{k}."
        for key, value in layer.state_dict().items():
            hub = key[len("block."):] if key.startswith("block.") else key
            out[p + mimo_block_to_hub(hub)] = value.detach().clone().contiguous()
    return out


def mimo_arch(j: dict) -> dict:
    """Per-layer attention / MLP settings from either config.json style (reference side)."""
    n = j["num_hidden_layers"]
    if "hybrid_layer_pattern" in j:  # published style
        sliding = [bool(p) for p in j["hybrid_layer_pattern"]]
        moe = [bool(f) for f in j["moe_layer_freq"]]
        full = dict(heads=j["num_attention_heads"], kv=j["num_key_value_heads"], hd=j["head_dim"],
                    vd=j["v_head_dim"], theta=j["rope_theta"], prf=j["partial_rotary_factor"],
                    sinks=j["add_full_attention_sink_bias"], window=None)
        swa = dict(heads=j["swa_num_attention_heads"], kv=j["swa_num_key_value_heads"], hd=j["swa_head_dim"],
                   vd=j["swa_v_head_dim"], theta=j["swa_rope_theta"], prf=j["partial_rotary_factor"],
                   sinks=j["add_swa_attention_sink_bias"], window=j["sliding_window"])
        eps, scale = j["layernorm_epsilon"], j["routed_scaling_factor"] or 1.0
    else:  # transformers style: sliding layers have 2x the kv heads and sinks, full layers neither
        sliding = [t == "sliding_attention" for t in j["layer_types"]]
        moe = [t == "sparse" for t in j["mlp_layer_types"]]
        rp = j["rope_parameters"]
        full = dict(heads=j["num_attention_heads"], kv=j["num_key_value_heads"], hd=j["head_dim"],
                    vd=j["v_head_dim"], theta=rp["full_attention"]["rope_theta"],
                    prf=rp["full_attention"]["partial_rotary_factor"], sinks=False, window=None)
        swa = dict(heads=j["num_attention_heads"], kv=2 * j["num_key_value_heads"], hd=j["head_dim"],
                   vd=j["v_head_dim"], theta=rp["sliding_attention"]["rope_theta"],
                   prf=rp["sliding_attention"]["partial_rotary_factor"], sinks=True, window=j["sliding_window"])
        eps, scale = j["rms_norm_eps"], j["routed_scaling_factor"] or 1.0
    assert len(sliding) == len(moe) == n
    return dict(n=n, sliding=sliding, moe=moe, full=full, swa=swa, eps=eps, scale=scale)


def mimo_reference(folder: str):
    j, w = r_read(folder)
    arch = mimo_arch(j)
    eps = arch["eps"]

    def attn_args(kind, p):
        s = arch[kind]
        return dict(heads=s["heads"], kv=s["kv"], hd=s["hd"], vd=s["vd"], window=s["window"],
                    inv_freq=r_inv_freq(s["hd"], s["prf"], s["theta"]),
                    sinks=w[p + "attention_sink_bias"] if s["sinks"] else None,
                    v_scale=j["attention_value_scale"], qk_norm=False, gate=False, eps=eps, zc=False)

    def block(x, p, kind, moe, post_attn_norm):
        pos = torch.arange(x.shape[0])
        h = x + r_attention(r_rms(x, w[p + "input_layernorm.weight"], eps, False), w, p + "self_attn.",
                            attn_args(kind, p + "self_attn."), pos)
        u = r_rms(h, w[p + post_attn_norm + ".weight"], eps, False)
        if moe:
            e = j["n_routed_experts"]
            st = lambda s: torch.stack([w[f"{p}mlp.experts.{i}.{s}_proj.weight"] for i in range(e)])  # noqa: E731
            f = r_moe(u, w[p + "mlp.gate.weight"], w[p + "mlp.gate.e_score_correction_bias"], st("gate"), st("up"),
                      st("down"), j["num_experts_per_tok"], j["norm_topk_prob"], arch["scale"], None)
        else:
            f = r_swiglu(u, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"],
                         None)
        return h + f

    def forward(ids):
        x = w["model.embed_tokens.weight"][ids]
        for i in range(arch["n"]):
            x = block(x, f"model.layers.{i}.", "swa" if arch["sliding"][i] else "full", arch["moe"][i],
                      "post_attention_layernorm")
        hidden = r_rms(x, w["model.norm.weight"], eps, False)
        return hidden @ w["lm_head.weight"].T, x, hidden

    def mtp_forward(prompt, hidden, prenorm):
        t, ys, logits = prompt.shape[0], [], []
        for k in range(N_MTP):
            p, n = f"model.mtp.layers.{k}.", t - 1 - k
            e = w["model.embed_tokens.weight"][prompt[k + 1:]]
            x = torch.cat([r_rms(e, w[p + "enorm.weight"], eps, False), r_rms(hidden[:n], w[p + "hnorm.weight"], eps,
                                                                                False)], -1) @ w[p + "eh_proj.weight"].T
            y = block(x, p, "swa", False, "pre_mlp_layernorm")
            ys.append(y)
            logits.append(r_rms(y, w[p + "final_layernorm.weight"], eps, False) @ w["lm_head.weight"].T)
        return ys, logits

    return forward, mtp_forward


@torch.no_grad()
def build_mimo_case(name: str, case: dict, seed: int, workdir: str):
    config = mimo_config(case)
    ext = mimo_config(case, N_MTP)
    model, gen = new_model(MiMoV2FlashForCausalLM, config, seed, init_mimo)
    n = config.num_hidden_layers
    mtp = nn.ModuleList([MimoMtpLayer(ext, n + k) for k in range(N_MTP)]).eval()
    randomize_(mtp, gen, init_mimo)
    for layer in mtp:  # sliding attention with sinks, dense MLP
        assert layer.block.self_attn.sinks is not None and layer.block.self_attn.sliding_window == 4
        assert layer.block.self_attn.k_proj.out_features == 2 * config.num_key_value_heads * config.head_dim
        assert not hasattr(layer.block.mlp, "gate") and layer.block.mlp.intermediate_size == config.intermediate_size
    attn0, attn1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert attn0.sinks is None and attn0.sliding_window is None and attn1.sliding_window == 4
    assert model.model.rotary_emb.full_attention_inv_freq.shape == (4,)  # rotary dim int(24 * 0.334) = 8

    prompt = draw_prompt(seed, EOS_ID + 1, case["vocab_size"])
    monitor = RouterMonitor()
    handles = hook_routers(model.modules(), MiMoV2FlashTopkRouter, monitor)

    # full forward (no cache); pre / post final-norm hidden from a hook on model.norm
    cap = {}
    hn = model.model.norm.register_forward_hook(lambda m, a, o: cap.update(pre=a[0][0], post=o[0]))
    logits = model(prompt[None], use_cache=False).logits[0]
    hn.remove()
    hidden, hidden_prenorm = cap["post"], cap["pre"]
    assert torch.equal(logits, model.lm_head(hidden))

    # greedy generation with a cache, then every step recomputed without one
    gcfg = GenerationConfig(do_sample=False, max_new_tokens=G_NEW, min_new_tokens=G_NEW, eos_token_id=None,
                            pad_token_id=EOS_ID, output_logits=True, return_dict_in_generate=True)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = EOS_ID
    gout = model.generate(prompt[None], generation_config=gcfg)
    greedy = gout.sequences[0, T_PROMPT:]
    greedy_logits = torch.cat(list(gout.logits), dim=0)
    assert greedy.shape[0] == G_NEW and torch.equal(greedy_logits.argmax(-1), greedy)
    ids, nocache_diff = prompt.clone(), 0.0
    for g in range(G_NEW):
        step = model(ids[None], use_cache=False).logits[0, -1]
        if int(step.argmax()) != int(greedy[g]):
            raise GoldenCheckFailed(f"no-cache greedy differs at step {g}")
        nocache_diff = max(nocache_diff, float((step - greedy_logits[g]).abs().max()))
        ids = torch.cat([ids, greedy[g:g + 1]])
    for hnd in handles:
        hnd.remove()
    n_moe = config.mlp_layer_types.count("sparse")
    assert monitor.calls == n_moe * (1 + 2 * G_NEW), monitor.calls

    mtp_y, mtp_logits = teacher_forced_mtp(
        mtp, model.model.embed_tokens, prompt, hidden, hidden_prenorm, "target",
        rotary=lambda x, pos: model.model.rotary_emb(x, pos, "sliding_attention"), mask_config=ext,
        final_norm=lambda k, layer: layer.final_layernorm, head=lambda k, layer: model.lm_head)

    stats = tie_checks(monitor.min_margin, greedy_logits, greedy, mtp_logits)
    stats["cache_vs_nocache_max_abs_diff"] = nocache_diff
    # how much the sinks and the window matter (the prompt forward without them)
    sinks = [layer.self_attn.sinks for layer in model.model.layers if layer.self_attn.sinks is not None]
    saved = [t.detach().clone() for t in sinks]
    for t in sinks:
        t.fill_(float("-inf"))
    stats["sink_effect_on_logits"] = float((model(prompt[None], use_cache=False).logits[0] - logits).abs().max())
    for t, v in zip(sinks, saved):
        t.copy_(v)
    stats["window_effect_on_logits"] = window_effect(
        model.config, lambda: model(prompt[None], use_cache=False).logits[0], logits)
    assert stats["sink_effect_on_logits"] > 1e-2 and stats["window_effect_on_logits"] > 1e-2, stats
    arrays = golden_arrays(prompt, logits, greedy, greedy_logits, hidden, hidden_prenorm, mtp_y, mtp_logits, seed)

    tensors = mimo_hub_tensors(model, mtp, workdir, name)
    if case["config_style"] == "hub":
        config_json = mimo_hub_config_json(case)
    else:
        with open(os.path.join(workdir, f"{name}_save_pretrained", "config.json")) as fh:
            config_json = json.load(fh)
        assert config_json["num_nextn_predict_layers"] == N_MTP
    return model, config_json, tensors, arrays, stats


@torch.no_grad()
def verify_mimo_folder(folder: str, model, case: dict, arrays: dict) -> dict:
    prompt = torch.from_numpy(arrays["prompt"])
    with open(os.path.join(folder, "config.json")) as fh:
        j = json.load(fh)
    kwargs = dict(attn_implementation="eager", experts_implementation="eager", dtype=torch.float32,
                  output_loading_info=True)
    if case["config_style"] == "hub":
        assert "num_nextn_predict_layers" not in j
        # transformers 5.17 ignores hybrid_layer_pattern / moe_layer_freq / swa_* / rope_theta: its own
        # defaults (full attention on layer 0 and every 6th) give a different layer_types
        # and "rope_scaling": null leaves rope_parameters None (from_pretrained then fails building the rotary)
        plain = MiMoV2FlashConfig.from_pretrained(folder)
        assert plain.layer_types != MIMO_COMMON["layer_types"] and plain.rope_parameters is None, plain
        kwargs["config"] = mimo_config_from_hub_json(j)
    m2, info = MiMoV2FlashForCausalLM.from_pretrained(folder, **kwargs)
    m2.eval()
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith("model.mtp.") for k in info["unexpected_keys"]), info["unexpected_keys"]
    assert m2.config.layer_types == MIMO_COMMON["layer_types"]
    assert m2.config.rope_parameters == mimo_rope_parameters(case), m2.config.rope_parameters
    sd1, sd2 = model.state_dict(), m2.state_dict()
    assert sorted(sd1) == sorted(sd2)
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    assert np.array_equal(m2(prompt[None], use_cache=False).logits[0].numpy(), arrays["logits"])
    forward, mtp_forward = mimo_reference(folder)
    return dict(reference_max_abs_diff=reference_check(folder, arrays, forward, mtp_forward))


def write_mimo_case(out_dir: str, name: str, case: dict, workdir: str) -> dict:
    (model, config_json, tensors, arrays, stats), seed, tries = draw_case(build_mimo_case, name, case, workdir)
    folder = os.path.join(out_dir, name)
    write_fixture_folder(folder, config_json, tensors, arrays)
    stats.update(verify_mimo_folder(folder, model, case, arrays))
    stats.update(seed=seed, tries=tries)
    return stats


# ----------------------------------------------------------------------------
# Step-3.5-Flash
# ----------------------------------------------------------------------------


def step_hub_config_json(case: dict) -> dict:
    """config.json in the published Step-3.5-Flash key style (per-layer lists cover the MTP layers too)."""
    c = STEP_COMMON
    n_all = c["num_hidden_layers"] + N_MTP
    return {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_attention_heads": c["num_attention_heads"],
        "num_attention_groups": c["num_attention_groups"],
        "head_dim": c["head_dim"],
        "num_hidden_layers": c["num_hidden_layers"],
        "vocab_size": case["vocab_size"],
        "max_seq_len": c["max_position_embeddings"],
        "max_position_embeddings": c["max_position_embeddings"],
        "layer_types": ["full_attention"] + ["sliding_attention"] * (n_all - 1),
        "sliding_window": c["sliding_window"],
        "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": c["swa_heads"],
                                    "num_attention_groups": c["num_attention_groups"], "head_dim": c["head_dim"],
                                    "true_head_dim": c["head_dim"]},
        "rope_theta": list(c["rope_theta"]),
        "partial_rotary_factors": list(c["partial_rotary_factors"]),
        "rope_scaling": dict(c["rope_scaling"]),
        "yarn_only_types": ["full_attention"],
        "moe_layers_enum": c["moe_layers_enum"],
        "moe_num_experts": c["moe_num_experts"],
        "moe_top_k": c["moe_top_k"],
        "moe_intermediate_size": c["moe_intermediate_size"],
        "share_expert_dim": c["share_expert_dim"],
        "moe_router_scaling_factor": c["moe_router_scaling_factor"],
        "moe_router_activation": "sigmoid",
        "use_moe_router_bias": True,
        "need_fp32_gate": True,
        "norm_expert_weight": True,
        "use_head_wise_attn_gate": True,
        "use_qk_norm": True,
        "zero_centered": True,
        "swiglu_limits": list(case["swiglu_limits"]),
        "swiglu_limits_shared": list(case["swiglu_limits_shared"]),
        "use_moe": True,
        "moe_layer_offset": 0,
        "moe_every_n_layer": 1,
        "att_impl_type": "GQA",
        "use_rope_layers": [],
        "sink": False,
        "num_nextn_predict_layers": N_MTP,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "rms_norm_eps": c["rms_norm_eps"],
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }


def step_configs(hub_json: dict) -> tuple[Step3p7TextConfig, Step3p7TextConfig]:
    """(target config, extended config with layers 0 .. N+2) parsed from the hub json by transformers.

    The target config is what from_pretrained makes of the file (the 7-long lists are cut to N and
    the tails kept as mtp_*); the extended one reads the same file with num_hidden_layers = N + 3 and
    no MTP layers, so layer index N + k of every per-layer list is MTP layer k's."""
    cfg = Step3p7TextConfig.from_dict(dict(hub_json))
    n = hub_json["num_hidden_layers"]
    ext = Step3p7TextConfig.from_dict(dict(hub_json, num_hidden_layers=n + N_MTP, num_nextn_predict_layers=0))
    for c in (cfg, ext):
        set_eager(c)
    assert cfg.layer_types == ext.layer_types[:n] and cfg.mtp_layer_types == ext.layer_types[n:]
    assert cfg.mlp_layer_types == ext.mlp_layer_types[:n] and cfg.mtp_mlp_layer_types == ext.mlp_layer_types[n:]
    assert cfg.swiglu_limits == ext.swiglu_limits[:n] and cfg.swiglu_limits_shared == ext.swiglu_limits_shared[:n]
    assert cfg.rope_parameters == ext.rope_parameters
    assert ext.mlp_layer_types == ["dense", "sparse", "sparse", "sparse", "dense", "dense", "dense"]
    assert [c.num_attention_heads for c in ext.per_layer_config] == [4, 6, 6, 6, 6, 6, 6]
    rp = cfg.rope_parameters
    assert rp["full_attention"]["rope_type"] == "llama3" and rp["sliding_attention"]["rope_type"] == "default"
    return cfg, ext


class StepLM(nn.Module):
    """Step3p7TextModel + lm_head (logits = lm_head(last_hidden_state)); state-dict names model.* / lm_head.*"""

    def __init__(self, config: Step3p7TextConfig):
        super().__init__()
        self.model = Step3p7TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        out = self.model(input_ids=input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return self.lm_head(out.last_hidden_state)


class StepMtpLayer(nn.Module):
    """One Step-3.5 MTP layer: enorm, hnorm, eh_proj, a Step3p7DecoderLayer, shared_head.{norm, output}."""

    def __init__(self, ext_config: Step3p7TextConfig, layer_idx: int):
        super().__init__()
        d, eps = ext_config.hidden_size, ext_config.rms_norm_eps
        self.enorm = Step3p7RMSNorm(d, eps=eps)
        self.hnorm = Step3p7RMSNorm(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = Step3p7DecoderLayer(ext_config, layer_idx)
        self.shared_head_norm = Step3p7RMSNorm(d, eps=eps)
        self.shared_head_output = nn.Linear(d, ext_config.vocab_size, bias=False)


_STEP_RENAMES = [  # in-memory suffix -> hub suffix (inverse of conversion_mapping.py "step3p7")
    ("mlp.gate.weight", "moe.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "moe.router_bias"),
    ("mlp.experts.down_proj", "moe.down_proj.weight"),
]


def step_to_hub(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        key, value = prefix + key, value.detach().to(torch.float32).contiguous()
        if key.endswith("mlp.experts.gate_up_proj"):  # [E, 2F, D] -> gate [E, F, D] + up [E, F, D]
            base, f = key[: -len("mlp.experts.gate_up_proj")], value.shape[1] // 2
            out[base + "moe.gate_proj.weight"] = value[:, :f].clone().contiguous()
            out[base + "moe.up_proj.weight"] = value[:, f:].clone().contiguous()
            continue
        for mem, hub in _STEP_RENAMES:
            if key.endswith("." + mem):
                key = key[: -len(mem)] + hub
                break
        key = key.replace(".mlp.shared_experts.", ".share_expert.")
        out[key] = value.clone()
    return out


def step_from_hub(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hub names -> in-memory names (as transformers' step3p7 conversion does)."""
    out = {}
    for key, value in tensors.items():
        if key.endswith("moe.up_proj.weight"):
            continue
        if key.endswith("moe.gate_proj.weight"):
            base = key[: -len("moe.gate_proj.weight")]
            out[base + "mlp.experts.gate_up_proj"] = torch.cat([value, tensors[base + "moe.up_proj.weight"]], dim=1)
            continue
        for mem, hub in _STEP_RENAMES:
            if key.endswith("." + hub):
                key = key[: -len(hub)] + mem
                break
        out[key.replace(".share_expert.", ".mlp.shared_experts.")] = value
    return out


def step_mtp_hub_tensors(layer: StepMtpLayer, layer_idx: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{layer_idx}."
    out = {
        p + "enorm.weight": layer.enorm.weight,
        p + "hnorm.weight": layer.hnorm.weight,
        p + "eh_proj.weight": layer.eh_proj.weight,
        p + "transformer.shared_head.norm.weight": layer.shared_head_norm.weight,
        p + "transformer.shared_head.output.weight": layer.shared_head_output.weight,
    }
    out = {k: v.detach().clone().contiguous() for k, v in out.items()}
    out.update(step_to_hub(layer.block.state_dict(), p))
    return out


def step_mtp_from_hub(tensors: dict[str, torch.Tensor], layer_idx: int) -> dict[str, torch.Tensor]:
    """model.layers.{L}.* -> a StepMtpLayer state dict."""
    p = f"model.layers.{layer_idx}."
    own = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
           "transformer.shared_head.norm.weight": "shared_head_norm.weight",
           "transformer.shared_head.output.weight": "shared_head_output.weight"}
    sub = {k[len(p):]: v for k, v in tensors.items() if k.startswith(p)}
    out = {own[k]: v for k, v in sub.items() if k in own}
    out.update({"block." + k: v for k, v in step_from_hub({k: v for k, v in sub.items() if k not in own}).items()})
    return out


class ClampMonitor:
    """Counts, per clamped module, how many SwiGLU gate / up values its bound actually clips."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def hook(self, name: str):
        def fn(module, args, output):
            x, lim = args[0].reshape(-1, args[0].shape[-1]), module.limit
            if isinstance(module, Step3p7MLP):
                g, u = module.act_fn(module.gate_proj(x)), module.up_proj(x)
            else:  # Step3p7Experts: every (token, chosen expert) pair
                idx = args[1].reshape(x.shape[0], -1)
                gu = torch.stack([torch.stack([x[t] @ module.gate_up_proj[int(e)].T for e in idx[t]])
                                  for t in range(x.shape[0])])
                g, u = module.act_fn(gu[..., : gu.shape[-1] // 2]), gu[..., gu.shape[-1] // 2:]
            self.counts[name] = self.counts.get(name, 0) + int((g > lim).sum() + (u.abs() > lim).sum())
        return fn


def clamped_modules(model: nn.Module):
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, (Step3p7MLP, Step3p7Experts)) and math.isfinite(m.limit)]


def step_reference(folder: str):
    j, w = r_read(folder)
    eps, n = j["rms_norm_eps"], j["num_hidden_layers"]
    other = j["attention_other_setting"]
    moe_layers = {int(i) for i in j["moe_layers_enum"].split(",")}
    assert j["use_qk_norm"] and j["zero_centered"] and j["use_head_wise_attn_gate"] and not j["sink"]
    assert j["moe_router_activation"] == "sigmoid" and j["use_moe_router_bias"] and not j["use_rope_layers"]

    def attn_args(layer):  # everything indexed by the absolute layer number
        lt = j["layer_types"][layer]
        heads, kv, hd = j["num_attention_heads"], j["num_attention_groups"], j["head_dim"]
        if lt == other["attention_type"]:
            heads, kv, hd = other["num_attention_heads"], other["num_attention_groups"], other["head_dim"]
        scaling = j["rope_scaling"] if lt in j["yarn_only_types"] else None
        assert scaling is None or scaling["rope_type"] == "llama3"
        return dict(heads=heads, kv=kv, hd=hd, vd=hd, window=j["sliding_window"] if lt == "sliding_attention" else None,
                    inv_freq=r_inv_freq(hd, j["partial_rotary_factors"][layer], j["rope_theta"][layer], scaling),
                    sinks=None, v_scale=1.0, qk_norm=True, gate=True, eps=eps, zc=True)

    def block(x, layer):
        p = f"model.layers.{layer}."
        pos = torch.arange(x.shape[0])
        h = x + r_attention(r_rms(x, w[p + "input_layernorm.weight"], eps, True), w, p + "self_attn.",
                            attn_args(layer), pos)
        u = r_rms(h, w[p + "post_attention_layernorm.weight"], eps, True)
        lim_shared = j["swiglu_limits_shared"][layer]
        if layer in moe_layers:
            f = r_moe(u, w[p + "moe.gate.weight"], w[p + "moe.router_bias"], w[p + "moe.gate_proj.weight"],
                      w[p + "moe.up_proj.weight"], w[p + "moe.down_proj.weight"], j["moe_top_k"],
                      j["norm_expert_weight"], j["moe_router_scaling_factor"], j["swiglu_limits"][layer])
            f = f + r_swiglu(u, w[p + "share_expert.gate_proj.weight"], w[p + "share_expert.up_proj.weight"],
                             w[p + "share_expert.down_proj.weight"], lim_shared)
        else:
            f = r_swiglu(u, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"],
                         lim_shared)
        return h + f

    def forward(ids):
        x = w["model.embed_tokens.weight"][ids]
        for i in range(n):
            x = block(x, i)
        hidden = r_rms(x, w["model.norm.weight"], eps, True)
        return hidden @ w["lm_head.weight"].T, x, hidden

    def mtp_forward(prompt, hidden, prenorm):
        t, ys, logits = prompt.shape[0], [], []
        for k in range(N_MTP):
            layer, cnt = n + k, t - 1 - k
            p = f"model.layers.{layer}."
            e = w["model.embed_tokens.weight"][prompt[k + 1:]]
            g = prenorm[:cnt] if k == 0 else ys[-1][:cnt]
            x = torch.cat([r_rms(e, w[p + "enorm.weight"], eps, True), r_rms(g, w[p + "hnorm.weight"], eps, True)],
                          -1) @ w[p + "eh_proj.weight"].T
            y = block(x, layer)
            ys.append(y)
            out = r_rms(y, w[p + "transformer.shared_head.norm.weight"], eps, True)
            logits.append(out @ w[p + "transformer.shared_head.output.weight"].T)
        return ys, logits

    return forward, mtp_forward


@torch.no_grad()
def step_run(lm: StepLM, mtp, ext, prompt: torch.Tensor):
    """Full forward, greedy with a cache (re-checked without), teacher-forced MTP."""
    cap = {}
    hn = lm.model.norm.register_forward_hook(lambda m, a, o: cap.update(pre=a[0][0], post=o[0]))
    logits = lm(prompt[None])[0]
    hn.remove()
    hidden, hidden_prenorm = cap["post"], cap["pre"]
    assert torch.equal(logits, lm.lm_head(hidden))

    cache = DynamicCache(config=lm.model.config)
    step = lm(prompt[None], past_key_values=cache, use_cache=True)[0, -1]
    rows, toks = [], []
    for g in range(G_NEW):
        rows.append(step)
        toks.append(step.argmax())
        if g < G_NEW - 1:
            step = lm(toks[-1].view(1, 1), past_key_values=cache, use_cache=True)[0, -1]
    greedy, greedy_logits = torch.stack(toks), torch.stack(rows)
    assert cache.get_seq_length() > 0
    ids, nocache_diff = prompt.clone(), 0.0
    for g in range(G_NEW):
        step = lm(ids[None])[0, -1]
        if int(step.argmax()) != int(greedy[g]):
            raise GoldenCheckFailed(f"no-cache greedy differs at step {g}")
        nocache_diff = max(nocache_diff, float((step - greedy_logits[g]).abs().max()))
        ids = torch.cat([ids, greedy[g:g + 1]])

    mtp_y, mtp_logits = teacher_forced_mtp(
        mtp, lm.model.embed_tokens, prompt, hidden, hidden_prenorm, "previous",
        rotary=lambda x, pos: lm.model.rotary_emb(x, pos, "sliding_attention"), mask_config=ext,
        final_norm=lambda k, layer: layer.shared_head_norm, head=lambda k, layer: layer.shared_head_output)
    return logits, hidden, hidden_prenorm, greedy, greedy_logits, mtp_y, mtp_logits, nocache_diff


@torch.no_grad()
def build_step_case(name: str, case: dict, seed: int, workdir: str):
    hub_json = step_hub_config_json(case)
    cfg, ext = step_configs(hub_json)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    lm = StepLM(cfg)
    lm.model.set_attn_implementation("eager")
    lm.model.set_experts_implementation("eager")
    lm.eval()
    assert lm.model.config._attn_implementation == "eager"
    randomize_(lm, gen, init_step)
    n = cfg.num_hidden_layers
    mtp = nn.ModuleList([StepMtpLayer(ext, n + k) for k in range(N_MTP)]).eval()
    randomize_(mtp, gen, init_step)
    for layer in mtp:  # sliding, 6 heads, dense, no clamp (entries 4..6 of the lists are 0)
        a = layer.block.self_attn
        assert a.sliding_window == 4 and a.num_heads == 6 and isinstance(layer.block.mlp, Step3p7MLP)
        assert layer.block.mlp.limit == float("inf")
    assert lm.model.layers[0].self_attn.num_heads == 4 and lm.model.layers[1].self_attn.num_heads == 6
    assert lm.model.norm.eps == hub_json["rms_norm_eps"]
    # llama3 scaling on the full layers only: pair 0 kept, pair 1 smoothed, pairs 2-3 divided by 2
    rot = lm.model.rotary_emb
    plain_full = r_inv_freq(hub_json["head_dim"], hub_json["partial_rotary_factors"][0], hub_json["rope_theta"][0])
    ratio = (rot.full_attention_inv_freq.double() / plain_full).tolist()
    assert abs(ratio[0] - 1) < 1e-6 and 0.5 + 1e-3 < ratio[1] < 1 - 1e-3, ratio
    assert all(abs(r - 0.5) < 1e-6 for r in ratio[2:]), ratio
    plain_swa = r_inv_freq(hub_json["head_dim"], hub_json["partial_rotary_factors"][1], hub_json["rope_theta"][1])
    assert torch.allclose(rot.sliding_attention_inv_freq.double(), plain_swa, rtol=1e-6, atol=0)

    prompt = draw_prompt(seed, EOS_ID + 1, case["vocab_size"])
    monitor, clamp = StepRouterMonitor(), ClampMonitor()
    handles = hook_routers(lm.modules(), Step3p7TopKRouter, monitor)
    clamp_handles = [m.register_forward_hook(clamp.hook(nm)) for nm, m in clamped_modules(lm)]
    logits = lm(prompt[None])[0]
    for hnd in clamp_handles:
        hnd.remove()
    expected = {f"model.layers.{i}.mlp" for i, lim in enumerate(case["swiglu_limits_shared"][:n])
                if lim and cfg.mlp_layer_types[i] == "dense"}
    expected |= {f"model.layers.{i}.mlp.shared_experts" for i, lim in enumerate(case["swiglu_limits_shared"][:n])
                 if lim and cfg.mlp_layer_types[i] == "sparse"}
    expected |= {f"model.layers.{i}.mlp.experts" for i, lim in enumerate(case["swiglu_limits"][:n]) if lim}
    assert set(clamp.counts) == expected, (clamp.counts, expected)
    assert all(c > 0 for c in clamp.counts.values()), f"a configured clamp never binds: {clamp.counts}"

    logits2, hidden, hidden_prenorm, greedy, greedy_logits, mtp_y, mtp_logits, nocache_diff = step_run(
        lm, mtp, ext, prompt)
    assert torch.equal(logits, logits2)
    for hnd in handles:
        hnd.remove()
    n_moe = cfg.mlp_layer_types.count("sparse")
    assert monitor.calls == n_moe * (2 + 2 * G_NEW), monitor.calls  # 2 prompt forwards, cache + no-cache greedy

    stats = tie_checks(monitor.min_margin, greedy_logits, greedy, mtp_logits)
    stats["cache_vs_nocache_max_abs_diff"] = nocache_diff
    if clamp.counts:  # how much the clamps matter: the same forward with every bound removed
        saved = [(m, m.limit) for _, m in clamped_modules(lm)]
        for m, _ in saved:
            m.limit = float("inf")
        stats["clamp_effect_on_logits"] = float((lm(prompt[None])[0] - logits).abs().max())
        for m, lim in saved:
            m.limit = lim
        assert stats["clamp_effect_on_logits"] > 1e-2, stats
        stats["clamped_values"] = dict(sorted(clamp.counts.items()))
    stats["window_effect_on_logits"] = window_effect(lm.model.config, lambda: lm(prompt[None])[0], logits)
    scaled = rot.full_attention_inv_freq.clone()
    rot.full_attention_inv_freq.copy_(plain_full.float())
    stats["rope_scaling_effect_on_logits"] = float((lm(prompt[None])[0] - logits).abs().max())
    rot.full_attention_inv_freq.copy_(scaled)
    assert stats["window_effect_on_logits"] > 1e-2 and stats["rope_scaling_effect_on_logits"] > 1e-4, stats
    arrays = golden_arrays(prompt, logits, greedy, greedy_logits, hidden, hidden_prenorm, mtp_y, mtp_logits, seed)

    tensors = step_to_hub(lm.state_dict())
    for k, layer in enumerate(mtp):
        extra = step_mtp_hub_tensors(layer, n + k)
        assert extra.keys().isdisjoint(tensors.keys())
        tensors.update(extra)
    # the inverse mapping restores transformers' names exactly
    mtp_prefixes = tuple(f"model.layers.{n + k}." for k in range(N_MTP))
    back = step_from_hub({k: v for k, v in tensors.items() if not k.startswith(mtp_prefixes)})
    sd = lm.state_dict()
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    return (lm, mtp, ext), hub_json, tensors, arrays, stats


TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                   patch_size=14)


@torch.no_grad()
def verify_step_folder(folder: str, models, arrays: dict, workdir: str, name: str) -> dict:
    lm, mtp, _ = models
    prompt = torch.from_numpy(arrays["prompt"])
    with open(os.path.join(folder, "config.json")) as fh:
        j = json.load(fh)
    tensors = load_safetensors(os.path.join(folder, "model.safetensors"))
    n = j["num_hidden_layers"]

    # 1. own reload: file -> in-memory names -> load_state_dict(strict=True) into fresh modules
    cfg, ext = step_configs(j)
    torch.manual_seed(0)
    lm2 = StepLM(cfg).eval()
    lm2.model.set_attn_implementation("eager")
    lm2.model.set_experts_implementation("eager")
    target = {k: v for k, v in tensors.items() if not any(k.startswith(f"model.layers.{n + i}.") for i in range(N_MTP))}
    lm2.load_state_dict(step_from_hub(target), strict=True)
    mtp2 = nn.ModuleList([StepMtpLayer(ext, n + k) for k in range(N_MTP)]).eval()
    for k in range(N_MTP):
        mtp2[k].load_state_dict(step_mtp_from_hub(tensors, n + k), strict=True)
    logits, hidden, prenorm, greedy, greedy_logits, mtp_y, mtp_logits, _ = step_run(lm2, mtp2, ext, prompt)
    assert np.array_equal(logits.numpy(), arrays["logits"])
    assert np.array_equal(greedy.numpy(), arrays["greedy"])
    assert np.array_equal(greedy_logits.numpy(), arrays["greedy_logits"])
    for k in range(N_MTP):
        assert np.array_equal(mtp_y[k].numpy(), arrays[f"mtp_y_{k}"])
        assert np.array_equal(mtp_logits[k].numpy(), arrays[f"mtp_logits_{k}"])

    # 2. transformers' own loader (conversion_mapping "step3p7") on the same tensors, inside a
    #    Step3p7ForConditionalGeneration with a tiny vision tower
    vl_dir = os.path.join(workdir, f"{name}_vl")
    os.makedirs(vl_dir, exist_ok=True)
    vl_cfg = Step3p7Config(text_config=dict(j), vision_config=dict(TINY_VISION), tie_word_embeddings=False)
    vl_json = vl_cfg.to_dict()
    vl_json["text_config"] = dict(j)  # the hub text config itself, not transformers' re-serialisation
    write_json(os.path.join(vl_dir, "config.json"), vl_json)
    os.symlink(os.path.abspath(os.path.join(folder, "model.safetensors")), os.path.join(vl_dir, "model.safetensors"))
    vl, info = Step3p7ForConditionalGeneration.from_pretrained(
        vl_dir, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32,
        output_loading_info=True)
    vl.eval()
    assert all(k.startswith(("model.vision_model.", "model.multi_modal_projector.")) for k in info["missing_keys"]), \
        info["missing_keys"]
    assert all(re.match(rf"model\.language_model\.layers\.({n}|{n + 1}|{n + 2})\.", k)
               for k in info["unexpected_keys"]), info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    sd1, sd2 = lm.model.state_dict(), vl.model.language_model.state_dict()
    assert sorted(sd1) == sorted(sd2)
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    assert torch.equal(vl.lm_head.weight, lm.lm_head.weight)
    out = vl.model.language_model(input_ids=prompt[None], use_cache=False).last_hidden_state
    # the weights are bit-identical, but the loaded (memory-mapped / concatenated) tensors send the
    # MoE matmuls down a different summation order: differences of a few 1e-7 remain
    hf_loader_diff = float((vl.lm_head(out)[0] - torch.from_numpy(arrays["logits"])).abs().max())
    assert hf_loader_diff <= 1e-5, hf_loader_diff

    # 3. the independent reference
    forward, mtp_forward = step_reference(folder)
    return dict(hf_loader_max_abs_diff=hf_loader_diff,
                reference_max_abs_diff=reference_check(folder, arrays, forward, mtp_forward))


def write_step_case(out_dir: str, name: str, case: dict, workdir: str) -> dict:
    (models, config_json, tensors, arrays, stats), seed, tries = draw_case(build_step_case, name, case, workdir)
    folder = os.path.join(out_dir, name)
    write_fixture_folder(folder, config_json, tensors, arrays)
    stats.update(verify_step_folder(folder, models, arrays, workdir, name))
    stats.update(seed=seed, tries=tries)
    return stats


# ----------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------


def write_case(out_dir: str, name: str, case: dict, workdir: str) -> dict:
    if case["family"] == "mimo":
        return write_mimo_case(out_dir, name, case, workdir)
    return write_step_case(out_dir, name, case, workdir)


def main() -> None:
    args = parse_args_and_setup(__doc__.split("\n")[0], CASES)
    write_cases(args, CASES, write_case, "")


if __name__ == "__main__":
    main()
