"""Build the Qwen hybrid (Gated DeltaNet + gated attention) golden fixtures with HF transformers.

Qwen3-Next, Qwen3.5 and Qwen3.5-MoE interleave Gated DeltaNet linear-attention layers with
gated full-attention layers (output gate from ``q_proj``, q/k norm, partial rotary), use
zero-centred RMSNorms (``x_hat * (1 + w)``), and publish one MTP layer under ``mtp.*``.
Tiny random models of each are run by transformers' own classes (eager attention and experts,
float32, CPU, torch's fallback Gated DeltaNet and causal-conv1d code), so CI can check the JAX
model against an implementation we did not write. For every case ``<case>`` in ``CASES`` it
writes ``tests/golden/<case>/``:

* ``config.json``: ``qwen3_next_moe`` in the published Qwen3-Next-80B-A3B style
  (``full_attention_interval``, top-level ``rope_theta`` / ``partial_rotary_factor``,
  ``"rope_scaling": null``, ``torch_dtype``); ``qwen3_next_saved`` exactly as transformers 5.17
  ``save_pretrained`` writes it (``layer_types``, ``rope_parameters``, ``dtype``);
  ``qwen3_5_dense`` / ``qwen3_5_moe`` in the published Qwen3.5 multimodal style (``text_config``
  with ``layer_types``, M-RoPE ``rope_parameters``, ``mtp_num_hidden_layers``, and a tiny
  ``vision_config``).
* ``model.safetensors``: every tensor under its hub name (``model.*`` for Qwen3-Next,
  ``model.language_model.*`` / ``model.visual.*`` / ``lm_head.weight`` for Qwen3.5) plus the MTP
  layer under ``mtp.*``. Qwen3-Next stores its experts per expert
  (``mlp.experts.{e}.{gate,up,down}_proj.weight``), Qwen3.5-MoE fused
  (``mlp.experts.gate_up_proj`` [E, 2F, D], ``mlp.experts.down_proj`` [E, D, F]).
* ``golden.npz``: prompt, full-forward logits, greedy generation, final hidden state and
  teacher-forced MTP logits (the arrays of the other fixtures; tests/golden/README.md).

The target tensors are checked against what ``save_pretrained`` writes, each folder is reloaded
with ``from_pretrained`` (logits must be bit-identical) and the MTP tensors are read back from
the file into fresh modules (MTP logits bit-identical). transformers 5.17 has no MTP path for
these models, so the MTP layer runs transformers' own decoder layer (a ``full_attention`` layer
of the model's class) and RMSNorm class, with the concat / projection wired by hand as vLLM's
``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py`` do. A float64 reference written from config.json and
model.safetensors alone must reproduce every golden array within 1e-4, and the same reference
with one plausible loader mistake (plain instead of zero-centred norms, Qwen3-Next's grouped
``in_proj_qkvz`` read flat, the MTP concat order, ...) must miss the logits. Draws whose routing
or argmax decisions are near a tie are redrawn.

Re-run from the repository root with a Python that has torch + transformers::

    python tests/golden/make_qwen3_next.py            # writes into tests/golden/
    python tests/golden/make_qwen3_next.py --out DIR  # writes elsewhere
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import transformers
from transformers import (
    GenerationConfig,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.masking_utils import create_causal_mask
from transformers.models.qwen3_5 import modeling_qwen3_5 as m35
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m35moe
from transformers.models.qwen3_next import modeling_qwen3_next as mnext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _golden_common import (  # noqa: E402  (shared with the other fixtures)
    G_NEW,
    LOGIT_MARGIN,
    ROUTER_MARGIN,
    GoldenCheckFailed,
    draw_case,
    fused_to_hub,
    load_safetensors,
    parse_args_and_setup,
    randomize_,
    target_arrays,
    top2_gap,
    write_cases,
    write_fixture_folder,
)

T_PROMPT = 24  # prompt length: long enough for the recurrent state and the conv window to matter
BOS_ID, EOS_ID = 0, 1  # prompts and greedy tokens avoid both

# family -> transformers classes
FAMILIES = {
    "qwen3_next": dict(
        model_cls=Qwen3NextForCausalLM, norm_cls=mnext.Qwen3NextRMSNorm, layer_cls=mnext.Qwen3NextDecoderLayer,
        router_cls=mnext.Qwen3NextTopKRouter, gdn_cls=mnext.Qwen3NextGatedDeltaNet,
    ),
    "qwen3_5": dict(
        model_cls=Qwen3_5ForConditionalGeneration, norm_cls=m35.Qwen3_5RMSNorm, layer_cls=m35.Qwen3_5DecoderLayer,
        router_cls=None, gdn_cls=m35.Qwen3_5GatedDeltaNet,
    ),
    "qwen3_5_moe": dict(
        model_cls=Qwen3_5MoeForConditionalGeneration, norm_cls=m35moe.Qwen3_5MoeRMSNorm,
        layer_cls=m35moe.Qwen3_5MoeDecoderLayer, router_cls=m35moe.Qwen3_5MoeTopKRouter,
        gdn_cls=m35moe.Qwen3_5MoeGatedDeltaNet,
    ),
}

# A tiny vision tower for the Qwen3.5 cases (its tensors are in the file; the text path never runs it).
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, num_position_embeddings=16, in_channels=3)

CASES = {
    "qwen3_next_moe": dict(
        family="qwen3_next", style="hub",
        vocab_size=136, hidden_size=48, num_hidden_layers=4, full_attention_interval=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, intermediate_size=48, mlp_only_layers=[1],
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=16,
        norm_topk_prob=True, rope_theta=5e5, rms_norm_eps=1e-6, seed=21000,
    ),
    "qwen3_next_saved": dict(
        family="qwen3_next", style="transformers",
        vocab_size=144, hidden_size=48, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.5,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, intermediate_size=32, mlp_only_layers=[],
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=8, shared_expert_intermediate_size=12,
        norm_topk_prob=False, rope_theta=2e5, rms_norm_eps=1e-6, seed=22000,
    ),
    "qwen3_5_dense": dict(
        family="qwen3_5", style="hub",
        vocab_size=152, hidden_size=48, num_hidden_layers=4, full_attention_interval=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25,
        mrope_section=[2, 1, 1],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, intermediate_size=64,
        rope_theta=1e7, rms_norm_eps=1e-6, seed=23000,
    ),
    "qwen3_5_moe": dict(
        family="qwen3_5_moe", style="hub",
        vocab_size=160, hidden_size=48, num_hidden_layers=4, full_attention_interval=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25,
        mrope_section=[2, 1, 1],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=16,
        rope_theta=5e6, rms_norm_eps=1e-6, seed=24000,
    ),
}


def layer_types(case: dict) -> list[str]:
    if "layer_types" in case:
        return list(case["layer_types"])
    k = case["full_attention_interval"]
    return ["linear_attention" if (i + 1) % k else "full_attention" for i in range(case["num_hidden_layers"])]


# ----------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------


def text_kwargs(case: dict) -> dict:
    """Keyword arguments of the text config shared by the three families."""
    out = dict(
        vocab_size=case["vocab_size"], hidden_size=case["hidden_size"], num_hidden_layers=case["num_hidden_layers"],
        num_attention_heads=case["num_attention_heads"], num_key_value_heads=case["num_key_value_heads"],
        head_dim=case["head_dim"], linear_num_key_heads=case["linear_num_key_heads"],
        linear_num_value_heads=case["linear_num_value_heads"], linear_key_head_dim=case["linear_key_head_dim"],
        linear_value_head_dim=case["linear_value_head_dim"], linear_conv_kernel_dim=case["linear_conv_kernel_dim"],
        layer_types=layer_types(case), rms_norm_eps=case["rms_norm_eps"], hidden_act="silu", attention_bias=False,
        attention_dropout=0.0, initializer_range=0.02, max_position_embeddings=256, tie_word_embeddings=False,
        use_cache=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=None,
    )
    rope = {"rope_type": "default", "rope_theta": case["rope_theta"],
            "partial_rotary_factor": case["partial_rotary_factor"]}
    if "mrope_section" in case:
        rope.update(mrope_section=case["mrope_section"], mrope_interleaved=True)
    out["rope_parameters"] = rope
    if "num_experts" in case:
        out.update(num_experts=case["num_experts"], num_experts_per_tok=case["num_experts_per_tok"],
                   moe_intermediate_size=case["moe_intermediate_size"],
                   shared_expert_intermediate_size=case["shared_expert_intermediate_size"])
    if "intermediate_size" in case:
        out["intermediate_size"] = case["intermediate_size"]
    return out


def make_config(case: dict):
    kw = text_kwargs(case)
    if case["family"] == "qwen3_next":
        return Qwen3NextConfig(**kw, mlp_only_layers=case["mlp_only_layers"], decoder_sparse_step=1,
                               norm_topk_prob=case["norm_topk_prob"], dtype="float32")
    vision = dict(VISION, out_hidden_size=case["hidden_size"])
    cls = Qwen3_5Config if case["family"] == "qwen3_5" else Qwen3_5MoeConfig
    return cls(text_config=kw, vision_config=vision, tie_word_embeddings=False, dtype="float32")


def hub_config_json(case: dict) -> dict:
    """config.json with the keys (and key order) of the published checkpoints."""
    if case["family"] == "qwen3_next":  # Qwen3-Next-80B-A3B
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": BOS_ID,
            "decoder_sparse_step": 1,
            "eos_token_id": EOS_ID,
            "full_attention_interval": case["full_attention_interval"],
            "head_dim": case["head_dim"],
            "hidden_act": "silu",
            "hidden_size": case["hidden_size"],
            "initializer_range": 0.02,
            "intermediate_size": case["intermediate_size"],
            "linear_conv_kernel_dim": case["linear_conv_kernel_dim"],
            "linear_key_head_dim": case["linear_key_head_dim"],
            "linear_num_key_heads": case["linear_num_key_heads"],
            "linear_num_value_heads": case["linear_num_value_heads"],
            "linear_value_head_dim": case["linear_value_head_dim"],
            "max_position_embeddings": 256,
            "mlp_only_layers": case["mlp_only_layers"],
            "model_type": "qwen3_next",
            "moe_intermediate_size": case["moe_intermediate_size"],
            "norm_topk_prob": case["norm_topk_prob"],
            "num_attention_heads": case["num_attention_heads"],
            "num_experts": case["num_experts"],
            "num_experts_per_tok": case["num_experts_per_tok"],
            "num_hidden_layers": case["num_hidden_layers"],
            "num_key_value_heads": case["num_key_value_heads"],
            "output_router_logits": False,
            "partial_rotary_factor": case["partial_rotary_factor"],
            "rms_norm_eps": case["rms_norm_eps"],
            "rope_scaling": None,
            "rope_theta": case["rope_theta"],
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": case["shared_expert_intermediate_size"],
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "transformers_version": transformers.__version__,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": case["vocab_size"],
        }
    # Qwen3.5 (the published Qwen3.5 config.json: text_config keys in that file's order, with
    # mamba_ssm_dtype and rope_parameters last)
    moe = case["family"] == "qwen3_5_moe"
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "float32",
        "eos_token_id": EOS_ID,
        "full_attention_interval": case["full_attention_interval"],
        "head_dim": case["head_dim"],
        "hidden_act": "silu",
        "hidden_size": case["hidden_size"],
        "initializer_range": 0.02,
    }
    if not moe:
        text["intermediate_size"] = case["intermediate_size"]
    text.update({
        "layer_types": layer_types(case),
        "linear_conv_kernel_dim": case["linear_conv_kernel_dim"],
        "linear_key_head_dim": case["linear_key_head_dim"],
        "linear_num_key_heads": case["linear_num_key_heads"],
        "linear_num_value_heads": case["linear_num_value_heads"],
        "linear_value_head_dim": case["linear_value_head_dim"],
        "max_position_embeddings": 256,
    })
    if not moe:
        text["mlp_only_layers"] = []
    text["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
    if moe:
        text["moe_intermediate_size"] = case["moe_intermediate_size"]
    text.update({"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
                 "num_attention_heads": case["num_attention_heads"]})
    if moe:
        text.update({"num_experts": case["num_experts"], "num_experts_per_tok": case["num_experts_per_tok"]})
    text.update({"num_hidden_layers": case["num_hidden_layers"],
                 "num_key_value_heads": case["num_key_value_heads"]})
    if moe:
        text["output_router_logits"] = False
    text["rms_norm_eps"] = case["rms_norm_eps"]
    if moe:
        text.update({"router_aux_loss_coef": 0.001,
                     "shared_expert_intermediate_size": case["shared_expert_intermediate_size"]})
    text.update({
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": case["vocab_size"],
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": case["mrope_section"],
            "rope_type": "default",
            "rope_theta": case["rope_theta"],
            "partial_rotary_factor": case["partial_rotary_factor"],
        },
    })
    vision = {
        "deepstack_visual_indexes": [],
        "depth": VISION["depth"],
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": VISION["hidden_size"],
        "in_channels": VISION["in_channels"],
        "initializer_range": 0.02,
        "intermediate_size": VISION["intermediate_size"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "num_heads": VISION["num_heads"],
        "num_position_embeddings": VISION["num_position_embeddings"],
        "out_hidden_size": case["hidden_size"],
        "patch_size": VISION["patch_size"],
        "spatial_merge_size": VISION["spatial_merge_size"],
        "temporal_patch_size": VISION["temporal_patch_size"],
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "image_token_id": 248056,
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": transformers.__version__,
        "video_token_id": 248057,
        "vision_config": vision,
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    }


# ----------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------


def qwen_init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random value for one parameter, chosen by its name (every tensor non-trivial)."""
    randn = lambda: torch.randn(shape, generator=gen, dtype=torch.float32)  # noqa: E731
    rand = lambda: torch.rand(shape, generator=gen, dtype=torch.float32)  # noqa: E731
    if ".visual." in "." + name:
        return 0.02 * randn()
    if name.endswith("A_log"):  # A = exp(A_log) in [0.05, 2]: slow and fast decaying heads
        return float(np.log(0.05)) + rand() * float(np.log(2.0 / 0.05))
    if name.endswith("dt_bias"):
        return 0.5 * randn() - 0.5
    if name.endswith("conv1d.weight"):
        return 0.3 * randn()
    if name.endswith("linear_attn.norm.weight"):  # the gated RMSNorm applies w as stored
        return 1.0 + 0.1 * randn()
    if "norm" in name:  # zero-centred RMSNorms: (1 + w)
        return 0.1 * randn()
    if "embed" in name:
        return 0.5 * randn()
    if name.endswith("mlp.gate.weight"):  # router
        return 0.3 * randn()
    if name.endswith("shared_expert_gate.weight"):
        return 0.3 * randn()
    return 0.1 * randn()


def text_model(model):
    return model.model if isinstance(model, Qwen3NextForCausalLM) else model.model.language_model


def text_prefix(case: dict) -> str:
    return "model." if case["family"] == "qwen3_next" else "model.language_model."


@torch.no_grad()
def new_model(case: dict, config, seed: int):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    fam = FAMILIES[case["family"]]
    model = fam["model_cls"](config)
    model.set_attn_implementation("eager")
    if case["family"] != "qwen3_5":
        model.set_experts_implementation("eager")
        assert text_model(model).config._experts_implementation == "eager"
    model.eval()
    assert text_model(model).config._attn_implementation == "eager"
    randomize_(model, gen, qwen_init)
    return model, gen


class QwenMtp(nn.Module):
    """The published MTP layer: ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc`` [D, 2D], one
    ``full_attention`` decoder layer of the model's own class, ``norm``; head and embedding are the target's."""

    def __init__(self, text_config, norm_cls, layer_cls):
        super().__init__()
        d = text_config.hidden_size
        cfg = copy.deepcopy(text_config)
        n = cfg.num_hidden_layers
        cfg.layer_types = list(cfg.layer_types) + ["full_attention"]
        self.pre_fc_norm_embedding = norm_cls(d, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(d, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList([layer_cls(cfg, layer_idx=n)])
        self.norm = norm_cls(d, eps=cfg.rms_norm_eps)
        assert self.layers[0].block_type == "full_attention"


def mtp_hub_tensors(mtp: QwenMtp, split_experts: bool) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone().contiguous() for k, v in mtp.state_dict().items()}
    if split_experts:
        return fused_to_hub(state, "mtp.")
    return {"mtp." + k: v for k, v in state.items()}


def hub_to_fused(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Inverse of fused_to_hub for the tensors under `prefix` (prefix stripped)."""
    out, experts = {}, {}
    for k, v in tensors.items():
        if not k.startswith(prefix):
            continue
        k = k[len(prefix):]
        parts = k.split(".")
        if ".mlp.experts." in "." + k and parts[-1] == "weight" and parts[-3].isdigit():
            base = ".".join(parts[:-3])
            experts.setdefault(base, {}).setdefault(parts[-2], {})[int(parts[-3])] = v
        else:
            out[k] = v
    for base, proj in experts.items():
        n = len(proj["down_proj"])
        out[base + ".gate_up_proj"] = torch.stack(
            [torch.cat([proj["gate_proj"][e], proj["up_proj"][e]], 0) for e in range(n)])
        out[base + ".down_proj"] = torch.stack([proj["down_proj"][e] for e in range(n)])
    return out


# ----------------------------------------------------------------------------
# runs
# ----------------------------------------------------------------------------


class SoftmaxRouterMonitor:
    """Forward hook on a softmax top-k router: re-derives the choice and records how far every routing
    decision is from a tie (gap between the k-th and (k+1)-th probability)."""

    def __init__(self):
        self.min_margin = float("inf")
        self.calls = 0

    def __call__(self, module, args, output):
        logits, _, idx = output
        probs = torch.softmax(logits.float(), dim=-1)
        ranked = probs.sort(dim=-1, descending=True)
        k = module.top_k
        mine = ranked.indices[:, :k].sort(-1).values
        if not torch.equal(mine, idx.sort(-1).values):
            raise AssertionError(f"re-derived routing disagrees with {type(module).__name__}")
        self.min_margin = min(self.min_margin, float((ranked.values[:, k - 1] - ranked.values[:, k]).min()))
        self.calls += 1


def rope_positions(case: dict, pos: torch.Tensor) -> torch.Tensor:
    """Position ids for the model's rotary embedding: [1, S], or [3, 1, S] (M-RoPE, text only: T = H = W)."""
    return pos[None] if case["family"] == "qwen3_next" else pos[None, None].expand(3, 1, -1)


@torch.no_grad()
def run_mtp(case: dict, model, mtp: QwenMtp, prompt: torch.Tensor, hidden: torch.Tensor, offset: int = 0):
    """Teacher-forced MTP over anchors p = 0..T-2: the embedding of token p+1 and the target's post-norm
    hidden state at p. RoPE / mask positions are the anchors' (p + offset), as vLLM passes them."""
    tm = text_model(model)
    t = prompt.shape[0]
    e = tm.embed_tokens(prompt[1:])  # token p+1 for anchor p, not zeroed anywhere
    h = hidden[: t - 1]
    x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(e), mtp.pre_fc_norm_hidden(h)], dim=-1))[None]
    pos = torch.arange(t - 1) + offset
    position_embeddings = tm.rotary_emb(x, rope_positions(case, pos))
    mask = create_causal_mask(config=tm.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                              position_ids=pos[None])
    y = mtp.layers[0](x, position_embeddings=position_embeddings, attention_mask=mask, position_ids=pos[None])
    logits = model.lm_head(mtp.norm(y))
    return y[0], logits[0]


@torch.no_grad()
def record_golden(case: dict, model, mtp: QwenMtp, prompt: torch.Tensor, seed: int) -> tuple[dict, dict]:
    fam = FAMILIES[case["family"]]
    tm = text_model(model)
    n_layers = tm.config.num_hidden_layers
    monitor = SoftmaxRouterMonitor()
    handles = []
    if fam["router_cls"] is not None:
        handles = [m.register_forward_hook(monitor) for m in list(model.modules()) + list(mtp.modules())
                   if isinstance(m, fam["router_cls"])]

    # 1. full forward, no cache
    captured = {}
    h_norm = tm.norm.register_forward_hook(lambda m, a, o: captured.__setitem__("prenorm", a[0]))
    out = model(prompt[None], use_cache=False, output_hidden_states=True)
    h_norm.remove()
    logits = out.logits[0]
    hidden = out.hidden_states[-1][0]
    assert len(out.hidden_states) == n_layers + 1
    assert torch.equal(hidden, tm.norm(captured["prenorm"])[0]), "hidden_states[-1] is not post-norm"
    assert not torch.allclose(hidden, captured["prenorm"][0])
    if case["family"] != "qwen3_next":  # text only: the 3-D M-RoPE positions are the 1-D ones repeated
        pos = torch.arange(T_PROMPT)
        explicit = model(prompt[None], use_cache=False, position_ids=pos[None, None].expand(4, 1, -1)).logits[0]
        assert torch.equal(explicit, logits)

    # 2. greedy generation (cache on: chunked prefill, then the recurrent decode path)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = EOS_ID
    gcfg = GenerationConfig(do_sample=False, max_new_tokens=G_NEW, min_new_tokens=G_NEW, eos_token_id=None,
                            pad_token_id=EOS_ID, output_logits=True, return_dict_in_generate=True)
    gout = model.generate(prompt[None], generation_config=gcfg)
    greedy = gout.sequences[0, T_PROMPT:]
    assert greedy.shape[0] == G_NEW
    greedy_logits = torch.cat([s for s in gout.logits], dim=0)  # [G, V], raw logits
    assert torch.equal(greedy_logits.argmax(-1), greedy)

    # same tokens when recomputed without a cache (every step a full chunked forward)
    ids = prompt.clone()
    nocache_diff = 0.0
    for g in range(G_NEW):
        step = model(ids[None], use_cache=False).logits[0, -1]
        nocache_diff = max(nocache_diff, float((step - greedy_logits[g]).abs().max()))
        if int(step.argmax()) != int(greedy[g]):
            raise GoldenCheckFailed(f"no-cache greedy differs at step {g}")
        ids = torch.cat([ids, step.argmax()[None]])
    assert nocache_diff < 1e-4, nocache_diff

    # 3. teacher-forced MTP (anchor positions), and the same at the embedded tokens' positions
    mtp_y, mtp_logits = run_mtp(case, model, mtp, prompt, hidden)
    _, mtp_logits_shift = run_mtp(case, model, mtp, prompt, hidden, offset=1)
    for hnd in handles:
        hnd.remove()

    # ---- tie checks ----
    n_moe = 0
    if fam["router_cls"] is not None:
        n_moe = sum(isinstance(m, fam["router_cls"]) for m in model.modules())
        n_mtp = sum(isinstance(m, fam["router_cls"]) for m in mtp.modules())
        full_forwards = 1 if case["family"] == "qwen3_next" else 2  # + the explicit M-RoPE positions run
        assert monitor.calls == n_moe * (full_forwards + 2 * G_NEW) + 2 * n_mtp, (monitor.calls, n_moe, n_mtp)
        if monitor.min_margin <= ROUTER_MARGIN:
            raise GoldenCheckFailed(f"router margin {monitor.min_margin:.2e}")
    gap_greedy = float(top2_gap(greedy_logits).min())
    gap_mtp = float(torch.minimum(top2_gap(mtp_logits), top2_gap(mtp_logits_shift)).min())
    if gap_greedy <= LOGIT_MARGIN:
        raise GoldenCheckFailed(f"greedy top-2 gap {gap_greedy:.2e}")
    if gap_mtp <= LOGIT_MARGIN:
        raise GoldenCheckFailed(f"mtp top-2 gap {gap_mtp:.2e}")
    if any(int(t) in (BOS_ID, EOS_ID) for t in greedy):
        raise GoldenCheckFailed("greedy output contains the bos / eos id")

    arrays = target_arrays(prompt, logits, greedy, greedy_logits, hidden, captured["prenorm"][0], seed)
    mtp_np = mtp_logits.numpy().astype(np.float32)
    # Qwen's MTP never zeroes the embedding, so both conventions of the other fixtures coincide
    arrays.update(mtp_logits=mtp_np, mtp_y=mtp_y.numpy().astype(np.float32), mtp_logits_nozero=mtp_np.copy())
    stats = dict(router_margin=monitor.min_margin if n_moe else None, greedy_gap=gap_greedy, mtp_gap=gap_mtp,
                 nocache_logit_diff=nocache_diff,
                 mtp_shifted_positions_diff=float((mtp_logits_shift - mtp_logits).abs().max()))
    return arrays, stats


# ----------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------


@torch.no_grad()
def checked_hub_tensors(case: dict, model, mtp: QwenMtp, workdir: str, name: str):
    """Every tensor of model.safetensors under its hub name; the target part is checked against what
    save_pretrained writes. Returns (tensors, save_pretrained folder)."""
    sp_dir = os.path.join(workdir, f"{name}_save_pretrained")
    model.save_pretrained(sp_dir)
    saved = load_safetensors(os.path.join(sp_dir, "model.safetensors"))
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    split = fused_to_hub(state, "")  # per-expert names, as save_pretrained writes them
    assert sorted(saved) == sorted(split), sorted(set(saved) ^ set(split))
    for k in saved:
        assert saved[k].dtype == torch.float32 and torch.equal(saved[k], split[k]), k
    if case["family"] == "qwen3_5_moe":
        # the published Qwen3.5-MoE checkpoints keep the experts fused: the in-memory layout
        target = {k: v.clone() for k, v in state.items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in target)
    else:
        target = split
    mtp_tensors = mtp_hub_tensors(mtp, split_experts=case["family"] == "qwen3_next")
    assert mtp_tensors.keys().isdisjoint(target.keys())
    return {**target, **mtp_tensors}, sp_dir


def config_json(case: dict, sp_dir: str) -> dict:
    if case["style"] == "hub":
        return hub_config_json(case)
    with open(os.path.join(sp_dir, "config.json")) as fh:
        saved = json.load(fh)
    assert saved["layer_types"] == layer_types(case), saved["layer_types"]
    assert "rope_parameters" in saved and "rope_theta" not in saved and "full_attention_interval" not in saved
    assert saved["dtype"] == "float32" and "torch_dtype" not in saved
    return saved


@torch.no_grad()
def verify_folder(case: dict, folder: str, model, mtp: QwenMtp, arrays: dict) -> None:
    """Reload with transformers' own loader and compare; read the MTP tensors back into fresh modules."""
    fam = FAMILIES[case["family"]]
    prompt = torch.from_numpy(arrays["prompt"])
    m2, info = fam["model_cls"].from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32,
        output_loading_info=True,
    ) if case["family"] != "qwen3_5" else fam["model_cls"].from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    m2.eval()
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info["unexpected_keys"]
    sd1, sd2 = model.state_dict(), m2.state_dict()
    assert sorted(sd1) == sorted(sd2)
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    tc = text_model(m2).config
    assert tc.layer_types == layer_types(case), tc.layer_types
    assert tc.rope_parameters["rope_theta"] == case["rope_theta"], tc.rope_parameters
    assert tc.rope_parameters["partial_rotary_factor"] == case["partial_rotary_factor"], tc.rope_parameters
    out = m2(prompt[None], use_cache=False, output_hidden_states=True)
    assert np.array_equal(out.logits[0].numpy(), arrays["logits"])
    assert np.array_equal(out.hidden_states[-1][0].numpy(), arrays["hidden"])

    # MTP: every mtp.* tensor of the file, and nothing else, loads strictly into fresh modules
    tensors = load_safetensors(os.path.join(folder, "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in tensors.values())
    fresh = QwenMtp(text_model(m2).config, fam["norm_cls"], fam["layer_cls"])
    fresh.load_state_dict(hub_to_fused(tensors, "mtp."), strict=True)
    fresh.eval()
    hidden = torch.from_numpy(arrays["hidden"])
    y, logits = run_mtp(case, m2, fresh, prompt, hidden)
    assert np.array_equal(logits.numpy(), arrays["mtp_logits"])
    assert np.array_equal(y.numpy(), arrays["mtp_y"])
    prefixes = {"mtp.", text_prefix(case), "lm_head."}
    if case["family"] != "qwen3_next":
        prefixes.add("model.visual.")
    assert all(any(k.startswith(p) for p in prefixes) for k in tensors), "unexpected tensor prefix"
    assert len({k for k in tensors if k.startswith("model.visual.")}) == (
        0 if case["family"] == "qwen3_next" else len([k for k in sd1 if k.startswith("model.visual.")]))


# ----------------------------------------------------------------------------
# independent float64 reference: reads only config.json and model.safetensors
# ----------------------------------------------------------------------------

REF_TOL = 1e-4  # float64 reference vs transformers (float32)


class Reference:
    """The forward pass and the MTP layer written out from the published descriptions (and vLLM's
    qwen3_next.py / qwen3_5.py / *_mtp.py), in float64, from the folder's files only."""

    def __init__(self, folder: str, mistake: str | None = None):
        self.mistake = mistake  # one of MISTAKES: a plausible loader error, to show the fixture catches it
        with open(os.path.join(folder, "config.json")) as fh:
            raw = json.load(fh)
        self.qwen35 = "text_config" in raw
        c = raw["text_config"] if self.qwen35 else raw
        self.c = c
        tensors = load_safetensors(os.path.join(folder, "model.safetensors"))
        self.w = {k: v.to(torch.float64) for k, v in tensors.items()}
        self.prefix = "model.language_model." if self.qwen35 else "model."
        n = c["num_hidden_layers"]
        if "layer_types" in c:
            self.layer_types = c["layer_types"]
        else:
            k = c["full_attention_interval"]
            self.layer_types = ["linear_attention" if (i + 1) % k else "full_attention" for i in range(n)]
        rope = c.get("rope_parameters") or {}
        self.theta = rope.get("rope_theta", c.get("rope_theta"))
        self.partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor"))
        if mistake == "partial_rotary_from_top_level":  # the stale key transformers writes next to rope_parameters
            self.partial = c["partial_rotary_factor"]
        self.eps = c["rms_norm_eps"]
        self.hd = c["head_dim"]
        self.moe = c.get("num_experts", 0) > 0
        # Qwen3.5-MoE has no norm_topk_prob key: it always renormalises the top-k probabilities
        self.norm_topk = c.get("norm_topk_prob", True)

    def t(self, name):
        return self.w[name]

    def rms0(self, x, w):  # zero-centred RMSNorm
        scale = w if self.mistake == "norms_not_zero_centred" else 1.0 + w
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * scale

    def rope(self, x, pos):  # NeoX rotate-half on the first rotary_dim dims of each head; x [T, H, hd]
        rd = self.hd if self.mistake == "rope_full_head_dim" else int(self.hd * self.partial)
        inv = 1.0 / (self.theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
        ang = pos.to(torch.float64)[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        xr, xp = x[..., :rd], x[..., rd:]
        rot = torch.cat([-xr[..., rd // 2:], xr[..., : rd // 2]], -1)
        return torch.cat([xr * cos + rot * sin, xp], -1)

    def attention(self, p, x, pos):
        c, hd = self.c, self.hd
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        t = x.shape[0]
        qg = (x @ self.t(p + "self_attn.q_proj.weight").T).view(t, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, nh * hd)  # per head: hd query rows, then hd gate rows
        k = (x @ self.t(p + "self_attn.k_proj.weight").T).view(t, nkv, hd)
        v = (x @ self.t(p + "self_attn.v_proj.weight").T).view(t, nkv, hd)
        q = self.rope(self.rms0(q, self.t(p + "self_attn.q_norm.weight")), pos)
        k = self.rope(self.rms0(k, self.t(p + "self_attn.k_norm.weight")), pos)
        grp = nh // nkv
        k, v = k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).reshape(t, nh * hd)
        if self.mistake != "no_attention_output_gate":
            o = o * torch.sigmoid(gate)
        return o @ self.t(p + "self_attn.o_proj.weight").T

    def gated_deltanet(self, p, x):
        c = self.c
        hk, hv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                          c["linear_value_head_dim"])
        r, t = hv // hk, x.shape[0]
        if self.qwen35:  # separate projections, q / k / v each head-major
            qkv = x @ self.t(p + "linear_attn.in_proj_qkv.weight").T
            q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], -1)
            z = (x @ self.t(p + "linear_attn.in_proj_z.weight").T).view(t, hv, dv)
            b = x @ self.t(p + "linear_attn.in_proj_b.weight").T
            a = x @ self.t(p + "linear_attn.in_proj_a.weight").T
        elif self.mistake == "qkvz_read_flat":  # as if [q | k | v | z] were each head-major
            qkvz = x @ self.t(p + "linear_attn.in_proj_qkvz.weight").T
            q, k, v, z = qkvz.split([hk * dk, hk * dk, hv * dv, hv * dv], -1)
            ba = x @ self.t(p + "linear_attn.in_proj_ba.weight").T
            b, a, z = ba[:, :hv], ba[:, hv:], z.reshape(t, hv, dv)
        else:  # Qwen3-Next: grouped per key head [q dk | k dk | v r*dv | z r*dv] and [b r | a r]
            qkvz = (x @ self.t(p + "linear_attn.in_proj_qkvz.weight").T).view(t, hk, 2 * dk + 2 * r * dv)
            q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], -1)
            ba = (x @ self.t(p + "linear_attn.in_proj_ba.weight").T).view(t, hk, 2 * r)
            b, a = ba[..., :r].reshape(t, hv), ba[..., r:].reshape(t, hv)
            q, k, v, z = q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), z.reshape(t, hv, dv)
        mixed = torch.cat([q, k, v], -1)  # [T, C]: the causal depthwise conv runs over these channels
        w = self.t(p + "linear_attn.conv1d.weight")[:, 0]  # [C, K]
        kk = w.shape[1]
        padded = torch.cat([torch.zeros(kk - 1, mixed.shape[1], dtype=mixed.dtype), mixed], 0)
        conv = sum(padded[j: j + t] * w[:, j] for j in range(kk))
        conv = conv * torch.sigmoid(conv)  # silu
        q, k, v = conv.split([hk * dk, hk * dk, hv * dv], -1)
        q, k, v = q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv)
        q, k = q.repeat_interleave(r, 1), k.repeat_interleave(r, 1)  # value head h reads key head h // r
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(b)
        g = -torch.exp(self.t(p + "linear_attn.A_log")) * F.softplus(a + self.t(p + "linear_attn.dt_bias"))
        state = torch.zeros(hv, dk, dv, dtype=torch.float64)
        outs = []
        for i in range(t):
            state = state * torch.exp(g[i])[:, None, None]
            delta = (v[i] - torch.einsum("hk,hkv->hv", k[i], state)) * beta[i][:, None]
            state = state + k[i][:, :, None] * delta[:, None, :]
            outs.append(torch.einsum("hk,hkv->hv", q[i], state))
        o = torch.stack(outs)  # [T, Hv, dv]
        wn = self.t(p + "linear_attn.norm.weight") + (1.0 if self.mistake == "gated_norm_zero_centred" else 0.0)
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + self.eps) * wn
        o = o * (z * torch.sigmoid(z))  # weight as stored (not zero-centred), gated by silu(z)
        return o.reshape(t, hv * dv) @ self.t(p + "linear_attn.out_proj.weight").T

    def mlp(self, p, x):
        silu = lambda u: u * torch.sigmoid(u)  # noqa: E731
        return (silu(x @ self.t(p + "gate_proj.weight").T) * (x @ self.t(p + "up_proj.weight").T)) @ \
            self.t(p + "down_proj.weight").T

    def experts(self, p):
        if p + "mlp.experts.gate_up_proj" in self.w:  # fused: gate rows [:F], up rows [F:]
            gu, down = self.t(p + "mlp.experts.gate_up_proj"), self.t(p + "mlp.experts.down_proj")
            f = gu.shape[1] // 2
            return [(gu[e, :f], gu[e, f:], down[e]) for e in range(gu.shape[0])]
        n = self.c["num_experts"]
        return [tuple(self.t(f"{p}mlp.experts.{e}.{j}_proj.weight") for j in ("gate", "up", "down"))
                for e in range(n)]

    def ffn(self, p, x):
        if p + "mlp.gate.weight" not in self.w:
            return self.mlp(p + "mlp.", x)
        probs = torch.softmax(x @ self.t(p + "mlp.gate.weight").T, -1)
        top, idx = probs.topk(self.c["num_experts_per_tok"], -1)
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        experts = self.experts(p)
        out = torch.zeros_like(x)
        for i in range(x.shape[0]):
            for wgt, e in zip(top[i], idx[i]):
                g, u, d = experts[int(e)]
                out[i] += wgt * ((F.silu(x[i] @ g.T) * (x[i] @ u.T)) @ d.T)
        shared_gate = torch.sigmoid(x @ self.t(p + "mlp.shared_expert_gate.weight").T)
        return out + shared_gate * self.mlp(p + "mlp.shared_expert.", x)

    def layer(self, p, kind, x, pos):
        h = self.rms0(x, self.t(p + "input_layernorm.weight"))
        x = x + (self.attention(p, h, pos) if kind == "full_attention" else self.gated_deltanet(p, h))
        return x + self.ffn(p, self.rms0(x, self.t(p + "post_attention_layernorm.weight")))

    def forward(self, ids):
        x = self.t(self.prefix + "embed_tokens.weight")[ids]
        pos = torch.arange(ids.shape[0])
        for i, kind in enumerate(self.layer_types):
            x = self.layer(f"{self.prefix}layers.{i}.", kind, x, pos)
        hidden = self.rms0(x, self.t(self.prefix + "norm.weight"))
        return hidden @ self.t("lm_head.weight").T, x, hidden

    def mtp(self, prompt, hidden):
        e = self.t(self.prefix + "embed_tokens.weight")[prompt[1:]]
        if self.mistake == "mtp_zero_embedding_at_0":
            e = e.clone()
            e[0] = 0.0
        parts = [self.rms0(e, self.t("mtp.pre_fc_norm_embedding.weight")),
                 self.rms0(hidden[:-1], self.t("mtp.pre_fc_norm_hidden.weight"))]
        if self.mistake == "mtp_hidden_first":
            parts = parts[::-1]
        x = torch.cat(parts, -1) @ self.t("mtp.fc.weight").T
        y = self.layer("mtp.layers.0.", "full_attention", x, torch.arange(prompt.shape[0] - 1))
        return y, self.rms0(y, self.t("mtp.norm.weight")) @ self.t("lm_head.weight").T


MISTAKES = ("norms_not_zero_centred", "gated_norm_zero_centred", "qkvz_read_flat", "rope_full_head_dim",
            "partial_rotary_from_top_level", "no_attention_output_gate", "mtp_hidden_first", "mtp_prenorm_hidden",
            "mtp_zero_embedding_at_0")


@torch.no_grad()
def mistakes_caught(case: dict, folder: str, arrays: dict) -> dict[str, float]:
    """For each plausible loader mistake, by how much the reference then misses the golden logits
    (max over `logits` and `mtp_logits`); each must exceed 1e-2."""
    out = {}
    for mistake in MISTAKES:
        if mistake == "qkvz_read_flat" and case["family"] != "qwen3_next":
            continue
        if mistake == "partial_rotary_from_top_level" and case["style"] != "transformers":
            continue  # only the save_pretrained config has two disagreeing values
        ref = Reference(folder, mistake)
        prompt = torch.from_numpy(arrays["prompt"])
        logits, prenorm, hidden = ref.forward(prompt)
        _, mtp_logits = ref.mtp(prompt, prenorm if mistake == "mtp_prenorm_hidden" else hidden)
        diff = max(float((logits - torch.from_numpy(arrays["logits"]).double()).abs().max()),
                   float((mtp_logits - torch.from_numpy(arrays["mtp_logits"]).double()).abs().max()))
        assert diff > 1e-2, (mistake, diff)
        out[mistake] = round(diff, 3)
    return out


@torch.no_grad()
def reference_check(case: dict, folder: str, arrays: dict) -> float:
    """The float64 reference must reproduce every golden array within REF_TOL; returns the max diff."""
    ref = Reference(folder)
    if case["family"] == "qwen3_next":  # vLLM builds the MTP layer as layer 0: MoE unless 0 is MLP-only
        c = ref.c
        moe0 = 0 not in c.get("mlp_only_layers", []) and c["num_experts"] > 0 and 1 % c["decoder_sparse_step"] == 0
        assert moe0 == ("mtp.layers.0.mlp.gate.weight" in ref.w)
    prompt = torch.from_numpy(arrays["prompt"])
    greedy = torch.from_numpy(arrays["greedy"])
    logits, prenorm, hidden = ref.forward(torch.cat([prompt, greedy[:-1]]))
    t = prompt.shape[0]
    y, mtp_logits = ref.mtp(prompt, hidden[:t] if ref.mistake != "mtp_prenorm_hidden" else prenorm[:t])
    pairs = [(logits[:t], "logits"), (hidden[:t], "hidden"), (prenorm[:t], "hidden_prenorm"),
             (logits[t - 1:], "greedy_logits"), (y, "mtp_y"), (mtp_logits, "mtp_logits")]
    worst = 0.0
    for mine, key in pairs:
        diff = float((mine - torch.from_numpy(arrays[key]).to(torch.float64)).abs().max())
        assert diff <= REF_TOL, f"{key}: float64 reference differs by {diff}"
        worst = max(worst, diff)
    return worst


# ----------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------


@torch.no_grad()
def build_case(name: str, case: dict, seed: int, workdir: str):
    config = make_config(case)
    model, gen = new_model(case, config, seed)
    fam = FAMILIES[case["family"]]
    mtp = QwenMtp(text_model(model).config, fam["norm_cls"], fam["layer_cls"])
    randomize_(mtp, gen, qwen_init)
    mtp.eval()
    pgen = torch.Generator().manual_seed(seed + 7919)
    prompt = torch.randint(EOS_ID + 1, case["vocab_size"], (T_PROMPT,), generator=pgen, dtype=torch.int64)
    arrays, stats = record_golden(case, model, mtp, prompt, seed)
    tensors, sp_dir = checked_hub_tensors(case, model, mtp, workdir, name)
    return model, mtp, tensors, arrays, stats, sp_dir


def write_case(out_dir: str, name: str, case: dict, workdir: str) -> dict:
    (model, mtp, tensors, arrays, stats, sp_dir), seed, tries = draw_case(build_case, name, case, workdir)
    folder = os.path.join(out_dir, name)
    write_fixture_folder(folder, config_json(case, sp_dir), tensors, arrays)
    verify_folder(case, folder, model, mtp, arrays)
    stats["reference_max_diff"] = reference_check(case, folder, arrays)
    stats["mistakes_caught"] = mistakes_caught(case, folder, arrays)
    stats.update(seed=seed, tries=tries,
                 safetensors_bytes=os.path.getsize(os.path.join(folder, "model.safetensors")))
    return stats


def check_torch_fallback() -> None:
    """The Gated DeltaNet and causal-conv1d code must be transformers' torch fallback (no fla /
    causal_conv1d / hub kernels)."""
    for pkg in ("fla", "causal_conv1d", "kernels"):
        if importlib.util.find_spec(pkg) is not None:
            raise SystemExit(f"{pkg} is installed: the fixtures are made with the torch fallback only")
    for mod in (mnext, m35, m35moe):
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                   "causal_conv1d_update"):
            assert getattr(mod, fn).__module__ == mod.__name__, (mod.__name__, fn)


def main() -> None:
    args = parse_args_and_setup(__doc__.split("\n")[0], CASES)
    check_torch_fallback()
    write_cases(args, CASES, write_case, "")


if __name__ == "__main__":
    main()
