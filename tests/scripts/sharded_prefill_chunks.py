"""Run on 2 fake CPU devices (the test sets XLA_FLAGS): prompts of several prefill chunks
under a tp=2 mesh, through jitted programs and through the executable store.

Prints one JSON object: per path, whether every greedy output equals the plain reference
generator's and the program cache sizes after warmup and after the job.
"""

import json
import os
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cpu_compile import fewer_collections  # noqa: E402
from spec_models import markov_model  # noqa: E402

from mtp_jax import compile_cache  # noqa: E402
from mtp_jax.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from mtp_jax.engine import Engine, Request  # noqa: E402
from mtp_jax.reference import generate_reference  # noqa: E402
from mtp_jax.sharding import make_mesh  # noqa: E402

assert len(jax.devices()) == 2, jax.devices()
fewer_collections()
model = markov_model("mimo", target_noise=0.5, mtp_noise=0.2, vocab=64, seed=1)
rng = np.random.default_rng(5)
# chunks of 32: one (5), 32 + 16 (40), 32 + 32 + 16 (70): a chunk length run twice in a
# prompt, after a chunk that returned its logits
prompts = [rng.integers(0, 64, size=n).tolist() for n in (70, 5, 40)]
budget = 10
want = [generate_reference(model, p, SamplingParams(max_tokens=budget), max_len=128)[0]
        for p in prompts]
cfg = EngineConfig(max_batch=2, max_model_len=128, page_size=8, prefill_chunk=32,
                   prefill_batch=1, steps_per_dispatch=4)


def run() -> dict:
    eng = Engine(model, SpecConfig(method="chain", num_speculative_tokens=2), cfg,
                 mesh=make_mesh("tp=2"))
    eng.warmup()
    warm = eng.cache_sizes()
    res = eng.generate([Request(i, p, SamplingParams(max_tokens=budget))
                        for i, p in enumerate(prompts)])
    return dict(equal=[r.token_ids == w for r, w in zip(res, want)],
                errors=[r.error for r in res if r.error], warm=warm,
                after=eng.cache_sizes(), chunks=eng.buckets())


out = {"jit": run()}  # the test process turns the compile cache off
with tempfile.TemporaryDirectory() as d:
    compile_cache.enable(d)  # programs from here on keep their executables in d
    out["store"] = run()
print("RESULT " + json.dumps(out))
