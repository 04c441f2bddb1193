"""Build the DeepSeek Sparse Attention golden fixtures (DeepSeek-V3.2, GLM-5) with HF transformers.

DeepSeek-V3.2 (``deepseek_v32``) is DeepSeek-V3 with a lightning indexer per MLA layer that picks,
for each query, the ``index_topk`` cached tokens it attends to; GLM-5 (``glm_moe_dsa``) is the same
over GLM's MoE, with interleaved RoPE in its indexer and layers that may reuse the previous
layer's selection (``indexer_types`` "shared"). Tiny random models of both are run by
transformers' own ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM`` (eager attention and
experts, float32, CPU) with ``index_topk`` small and prompts of 40 tokens, so the selection binds
on almost every query. For every case it writes ``tests/golden/<family>_<case>/``:

* ``config.json``: ``deepseek_v32_exp`` in the published DeepSeek-V3.2-Exp style (DeepSeek-V3 keys,
  ``rope_scaling`` yarn, ``index_n_heads`` / ``index_head_dim`` / ``index_topk``);
  ``glm_moe_dsa_glm5`` in the published GLM-5 style (``rope_parameters``, ``rope_interleave``,
  ``indexer_rope_interleave``, ``first_k_dense_replace``); ``deepseek_v32_saved`` and
  ``glm_moe_dsa_shared`` exactly as transformers 5.17 ``save_pretrained`` writes them
  (``layer_types``, ``mlp_layer_types``, ``indexer_types`` with a "shared" layer for GLM).
* ``model.safetensors``: every tensor under the hub names, the indexer's
  ``self_attn.indexer.{wq_b, wk, weights_proj}.weight`` and ``self_attn.indexer.k_norm.{weight,
  bias}`` included (none on a shared layer), plus the MTP layer at
  ``model.layers.{num_hidden_layers}.`` with its own indexer.
* ``golden.npz``: the arrays of the other fixtures (tests/golden/README.md).

Beyond the checks of _golden_common (routing and argmax margins, cached greedy equal to
uncached, save_pretrained names, bit-identical reload), every indexer call without a cache
(the prompt forward, the uncached greedy re-run over every generated token, the MTP layer) is
re-derived here and must pick the same tokens with a gap of at least INDEX_MARGIN between the
last selected and the first rejected score; the sparse model's logits must differ from the
same weights with index_topk past the prompt (dense), so a loader that ignores the selection
fails. A draw that fails a margin is redrawn with the next seed.

Re-run from the repository root with a Python that has torch + transformers::

    python tests/golden/make_dsa.py            # writes into tests/golden/
    python tests/golden/make_dsa.py --out DIR  # writes elsewhere
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

import transformers
from transformers import (DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig,
                          GlmMoeDsaForCausalLM)
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _golden_common as common  # noqa: E402  (shared with the other fixtures)
from _golden_common import (  # noqa: E402
    GoldenCheckFailed,
    MtpWeights,
    checked_hub_tensors,
    draw_case,
    draw_prompt,
    init_value,
    load_safetensors,
    new_model,
    parse_args_and_setup,
    randomize_,
    record_golden,
    reload_target,
    write_fixture_folder,
)

# Prompts long enough that index_topk (6..12) binds on most queries; with the 16 greedy tokens
# they fit test_golden's engines (max_model_len 64).
common.T_PROMPT = 40
INDEX_MARGIN = 1e-4  # min gap between the last selected and the first rejected index score
DENSE_DIFF = 1e-2  # the sparse logits must differ from the dense ones by more than this

BOS_ID, EOS_ID = 0, 1

FAMILIES = {
    "deepseek_v32": dict(config_cls=DeepseekV32Config, model_cls=DeepseekV32ForCausalLM, mod=v32,
                         prefix="DeepseekV32", interleave=False),
    "glm_moe_dsa": dict(config_cls=GlmMoeDsaConfig, model_cls=GlmMoeDsaForCausalLM, mod=glm,
                        prefix="GlmMoeDsa", interleave=True),
}

YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 0.8, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64, "type": "yarn"}

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
              qk_rope_head_dim=8, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
              initializer_range=0.02, tie_word_embeddings=False, use_cache=True)

CASES = {
    "deepseek_v32_exp": dict(
        family="deepseek_v32", style="hub", vocab_size=128, num_hidden_layers=3, dense_layers=1,
        q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, intermediate_size=48,
        moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=YARN, max_position_embeddings=256,
        index_n_heads=8, index_head_dim=16, index_topk=8, indexer_types=None,
        own_embed_and_head=True, seed=11000),
    "deepseek_v32_saved": dict(
        family="deepseek_v32", style="transformers", vocab_size=144, num_hidden_layers=2,
        dense_layers=1, q_lora_rank=24, qk_nope_head_dim=12, v_head_dim=8, intermediate_size=24,
        moe_intermediate_size=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, n_shared_experts=1, routed_scaling_factor=1.5, rms_norm_eps=1e-6,
        rope_theta=5e4, rope_scaling=None, max_position_embeddings=256,
        index_n_heads=6, index_head_dim=12, index_topk=12, indexer_types=None,
        own_embed_and_head=True, seed=12000),
    "glm_moe_dsa_glm5": dict(
        family="glm_moe_dsa", style="hub", vocab_size=128, num_hidden_layers=3, dense_layers=1,
        q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16, intermediate_size=48,
        moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
        topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, rms_norm_eps=1e-5,
        rope_theta=1e6, rope_scaling=None, max_position_embeddings=256,
        index_n_heads=8, index_head_dim=16, index_topk=10, indexer_types=None,
        own_embed_and_head=False, seed=13000),
    "glm_moe_dsa_shared": dict(
        family="glm_moe_dsa", style="transformers", vocab_size=144, num_hidden_layers=4,
        dense_layers=2, q_lora_rank=32, qk_nope_head_dim=12, v_head_dim=8, intermediate_size=24,
        moe_intermediate_size=4, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
        topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, rms_norm_eps=1e-5,
        rope_theta=5e4, rope_scaling=None, max_position_embeddings=256,
        index_n_heads=8, index_head_dim=16, index_topk=6,
        indexer_types=["full", "shared", "full", "shared"],
        own_embed_and_head=True, seed=14000),
}


class GlmMtpDecoderLayer(glm.GlmMoeDsaDecoderLayer):
    """GLM-5's decoder layer as an MTP block: it runs its own indexer (no previous layer
    hands it a selection) and returns the hidden states alone (the layer also returns its
    top-k for the next layer)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)[0]


def init_dsa(name: str, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """_golden_common's draw, but the index key norm's bias near zero (it is a LayerNorm bias,
    not a norm weight)."""
    if name.endswith("k_norm.bias"):
        return 0.1 * torch.randn(shape, generator=gen, dtype=torch.float32)
    return init_value(name, shape, gen)


def mlp_layer_types(case: dict, extra: int = 0) -> list[str]:
    n, dense = case["num_hidden_layers"], case["dense_layers"]
    return ["dense"] * dense + ["sparse"] * (n - dense + extra)


def rope_parameters(case: dict) -> dict:
    rs = case["rope_scaling"]
    if rs is None:
        return {"rope_type": "default", "rope_theta": float(case["rope_theta"])}
    return {"rope_type": rs["type"], "rope_theta": float(case["rope_theta"]),
            "factor": float(rs["factor"]),
            "original_max_position_embeddings": rs["original_max_position_embeddings"],
            "beta_fast": float(rs["beta_fast"]), "beta_slow": float(rs["beta_slow"]),
            "mscale": float(rs["mscale"]), "mscale_all_dim": float(rs["mscale_all_dim"])}


def make_config(case: dict, index_topk=None):
    fam = FAMILIES[case["family"]]
    kw = dict(
        **COMMON, vocab_size=case["vocab_size"], num_hidden_layers=case["num_hidden_layers"],
        mlp_layer_types=mlp_layer_types(case), first_k_dense_replace=case["dense_layers"],
        q_lora_rank=case["q_lora_rank"], qk_nope_head_dim=case["qk_nope_head_dim"],
        v_head_dim=case["v_head_dim"], intermediate_size=case["intermediate_size"],
        moe_intermediate_size=case["moe_intermediate_size"],
        n_routed_experts=case["n_routed_experts"],
        num_experts_per_tok=case["num_experts_per_tok"], n_group=case["n_group"],
        topk_group=case["topk_group"], n_shared_experts=case["n_shared_experts"],
        routed_scaling_factor=case["routed_scaling_factor"], norm_topk_prob=True,
        rms_norm_eps=case["rms_norm_eps"], max_position_embeddings=case["max_position_embeddings"],
        rope_parameters=rope_parameters(case), index_n_heads=case["index_n_heads"],
        index_head_dim=case["index_head_dim"],
        index_topk=case["index_topk"] if index_topk is None else index_topk,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=None, dtype="float32")
    if case["indexer_types"] is not None:
        kw["indexer_types"] = list(case["indexer_types"])
    return fam["config_cls"](**kw)


def hub_config_json(case: dict) -> dict:
    """config.json with the keys of the published DeepSeek-V3.2-Exp / GLM-5 config.json."""
    t = case
    if case["family"] == "deepseek_v32":
        out = {
            "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
            "ep_size": 1, "first_k_dense_replace": t["dense_layers"], "hidden_act": "silu",
            "hidden_size": COMMON["hidden_size"], "index_head_dim": t["index_head_dim"],
            "index_n_heads": t["index_n_heads"], "index_topk": t["index_topk"],
            "initializer_range": 0.02, "intermediate_size": t["intermediate_size"],
            "kv_lora_rank": COMMON["kv_lora_rank"],
            "max_position_embeddings": t["max_position_embeddings"], "model_type": "deepseek_v32",
            "moe_intermediate_size": t["moe_intermediate_size"], "moe_layer_freq": 1,
            "n_group": t["n_group"], "n_routed_experts": t["n_routed_experts"],
            "n_shared_experts": t["n_shared_experts"], "norm_topk_prob": True,
            "num_attention_heads": COMMON["num_attention_heads"],
            "num_experts_per_tok": t["num_experts_per_tok"],
            "num_hidden_layers": t["num_hidden_layers"],
            "num_key_value_heads": COMMON["num_key_value_heads"], "num_nextn_predict_layers": 1,
            "q_lora_rank": t["q_lora_rank"], "qk_nope_head_dim": t["qk_nope_head_dim"],
            "qk_rope_head_dim": COMMON["qk_rope_head_dim"], "rms_norm_eps": t["rms_norm_eps"],
            "rope_scaling": None if t["rope_scaling"] is None else dict(t["rope_scaling"]),
            "rope_theta": t["rope_theta"], "routed_scaling_factor": t["routed_scaling_factor"],
            "scoring_func": "sigmoid", "tie_word_embeddings": False,
            "topk_group": t["topk_group"], "topk_method": "noaux_tc", "torch_dtype": "float32",
            "transformers_version": transformers.__version__, "use_cache": True,
            "v_head_dim": t["v_head_dim"], "vocab_size": t["vocab_size"],
        }
        return out
    qk = t["qk_nope_head_dim"] + COMMON["qk_rope_head_dim"]
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": BOS_ID, "dtype": "float32",
        "eos_token_id": EOS_ID, "ep_size": 1, "first_k_dense_replace": t["dense_layers"],
        "head_dim": COMMON["qk_rope_head_dim"], "hidden_act": "silu",
        "hidden_size": COMMON["hidden_size"], "index_head_dim": t["index_head_dim"],
        "index_n_heads": t["index_n_heads"], "index_topk": t["index_topk"],
        "indexer_rope_interleave": True, "initializer_range": 0.02,
        "intermediate_size": t["intermediate_size"], "kv_lora_rank": COMMON["kv_lora_rank"],
        "max_position_embeddings": t["max_position_embeddings"], "model_type": "glm_moe_dsa",
        "moe_intermediate_size": t["moe_intermediate_size"], "moe_layer_freq": 1,
        "n_group": t["n_group"], "n_routed_experts": t["n_routed_experts"],
        "n_shared_experts": t["n_shared_experts"], "norm_topk_prob": True,
        "num_attention_heads": COMMON["num_attention_heads"],
        "num_experts_per_tok": t["num_experts_per_tok"],
        "num_hidden_layers": t["num_hidden_layers"],
        "num_key_value_heads": COMMON["num_key_value_heads"], "num_nextn_predict_layers": 1,
        "pad_token_id": None, "pretraining_tp": 1, "q_lora_rank": t["q_lora_rank"],
        "qk_head_dim": qk, "qk_nope_head_dim": t["qk_nope_head_dim"],
        "qk_rope_head_dim": COMMON["qk_rope_head_dim"], "rms_norm_eps": t["rms_norm_eps"],
        "rope_interleave": True,
        "rope_parameters": {"rope_theta": t["rope_theta"], "rope_type": "default"},
        "routed_scaling_factor": t["routed_scaling_factor"], "scoring_func": "sigmoid",
        "tie_word_embeddings": False, "topk_group": t["topk_group"], "topk_method": "noaux_tc",
        "transformers_version": transformers.__version__, "use_cache": True,
        "v_head_dim": t["v_head_dim"], "vocab_size": t["vocab_size"],
    }


class IndexerMonitor:
    """Forward hook (with kwargs) on the indexers: for every call without a cache, re-derives
    the index scores as the module computes them, checks it picked the same tokens, and
    records the smallest gap between the last selected and the first rejected score of a
    query that sees more than index_topk tokens."""

    def __init__(self, fam: dict):
        self.rope = (fam["mod"].apply_rotary_pos_emb_interleave if fam["interleave"]
                     else fam["mod"].apply_rotary_pos_emb)
        self.min_margin = float("inf")
        self.calls = self.bound = 0

    @torch.no_grad()
    def __call__(self, module, args, kwargs, output):
        names = ("hidden_states", "q_resid", "position_embeddings", "attention_mask")
        got = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
        if kwargs.get("past_key_values") is not None or (len(args) > 5 and args[5] is not None):
            return  # cached calls: their selections are re-checked by the uncached re-runs
        x, q_resid = got["hidden_states"], got["q_resid"]
        cos, sin = got["position_embeddings"]
        b, s, _ = x.shape
        e = module.qk_rope_head_dim
        q = module.wq_b(q_resid).view(b, s, module.n_heads, module.head_dim)
        k = module.k_norm(module.wk(x)).unsqueeze(2)
        q_rot, k_rot = self.rope(q[..., :e], k[..., :e], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., e:]], dim=-1)
        k = torch.cat([k_rot, k[..., e:]], dim=-1)[:, :, 0]
        dots = torch.einsum("bthd,bsd->bths", q.double(), k.double()).clamp_min(0)
        w = module.weights_proj(x).double() * module.n_heads ** -0.5 * module.softmax_scale
        scores = torch.einsum("bth,bths->bts", w, dots)
        visible = torch.ones(s, s, dtype=torch.bool).tril()[None]
        scores = scores.masked_fill(~visible, float("-inf"))
        topk = min(module.index_topk, s)
        ranked = scores.sort(dim=-1, descending=True)
        mine = ranked.indices[..., :topk].sort(-1).values
        theirs = output.long().sort(-1).values
        rows = visible.sum(-1).expand(b, s) > topk  # queries the selection binds on
        if not torch.equal(mine[rows], theirs[rows]):
            raise GoldenCheckFailed("re-derived index selection disagrees (f32 vs f64 near-tie)")
        if rows.any():
            gap = ranked.values[..., topk - 1] - ranked.values[..., topk]
            self.min_margin = min(self.min_margin, float(gap[rows].min()))
            self.bound += int(rows.sum())
        self.calls += 1


@torch.no_grad()
def build_case(name: str, case: dict, seed: int, workdir: str):
    fam = FAMILIES[case["family"]]
    config = make_config(case)
    model, gen = new_model(fam["model_cls"], config, seed, init_dsa)
    mtp_config = copy.deepcopy(model.config)
    mtp_config.mlp_layer_types = mlp_layer_types(case, extra=1)
    if case["family"] == "glm_moe_dsa":
        mtp_config.indexer_types = list(model.config.indexer_types) + ["full"]
    mod = fam["mod"]
    layer_cls = (GlmMtpDecoderLayer if case["family"] == "glm_moe_dsa"
                 else v32.DeepseekV32DecoderLayer)
    mtp = MtpWeights(mtp_config, getattr(mod, fam["prefix"] + "RMSNorm"), layer_cls,
                     own_embed_and_head=case["own_embed_and_head"])
    randomize_(mtp, gen, init_dsa)
    mtp.eval()
    embed = mtp.embed_tokens if case["own_embed_and_head"] else model.model.embed_tokens
    head = mtp.shared_head_head if case["own_embed_and_head"] else model.lm_head
    prompt = draw_prompt(seed, EOS_ID + 1, case["vocab_size"])

    monitor = IndexerMonitor(fam)
    indexer_cls = getattr(mod, fam["prefix"] + "Indexer")
    hooks = [m.register_forward_hook(monitor, with_kwargs=True)
             for m in list(model.modules()) + list(mtp.modules()) if isinstance(m, indexer_cls)]
    try:
        arrays, stats = record_golden(model, mtp, embed, head, prompt, EOS_ID,
                                      getattr(mod, fam["prefix"] + "TopkRouter"), seed)
    finally:
        for h in hooks:
            h.remove()
    if monitor.min_margin <= INDEX_MARGIN:
        raise GoldenCheckFailed(f"index margin {monitor.min_margin:.2e}")
    if any(int(t) in (BOS_ID, EOS_ID) for t in arrays["greedy"]):
        raise GoldenCheckFailed("greedy output contains the bos / eos id")

    # the same weights attending densely must give other logits: the selection matters
    dense = fam["model_cls"](make_config(case, index_topk=4096))
    dense.set_attn_implementation("eager")
    dense.set_experts_implementation("eager")
    dense.load_state_dict(model.state_dict())
    dense.eval()
    full = torch.cat([prompt, torch.from_numpy(arrays["greedy"])])
    diff = float((dense(full[None], use_cache=False).logits[0, :len(prompt)]
                  - torch.from_numpy(arrays["logits"])).abs().max())
    if diff <= DENSE_DIFF:
        raise GoldenCheckFailed(f"sparse logits within {diff:.1e} of the dense ones")
    tensors, sp_dir = checked_hub_tensors(model, mtp, workdir, name)
    shared = case["indexer_types"] or ["full"] * case["num_hidden_layers"]
    for i, kind in enumerate(shared + ["full"]):
        key = f"model.layers.{i}.self_attn.indexer.k_norm.bias"
        assert (key in tensors) == (kind == "full"), key
    stats.update(index_margin=monitor.min_margin, index_calls=monitor.calls,
                 selections_bound=monitor.bound, dense_logits_diff=diff)
    return model, tensors, arrays, stats, sp_dir


def config_json(case: dict, sp_dir: str) -> dict:
    if case["style"] == "hub":
        return hub_config_json(case)
    with open(os.path.join(sp_dir, "config.json")) as fh:
        saved = json.load(fh)
    saved["num_nextn_predict_layers"] = 1  # the appended MTP layer (transformers drops it)
    assert saved["mlp_layer_types"] == mlp_layer_types(case), saved["mlp_layer_types"]
    assert "rope_parameters" in saved and "rope_theta" not in saved, saved
    assert set(saved["layer_types"]) == {"deepseek_sparse_attention"}, saved["layer_types"]
    if case["indexer_types"] is not None:
        assert saved["indexer_types"] == case["indexer_types"], saved["indexer_types"]
    return saved


@torch.no_grad()
def verify_folder(folder: str, model, case: dict, arrays: dict) -> None:
    """Reload with transformers' own loader: same weights, bit-identical logits."""
    fam = FAMILIES[case["family"]]
    m2 = reload_target(fam["model_cls"], folder, model, arrays)
    assert m2.config.index_topk == case["index_topk"]
    assert m2.config.index_n_heads == case["index_n_heads"]
    assert m2.config.mlp_layer_types == mlp_layer_types(case), m2.config.mlp_layer_types
    if case["indexer_types"] is not None:
        assert m2.config.indexer_types == case["indexer_types"]
    tensors = load_safetensors(os.path.join(folder, "model.safetensors"))
    p = f"model.layers.{case['num_hidden_layers']}."
    own = [p + "embed_tokens.weight", p + "shared_head.head.weight"]
    assert all((k in tensors) == case["own_embed_and_head"] for k in own), own
    assert p + "self_attn.indexer.wq_b.weight" in tensors


def write_case(out_dir: str, name: str, case: dict, workdir: str) -> dict:
    (model, tensors, arrays, stats, sp_dir), seed, tries = draw_case(build_case, name, case,
                                                                     workdir)
    folder = os.path.join(out_dir, name)
    write_fixture_folder(folder, config_json(case, sp_dir), tensors, arrays)
    verify_folder(folder, model, case, arrays)
    stats.update(seed=seed, tries=tries)
    return stats


def main() -> None:
    args = parse_args_and_setup(__doc__.split("\n")[0], CASES)
    common.write_cases(args, CASES, write_case, "")


if __name__ == "__main__":
    main()
