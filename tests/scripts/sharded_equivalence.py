"""Run on 8 fake CPU devices (the test sets XLA_FLAGS): sharded engines vs the reference.

Prints one JSON object: per method, whether every greedy output equals the plain
reference generator's (itself checked against the single-device engine in test_step),
and the orbax restore-into-sharding checks.
"""

import dataclasses
import json
import os
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cpu_compile import fewer_collections  # noqa: E402
from spec_models import markov_model  # noqa: E402

from mtp_jax.checkpoint import load, save_orbax, to_flat  # noqa: E402
from mtp_jax.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from mtp_jax.engine import Engine, Request  # noqa: E402
from mtp_jax.reference import generate_reference  # noqa: E402
from mtp_jax.sharding import make_mesh, param_sharding, param_spec  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()
fewer_collections()
model = markov_model("mimo", target_noise=0.5, mtp_noise=0.2, vocab=64, seed=1)
rng = np.random.default_rng(3)
prompts = [rng.integers(0, 64, size=n).tolist() for n in (3, 9, 17, 30)]
budgets = (20, 12, 25, 16)
want = [generate_reference(model, p, SamplingParams(max_tokens=b), max_len=96)[0]
        for p, b in zip(prompts, budgets)]
cfg = EngineConfig(max_batch=4, max_model_len=96, page_size=8, prefill_chunk=16,
                   steps_per_dispatch=6)
out = {"methods": {}}
meshes = {"none": "tp=2,dp=4", "chain": "tp=2,dp=2", "window": "tp=2,dp=1",
          "eagle": "tp=2,dp=4", "per_step": "dp=2,tp=2"}
# prefill_batch 4 (the accelerators' default is 8: the 4 prompts share prefill forwards,
# rows split over dp) on two meshes; the others prefill one prompt a forward, which
# compiles 4 fewer programs (this script: 74 -> 45 s on 2 cores with all at 1)
BATCHED = ("none", "chain")
for method, spec in meshes.items():
    mesh = make_mesh(spec)
    rows = 4 if method in BATCHED else 1
    eng = Engine(model, SpecConfig(method=method, num_speculative_tokens=2),
                 dataclasses.replace(cfg, prefill_batch=rows), mesh=mesh)
    res = eng.generate([Request(i, p, SamplingParams(max_tokens=b))
                        for i, (p, b) in enumerate(zip(prompts, budgets))])
    qkv = eng.model.params["target"]["layers"][0]["attn"]["qkv"][...]
    out["methods"][method] = dict(
        mesh=spec, equal=[r.token_ids == w for r, w in zip(res, want)],
        prefill_rows=eng.row_buckets()[-1],
        accepted=sum(sum(r.accepted_per_depth) for r in res),
        qkv_spec=list(qkv.sharding.spec), kv_spec=list(eng.state.caches[0][0].sharding.spec),
        slots_spec=list(eng.state.length.sharding.spec))

mesh = make_mesh("tp=2,dp=4")
with tempfile.TemporaryDirectory() as d:
    save_orbax(model, d)
    restored = load(d, shardings=param_sharding(mesh))
    flat, orig = to_flat(restored.params), to_flat(model.params)
    out["orbax"] = dict(
        equal=all(np.array_equal(np.asarray(flat[k]), np.asarray(orig[k])) for k in orig),
        sharded=all(flat[k].sharding.spec == param_spec(mesh, k, flat[k].shape) for k in flat),
        spread=all(len(flat[k].sharding.device_set) == 8 for k in flat),
        vocab_split=list(flat[("target", "lm_head")].sharding.spec),
        shard_shape=list(flat[("target", "lm_head")].addressable_shards[0].data.shape))
print("RESULT " + json.dumps(out))
