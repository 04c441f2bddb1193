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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import zipfile

import numpy as np
import torch
from torch import nn

import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GenerationConfig, Glm4MoeConfig, Glm4MoeForCausalLM, Qwen3MoeConfig
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import MtpModel
from transformers.models.glm4_moe.modeling_glm4_moe import (
    Glm4MoeDecoderLayer,
    Glm4MoeRMSNorm,
    Glm4MoeRotaryEmbedding,
    Glm4MoeTopkRouter,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

EXPECTED_VERSIONS = {"transformers": "5.17.0", "torch": "2.13.0"}

T_PROMPT = 12  # prompt length
G_NEW = 16  # greedy tokens generated
ROUTER_MARGIN = 1e-4  # min gap between the last chosen and first rejected router candidate
LOGIT_MARGIN = 1e-3  # min top-1 / top-2 gap of every argmax the fixtures pin down
MAX_TRIES = 200

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


class GoldenCheckFailed(Exception):
    """A draw whose routing / argmax decisions are too close to a tie."""


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def save_npz_deterministic(path: str, arrays: dict[str, np.ndarray]) -> None:
    """np.savez equivalent whose zip entries carry a fixed timestamp (byte-reproducible)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            with zf.open(info, "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, np.require(arrays[name], requirements='C'), allow_pickle=False)


def init_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random value for one parameter / persistent buffer, chosen by its (module-relative) name."""
    randn = lambda: torch.randn(shape, generator=gen, dtype=torch.float32)  # noqa: E731
    if name.endswith("e_score_correction_bias"):
        return torch.rand(shape, generator=gen, dtype=torch.float32) * 0.2 - 0.1  # U[-0.1, 0.1]
    if "norm" in name:  # input/post_attention_layernorm, q/k_norm, model.norm, enorm, hnorm, shared_head norm
        return 1.0 + 0.1 * randn()
    if name.endswith(".bias"):
        return 0.05 * randn()
    if "embed" in name:
        return 0.5 * randn()
    if name.endswith("mlp.gate.weight"):  # router
        return 0.15 * randn()
    return 0.1 * randn()  # every other linear (attention, MLPs, experts, eh_proj, heads)


@torch.no_grad()
def randomize_(module: nn.Module, gen: torch.Generator) -> None:
    """Fill every parameter and persistent buffer of `module`, in sorted-name order."""
    state = module.state_dict()
    for name in sorted(state):
        tensor = state[name]
        tensor.copy_(init_value(name, tuple(tensor.shape), gen))


def fused_to_hub(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """transformers 5.x in-memory layout -> hub layout.

    ``mlp.experts.gate_up_proj`` [E, 2F, D] becomes ``mlp.experts.{e}.gate_proj.weight`` = rows [:F] and
    ``mlp.experts.{e}.up_proj.weight`` = rows [F:] (the inverse of transformers' MergeModulelist(dim=0) +
    Concatenate(dim=1) load conversion); ``mlp.experts.down_proj`` [E, D, F] becomes
    ``mlp.experts.{e}.down_proj.weight``.  Everything else keeps its name.
    """
    out = {}
    for key, value in state.items():
        value = value.detach().to(torch.float32).contiguous()
        if key.endswith("mlp.experts.gate_up_proj"):
            base = key[: -len("gate_up_proj")]
            f = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}{base}{e}.gate_proj.weight"] = value[e, :f].clone().contiguous()
                out[f"{prefix}{base}{e}.up_proj.weight"] = value[e, f:].clone().contiguous()
        elif key.endswith("mlp.experts.down_proj"):
            base = key[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{prefix}{base}{e}.down_proj.weight"] = value[e].clone().contiguous()
        else:
            out[prefix + key] = value.clone()
    return out


def load_safetensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """Per-row gap between the largest and second-largest entry."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return top[..., 0] - top[..., 1]


class RouterMonitor:
    """Forward hook on Glm4MoeTopkRouter: records how far every routing decision is from a tie.

    Re-derives the choice the way the HF router does (sigmoid scores + e_score_correction_bias, group score =
    sum of the top-2 corrected scores of each group, keep topk_group groups, mask the rest, top-k) and asserts it
    picked the same experts as the router itself.
    """

    def __init__(self):
        self.min_margin = float("inf")
        self.calls = 0

    def __call__(self, module: Glm4MoeTopkRouter, args, output):
        _, _, topk_indices = output
        x = args[0].reshape(-1, module.hidden_dim).float()
        scores = torch.sigmoid(x @ module.weight.float().t())
        corrected = scores + module.e_score_correction_bias
        n_tok = corrected.shape[0]
        per_group = module.num_experts // module.num_group
        grouped = corrected.view(n_tok, module.num_group, per_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        margins = []
        if module.topk_group < module.num_group:
            gs = group_scores.sort(dim=-1, descending=True).values
            margins.append(gs[:, module.topk_group - 1] - gs[:, module.topk_group])
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(module.topk_group, dim=-1).indices, True)
        keep = keep[:, :, None].expand(-1, -1, per_group).reshape(n_tok, module.num_experts)
        masked = corrected.masked_fill(~keep, float("-inf"))
        ranked = masked.sort(dim=-1, descending=True)
        k = module.top_k
        if module.topk_group * per_group > k:
            margins.append(ranked.values[:, k - 1] - ranked.values[:, k])
        mine = ranked.indices[:, :k].sort(-1).values
        theirs = topk_indices.reshape(n_tok, k).sort(-1).values
        if not torch.equal(mine, theirs):
            raise AssertionError("re-derived routing disagrees with Glm4MoeTopkRouter")
        for m in margins:
            self.min_margin = min(self.min_margin, float(m.min()))
        self.calls += 1


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


class MtpWeights(nn.Module):
    """Holder for the appended MTP layer's weights, in transformers' own module classes."""

    def __init__(self, config: Glm4MoeConfig, own_embed_and_head: bool):
        super().__init__()
        d = config.hidden_size
        self.enorm = Glm4MoeRMSNorm(d, eps=config.rms_norm_eps)
        self.hnorm = Glm4MoeRMSNorm(d, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.layer = Glm4MoeDecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.shared_head_norm = Glm4MoeRMSNorm(d, eps=config.rms_norm_eps)
        if own_embed_and_head:
            self.embed_tokens = nn.Embedding(config.vocab_size, d)
            self.shared_head_head = nn.Linear(d, config.vocab_size, bias=False)

    def hub_tensors(self, num_hidden_layers: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{num_hidden_layers}."
        out = {
            p + "enorm.weight": self.enorm.weight,
            p + "hnorm.weight": self.hnorm.weight,
            p + "eh_proj.weight": self.eh_proj.weight,
            p + "shared_head.norm.weight": self.shared_head_norm.weight,
        }
        if hasattr(self, "embed_tokens"):
            out[p + "embed_tokens.weight"] = self.embed_tokens.weight
            out[p + "shared_head.head.weight"] = self.shared_head_head.weight
        out = {k: v.detach().clone().contiguous() for k, v in out.items()}
        out.update(fused_to_hub(self.layer.state_dict(), p))
        return out


@torch.no_grad()
def run_mtp(model, mtp: MtpWeights, embed: nn.Module, head: nn.Module, prompt, hidden, zero_first: bool = True):
    """Teacher-forced MTP over anchors i = 0..T-2 (only the concat / projection wiring is hand-written)."""
    config = model.config
    t = prompt.shape[0]
    e = embed(prompt[1:])  # token i+1 for anchor i
    anchor_pos = torch.arange(t - 1)
    if zero_first:
        e = torch.where((anchor_pos == 0)[:, None], torch.zeros_like(e), e)  # zeroed at anchor position 0
    h = hidden[: t - 1]
    x = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(h)], dim=-1))[None]
    position_ids = anchor_pos[None]
    rotary = Glm4MoeRotaryEmbedding(config)
    position_embeddings = rotary(x, position_ids)
    mask = create_causal_mask(
        config=config, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=position_ids
    )
    y = mtp.layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
    logits = head(mtp.shared_head_norm(y))
    return e, y[0], logits[0]


@torch.no_grad()
def build_glm_case(name: str, case: dict, seed: int, workdir: str):
    """One draw of a case. Returns (config dict, tensors, arrays) or raises GoldenCheckFailed."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    config = make_config(case)
    model = Glm4MoeForCausalLM(config)
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    model.eval()
    assert model.config._attn_implementation == "eager"
    assert model.config._experts_implementation == "eager"
    randomize_(model, gen)

    own = case["mtp_style"] == "glm45"
    mtp = MtpWeights(model.config, own_embed_and_head=own)
    randomize_(mtp, gen)
    mtp.eval()
    if own:
        assert not torch.equal(mtp.embed_tokens.weight, model.model.embed_tokens.weight)
        assert not torch.equal(mtp.shared_head_head.weight, model.lm_head.weight)
        mtp_embed, mtp_head = mtp.embed_tokens, mtp.shared_head_head
    else:
        mtp_embed, mtp_head = model.model.embed_tokens, model.lm_head

    pad, eos = special_ids(case["vocab_size"])
    pgen = torch.Generator().manual_seed(seed + 7919)
    prompt = torch.randint(0, case["vocab_size"] - len(eos), (T_PROMPT,), generator=pgen, dtype=torch.int64)

    monitor = RouterMonitor()
    handles = [m.register_forward_hook(monitor) for m in list(model.modules()) + list(mtp.modules())
               if isinstance(m, Glm4MoeTopkRouter)]

    # 1. full forward, no cache
    captured = {}
    h_norm = model.model.norm.register_forward_hook(lambda m, a, o: captured.__setitem__("prenorm", a[0]))
    out = model(prompt[None], use_cache=False, output_hidden_states=True)
    h_norm.remove()
    logits = out.logits[0]
    hidden = out.hidden_states[-1][0]
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    assert torch.equal(hidden, model.model.norm(captured["prenorm"])[0]), "hidden_states[-1] is not post-norm"
    assert not torch.allclose(hidden, captured["prenorm"][0])

    # 2. greedy generation (cache on, no early stop)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad
    gcfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=G_NEW,
        min_new_tokens=G_NEW,
        eos_token_id=None,
        pad_token_id=pad,
        output_logits=True,
        return_dict_in_generate=True,
    )
    gout = model.generate(prompt[None], generation_config=gcfg)
    greedy = gout.sequences[0, T_PROMPT:]
    assert greedy.shape[0] == G_NEW
    greedy_logits = torch.cat([s for s in gout.logits], dim=0)  # [G, V], raw (unprocessed) logits
    assert torch.equal(greedy_logits.argmax(-1), greedy)

    # same tokens when recomputed without a cache
    ids = prompt.clone()
    for g in range(G_NEW):
        step = model(ids[None], use_cache=False).logits[0, -1]
        if int(step.argmax()) != int(greedy[g]):
            raise GoldenCheckFailed(f"no-cache greedy differs at step {g}")
        ids = torch.cat([ids, step.argmax()[None]])

    # 3. teacher-forced MTP
    _, mtp_y, mtp_logits = run_mtp(model, mtp, mtp_embed, mtp_head, prompt, hidden)
    # same without zeroing the anchor-0 embedding (what transformers' own generate(use_mtp=True) feeds)
    _, _, mtp_logits_nozero = run_mtp(model, mtp, mtp_embed, mtp_head, prompt, hidden, zero_first=False)
    for hnd in handles:
        hnd.remove()

    # ---- tie checks ----
    expected_router_calls = (config.num_hidden_layers - config.first_k_dense_replace) * (1 + G_NEW + G_NEW) + 2
    assert monitor.calls == expected_router_calls, (monitor.calls, expected_router_calls)
    gap_greedy = float(top2_gap(greedy_logits).min())
    gap_mtp = float(torch.minimum(top2_gap(mtp_logits), top2_gap(mtp_logits_nozero)).min())
    if monitor.min_margin <= ROUTER_MARGIN:
        raise GoldenCheckFailed(f"router margin {monitor.min_margin:.2e}")
    if gap_greedy <= LOGIT_MARGIN:
        raise GoldenCheckFailed(f"greedy top-2 gap {gap_greedy:.2e}")
    if gap_mtp <= LOGIT_MARGIN:
        raise GoldenCheckFailed(f"mtp top-2 gap {gap_mtp:.2e}")
    if any(int(t) in eos for t in greedy):
        raise GoldenCheckFailed("greedy output contains an eos id")

    # ---- files ----
    target = fused_to_hub(model.state_dict(), "")
    # the hand-written split must equal what transformers' save_pretrained writes for the target
    sp_dir = os.path.join(workdir, f"{name}_save_pretrained")
    model.save_pretrained(sp_dir)
    saved = load_safetensors(os.path.join(sp_dir, "model.safetensors"))
    assert sorted(saved) == sorted(target), sorted(set(saved) ^ set(target))
    for k in saved:
        assert saved[k].dtype == torch.float32 and torch.equal(saved[k], target[k]), k
    mtp_tensors = mtp.hub_tensors(config.num_hidden_layers)
    assert mtp_tensors.keys().isdisjoint(target.keys())
    tensors = {**target, **mtp_tensors}
    if case["config_style"] == "hub":
        config_json = hub_config_json(case)
    else:
        with open(os.path.join(sp_dir, "config.json")) as fh:
            config_json = json.load(fh)

    arrays = {
        "prompt": prompt.numpy().astype(np.int64),
        "logits": logits.numpy().astype(np.float32),
        "greedy": greedy.numpy().astype(np.int64),
        "greedy_logits": greedy_logits.numpy().astype(np.float32),
        "hidden": hidden.numpy().astype(np.float32),
        "hidden_prenorm": captured["prenorm"][0].numpy().astype(np.float32),
        "mtp_logits": mtp_logits.numpy().astype(np.float32),
        "mtp_y": mtp_y.numpy().astype(np.float32),
        "mtp_logits_nozero": mtp_logits_nozero.numpy().astype(np.float32),
        "seed": np.array(seed, dtype=np.int64),
    }
    stats = dict(router_margin=monitor.min_margin, greedy_gap=gap_greedy, mtp_gap=gap_mtp)
    return model, mtp, config_json, tensors, arrays, stats


@torch.no_grad()
def verify_folder(folder: str, model, mtp: MtpWeights, case: dict, arrays: dict) -> None:
    """Reload the written folder with transformers' own loaders and compare."""
    prompt = torch.from_numpy(arrays["prompt"])
    n_layers = case["num_hidden_layers"]
    m2, info = Glm4MoeForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32,
        output_loading_info=True,
    )
    m2.eval()
    assert not info["missing_keys"], info["missing_keys"]
    assert all(k.startswith(f"model.layers.{n_layers}.") for k in info["unexpected_keys"]), info["unexpected_keys"]
    rp = m2.config.rope_parameters
    assert rp["rope_theta"] == case["rope_theta"] and rp["partial_rotary_factor"] == case["partial_rotary_factor"], rp
    assert m2.config.num_nextn_predict_layers == 1
    sd1, sd2 = model.state_dict(), m2.state_dict()
    assert sorted(sd1) == sorted(sd2)
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    out = m2(prompt[None], use_cache=False, output_hidden_states=True)
    assert np.array_equal(out.logits[0].numpy(), arrays["logits"])
    assert np.array_equal(out.hidden_states[-1][0].numpy(), arrays["hidden"])

    # MTP layer through transformers' own MtpModel loader (hub names -> MtpLayer incl. fused experts)
    m2._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n_layers}\..*"]
    hf_mtp = MtpModel.from_pretrained(m2)
    hf_mtp.set_attn_implementation("eager")
    hf_mtp.set_experts_implementation("eager")
    hf_mtp.eval()
    layer = hf_mtp.layers[0]
    for mine, theirs in [
        (mtp.enorm.weight, layer.enorm.weight),
        (mtp.hnorm.weight, layer.hnorm.weight),
        (mtp.eh_proj.weight, layer.eh_proj.weight),
        (mtp.shared_head_norm.weight, layer.post_norm.weight),
    ]:
        assert torch.equal(mine, theirs)
    sd_mine, sd_theirs = mtp.layer.state_dict(), layer.mtp_block.state_dict()
    assert sorted(sd_mine) == sorted(sd_theirs)
    for k in sd_mine:
        assert torch.equal(sd_mine[k], sd_theirs[k]), k
    # HF's MtpModel always takes embedding / head from the main model; use the file's own ones when present
    tensors = load_safetensors(os.path.join(folder, "model.safetensors"))
    p = f"model.layers.{n_layers}."
    if case["mtp_style"] == "glm45":
        embed_w, head_w = tensors[p + "embed_tokens.weight"], tensors[p + "shared_head.head.weight"]
        assert not torch.equal(embed_w, tensors["model.embed_tokens.weight"])
        assert not torch.equal(head_w, tensors["lm_head.weight"])
    else:
        assert p + "embed_tokens.weight" not in tensors and p + "shared_head.head.weight" not in tensors
        embed_w, head_w = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    t = prompt.shape[0]
    e = nn.functional.embedding(prompt[1:], embed_w)
    e[0] = 0.0
    hidden = torch.from_numpy(arrays["hidden"])[: t - 1]
    pos = torch.arange(t - 1)[None]
    pe = hf_mtp.rotary_emb(e[None], position_ids=pos)
    mask = create_causal_mask(
        config=hf_mtp.config, inputs_embeds=e[None], attention_mask=None, past_key_values=None, position_ids=pos
    )
    y_normed = layer(e[None], hidden[None], position_embeddings=pe, attention_mask=mask, position_ids=pos,
                     past_key_values=None)
    hf_logits = nn.functional.linear(y_normed[0], head_w)
    diff = float((hf_logits - torch.from_numpy(arrays["mtp_logits"])).abs().max())
    assert diff <= 1e-5, f"MtpModel reproduction differs by {diff}"
    return diff


def write_glm_case(out_dir: str, name: str, case: dict, workdir: str) -> dict:
    last_err = None
    for attempt in range(MAX_TRIES):
        seed = case["seed"] + attempt
        try:
            model, mtp, config_json, tensors, arrays, stats = build_glm_case(name, case, seed, workdir)
            break
        except GoldenCheckFailed as err:
            last_err = err
    else:
        raise RuntimeError(f"{name}: no seed passed the tie checks ({last_err})")
    folder = os.path.join(out_dir, f"glm4_moe_{name}")
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(config_json, fh, indent=2)
        fh.write("\n")
    save_file({k: tensors[k] for k in sorted(tensors)}, os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})
    save_npz_deterministic(os.path.join(folder, "golden.npz"), arrays)
    stats["hf_mtp_model_max_abs_diff"] = verify_folder(folder, model, mtp, case, arrays)
    stats.update(seed=seed, tries=attempt + 1)
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)),
                        help="output directory (default: the directory of this script)")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()

    versions = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}
    if versions != EXPECTED_VERSIONS:
        print(f"warning: fixtures were generated with {EXPECTED_VERSIONS}, running {versions}")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.cases:
            stats = write_glm_case(args.out, name, CASES[name], workdir)
            print(f"glm4_moe_{name}: {stats}")
    stats = write_qwen3_block(args.out)
    print(f"qwen3_moe_block: {stats}")


if __name__ == "__main__":
    main()
