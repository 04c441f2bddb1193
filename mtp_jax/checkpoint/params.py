"""A loaded model (`Model`: config, NNX graph definition, parameters, tokenizer) and the
transforms on its parameters: built from {state path: array} (`from_params`,
`with_params`), flattened (`to_flat`), quantized (`quantize_model`), given a quantized
draft head (`with_draft_head`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp
from flax import nnx

from .. import qarray, quant
from ..config import ConfigError, ModelConfig
from ..mtp import MTPModel
from .safetensors_io import CheckpointError, listed, problems_error


@dataclasses.dataclass
class Model:
    """A loaded model: config, NNX graph definition, parameters and tokenizer (if any)."""

    config: ModelConfig
    graphdef: Any
    params: Any  # nnx.State
    tokenizer: Any = None  # tokenizers.Tokenizer
    eos_token_ids: tuple = ()
    path: Optional[str] = None
    # fp8 KV cache scales per layer ((k [H], v [H]) floats), from kv_scales.json beside
    # the weights or set with calibration.calibrate_kv_scales; None: calibrated when needed
    kv_scales: Optional[tuple] = None
    chat_template: Any = None  # mtp_jax.chat.ChatTemplate, for requests given as messages
    generation: Any = None  # tokenizer.GenerationConfig (generation_config.json) or None

    @property
    def generation_defaults(self) -> dict:
        """The checkpoint's sampling defaults ({SamplingParams field: value}) from
        generation_config.json; {} without one."""
        return dict(self.generation.sampling) if self.generation is not None else {}

    @property
    def stop_token_ids(self) -> tuple:
        """Tokens that end every request: config.json's eos ids, then
        generation_config.json's."""
        more = self.generation.eos_token_ids if self.generation is not None else ()
        return tuple(dict.fromkeys(tuple(self.eos_token_ids) + tuple(more)))

    def module(self) -> MTPModel:
        return nnx.merge(self.graphdef, self.params)

    @property
    def dtype(self):
        """The model's compute dtype (that of its unquantized parameters, the norms')."""
        return self.params["target"]["final_norm"]["weight"][...].dtype


def abstract_model(cfg: ModelConfig, dtype):
    return nnx.eval_shape(lambda: MTPModel(cfg, dtype=dtype, rngs=nnx.Rngs(params=0)))


def from_params(cfg: ModelConfig, flat: dict, dtype, **extra) -> Model:
    """Build a Model from {state path: array}; every parameter must be present.

    Each parameter takes the dtype the module gives it: `dtype`, except the few kept in
    float32 whatever the model dtype (the MoE router)."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    missing = []
    for path, var in state.flat_state():
        if tuple(path) not in flat:
            missing.append("/".join(map(str, path)))
            continue
        v = flat[tuple(path)]
        var.set_value(v if qarray.is_quantized(v) else jnp.asarray(v, var.get_value().dtype))
    if missing:
        raise problems_error("parameters not provided: ", [lambda n: listed(missing, n)], "")
    return Model(cfg, graphdef, state, **extra)


def with_params(model: Model, cfg: ModelConfig, flat: dict) -> Model:
    """`model` rebuilt from {state path: array} under config `cfg` (its dtype, tokenizer,
    eos ids, path and KV scales kept): for transforms that add or replace parameters."""
    extra = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
             if f.name not in ("config", "graphdef", "params")}
    return from_params(cfg, flat, model.dtype, **extra)


def to_flat(params) -> dict:
    return {tuple(p): v.get_value() for p, v in params.flat_state()}



def refuse_run_time_options(model: Model) -> None:
    if model.config.draft_vocab_size:
        raise CheckpointError("this model drafts over a reduced vocabulary, a run-time "
                              "option: save the model it was made from and pass the ids "
                              "file with --draft-vocab")
    if model.config.draft_head:
        raise CheckpointError("this model's draft reads a quantized copy of its head, a "
                              "run-time option: save the model it was made from and pass "
                              f"--draft-head {model.config.draft_head}")



def quantize_model(model: Model, mode: str) -> Model:
    """A copy of `model` with its matmul weights quantized (`quant.MODES`); QuantizationError
    for a model that is already quantized."""
    mode = quant.check_mode(mode)
    if mode is None:
        return model
    held = quant.mode_of(model.params)
    if held is not None:
        raise quant.QuantizationError(f"the model is already quantized ({held}): quantize "
                                      "its unquantized checkpoint instead")
    quant.check_backend(mode)
    return dataclasses.replace(model, params=quant.quantize_params(model.graphdef,
                                                                   model.params, mode))


def with_draft_head(model: Model, mode: str) -> Model:
    """A copy of `model` whose draft reads a quantized copy (`quant.MODES`) of its head
    where few rows go through it: small batches, whose head products the quantized-matmul
    kernel streams in fewer bytes (`MTPModel.draft_logits`). The target keeps its head,
    so verification, and with it the output, is unchanged; the copy adds the head's
    quantized bytes to the model. With a draft vocabulary the reduced heads are copied.
    ConfigError without MTP modules or when applied twice; QuantizationError for a model
    whose head is already quantized, an unknown mode, or fp8 where it cannot run."""
    mode = quant.check_mode(mode)
    if mode is None:
        return model
    cfg = model.config
    if not cfg.num_mtp_modules:
        raise ConfigError("a draft head needs MTP modules; this model has none")
    if cfg.draft_head:
        raise ConfigError(f"the draft already reads a quantized ({cfg.draft_head}) copy of "
                          "its head")
    heads = [qarray.value(w) for w in model.module().draft_head_weights()]
    if any(qarray.is_quantized(w) for w in heads):
        raise quant.QuantizationError("the draft's head is already quantized (the model's "
                                      "weights are): a quantized copy would gain nothing")
    quant.check_backend(mode)
    flat = to_flat(model.params)
    for i, w in enumerate(heads):
        flat[("draft_heads", i, "head")] = quant.quantize_array(w, (0,), mode)
    return with_params(model, dataclasses.replace(cfg, draft_head=mode), flat)
