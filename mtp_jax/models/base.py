"""The model-family interface: what a family knows that the generic code does not.

A family is a `Family` subclass (one per file in this package, an instance per registry
line in `models/__init__.py`). Its class attributes are facts, its methods the few places
where a family reads, writes or names things its own way; the defaults here are the
DeepSeek-V3-style checkpoint (`model.layers.{N + k}.*` MTP layers with `enorm`, `hnorm`,
`eh_proj`, `shared_head`), so a family states only how it differs.

- Which configs: `name` (`ModelConfig.layout`), `model_types` (config.json `model_type`
  values it claims), `architecture` (written on export).
- What its configs may hold: `moe` (DeepSeek-style MoE keys are read and the expert
  tensors known), `mla` (MLA keys are read), `partial_rotary_factor` (its default).
- Config facts: `config_defaults` (ModelConfig fields it fixes, e.g. QKV bias, q/k norm,
  zero-centred norms), `config_switches` (its own config.json spellings of boolean fields),
  `mtp` (an `MTPWiring`: how the MTP layers are wired).
- Config reading / writing: `translate` (its own key style -> the generic keys and the
  per-layer fields, before `parse.parse_config`), `check_topk_method`, `export` (the
  family's keys of `to_hf`).
- Tensor names, both ways (`entries`, a list of models.tensors.Entry): the target's names
  are common to all families; `layer_entries` / `ffn_entries` build a decoder layer,
  `mtp_entries` an MTP layer from `mtp_prefix`, `mtp_input`, `mtp_post_attn_norm`,
  `mtp_head`; `mtp_shared_input` for one input side shared by all MTP layers;
  `tensor_aliases` for other published spellings of a name.
- Fix-ups from the checkpoint: `fit_to_checkpoint` (facts its config.json leaves out but
  its tensor names tell).

Reuse: attention and FFN entries come from the layer's spec (GQA or MLA, dense or MoE), so a
family with MLA attention and DeepSeek-style MoE needs no entries of its own; a new family
can subclass the nearest one and override a fact or two.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Optional

from ..config import ConfigError, ModelConfig
from .fields import moe_fields, rope_scaling_dict
from .parse import parse_config
from .tensors import (Entry, embedding, gqa_entries, linear, mla_entries, moe_entries,
                      swiglu_entries, vector)


@dataclasses.dataclass(frozen=True)
class MTPWiring:
    """How a family's MTP layers are wired (the ModelConfig `mtp_*` fields, DESIGN.md):
    module k computes Block_k(Proj_k(concat(norm_e(embed(t)), norm_h(h)))) in `concat_order`;
    the embedding is zeroed at position 0 if `zero_embed_at_pos0`; `hidden_from`: the
    target hidden handed over (before / after the final norm); `output_hidden`: the hidden
    a module hands on; `hidden_source`: module k reads module k-1's hidden (`previous`) or
    the target's (`target`); `own_head` / `own_embed`: per-layer `shared_head.head` /
    `embed_tokens`; `shared_input`: one fc / pre-norms / final norm for all layers."""

    concat_order: str = "hidden_first"
    zero_embed_at_pos0: bool = True
    hidden_from: str = "post_norm"
    output_hidden: str = "post_norm"
    hidden_source: str = "previous"
    own_head: bool = False
    own_embed: bool = False
    shared_input: bool = False

    def fields(self) -> dict:
        """As ModelConfig keyword arguments."""
        return {"mtp_" + f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class Family:
    """A model family (module docstring). Instances hold no state: every fact is a class
    attribute, so subclasses override facts and methods alike."""

    name: str = ""
    model_types: tuple = ()
    architecture: str = ""
    moe: bool = False
    mla: bool = False
    gdn: bool = False  # its configs may hold Gated DeltaNet linear-attention layers
    partial_rotary_factor: float = 1.0
    config_defaults: Mapping = {}
    config_switches: Mapping = {}  # config.json key -> boolean ModelConfig field
    mtp: MTPWiring = MTPWiring()
    # MTP layer k's tensor prefix ({k}: module index, {layer}: num_layers + k)
    mtp_prefix: str = "model.layers.{layer}."
    # its input side, under the prefix: embedding norm, hidden norm, projection, final
    # norm; None where one input side serves all layers (`mtp_shared_input`)
    mtp_input: Optional[tuple] = ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                  "shared_head.norm.weight")
    mtp_shared_input: tuple = ()  # full names, in the order of `mtp_input`
    mtp_post_attn_norm: str = "post_attention_layernorm"
    mtp_head: str = "shared_head.head.weight"  # under the prefix, with `mtp.own_head`
    tensor_aliases: tuple = ()  # (compiled pattern, replacement): other spellings
    # (compiled patterns) tensors of a checkpoint that are not the language model's (a
    # multimodal checkpoint's vision tower): left unread
    ignored_tensors: tuple = ()

    # ------------------------------------------------------------ config.json
    def translate(self, raw: dict, mtp_layers: Optional[int]) -> tuple[dict, dict]:
        """(raw with the family's own keys rewritten to the generic ones, extra ModelConfig
        fields); `extra["moe_updates"]` holds MoEConfig fields to replace."""
        return raw, {}

    def check_topk_method(self, method: str) -> None:
        """Refuse a `topk_method` the family's router does not have (ConfigError)."""

    def parse(self, raw: dict, mtp_layers: Optional[int] = None) -> ModelConfig:
        return parse_config(raw, self, mtp_layers)

    def to_hf(self, cfg: ModelConfig) -> dict:
        """The config.json dict of `cfg`: the keys every family writes, then `export`."""
        out = {
            "architectures": [self.architecture], "model_type": cfg.layout,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "num_nextn_predict_layers": cfg.num_mtp_modules, "torch_dtype": cfg.dtype,
            "attention_bias": cfg.attention_bias, "qk_norm": cfg.qk_norm,
            "mtp_hidden_source": cfg.mtp_hidden_source,
            "mtp_concat_order": cfg.mtp_concat_order, "mtp_hidden_from": cfg.mtp_hidden_from,
            "mtp_output_hidden": cfg.mtp_output_hidden,
            "mtp_zero_embed_at_pos0": cfg.mtp_zero_embed_at_pos0,
        }
        # written where it is not 1, or where the family's default (read back) is not 1
        if cfg.partial_rotary_factor != 1.0 or self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = cfg.partial_rotary_factor
        return self.export(cfg, out)

    def export(self, cfg: ModelConfig, out: dict) -> dict:
        """`out` completed with the MoE, MLA, RoPE-scaling and sliding-window keys."""
        if cfg.moe is not None:
            out.update(moe_fields(cfg.moe), first_k_dense_replace=cfg.moe.first_dense)
        if cfg.mla is not None:
            m = cfg.mla
            out.update(kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank,
                       qk_nope_head_dim=m.qk_nope_dim, qk_rope_head_dim=m.qk_rope_dim,
                       v_head_dim=m.v_head_dim, rope_interleave=m.rope_interleave)
        if cfg.rope_scaling is not None:
            out["rope_scaling"] = rope_scaling_dict(cfg.rope_scaling)
        windows = list(cfg.sliding_windows) + list(cfg.mtp_sliding_windows)
        if any(w is not None for w in windows):
            sizes = {w for w in windows if w is not None}
            if len(sizes) != 1:
                raise ConfigError("HF configs carry one sliding_window size; got " + str(sizes))
            out["sliding_window"] = sizes.pop()
            out["layer_types"] = ["sliding_attention" if w else "full_attention"
                                  for w in windows]
        return out

    # --------------------------------------------------------------- tensors
    def entries(self, cfg: ModelConfig) -> list[Entry]:
        """Every parameter of the model with the HF tensors it is built from."""
        d, v = cfg.hidden_size, cfg.vocab_size
        es = [embedding(("target", "embed"), "model.embed_tokens.weight", v, d),
              vector(("target", "final_norm", "weight"), "model.norm.weight", d)]
        if not cfg.tie_word_embeddings:
            es.append(linear(("target", "lm_head"), "lm_head.weight", v, d))
        for i in range(cfg.num_layers):
            es += self.layer_entries(cfg, i, ("target", "layers", i), f"model.layers.{i}.")
        for k in range(cfg.num_mtp_modules):
            es += self.mtp_entries(cfg, k)
        if cfg.mtp_shared_input and cfg.num_mtp_modules:
            es += mtp_input_entries(("mtp_shared",), d, *self.mtp_shared_input)
        return es

    def mtp_entries(self, cfg: ModelConfig, k: int) -> list[Entry]:
        """MTP layer k: its input side, its decoder layer, its own head and embedding."""
        d, v = cfg.hidden_size, cfg.vocab_size
        path = ("mtp", k)
        p = self.mtp_prefix.format(k=k, layer=cfg.num_layers + k)
        es = []
        if self.mtp_input is not None:
            es += mtp_input_entries(path + ("input",), d, *(p + x for x in self.mtp_input))
        es += self.layer_entries(cfg, cfg.num_layers + k, path + ("block",), p,
                                 post_attn_norm=self.mtp_post_attn_norm)
        if cfg.mtp_own_head:
            es.append(linear(path + ("head",), p + self.mtp_head, v, d))
        if cfg.mtp_own_embed:
            es.append(embedding(path + ("embed",), p + "embed_tokens.weight", v, d))
        return es

    def layer_entries(self, cfg: ModelConfig, layer: int, path: tuple, prefix: str, *,
                      post_attn_norm: str = "post_attention_layernorm") -> list[Entry]:
        """Norms, attention and FFN tensors of one decoder layer (target or MTP), from its
        spec: GQA or MLA attention, dense or MoE FFN."""
        spec = cfg.layer_spec(layer)
        att = spec.attention
        d = cfg.hidden_size
        es = [vector(path + ("input_norm", "weight"), prefix + "input_layernorm.weight", d),
              vector(path + ("post_attn_norm", "weight"), prefix + post_attn_norm + ".weight",
                     d)]
        attention = mla_entries if att.kind == "mla" else gqa_entries
        es += attention(att, d, path + ("attn",), prefix + "self_attn.")
        return es + self.ffn_entries(spec, d, path, prefix)

    def ffn_entries(self, spec, d: int, path: tuple, prefix: str) -> list[Entry]:
        """A layer's FFN: DeepSeek-style MoE (`mlp.gate`, `mlp.experts.{e}.*`,
        `mlp.shared_experts.*`) or a SwiGLU `mlp.*`."""
        if spec.is_moe:
            return moe_entries(spec.ffn, d, path + ("mlp",), prefix + "mlp.")
        return swiglu_entries(d, spec.ffn.intermediate_size, path + ("mlp",), prefix + "mlp.")

    def fit_to_checkpoint(self, cfg: ModelConfig, names, path: str) -> ModelConfig:
        """`cfg` with the facts its config.json leaves out read from the checkpoint's tensor
        `names` (the folder `path` holds config.json)."""
        return cfg


def mtp_input_entries(path: tuple, d: int, enorm: str, hnorm: str, proj: str,
                      final: str) -> list[Entry]:
    """An MTP input side: the two pre-projection norms, the [2d -> d] projection and the
    final norm before the head."""
    return [vector(path + ("enorm", "weight"), enorm, d),
            vector(path + ("hnorm", "weight"), hnorm, d),
            linear(path + ("proj",), proj, d, 2 * d),
            vector(path + ("final_norm", "weight"), final, d)]


def aliases(*rules: tuple) -> tuple:
    """`tensor_aliases` from (regular expression, replacement) pairs."""
    return tuple((re.compile(pattern), repl) for pattern, repl in rules)
