"""mtp_jax: multi-token-prediction speculative decoding in JAX.

`load(path)` gives a Model (config, params, tokenizer); `Engine(model, spec=SpecConfig(...))`
runs batches with one of the draft strategies; `python -m mtp_jax.generate` is the CLI.
Names that pull in jax are imported on first use, so the plain-Python parts (config,
strategies, scheduler) import without it.
"""

from . import models  # noqa: F401  (registers the families' layouts with ModelConfig)
from .config import ConfigError, EngineConfig, ModelConfig, SamplingParams, SpecConfig

# name -> the module that defines it, imported on first use
_LAZY = {"load": "checkpoint", "quantize_model": "checkpoint", "Model": "checkpoint",
         "CheckpointError": "checkpoint", "save_hf": "checkpoint", "save_orbax": "checkpoint",
         "with_draft_head": "checkpoint", "with_draft_vocab": "draft_vocab",
         "QuantizationError": "quant", "Engine": "engine", "Request": "engine",
         "Result": "engine"}

__all__ = ["load", "quantize_model", "QuantizationError", "Model", "ModelConfig", "SpecConfig",
           "SamplingParams", "EngineConfig", "ConfigError", "CheckpointError", "save_hf",
           "save_orbax", "with_draft_vocab", "with_draft_head", "Engine", "Request", "Result"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
