"""Small random HF checkpoints in each supported layout, and a numpy reference of their math.

Written independently of `mtp_jax.checkpoint.save_hf` / the families' tensor maps: the config.json
dicts follow each real layout's own style and the tensor names and shapes follow the
public layout rules (HF `[out, in]` linear weights), so a loader that maps a name or a
shape wrongly fails against these files instead of agreeing with itself.

- ``hf_config(layout, ...)``: the config.json dict (MiMo: Qwen2 keys, QKV bias,
  ``num_nextn_predict_layers``; DeepSeek-V3 naming on a dense GQA block; Qwen3-Next dense:
  ``mtp_num_hidden_layers``, q/k norm, zero-centred norms, partial rotary; Step-3.5:
  ``layer_types`` over target + MTP layers with sliding windows).
- ``hf_tensors(config, seed)``: {HF name: array}, random, in float32.
- ``write_checkpoint(path, config, tensors, shards=1)``: config.json + one safetensors file,
  or several shards and a ``model.safetensors.index.json``.
- ``write_config`` / ``write_shards(path, [dict, ...], weight_map=None)``: the pieces, for
  hand-made broken shard sets.
- ``make_checkpoint(path, layout, ...)``: the three above in one call; returns
  (config, tensors) so a test can corrupt either and write again.
- ``forward_train_jit(graphdef, params, tokens)``: one jitted `forward_train` shared by the
  test files, so a model shape compiles once per session.
- ``np_*``: float64 numpy implementations of RMSNorm, RoPE (default, linear, dynamic, yarn,
  llama3; partial rotary; rotate-half convention), GQA attention with an optional sliding
  window, SwiGLU, a decoder block, the target forward and the MTP modules, reading the HF
  tensors directly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Optional

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from mtp_jax.checkpoint.safetensors_io import write_safetensors
from mtp_jax.mtp import forward_train

LAYOUTS = ("mimo", "deepseek_v3", "qwen3_next", "step3p5")

# MTP facts of each layout as the public implementations run them: the concat order of
# the projection input, embedding zeroed at position 0, which target hidden feeds module
# 1 (before / after the final norm), which hidden a module hands on, per-module head /
# embedding, one shared input side (Qwen3-Next), zero-centred norms.
FACTS = {
    "mimo": dict(concat="hidden_first", zero_pos0=True, hidden_from="post_norm",
                 out_hidden="post_norm", own_head=False, own_embed=False, shared_input=False,
                 norm_offset=0.0),
    "deepseek_v3": dict(concat="embed_first", zero_pos0=True, hidden_from="post_norm",
                        out_hidden="pre_norm", own_head=True, own_embed=True,
                        shared_input=False, norm_offset=0.0),
    "qwen3_next": dict(concat="embed_first", zero_pos0=False, hidden_from="post_norm",
                       out_hidden="post_norm", own_head=False, own_embed=False,
                       shared_input=True, norm_offset=1.0),
    "step3p5": dict(concat="embed_first", zero_pos0=False, hidden_from="pre_norm",
                    out_hidden="pre_norm", own_head=True, own_embed=False, shared_input=False,
                    norm_offset=1.0),
}

# An MTP layer's own head (its norm, its projection) as each layout publishes it.
HEAD_NAMES = {"deepseek_v3": ("shared_head.norm.weight", "shared_head.head.weight"),
              "step3p5": ("transformer.shared_head.norm.weight",
                          "transformer.shared_head.output.weight")}


# --------------------------------------------------------------------------- configs
def hf_config(layout: str, *, vocab: int = 96, hidden: int = 32, intermediate: int = 64,
              layers: int = 2, heads: int = 4, kv_heads: int = 2, num_mtp: Optional[int] = None,
              torch_dtype: str = "float32", **extra) -> dict:
    """A config.json dict in `layout`'s own style; `extra` keys are added or replace."""
    if layout == "mimo":
        num_mtp = 2 if num_mtp is None else num_mtp
        cfg = {
            "architectures": ["MiMoForCausalLM"], "model_type": "mimo",
            "attention_bias": True, "attention_dropout": 0.0, "bos_token_id": 1,
            "eos_token_id": 2, "hidden_act": "silu", "hidden_size": hidden,
            "initializer_range": 0.02, "intermediate_size": intermediate,
            "max_position_embeddings": 256, "max_window_layers": layers,
            "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": kv_heads, "num_nextn_predict_layers": num_mtp,
            "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 640000.0,
            "sliding_window": 256, "tie_word_embeddings": False, "torch_dtype": torch_dtype,
            "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False,
            "vocab_size": vocab,
        }
    elif layout == "deepseek_v3":
        num_mtp = 3 if num_mtp is None else num_mtp
        cfg = {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
            "eos_token_id": 1, "hidden_act": "silu", "hidden_size": hidden,
            "initializer_range": 0.02, "intermediate_size": intermediate,
            "max_position_embeddings": 256, "num_attention_heads": heads,
            "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
            "num_nextn_predict_layers": num_mtp, "rms_norm_eps": 1e-6,
            "rope_scaling": {"type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32,
                             "beta_slow": 1},
            "rope_theta": 10000, "tie_word_embeddings": False, "torch_dtype": torch_dtype,
            "transformers_version": "4.33.1", "use_cache": True, "vocab_size": vocab,
        }
    elif layout == "qwen3_next":
        num_mtp = 2 if num_mtp is None else num_mtp
        cfg = {
            "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": False,
            "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 16,
            "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
            "intermediate_size": intermediate,
            "layer_types": ["full_attention"] * layers, "max_position_embeddings": 256,
            "mtp_num_hidden_layers": num_mtp, "num_attention_heads": heads,
            "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
            "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "rope_scaling": None,
            "rope_theta": 10000000, "tie_word_embeddings": False, "torch_dtype": torch_dtype,
            "transformers_version": "4.57.0.dev0", "use_cache": True, "vocab_size": vocab,
        }
    elif layout == "step3p5":
        num_mtp = 3 if num_mtp is None else num_mtp
        target_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(layers)]
        cfg = {
            "architectures": ["Step3p5ForCausalLM"], "model_type": "step3p5",
            "bos_token_id": 0, "eos_token_id": 1, "head_dim": 16, "hidden_act": "silu",
            "hidden_size": hidden, "intermediate_size": intermediate,
            "layer_types": target_types + ["sliding_attention"] * num_mtp,
            "max_position_embeddings": 256, "num_attention_heads": heads,
            "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
            "num_nextn_predict_layers": num_mtp, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "sliding_window": 4, "tie_word_embeddings": False, "torch_dtype": torch_dtype,
            "use_qk_norm": True, "vocab_size": vocab,
        }
    else:
        raise ValueError(f"unknown layout {layout!r}")
    cfg.update(extra)
    return cfg


def layout_of(config: dict) -> str:
    return {"mimo": "mimo", "deepseek_v3": "deepseek_v3", "qwen3_next": "qwen3_next",
            "step3p5": "step3p5"}[config["model_type"]]


@dataclasses.dataclass(frozen=True)
class Arch:
    """What the numpy reference needs to know, read from an HF config dict by hand."""

    layout: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    norm_offset: float
    qkv_bias: bool
    qk_norm: bool
    tied: bool
    rope: dict  # keyword arguments of np_inv_freq
    windows: tuple  # per target layer
    mtp_windows: tuple  # per MTP module
    num_mtp: int
    concat: str
    zero_pos0: bool
    hidden_from: str
    out_hidden: str
    own_head: bool
    own_embed: bool
    shared_input: bool
    source: str = "previous"


def arch_of(config: dict) -> Arch:
    layout = layout_of(config)
    facts = FACTS[layout]
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    num_mtp = config.get("num_nextn_predict_layers", config.get("mtp_num_hidden_layers", 0))
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if types is not None:
        kinds = [window if t == "sliding_attention" else None for t in types]
        windows = tuple(kinds[:layers])
        mtp_windows = tuple(kinds[layers:]) or (None,) * num_mtp
    elif config.get("use_sliding_window") and window:
        start = config.get("max_window_layers", 0)
        windows = tuple(window if i >= start else None for i in range(layers))
        mtp_windows = (None,) * num_mtp
    else:
        windows, mtp_windows = (None,) * layers, (None,) * num_mtp
    rs = config.get("rope_scaling") or {}
    rope = dict(rot_dim=int(head_dim * config.get("partial_rotary_factor", 1.0)),
                theta=float(config.get("rope_theta", 10000.0)),
                kind=rs.get("rope_type", rs.get("type", "default")),
                factor=rs.get("factor", 1.0),
                original_max=rs.get("original_max_position_embeddings",
                                    config.get("max_position_embeddings")),
                beta_fast=rs.get("beta_fast", 32.0), beta_slow=rs.get("beta_slow", 1.0),
                attention_factor=rs.get("attention_factor"),
                low_freq_factor=rs.get("low_freq_factor", 1.0),
                high_freq_factor=rs.get("high_freq_factor", 4.0))
    qk_norm = layout == "qwen3_next" or bool(config.get("use_qk_norm", False))
    return Arch(layout=layout, vocab=config["vocab_size"], hidden=config["hidden_size"],
                layers=layers, heads=heads, kv_heads=config.get("num_key_value_heads", heads),
                head_dim=head_dim, eps=config.get("rms_norm_eps", 1e-6),
                norm_offset=facts["norm_offset"], qkv_bias=bool(config.get("attention_bias")),
                qk_norm=qk_norm, tied=bool(config.get("tie_word_embeddings")), rope=rope,
                windows=windows, mtp_windows=mtp_windows, num_mtp=num_mtp,
                concat=facts["concat"], zero_pos0=facts["zero_pos0"],
                hidden_from=facts["hidden_from"], out_hidden=facts["out_hidden"],
                own_head=facts["own_head"], own_embed=facts["own_embed"],
                shared_input=facts["shared_input"])


# --------------------------------------------------------------------------- tensors
def _block_names(arch: Arch, prefix: str) -> dict:
    d, h = arch.hidden, arch.head_dim  # "f" (the MLP width) is filled in by the caller
    n, kv = arch.heads, arch.kv_heads
    names = {
        prefix + "input_layernorm.weight": ("norm", (d,)),
        prefix + "self_attn.q_proj.weight": ("linear", (n * h, d)),
        prefix + "self_attn.k_proj.weight": ("linear", (kv * h, d)),
        prefix + "self_attn.v_proj.weight": ("linear", (kv * h, d)),
        prefix + "self_attn.o_proj.weight": ("linear", (d, n * h)),
        prefix + "post_attention_layernorm.weight": ("norm", (d,)),
        prefix + "mlp.gate_proj.weight": ("linear", ("f", d)),
        prefix + "mlp.up_proj.weight": ("linear", ("f", d)),
        prefix + "mlp.down_proj.weight": ("linear", (d, "f")),
    }
    if arch.qkv_bias:
        names[prefix + "self_attn.q_proj.bias"] = ("bias", (n * h,))
        names[prefix + "self_attn.k_proj.bias"] = ("bias", (kv * h,))
        names[prefix + "self_attn.v_proj.bias"] = ("bias", (kv * h,))
    if arch.qk_norm:
        names[prefix + "self_attn.q_norm.weight"] = ("norm", (h,))
        names[prefix + "self_attn.k_norm.weight"] = ("norm", (h,))
    return names


def hf_tensor_specs(config: dict) -> dict:
    """{HF name: (kind, shape)} for every tensor of the checkpoint, from the layout rules."""
    arch = arch_of(config)
    d, v, f = arch.hidden, arch.vocab, config["intermediate_size"]
    specs = {"model.embed_tokens.weight": ("embed", (v, d)),
             "model.norm.weight": ("norm", (d,))}
    if not arch.tied:
        specs["lm_head.weight"] = ("linear", (v, d))
    for i in range(arch.layers):
        specs.update(_block_names(arch, f"model.layers.{i}."))
    for k in range(arch.num_mtp):
        if arch.layout == "mimo":
            p = f"model.mtp_layers.{k}."
            specs.update({p + "token_layernorm.weight": ("norm", (d,)),
                          p + "hidden_layernorm.weight": ("norm", (d,)),
                          p + "input_proj.weight": ("linear", (d, 2 * d)),
                          p + "final_layernorm.weight": ("norm", (d,))})
        elif arch.layout in ("deepseek_v3", "step3p5"):
            p = f"model.layers.{arch.layers + k}."
            specs.update({p + "enorm.weight": ("norm", (d,)),
                          p + "hnorm.weight": ("norm", (d,)),
                          p + "eh_proj.weight": ("linear", (d, 2 * d)),
                          p + HEAD_NAMES[arch.layout][0]: ("norm", (d,)),
                          p + HEAD_NAMES[arch.layout][1]: ("linear", (v, d))})
            if arch.layout == "deepseek_v3":
                specs[p + "embed_tokens.weight"] = ("embed", (v, d))
        else:
            p = f"mtp.layers.{k}."
        specs.update(_block_names(arch, p))
    if arch.layout == "qwen3_next" and arch.num_mtp:
        specs.update({"mtp.fc.weight": ("linear", (d, 2 * d)),
                      "mtp.pre_fc_norm_embedding.weight": ("norm", (d,)),
                      "mtp.pre_fc_norm_hidden.weight": ("norm", (d,)),
                      "mtp.norm.weight": ("norm", (d,))})
    return {name: (kind, tuple(f if s == "f" else s for s in shape))
            for name, (kind, shape) in specs.items()}


def hf_tensors(config: dict, *, seed: int = 0) -> dict:
    """Random float32 tensors for every name of the checkpoint, HF shapes."""
    rng = np.random.default_rng(seed)
    offset = FACTS[layout_of(config)]["norm_offset"]
    out = {}
    for name, (kind, shape) in sorted(hf_tensor_specs(config).items()):
        x = rng.standard_normal(shape)
        if kind == "norm":  # zero-centred norms store w - 1
            x = 1.0 - offset + 0.2 * x
        elif kind == "bias":
            x = 0.2 * x
        elif kind == "linear":
            x = x / math.sqrt(shape[1])
        out[name] = x.astype(np.float32)
    return out


def write_checkpoint(path: str, config: dict, tensors: dict, *, shards: int = 1,
                     dtype=None) -> list:
    """config.json and the safetensors (one file, or `shards` files plus the index).

    Returns the safetensors file names. Tensors are cast to `dtype` if given.
    """
    write_config(path, config)
    if dtype is not None:
        tensors = {k: np.asarray(v).astype(dtype) for k, v in tensors.items()}
    if shards == 1:
        write_safetensors(os.path.join(path, "model.safetensors"), tensors,
                          metadata={"format": "pt"})
        return ["model.safetensors"]
    names = sorted(tensors)
    parts = [{n: tensors[n] for n in names[i::shards]} for i in range(shards)]
    return write_shards(path, parts)


def write_config(path: str, config: dict) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_shards(path: str, parts: list, weight_map: Optional[dict] = None) -> list:
    """Write the tensor dicts in `parts` as shards and the index (derived or as given)."""
    files = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    derived = {}
    for fname, part in zip(files, parts):
        write_safetensors(os.path.join(path, fname), part, metadata={"format": "pt"})
        derived.update({n: fname for n in part})
    total = sum(np.asarray(t).nbytes for part in parts for t in part.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total},
                   "weight_map": derived if weight_map is None else weight_map}, f, indent=2)
    return files


def make_checkpoint(path: str, layout: str, *, shards: int = 1, seed: int = 0, dtype=None,
                    **config_extra) -> tuple:
    """Write a random checkpoint of `layout`; returns (config dict, float32 tensors)."""
    config = hf_config(layout, **config_extra)
    tensors = hf_tensors(config, seed=seed)
    write_checkpoint(path, config, tensors, shards=shards, dtype=dtype)
    return config, tensors


BF16 = np.dtype(ml_dtypes.bfloat16)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def forward_train_jit(graphdef, params, tokens):
    """(target logits [b, T, v], [module k logits [b, T - k - 1, v]]) of `forward_train`."""
    return forward_train(nnx.merge(graphdef, params), tokens)


# ------------------------------------------------------------------- numpy reference
def np_rms_norm(x, w, eps, offset=0.0):
    x = np.asarray(x, np.float64)
    rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x / rms * (offset + np.asarray(w, np.float64))


def np_inv_freq(*, rot_dim, theta, kind="default", factor=1.0, original_max=None,
                beta_fast=32.0, beta_slow=1.0, attention_factor=None, low_freq_factor=1.0,
                high_freq_factor=4.0):
    """Inverse frequencies [rot_dim / 2] and the cos / sin scale, HF / vLLM definitions."""
    exponents = np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim
    if kind == "dynamic":
        # Static NTK-aware base for the whole scaled context (vLLM's dynamic NTK cache):
        # longest length L = original * factor,
        # base' = base * (f * L / orig - (f - 1)) ** (d / (d - 2)).
        longest = original_max * factor
        ntk = (factor * longest / original_max - (factor - 1)) ** (rot_dim / (rot_dim - 2))
        return 1.0 / (theta * ntk) ** exponents, 1.0
    freq = theta ** -exponents
    if kind == "default":
        return freq, 1.0
    if kind == "linear":
        return freq / factor, 1.0
    if kind == "llama3":
        out = []
        for fr in freq:
            wavelength = 2 * math.pi / fr
            if wavelength < original_max / high_freq_factor:  # high frequency: kept
                out.append(fr)
            elif wavelength > original_max / low_freq_factor:  # low frequency: interpolated
                out.append(fr / factor)
            else:  # in between: blend by how many rotations fit the original context
                t = (original_max / wavelength - low_freq_factor) / (
                    high_freq_factor - low_freq_factor)
                out.append((1 - t) * fr / factor + t * fr)
        return np.array(out), 1.0
    if kind == "yarn":
        def dim_for(rotations):  # the dim index that makes `rotations` turns in the context
            return rot_dim * math.log(original_max / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))
        lo = max(math.floor(dim_for(beta_fast)), 0)
        hi = min(math.ceil(dim_for(beta_slow)), rot_dim - 1)
        if hi == lo:
            hi += 0.001
        out = []
        for i, fr in enumerate(freq):
            interp_weight = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: extrapolate
            out.append(fr * (1 - interp_weight) + fr / factor * interp_weight)
        if attention_factor is None:
            attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        return np.array(out), float(attention_factor)
    raise ValueError(kind)


def np_rope(x, pos, inv_freq, scale=1.0):
    """x [t, heads, h], pos [t]: rotate-half RoPE on the first 2 * len(inv_freq) dims."""
    x = np.asarray(x, np.float64)
    half = len(inv_freq)
    out = x.copy()
    for ti, p in enumerate(np.asarray(pos)):
        for j in range(half):
            c, s = math.cos(p * inv_freq[j]) * scale, math.sin(p * inv_freq[j]) * scale
            a, b = x[ti, :, j], x[ti, :, j + half]
            out[ti, :, j] = a * c - b * s
            out[ti, :, j + half] = b * c + a * s
    return out


def np_attention(q, k, v, q_pos, k_pos, window=None):
    """q [t, n, h], k / v [s, kv, h]; query head i uses kv head i // (n / kv).

    A query at position p sees keys at positions j with p - window < j <= p.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    t, n, h = q.shape
    group = n // k.shape[1]
    out = np.zeros((t, n, v.shape[2]))
    for i in range(t):
        for head in range(n):
            kvh = head // group
            seen = [j for j in range(k.shape[0]) if k_pos[j] <= q_pos[i]
                    and (window is None or k_pos[j] > q_pos[i] - window)]
            s = np.array([q[i, head] @ k[j, kvh] / math.sqrt(h) for j in seen])
            w = np.exp(s - s.max())
            w /= w.sum()
            out[i, head] = w @ v[seen, kvh]
    return out


def np_swiglu(x, gate, up, down):
    """HF weights: gate / up [f, d], down [d, f]."""
    g = x @ np.asarray(gate, np.float64).T
    return ((g / (1 + np.exp(-g))) * (x @ np.asarray(up, np.float64).T)) @ np.asarray(
        down, np.float64).T


def block_weights(tensors: dict, prefix: str) -> dict:
    """The HF tensors of one decoder block under short names."""
    short = {"input_layernorm.weight": "input_norm", "self_attn.q_proj.weight": "q",
             "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
             "self_attn.o_proj.weight": "o", "self_attn.q_proj.bias": "q_bias",
             "self_attn.k_proj.bias": "k_bias", "self_attn.v_proj.bias": "v_bias",
             "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
             "post_attention_layernorm.weight": "post_norm", "mlp.gate_proj.weight": "gate",
             "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down"}
    return {s: np.asarray(tensors[prefix + n], np.float64) for n, s in short.items()
            if prefix + n in tensors}


def np_block(x, pos, w: dict, arch: Arch, window):
    """One pre-norm decoder block on x [t, d] at positions pos [t]; HF weights `w`."""
    n, kv, h = arch.heads, arch.kv_heads, arch.head_dim
    t = x.shape[0]
    inv, scale = np_inv_freq(**arch.rope)
    a = np_rms_norm(x, w["input_norm"], arch.eps, arch.norm_offset)
    q, k, v = a @ w["q"].T, a @ w["k"].T, a @ w["v"].T
    if "q_bias" in w:
        q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    q, k, v = q.reshape(t, n, h), k.reshape(t, kv, h), v.reshape(t, kv, h)
    if "q_norm" in w:
        q = np_rms_norm(q, w["q_norm"], arch.eps, arch.norm_offset)
        k = np_rms_norm(k, w["k_norm"], arch.eps, arch.norm_offset)
    q, k = np_rope(q, pos, inv, scale), np_rope(k, pos, inv, scale)
    x = x + np_attention(q, k, v, pos, pos, window).reshape(t, n * h) @ w["o"].T
    m = np_rms_norm(x, w["post_norm"], arch.eps, arch.norm_offset)
    return x + np_swiglu(m, w["gate"], w["up"], w["down"])


def np_decoder(embed, blocks: list, final_norm, head, arch: Arch, tokens):
    """Target forward of one sequence from short-name block weights (`block_weights`).

    Returns (logits [t, v], pre-norm hidden [t, d], post-norm hidden [t, d]).
    """
    tokens = np.asarray(tokens)
    pos = np.arange(len(tokens))
    x = np.asarray(embed, np.float64)[tokens]
    for i, w in enumerate(blocks):
        x = np_block(x, pos, w, arch, arch.windows[i])
    post = np_rms_norm(x, final_norm, arch.eps, arch.norm_offset)
    return post @ np.asarray(head, np.float64).T, x, post


def np_target(tensors: dict, arch: Arch, tokens):
    """`np_decoder` reading the HF tensors of the target."""
    blocks = [block_weights(tensors, f"model.layers.{i}.") for i in range(arch.layers)]
    head = tensors["model.embed_tokens.weight" if arch.tied else "lm_head.weight"]
    return np_decoder(tensors["model.embed_tokens.weight"], blocks,
                      tensors["model.norm.weight"], head, arch, tokens)


def mtp_weights(tensors: dict, arch: Arch, k: int) -> dict:
    """Module k's HF tensors under short names: enorm, hnorm, proj [d, 2d], final_norm,
    block (dict), head [v, d], embed [v, d]."""
    if arch.layout == "mimo":
        p = f"model.mtp_layers.{k}."
        w = dict(enorm=tensors[p + "token_layernorm.weight"],
                 hnorm=tensors[p + "hidden_layernorm.weight"],
                 proj=tensors[p + "input_proj.weight"],
                 final_norm=tensors[p + "final_layernorm.weight"])
    elif arch.layout in ("deepseek_v3", "step3p5"):
        p = f"model.layers.{arch.layers + k}."
        w = dict(enorm=tensors[p + "enorm.weight"], hnorm=tensors[p + "hnorm.weight"],
                 proj=tensors[p + "eh_proj.weight"],
                 final_norm=tensors[p + HEAD_NAMES[arch.layout][0]])
    else:
        p = f"mtp.layers.{k}."
        w = dict(enorm=tensors["mtp.pre_fc_norm_embedding.weight"],
                 hnorm=tensors["mtp.pre_fc_norm_hidden.weight"], proj=tensors["mtp.fc.weight"],
                 final_norm=tensors["mtp.norm.weight"])
    w["block"] = block_weights(tensors, p)
    if arch.own_head:
        w["head"] = tensors[p + HEAD_NAMES[arch.layout][1]]
    else:
        w["head"] = tensors["model.embed_tokens.weight" if arch.tied else "lm_head.weight"]
    w["embed"] = tensors[p + "embed_tokens.weight" if arch.own_embed
                         else "model.embed_tokens.weight"]
    return {key: (val if key == "block" else np.asarray(val, np.float64))
            for key, val in w.items()}


def np_mtp(w: dict, arch: Arch, k: int, tokens, hidden, pos):
    """MTP module k on tokens [t] paired with consumed hiddens [t, d] at positions [t].

    Returns (hidden handed on [t, d], logits [t, v]).
    """
    e = w["embed"][np.asarray(tokens)]
    if arch.zero_pos0:
        e = np.where((np.asarray(pos) == 0)[:, None], 0.0, e)
    e = np_rms_norm(e, w["enorm"], arch.eps, arch.norm_offset)
    hn = np_rms_norm(hidden, w["hnorm"], arch.eps, arch.norm_offset)
    x = np.concatenate([hn, e] if arch.concat == "hidden_first" else [e, hn], axis=-1)
    x = x @ w["proj"].T
    y = np_block(x, pos, w["block"], arch, arch.mtp_windows[k])
    out = np_rms_norm(y, w["final_norm"], arch.eps, arch.norm_offset)
    return (out if arch.out_hidden == "post_norm" else y), out @ w["head"].T


def np_mtp_chain(weights: list, arch: Arch, tokens, target_pre, target_post):
    """Training-style chain over one sequence: module k (0-based) at anchor i consumes
    t_{i+k+1} and predicts t_{i+k+2}, anchors 0..T-k-2. Returns the list of logits."""
    tokens = np.asarray(tokens)
    T = len(tokens)
    h0 = target_post if arch.hidden_from == "post_norm" else target_pre
    h, outs = h0, []
    for k, w in enumerate(weights):
        span = T - k - 1
        src = h[:span] if arch.source == "previous" else h0[:span]
        h, logits = np_mtp(w, arch, k, tokens[k + 1: k + 1 + span], src, np.arange(span))
        outs.append(logits)
    return outs
