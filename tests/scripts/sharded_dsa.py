"""Run on 8 fake CPU devices (the test sets XLA_FLAGS): DeepSeek Sparse Attention models on
meshes (the index keys replicated with the latent rows, the query heads split over tp, the
slots over dp) against transformers' greedy tokens (the golden fixtures).

Prints one JSON line: per (case, method, mesh), whether the outputs equal the golden
greedy tokens.
"""

import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cpu_compile import fewer_collections  # noqa: E402

from mtp_jax.checkpoint import load  # noqa: E402
from mtp_jax.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from mtp_jax.engine import Engine, Request  # noqa: E402
from mtp_jax.sharding import make_mesh  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()
fewer_collections()
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "golden")
# one prefill chunk per prompt: under tp, a prefill chunk program called twice for one
# prompt is refused by the input sharding it was compiled for (the carried logits), an
# engine issue apart from DSA that every family shares
cfg = EngineConfig(max_batch=2, max_model_len=64, page_size=8, prefill_chunk=64,
                   steps_per_dispatch=8)
runs = {"glm_moe_dsa_shared": [("none", 1, "tp=2,dp=2"), ("eagle", 2, "tp=2,dp=1")],
        "deepseek_v32_exp": [("chain", 1, "tp=2,dp=2")]}
out = {}
for case, methods in runs.items():
    model = load(os.path.join(GOLDEN, case))
    gold = dict(np.load(os.path.join(GOLDEN, case, "golden.npz")))
    prompt = gold["prompt"].tolist()
    for method, k, spec in methods:
        eng = Engine(model, SpecConfig(method=method, num_speculative_tokens=k), cfg,
                     mesh=make_mesh(spec))
        res = eng.generate([Request("a", prompt, SamplingParams(max_tokens=16)),
                            Request("b", prompt[::-1], SamplingParams(max_tokens=16))])
        out[f"{case} {method} {spec}"] = res[0].token_ids == gold["greedy"].tolist()
print("RESULT " + json.dumps(out))
