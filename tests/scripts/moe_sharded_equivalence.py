"""Run on 8 fake CPU devices (the test sets XLA_FLAGS): an MoE (GLM-4.5 layout) model with
experts split over `ep` (and their FFN dim over `tp`) against the same model on one device.
With the argument `deepseek_v3`: the golden DeepSeek-V3 model (MLA: query heads over `tp`,
the latent cache replicated; experts over `ep`) instead; with `qwen3_next`: the golden
Qwen3-Next model (Gated DeltaNet layers: their per-slot states over `dp`, the rest as
above).

Prints one JSON object: per mesh, the largest logits difference of a full forward (target
and MTP), whether the engine's greedy outputs equal the plain reference generator's, and
the shardings the loader produced when it streamed the checkpoint onto the mesh.
"""

import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cpu_compile import fewer_collections  # noqa: E402
from test_moe import moe_model  # noqa: E402

from mtp_jax.checkpoint import load, save_hf, to_flat  # noqa: E402
from mtp_jax.config import ConfigError, EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from mtp_jax.engine import Engine, Request  # noqa: E402
from mtp_jax.mtp import forward_train  # noqa: E402
from mtp_jax.reference import generate_reference  # noqa: E402
from mtp_jax.sharding import make_mesh, param_sharding, use_mesh  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()
fewer_collections()
DEEPSEEK = sys.argv[1:] == ["deepseek_v3"]
QWEN = sys.argv[1:] == ["qwen3_next"]
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "golden")
if DEEPSEEK:  # 16 experts in 4 groups, 2 shared, 2 dense layers, 4 MLA heads, YaRN
    model = load(os.path.join(GOLDEN, "deepseek_v3_yarn"), dtype="float32")
elif QWEN:  # 3 linear + 1 gated full-attention layer, 8 experts, a dense layer, MTP MoE
    model = load(os.path.join(GOLDEN, "qwen3_next_moe"), dtype="float32")
else:  # 8 experts in 2 groups, a shared expert, a dense first layer, the MTP layer MoE too.
    model = moe_model(vocab_size=64, n_routed_experts=8, moe_intermediate_size=16)
tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 12)), jnp.int32)
MOE_LAYER = next(i for i in range(model.config.num_layers)
                 if model.config.moe.is_moe_layer(i))


def forward(m, mesh):
    graphdef, params = nnx.split(m.module())

    @jax.jit
    def f(params, tokens):
        with use_mesh(mesh):
            logits, outs = forward_train(nnx.merge(graphdef, params), tokens)
        return logits, outs[0]

    return [np.asarray(x) for x in f(params, tokens)]


want = forward(model, None)
rng = np.random.default_rng(3)
prompts = [rng.integers(0, 64, size=n).tolist() for n in (3, 9, 17, 30)]
budgets = (14, 9, 12, 10)
ref = [generate_reference(model, p, SamplingParams(max_tokens=b), max_len=80)[0]
       for p, b in zip(prompts, budgets)]
out = {"meshes": {}}
with tempfile.TemporaryDirectory() as folder:
    save_hf(model, folder, dtype="float32", max_shard_bytes=40_000)
    runs = {"ep=2": ("chain", 1), "ep=2,tp=2": ("eagle", 2), "ep=4,dp=2": ("none", 0),
            "tp=2": ("chain", 1)}
    if DEEPSEEK:
        runs = {"tp=2": ("chain", 1), "ep=2,tp=2,dp=2": ("eagle", 2)}
    if QWEN:
        runs = {"ep=2,tp=2": ("eagle", 2), "tp=2,dp=2": ("chain", 1)}
    for spec, (method, k) in runs.items():
        mesh = make_mesh(spec)
        loaded = load(folder, shardings=param_sharding(mesh))
        got = forward(loaded, mesh)
        flat = to_flat(loaded.params)
        gu = flat[("target", "layers", MOE_LAYER, "mlp", "experts_gate_up")]
        # meshes with dp prefill the 4 prompts as rows of one forward (rows over dp); the
        # others one prompt a forward, which compiles 4 fewer programs
        rows = 4 if "dp" in spec else 1
        eng = Engine(loaded, SpecConfig(method=method, num_speculative_tokens=max(k, 1)),
                     EngineConfig(max_batch=4, max_model_len=80, page_size=8,
                                  prefill_chunk=16, steps_per_dispatch=5,
                                  prefill_batch=rows), mesh=mesh)
        res = eng.generate([Request(i, p, SamplingParams(max_tokens=b))
                            for i, (p, b) in enumerate(zip(prompts, budgets))])
        out["meshes"][spec] = dict(
            target_diff=float(np.max(np.abs(got[0] - want[0]))),
            mtp_diff=float(np.max(np.abs(got[1] - want[1]))),
            method=method,
            equal=[r.token_ids == w for r, w in zip(res, ref)],
            prefill_rows=eng.row_buckets()[-1],
            experts_spec=[x for x in gu.sharding.spec],
            experts_shard_shape=list(gu.addressable_shards[0].data.shape),
            experts_equal=bool(np.array_equal(
                np.asarray(gu), np.asarray(to_flat(model.params)[
                    ("target", "layers", MOE_LAYER, "mlp", "experts_gate_up")]))))
        if DEEPSEEK:
            attn = flat[("target", "layers", 0, "attn", "w_uk")]
            out["meshes"][spec]["w_uk_spec"] = [x for x in attn.sharding.spec]
    if QWEN:
        st = eng.state.caches[0][1]  # the last engine's: a linear layer's recurrent state
        out["state_spec"] = [x for x in st.sharding.spec]
    try:
        Engine(model, SpecConfig(method="none"), EngineConfig(max_batch=3, max_model_len=80),
               mesh=make_mesh("ep=3"))
        out["ep3_error"] = None
    except ConfigError as e:
        out["ep3_error"] = str(e)
print("RESULT " + json.dumps(out))
