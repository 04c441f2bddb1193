"""mtp_jax: multi-token-prediction speculative decoding in JAX.

`load(path)` gives a Model (config, params, tokenizer); `Engine(model, spec=SpecConfig(...))`
runs batches with one of the draft strategies; `python -m mtp_jax.generate` is the CLI.
"""

from . import models  # noqa: F401  (registers the families' layouts with ModelConfig)
from .checkpoint import (CheckpointError, Model, load, quantize_model, save_hf, save_orbax,
                         with_draft_head)
from .config import ConfigError, EngineConfig, ModelConfig, SamplingParams, SpecConfig
from .draft_vocab import with_draft_vocab
from .quant import QuantizationError

__all__ = ["load", "quantize_model", "QuantizationError", "Model", "ModelConfig", "SpecConfig",
           "SamplingParams", "EngineConfig", "ConfigError", "CheckpointError", "save_hf",
           "save_orbax", "with_draft_vocab", "with_draft_head", "Engine", "Request", "Result"]


def __getattr__(name):  # the engine pulls in the kernels: import it on first use
    if name in ("Engine", "Request", "Result"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(name)
